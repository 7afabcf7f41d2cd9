"""Async vs sync, end to end: the same config run twice in one go, with async_level = 2 and 0.

Generation and training get one core each (CPU affinity), so one 2-core machine stands in for separate
machines: the inference worker on core 0; trainer, verifier, orchestrator and relay (the trusted
cluster) on core 1. Reports the ratio of trained samples per second and the reward reached at equal
wall time. The ceiling is (generation + training) / max(generation, training).

    python bench/e2e_async_bench.py [--minutes 4] [--size small]

`--compare-ref REF` instead measures the trainer's step time with REF's code ("before") and with this
checkout ("after"), both async 2, in alternating runs (`--pairs`), and writes checkpoint_step_time.md:
what the background checkpoint takes off the trainer's critical path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def run_mode(out: Path, async_level: int, args, name: str = "", code: Path = REPO) -> dict:
    """One run of `swarmrl run` with the code in `code` (this checkout, or another commit's files)."""
    name = name or f"async{async_level}"
    cmd = [
        sys.executable, "-m", "swarmrl", "run", "--config", str(code / "configs" / "demo.toml"),
        "--output_dir", str(out), "--name", name,
        "--orchestrator.async_level", str(async_level), "--trainer.max_staleness", str(max(async_level, 0)),
        "--orchestrator.port", "0", "--model.init_size", args.size,
        "--trainer.max_steps", "100000", "--max_minutes", str(args.minutes), "--stop_reward", "null",
        "--resources.cpu_affinity", json.dumps({"workers": [0], "trainer": [1], "verifier": [1], "orchestrator": [1],
        "relays": [1]}),
        "--worker.num_threads", "1", "--trainer.num_threads", "1",
        *args.extra,
    ]
    if (out / name).exists():  # a fresh run: an old run folder would be resumed from its checkpoint
        shutil.rmtree(out / name)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(code))
    log = (out / f"{name}.log").open("wb")
    load_before = os.getloadavg()[1]  # the machine is shared: say how busy it was
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=code, start_new_session=True)
    try:
        proc.wait(timeout=args.minutes * 60 + 600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    result = summarize_run(out / name, async_level)
    result["wall_s"] = time.time() - t0
    result["load_avg_5min"] = (load_before, os.getloadavg()[1])
    result["step_times"] = step_times(out / name)
    return result


def step_times(run_dir: Path) -> dict:
    """Per step, steady state (the first step excluded): the trainer's critical path (training, plus the
    publishing and checkpoint it waited for: `time/step` where the code has it, else the sum of its
    parts), each part, and the wall time between consecutive steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    critical = [r["time/step"] if "time/step" in r else r["time/train"] + r.get("time/publish",
        0.0) + r.get("time/checkpoint", 0.0) for r in rows]
    gaps = sorted(b["time"] - a["time"] for a, b in zip(rows, rows[1:]))
    return {
        "steps": len(rows),
        "critical_path_s": sum(critical) / len(critical),
        "train_s": mean("time/train"),
        "publish_in_step_s": mean("time/publish"),
        "checkpoint_in_step_s": mean("time/checkpoint") + mean("time/checkpoint_wait") + mean("time/snapshot"),
        "checkpoint_background_s": mean("time/checkpoint_bg"),
        "publish_background_s": mean("time/publish_bg"),
        "wait_for_rollouts_s": mean("time/wait_for_rollouts"),
        "median_step_period_s": gaps[len(gaps) // 2] if gaps else None,
    }


def compare_checkpoints(args) -> None:
    """Before (REF's code) and after (this checkout), async 2, alternating; step times side by side."""
    out = Path(args.out)
    before = out / f"code-{args.compare_ref}"
    if not before.exists():
        before.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.compare_ref], check=True,
            capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
        text=True).stdout.strip()
    runs: list[tuple[str, dict]] = []
    order = [("before", before), ("after", REPO)]
    if args.report_only:  # re-derive the table from the recorded runs
        saved = json.loads((RESULTS / "checkpoint_step_time.json").read_text())
        runs, rev = [(r.pop("code"), r) for r in saved["runs"]], saved.get("after_rev", rev)
        args.pairs = len(runs) // 2
    if args.from_runs:  # re-derive from the run folders in --out (a comparison stopped early): complete pairs only
        complete = [i for i in range(args.pairs) if all((out / f"{lb}{i}" / "metrics.jsonl").exists()
            for lb in ("before", "after"))]
        for i in complete:
            for label in ("before", "after"):
                r = summarize_run(out / f"{label}{i}", 2)
                # not recorded
                r.update(step_times=step_times(out / f"{label}{i}"), load_avg_5min=(float("nan"), float("nan")))
                runs.append((label, r))
        args.pairs = len(complete)
    for i in range(0 if args.report_only or args.from_runs else args.pairs):
        for label, code in (order if i % 2 == 0 else order[::-1]):
            subprocess.run(["sync"])
            time.sleep(5)
            result = run_mode(out, 2, args, name=f"{label}{i}", code=code)
            print(json.dumps({"run": f"{label}{i}", **result["step_times"],
                "trained_samples_per_s": result["trained_samples_per_s"]}), flush=True)
            runs.append((label, result))
    for _, r in runs:  # the share of the trainer's critical path spent publishing and checkpointing
        st = r["step_times"]
        st["io_share_of_critical_path"] = (st["publish_in_step_s"] + st["checkpoint_in_step_s"]) / st["critical_path_s"]
    keys = [
        ("critical_path_s", "**trainer critical path per step** (train + publish + checkpoint it waits for)"),
        ("train_s", "train (forward/backward/optimizer)"), ("publish_in_step_s", "publish, in the step"),
        ("checkpoint_in_step_s", "checkpoint, in the step (after: copy + wait for the previous write)"),
        ("checkpoint_background_s", "checkpoint, in the background"), ("publish_background_s",
        "publish, in the background"),
        ("wait_for_rollouts_s", "wait for rollouts"), ("median_step_period_s", "median wall time between steps"),
        ("io_share_of_critical_path", "share of the critical path spent publishing and checkpointing"),
    ]
    avg = {label: {k: sum(r["step_times"][k] or 0.0 for lb, r in runs if lb == label) / args.pairs for k, _ in keys}
        for label in ("before", "after")}
    thr = {label: sum(r["trained_samples_per_s"] for lb, r in runs if lb == label) / args.pairs for label in ("before",
        "after")}
    lines = [
        "# Checkpoints off the critical path: the trainer's step time before and after",
        "",
        f"Command: `python bench/e2e_async_bench.py {' '.join(a for a in sys.argv[1:] if a != '--report-only')}`"
        + (" (this table re-derived from its recorded runs with `--report-only`)" if args.report_only else ""),
        "",
        f"Before: the code of `{args.compare_ref}` (checkpoint and publish inside the step, checkpoint_every = 1, "
        f"every file fsynced). "
        f"After: `{rev}` (the step takes copies; publish and checkpoint are written by a background thread while the "
        f"next step trains; "
        f"the batch is committed once its checkpoint is durable). Both async_level 2, the demo config, worker on core "
        f"0, the trusted side "
        f"on core 1; {args.pairs} pair(s) of {args.minutes} min runs, alternating which goes first. Means per step, "
        f"first step excluded.",
        "",
        "| per step (s) | before | after |",
        "|---|---|---|",
        *(f"| {title} | {avg['before'][k]:.3f} | {avg['after'][k]:.3f} |" for k, title in keys),
        f"| trained samples/s, whole run | {thr['before']:.2f} | {thr['after']:.2f} |",
        "",
        "All runs:",
        "",
        "| run | critical path | train | publish + checkpoint in step (share) | median step period | trained "
        "samples/s | samples dropped stale | steps | machine load (5 min avg, start / end) |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {lb}, pair {i // 2 + 1} | {r['step_times']['critical_path_s']:.3f} | {r['step_times']['train_s']:.3f} | "
          f"{r['step_times']['publish_in_step_s'] + r['step_times']['checkpoint_in_step_s']:.3f} "
          f"({r['step_times']['io_share_of_critical_path']:.0%}) | "
          f"{r['step_times']['median_step_period_s']:.3f} | {r['trained_samples_per_s']:.2f} | "
          f"{r['samples_dropped_stale']:.0f} | {r['steps']} | {r['load_avg_5min'][0]:.1f} / "
          f"{r['load_avg_5min'][1]:.1f} |"
          for i, (lb, r) in enumerate(runs)),
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint_step_time.json").write_text(json.dumps(
        {"after_rev": rev, "runs": [{"code": lb, **{k: v for k, v in r.items() if k != "curve"}} for lb, r in runs],
        "mean": avg}, indent=2))
    (RESULTS / "checkpoint_step_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summarize_run(run_dir: Path, async_level: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) < 3:
        raise SystemExit(f"{run_dir.name}: only {len(rows)} steps; see its log")
    # Steady state: from the end of the first step (start-up excluded) to the end of the last.
    start, end = rows[0]["time"], rows[-1]["time"]
    trained = sum(r.get("samples/trained", 0) for r in rows[1:])
    gen = [r["time/wait_for_rollouts"] for r in rows[1:]]
    train = [r["time/train"] for r in rows[1:]]
    with sqlite3.connect(run_dir / "orchestrator.sqlite") as con:
        meta = {k: float(v) for k, v in con.execute("SELECT key, value FROM meta")}
    return {
        "async_level": async_level,
        "steps": len(rows),
        "trained_samples_per_s": trained / (end - start),
        "groups_kept": meta.get("groups_kept", 0.0),
        "groups_dropped_zero_signal": meta.get("groups_dropped_zero_signal", 0.0),
        "samples_dropped_stale": meta.get("samples_dropped_stale", 0.0),
        "mean_wait_for_rollouts_s": sum(gen) / len(gen),
        "mean_train_s": sum(train) / len(train),
        "curve": [(r["time"] - start, r["reward_mean"], r.get("samples/trained", 0)) for r in rows],
    }


def first_time(curve, threshold: float) -> float | None:
    return next((t for t, r, _ in curve if r is not None and r >= threshold), None)


def trained_per_s_until(curve, t_end: float) -> float:
    """Trained samples per second from the end of the first step to t_end."""
    return sum(n for t, _, n in curve[1:] if t <= t_end) / t_end


def reward_at(curve, t: float, window: int = 3) -> float:
    before = [r for s, r, _ in curve if s <= t and r is not None]
    tail = before[-window:] or [curve[0][1]]
    return sum(tail) / len(tail)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--size", default="small")
    ap.add_argument("--out", default=str(REPO / "bench" / ".work" / "async"))
    ap.add_argument("--report-only", action="store_true", help="re-derive the report from the run folders in --out")
    ap.add_argument("--threshold", type=float, default=0.9, help="the reward that ends the learning window")
    ap.add_argument("--compare-ref", default="",
        help="measure step times: this git ref's code (before) against this checkout (after)")
    ap.add_argument("--pairs", type=int, default=2,
        help="with --compare-ref: before/after pairs, alternating which goes first")
    ap.add_argument("--from-runs", action="store_true",
        help="with --compare-ref: re-derive the table from the run folders in --out")
    ap.add_argument("extra", nargs="*", help="more config overrides for both runs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compare_ref:
        compare_checkpoints(args)
        return
    results = {}
    for level in (2, 0):  # side by side, one after the other in one run
        if args.report_only:
            results[level] = summarize_run(out / f"async{level}", level)
            continue
        subprocess.run(["sync"])
        time.sleep(5)
        results[level] = run_mode(out, level, args)
        print(json.dumps({k: v for k, v in results[level].items() if k != "curve"}))
    a, s = results[2], results[0]
    horizon = min(a["curve"][-1][0], s["curve"][-1][0])
    gen, train = s["mean_wait_for_rollouts_s"], s["mean_train_s"]  # the sync run separates the two phases
    # The learning window: until the first of the two runs reaches the threshold. Past it, a converged
    # policy yields mostly zero-signal groups, which the filter drops, so trained samples/s measures how
    # rare informative groups have become, not the pipeline; and the faster learner gets there first.
    reach = {"async": first_time(a["curve"], args.threshold), "sync": first_time(s["curve"], args.threshold)}
    window = min([t for t in reach.values() if t is not None] or [horizon])
    summary = {
        "learning_window": {
            "threshold": args.threshold,
            "seconds": window,
            "trained_samples_per_s": {"async": trained_per_s_until(a["curve"], window),
            "sync": trained_per_s_until(s["curve"], window)},
            "reward_at_end": {"async": reward_at(a["curve"], window), "sync": reward_at(s["curve"], window)},
        },
        "seconds_to_threshold": reach,
        "throughput_ratio_async_over_sync": trained_per_s_until(a["curve"], window) / trained_per_s_until(s["curve"],
        window),
        "whole_run_throughput_ratio": a["trained_samples_per_s"] / s["trained_samples_per_s"],
        "reward_at_equal_wall_time": {"seconds": horizon, "async": reward_at(a["curve"], horizon),
        "sync": reward_at(s["curve"], horizon)},
        "ceiling_from_sync_phases": (gen + train) / max(gen, train),
        "runs": {str(k): {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in results.items()},
        "config": {"size": args.size, "minutes": args.minutes, "extra": args.extra},
    }
    lw = summary["learning_window"]

    def fmt_t(t: float | None) -> str:
        return "not reached" if t is None else f"{t:.0f} s"

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "e2e_async_bench.json").write_text(json.dumps({**summary, "curves": {str(k): v["curve"] for k,
        v in results.items()}}, indent=2))
    lines = [
        "# Async (async_level = 2) vs sync (async_level = 0), end to end",
        "",
        "Command: `python bench/e2e_async_bench.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "Worker pinned to core 0; trainer, verifier, orchestrator and relay pinned to core 1. Time counts from the "
        "end of",
        "each run's first step (start-up excluded).",
        "",
        "| | async 2 | sync 0 |",
        "|---|---|---|",
        f"| **trained samples/s while learning** (first {window:.0f} s, until a run reaches reward {args.threshold}) "
        f"| {lw['trained_samples_per_s']['async']:.2f} | {lw['trained_samples_per_s']['sync']:.2f} |",
        f"| mean reward at {window:.0f} s | {lw['reward_at_end']['async']:.3f} | {lw['reward_at_end']['sync']:.3f} |",
        f"| time to reward {args.threshold} | {fmt_t(reach['async'])} | {fmt_t(reach['sync'])} |",
        f"| trained samples/s, whole run | {a['trained_samples_per_s']:.2f} | {s['trained_samples_per_s']:.2f} |",
        f"| mean reward at {horizon:.0f} s | {summary['reward_at_equal_wall_time']['async']:.3f} | "
        f"{summary['reward_at_equal_wall_time']['sync']:.3f} |",
        f"| groups verified: kept / dropped for zero signal | {a['groups_kept']:.0f} / "
        f"{a['groups_dropped_zero_signal']:.0f} | {s['groups_kept']:.0f} / {s['groups_dropped_zero_signal']:.0f} |",
        f"| steps | {a['steps']} | {s['steps']} |",
        f"| mean wait for rollouts per step (s) | {a['mean_wait_for_rollouts_s']:.2f} | "
        f"{s['mean_wait_for_rollouts_s']:.2f} |",
        f"| mean train time per step (s) | {a['mean_train_s']:.2f} | {s['mean_train_s']:.2f} |",
        "",
        f"**Throughput ratio async / sync while learning: {summary['throughput_ratio_async_over_sync']:.2f}x**; over "
        f"the whole run "
        f"{summary['whole_run_throughput_ratio']:.2f}x (ceiling from the sync run's phases, (gen + train) / max(gen, "
        f"train): "
        f"{summary['ceiling_from_sync_phases']:.2f}x).",
        "",
        "Past the learning window most groups are all-correct: the zero-signal filter drops them and trained samples/s",
        "falls in whichever run got there, first the async one. In the sync run, \"wait for rollouts\" is more than",
        "generation: after each step the worker pulls the new version through the relay, reloads vLLM, leases, "
        "generates,",
        "submits, and the verifier scores, all while the trainer idles. Async overlaps these fixed latencies too, so "
        "the",
        "ratio can exceed the ceiling computed from the two phases alone. The trainer's step is slower in the "
        "async run",
        "because verification and the orchestrator share its core while it trains.",
    ]
    (RESULTS / "e2e_async_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
