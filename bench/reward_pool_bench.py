"""Reward pool overhead: the same completions scored in-process and through `verifier.reward_pool`, side by side.

    python bench/reward_pool_bench.py [--toy 20000] [--math 400] [--rounds 7] [--kills 5]

Per round, interleaved so that all modes see the same load on the shared machine: the toy task and the
math task (math-verify), each scored (a) in this process, one call per completion, as verifier/service.py
does today, (b) through a pool of 1 process (the pure IPC + bookkeeping cost: no parallelism) and (c) a pool
of 2 processes (this machine's default, min(4, cpus)). Reported per completion: wall time, and CPU time of
all processes involved (this one's process_time, plus the children's utime + stime from /proc, 10 ms
ticks, hence the large toy batch). Also: how long after a timeout kill the replacement process is ready
(forkserver vs spawn), and the per-call duration of honest math-verify calls (the basis of the 2 s default
limit). Writes bench/results/reward_pool.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from environments.tasks import TaskItem, get_task  # noqa: E402
from verifier.reward_pool import RewardPool, RewardPoolConfig  # noqa: E402
from verifier.reward_requests import RewardRequest  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SLEEPY = "import time\ndef sleepy(text, item):\n    time.sleep(3600)\n"


def cpu_of(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds (fields 14 and 15 of /proc/<pid>/stat)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) * TICK_S
    return total


def workloads(n_toy: int, n_math: int) -> dict[str, list[RewardRequest]]:
    toy_params = {"digits": 4}
    toy = get_task("toy", **toy_params)
    toy_reqs = []
    for i, item in enumerate(toy.make_prompts(n_toy // 4, seed=0)):
        for text in (item.answer, item.answer[:2], item.answer + "9", "x" * (i % 7)):
            toy_reqs.append(RewardRequest("toy", item, text, params=toy_params))
    math_reqs = []
    for i, item in enumerate(get_task("math").make_prompts(n_math, seed=0)):
        a = int(item.answer)
        text = [
            f"Let me compute it step by step. The result is \\boxed{{{a}}}.",
            f"The answer is {a}.",
            f"So we get $\\frac{{{2 * a}}}{{2}}$",
            f"\\boxed{{{a + 1}}}",
            "I am not sure.",
        ][i % 5]
        math_reqs.append(RewardRequest("math", item, text))
    return {"toy": toy_reqs, "math": math_reqs}


def in_process(reqs: list[RewardRequest]) -> tuple[float, float, list[float]]:
    tasks = {}
    t, c = time.perf_counter(), time.process_time()
    out = []
    for r in reqs:
        key = (r.task, tuple(sorted(r.params.items())))
        if key not in tasks:
            tasks[key] = get_task(r.task, **r.params)
        out.append(tasks[key].reward(r.item, r.text))
    return time.perf_counter() - t, time.process_time() - c, out


def pooled(pool: RewardPool, reqs: list[RewardRequest]) -> tuple[float, float, list[float]]:
    """CPU is NaN for a run in which a child was replaced (its CPU time went with it); see the log for why."""
    pids = pool.pids()
    c0, t, c = cpu_of(pids), time.perf_counter(), time.process_time()
    results = pool.score_many(reqs)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    if pool.pids() != pids:
        return wall, float("nan"), [r.reward for r in results]
    return wall, cpu + cpu_of(pids) - c0, [r.reward for r in results]


def replacement_s(start_method: str, kills: int, plugin_dir: str) -> list[float]:
    """Per kill: time from the end of a timed-out call to a completion scored by the replacement process."""
    cfg = RewardPoolConfig(processes=1, time_limit_s=0.2, start_method=start_method, import_paths=[plugin_dir])
    toy = RewardRequest("toy", TaskItem("x", "copy:12=", "12"), "12")
    out = []
    with RewardPool(cfg, warmup=[("math", {})]) as pool:
        for _ in range(kills):
            assert pool.score(RewardRequest("bench_sleepy:sleepy", toy.item, "t")).status.value == "timed_out"
            t = time.perf_counter()
            assert pool.score(toy).reward == 1.0
            out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", type=int, default=20000)
    ap.add_argument("--math", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # shows any replacement
    load_start = os.getloadavg()[0]
    work = workloads(args.toy, args.math)
    modes = ["in-process", "pool x1", "pool x2"]
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {(w, m): [] for w in work for m in modes}
    pools = {"pool x1": RewardPool(RewardPoolConfig(processes=1), warmup=[("math", {}), ("toy", {"digits": 4})]),
             "pool x2": RewardPool(RewardPoolConfig(processes=2), warmup=[("math", {}), ("toy", {"digits": 4})])}
    for name, reqs in work.items():  # warm both sides (imports, math-verify's parsers, the chunk-size estimate)
        in_process(reqs[:50])
        for pool in pools.values():
            pool.score_many(reqs[:200])
    math_call_ms = []
    for rnd in range(args.rounds):
        for name, reqs in work.items():
            order = modes if rnd % 2 == 0 else modes[::-1]
            expected = None
            for mode in order:
                wall, cpu, rewards = in_process(reqs) if mode == "in-process" else pooled(pools[mode], reqs)
                if expected is None:
                    expected = rewards
                assert rewards == expected, f"{mode} disagrees on {name}"
                runs[(name, mode)].append((wall / len(reqs) * 1e6, cpu / len(reqs) * 1e6))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    math_task = get_task("math")
    for r in work["math"][:100]:
        t = time.perf_counter()
        math_task.reward(r.item, r.text)
        math_call_ms.append((time.perf_counter() - t) * 1e3)
    replaced = {name: pool.restarts for name, pool in pools.items()}
    for pool in pools.values():
        pool.close()
    with tempfile.TemporaryDirectory() as d:
        Path(d, "bench_sleepy.py").write_text(SLEEPY)
        sys.path.insert(0, d)
        restart = {m: replacement_s(m, args.kills, d) for m in ("forkserver", "spawn")}
    load_end = os.getloadavg()[0]
    write_report(args, work, runs, modes, math_call_ms, restart, load_start, load_end, replaced)


NOTES = """How to read it
- "pool x1" against "in-process" is the cost of the pool itself (pickling, IPC, the child's limits and
  bookkeeping) at equal parallelism: the overhead columns of those rows are the numbers to quote.
