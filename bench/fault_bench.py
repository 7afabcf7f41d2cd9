"""A long kill loop against a real `swarmrl run`: every component killed with SIGKILL at random instants,
several rounds, then the exactly-once audit from the run's own files, and the time the run spent
recovering.

    python bench/fault_bench.py [--rounds 5] [--seed 0] [--size tiny]

The run is the demo config (real vLLM worker processes, verifier, trainer, relay, orchestrator) with two
workers. Each round kills the orchestrator, the trainer, verifier-0, relay-0, a worker and the driver
(which is then started again with the same command), in a random order; before each kill the run must
have committed two more steps. Reports, per component: kills, the recovery time (from the kill to the
run's next committed step), and what the run itself recorded (restarts and seconds lost, as /v1/status
shows them); and the audit: accepted = trained once + dropped stale + still buffered + zero-signal, with
trained twice and lost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"

from swarmrl.audit import audit_run  # noqa: E402
from tools.chaos import Chaos, restart_counts  # noqa: E402

TARGETS = ["orchestrator", "trainer", "verifier-0", "relay-0", "worker-0", "worker-1", "driver"]


def command(out: Path, args) -> list[str]:
    return [
        sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "demo.toml"), "--output_dir",
        str(out), "--name", "faults", "--model.init_size", args.size, "--orchestrator.port", "0", "--num_workers", "2",
        "--trainer.max_steps", "1000000", "--max_minutes", "600", "--stop_reward", "null",
        "--orchestrator.lease_timeout_s", "10", "--resources.max_restarts", "1000", "--worker.num_threads", "1",
        "--trainer.num_threads", "1", *args.extra,
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--out", default=str(REPO / "bench" / ".work" / "faults"))
    ap.add_argument("--name", default="fault_bench", help="results file name (bench/results/<name>.json|md)")
    ap.add_argument("extra", nargs="*", help="more config overrides")
    args = ap.parse_args()
    out = Path(args.out)
    if (out / "faults").exists():
        shutil.rmtree(out / "faults")  # a fresh run
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def start() -> subprocess.Popen:
        log = (out / "driver.log").open("ab")
        return subprocess.Popen(command(out, args), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            start_new_session=True)

    t0 = time.time()
    chaos = Chaos(out / "faults", start(), start, seed=args.seed, log=lambda line: print(line, flush=True))
    try:
        chaos.run(TARGETS, rounds=args.rounds)
        base = chaos.steps()
        chaos.wait_for(lambda: chaos.steps() >= base + 3, "three steps after the last recovery")
    finally:
        if chaos.driver.poll() is None:
            chaos.driver.send_signal(2)  # Ctrl-C: the last steps made durable, a clean stop
            chaos.driver.wait(300)
    wall = time.time() - t0
    audit = audit_run(out / "faults")
    recorded = restart_counts(out / "faults")
    report(args, chaos, audit, recorded, wall)


def report(args, chaos: Chaos, audit, recorded: dict, wall: float) -> None:
    kills = chaos.kills
    by_target = {}
    for t in TARGETS:
        rec = [k.recovery_s for k in kills if k.target == t]
        if rec:
            by_target[t] = {"kills": len(rec), "recovery_s_mean": mean(rec), "recovery_s_max": max(rec),
                            "recorded_restarts": recorded.get(t, (0, 0.0))[0], "recorded_seconds_lost": recorded.get(t,
                            (0, 0.0))[1]}
    recovering = sum(k.recovery_s for k in kills)
    summary = {
        "command": "python bench/fault_bench.py " + " ".join(sys.argv[1:]),
        "wall_s": wall, "kills": len(kills), "time_recovering_s": recovering, "by_target": by_target,
        "audit": audit.as_dict(), "kill_log": [k.as_dict() for k in kills],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=2))
    a = audit
    lines = [
        "# Fault benchmark: every component killed at random instants, then the exactly-once audit",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"{len(kills)} kills in {wall / 60:.1f} min of run ({args.rounds} rounds of {', '.join(TARGETS)}, random "
        f"order, seed {args.seed}).",
        f"Time from a kill to the run's next committed step, summed: **{recovering:.0f} s** ({recovering / wall:.0%} "
        f"of the run).",
        "",
        "| component | kills | recovery: mean / max (s) | restarts the run recorded | seconds lost it recorded |",
        "|---|---|---|---|---|",
        *(f"| {t} | {v['kills']} | {v['recovery_s_mean']:.1f} / {v['recovery_s_max']:.1f} | {v['recorded_restarts']} "
        f"| {v['recorded_seconds_lost']:.1f} |"
          for t, v in by_target.items()),
        "",
        "| audit (samples, from the run's files) | |",
        "|---|---|",
        f"| accepted | {a.accepted} |",
        f"| = trained once | {a.trained_once} |",
        f"| + dropped stale | {a.dropped_stale} |",
        f"| + still buffered | {a.buffered} |",
        f"| + zero-signal groups | {a.zero_signal} |",
        f"| **trained twice** | **{a.trained_twice}** |",
        f"| **lost** | **{a.lost}** |",
        f"| batches by state | {a.batches} |",
        f"| versions announced (consecutive 0..N) | {a.versions} ({'yes' if a.versions_consecutive else 'NO'}) |",
        f"| problems | {a.problems or 'none'} |",
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
