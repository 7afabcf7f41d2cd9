"""Verifier pool benchmark: verified tokens/s with 1 and with 2 verifier actors, one core each (Ray
`num_cpus=1`, torch threads = 1, the production `VerifierActor`), side by side in one run on the same
honest rollouts (generated once by the real vLLM worker engine, seeded draws, proofs).

    python bench/verifier_pool_bench.py [--size small] [--seqs 48] [--max-tokens 128] [--runs 4]

Each run verifies every rollout once with 1 actor and once with 2 (the order alternates between runs),
through `RayVerifierPool.verify_many`, the orchestrator's dispatch. Wall time: the pool's throughput is
what parallel actors buy. The 1-minute load average is recorded before and after each measurement: the
project machine has 2 cores shared with other jobs, so the ratio is only as good as the load allows;
all runs are reported. Results: bench/results/verifier_pool.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


FINDINGS = """\
Where the ratio goes (recorded runs, loads 4-30 on 2 cores): two things keep it below 2. (1) The other jobs leave the
two actors about 1.3 cores, not 2 (the cores-obtained column). (2) Each actor verifies half of the call's jobs, and
an actor's tokens per CPU-second falls to ~0.6-0.7 of the whole-batch value at half the batch: the control row shows
the same drop with one actor, so it is the smaller call, not the two actors running at once. An in-process profile of
`Verifier.verify_many` on the same model (1 thread) shows no such fixed cost per call (2 jobs: 0.011 CPU-s; 24 jobs,
999 tokens: 0.53 CPU-s; 48 jobs, 2670 tokens: 1.72 CPU-s), so the extra cost sits outside the verifier's code (the
Ray call: moving the jobs, the actor's own threads); not yet pinned down. Because of it the orchestrator gives each
live actor a whole verify batch (16 submissions) per call as the pool grows, instead of splitting the same batch."""


def load() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system, all threads) of these processes so far, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def measure(dispatch, jobs: list, tokens: int, pids: list[int]) -> dict:
    """One pass over every job. `cores_obtained`: the CPU time the actors got per second of wall time
    (at most one per actor): how much of the machine the other jobs left them."""
    before, cpu = load(), cpu_seconds(pids)
    t = time.perf_counter()
    verdicts = dispatch.verify_many(jobs)
    wall = time.perf_counter() - t
    cpu = cpu_seconds(pids) - cpu
    accepted = sum(v.status.value == "accepted" for v in verdicts)
    return {"wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "submissions_per_s": round(len(jobs) / wall, 2), "cores_obtained": round(cpu / wall, 2),
            "tokens_per_cpu_s": round(tokens / cpu, 1), "accepted": accepted, "load_before": before,
            "load_after": load()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--seqs", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "verifier_pool"))
    args = ap.parse_args()

    import ray

    from protocol.models import SamplingParams
    from swarmrl.actors import RayVerifierPool
    from swarmrl.verifier_pool import VerifierPool
    from tools.verifier_calibration import honest_jobs
    from trainer.tiny_model import init_model
    from verifier.config import VerifierConfig

    work = Path(tempfile.mkdtemp(prefix="vpool-bench-"))
    model_dir = init_model(work / args.size, args.size, seed=0)
    t = time.perf_counter()
    jobs = honest_jobs(model_dir, args.seqs, SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
        stop_token_ids=[]))
    gen_s = time.perf_counter() - t
    tokens = sum(j.submission.num_tokens for j in jobs)
    print(f"generated {len(jobs)} honest rollouts, {tokens} tokens, in {gen_s:.1f} s", flush=True)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = VerifierPool(VerifierConfig(num_threads=1), lambda v: model_dir, str(model_dir), num_cpus=1,
        retire_after_s=0)
    try:
        pool.grow(2)
        pool.wait_live(2, timeout_s=600)
        actors = pool.handles()
        pids = [ray.get(a.ping.remote())[0] for a in actors]
        for a in actors:  # load the model in each actor before timing
            ray.get(a.verify_many.remote(jobs[:2]))
        runs = []
        for r in range(args.runs):
            row: dict = {"run": r}
            for k in ((1, 2) if r % 2 == 0 else (2, 1)):
                row[f"actors_{k}"] = measure(RayVerifierPool(actors[:k], timeout_s=3600), jobs, tokens, pids[:k])
            # Control: one actor, the half of the jobs that each of two actors gets. Its tokens per CPU-second
            # tell a cost of smaller batches per call apart from a cost of two actors running at once.
            row["actors_1_half"] = measure(RayVerifierPool(actors[:1], timeout_s=3600), jobs[0::2],
                sum(j.submission.num_tokens for j in jobs[0::2]), pids[:1])
            row["ratio"] = round(row["actors_2"]["tokens_per_s"] / row["actors_1"]["tokens_per_s"], 3)
            row["cpu_efficiency_ratio"] = round(
                row["actors_2"]["tokens_per_cpu_s"] / row["actors_1"]["tokens_per_cpu_s"], 3)
            runs.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pool.shutdown()
        ray.shutdown()

    ratios = [r["ratio"] for r in runs]
    loads = [m[k] for r in runs for m in (r["actors_1"], r["actors_2"]) for k in ("load_before", "load_after")]
    result = {
        "model": args.size,
        "completions": len(jobs),
        "tokens": tokens,
        "max_tokens": args.max_tokens,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "runs": runs,
        "ratio_median": round(statistics.median(ratios), 3),
        "cpu_efficiency_ratio_median": round(statistics.median(r["cpu_efficiency_ratio"] for r in runs), 3),
        "half_batch_cpu_efficiency_ratio_median": round(statistics.median(
        r["actors_1_half"]["tokens_per_cpu_s"] / r["actors_1"]["tokens_per_cpu_s"] for r in runs), 3),
        "cores_obtained_median": {k: statistics.median(r[f"actors_{k}"]["cores_obtained"] for r in runs) for k in (1,
        2)},
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "load_min": min(loads),
        "load_max": max(loads),
        "accepted_all": all(r[f"actors_{k}"]["accepted"] == len(jobs) for r in runs for k in (1, 2)),
        "command": "python bench/verifier_pool_bench.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Verifier pool: verified tokens/s with 1 and 2 actors",
        "",
        f"`{result['command']}` — {len(jobs)} honest rollouts of the `{args.size}` model ({tokens} generated tokens, "
        f"real vLLM worker "
        f"engine, seeded draws and proofs), each verified by the production `VerifierActor` (Ray num_cpus=1, torch "
        f"threads 1) "
        f"through `RayVerifierPool.verify_many`. Wall time; the order of 1 and 2 actors alternates between runs. "
        f"Machine: "
        f"{os.cpu_count()} cores shared with other jobs, 1-minute load average "
        f"{result['load_min']}–{result['load_max']} during the runs.",
        "",
        "| run | 1 actor tok/s | 2 actors tok/s | ratio 2/1 | cores obtained (1 / 2 actors) | tok per CPU-s (1 / 2 "
        "actors) | load (1 actor) | load (2 actors) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        a1, a2 = r["actors_1"], r["actors_2"]
        lines.append(f"| {r['run']} | {a1['tokens_per_s']} | {a2['tokens_per_s']} | {r['ratio']} | "
            f"{a1['cores_obtained']} / {a2['cores_obtained']} | "
                     f"{a1['tokens_per_cpu_s']} / {a2['tokens_per_cpu_s']} | "
                     f"{a1['load_before']}→{a1['load_after']} | {a2['load_before']}→{a2['load_after']} |")
    lines += [
        "",
        f"Ratio 2 actors / 1 actor: median **{result['ratio_median']}**, min {result['ratio_min']}, max "
        f"{result['ratio_max']} "
        f"over {len(runs)} runs. Every verdict accepted: {result['accepted_all']}. Cores the actors obtained (CPU "
        f"seconds per "
        f"wall second, at most 1 per actor), median: {result['cores_obtained_median'][1]} with 1 actor, "
        f"{result['cores_obtained_median'][2]} with 2. Tokens per CPU-second, 2 actors / 1 actor (what splitting the "
        f"work "
        f"costs or saves per unit of CPU, independent of how much CPU the other jobs left), median: "
        f"{result['cpu_efficiency_ratio_median']}; "
        f"control, one actor verifying the half that each of two actors gets, tokens per CPU-second against the whole "
        f"set: "
        f"{result['half_batch_cpu_efficiency_ratio_median']}.",
        "",
        "Reading it: two one-core actors can at best double the throughput when two cores are free for them. With the "
        "load "
        "average above the core count, the two actors compete with other jobs for the same 2 cores, so the measured "
        "ratio is a "
        "lower bound on what a second actor (a second GPU, a second pod) adds on a machine of its own. The "
        "cores-obtained "
        "column says how much CPU the other jobs left them: the throughput ratio follows it.",
        "",
        FINDINGS,
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