- "pool x2" adds parallelism on a 2-core VM that other jobs also load, so its wall time can beat
  in-process, and its CPU per completion rises (two busy children contend for the same cores); neither
  says much about a verifier host with idle cores.
- Wall times on this machine swing with the other jobs' load (see all runs); CPU times are steadier.
- A replacement after a kill is a fork of the forkserver plus the math warm-up call (~60 ms of CPU);
  spawn re-imports math-verify / sympy / pydantic in every new child."""


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.1f}" for x in xs)


def write_report(args, work, runs, modes, math_call_ms, restart, load_start, load_end, replaced) -> None:
    lines = [
        "# Reward pool: per-completion overhead vs in-process rewards",
        "",
        f"Command: `python bench/reward_pool_bench.py --toy {args.toy} --math {args.math} --rounds {args.rounds} "
        f"--kills {args.kills}`",
        "",
        f"{os.cpu_count()}-core VM shared with other jobs (1-min load average {load_start:.1f} at start, "
        f"{load_end:.1f} at end).",
        f"Workloads: toy (digits=4), {len(work['toy'])} completions per run; math (math-verify), {len(work['math'])} "
        f"completions",
        "per run (boxed / plain / LaTeX-fraction / wrong / no answer, in equal parts). Modes interleaved per round, "
        "order",
        "alternating; every run's rewards are checked equal to the in-process ones. Pools: forkserver, default limits",
        "(2 s wall, 4 CPU s, +1 GiB address space per completion), default chunking (<= 32 per message).",
        "CPU = this process's process_time + the children's utime+stime (/proc, 10 ms ticks), per completion.",
        "",
        "| task | mode | median wall us/completion | median CPU us/completion | wall / in-process | CPU / in-process "
        "| wall overhead us | CPU overhead us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in work:
        base_w = statistics.median(w for w, _ in runs[(name, "in-process")])
        base_c = statistics.median(c for _, c in runs[(name, "in-process")])
        for mode in modes:
            w = statistics.median(x for x, _ in runs[(name, mode)])
            c = statistics.median(y for _, y in runs[(name, mode)] if y == y)  # NaN: a run with a replacement
            lines.append(
                f"| {name} | {mode} | {w:.1f} | {c:.1f} | {w / base_w:.2f}x | {c / base_c:.2f}x | {w - base_w:+.1f} | "
                f"{c - base_c:+.1f} |")
    lines += ["", "All runs (us per completion, in round order):", ""]
    for (name, mode), xs in runs.items():
        lines.append(f"- {name}, {mode}: wall [{fmt([w for w, _ in xs])}]; CPU [{fmt([c for _, c in xs])}]")
    mc = sorted(math_call_ms)
    lines += [
        "",
        "Children replaced during the honest runs above (none expected; each would be in the log with its cause): "
        + ", ".join(f"{k}: {v}" for k, v in replaced.items()) + ".",
        "",
        f"Honest math-verify calls in-process (first 100 completions above, ms): median {statistics.median(mc):.2f}, "
        f"p90 {mc[int(0.9 * len(mc))]:.2f}, max {mc[-1]:.2f}.",
        "",
        "Replacement after a timeout kill (pool of 1, limit 0.2 s, math warm-up): seconds from the end of the",
        "timed-out call to the next completion scored by the new process:",
        "",
    ]
    for method, xs in restart.items():
        lines.append(f"- {method}: median {statistics.median(xs):.3f} s (runs: {', '.join(f'{x:.3f}' for x in xs)})")
    lines += ["", NOTES]
    out = REPO / "bench" / "results" / "reward_pool.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
