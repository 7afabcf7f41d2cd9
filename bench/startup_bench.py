"""Start-up: seconds from `swarmrl run` to the first trained step, with the base model given, for two checkouts
side by side (runs alternated A B A B ...), recorded in bench/results/startup.md.

Each run is `swarmrl run --config configs/demo.toml --model.path <made once> --trainer.max_steps 1`, the
config's own sizes. Launch -> first trained step is measured from outside (the subprocess starts -> the
first record in metrics.jsonl), so a checkout that does not log its phases is measured the same way; the
phases are read from the driver's log where it writes them ("start-up phase").

    python bench/startup_bench.py --before /path/to/old/checkout [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
WORK = REPO / "bench" / ".work" / "startup"
PHASE = re.compile(r"start-up phase\s+phase=(?P<phase>.+?) seconds=(?P<s>[\d.]+)")


def make_base_model() -> Path:
    """The demo's base model, made once (the same arguments as configs/demo.toml's [model])."""
    from trainer.tiny_model import init_model

    out = WORK / "base-model"
    if not (out / "config.json").exists():
        init_model(out, "small", seed=0, tie_embeddings=True, pretrain_steps=60, pretrain_target=0.6,
                   pretrain_max_steps=300)
    return out


def one_run(checkout: Path, model: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "swarmrl", "run", "--config", str(checkout / "configs" / "demo.toml"),
           "--output_dir", str(out), "--name", "run", "--model.path", str(model), "--trainer.max_steps", "1",
           "--orchestrator.port", "0", "--log_level", "INFO"]
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONUNBUFFERED": "1"}
    load = os.getloadavg()
    started = time.time()
    with (out / "driver.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
        metrics, first = out / "run" / "metrics.jsonl", None
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.stat().st_size:
                first = time.time() - started
            time.sleep(0.2)
    wall = time.time() - started
    text = (out / "driver.log").read_text(errors="replace")
    phases = {m["phase"]: float(m["s"]) for m in PHASE.finditer(text)}
    return {"exit": proc.returncode, "first_step_s": None if first is None else round(first, 1),
            "wall_s": round(wall, 1), "load_before": [round(x, 2) for x in load], "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the earlier code")
    ap.add_argument("--after", type=Path, default=REPO)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    model = make_base_model()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.runs):
        for name, checkout in (("before", args.before), ("after", args.after)):
            r = one_run(checkout.resolve(), model, WORK / f"{name}-{i}")
            runs[name].append(r)
            print(name, i, json.dumps(r), flush=True)
    firsts = {k: [r["first_step_s"] for r in v if r["first_step_s"] is not None] for k, v in runs.items()}
    ratio = (statistics.median(firsts["after"]) / statistics.median(firsts["before"])
             if firsts["after"] and firsts["before"] else None)
    (args.out / "startup.json").write_text(json.dumps({"runs": runs, "median_ratio": ratio}, indent=2))
    lines = ["# Start-up: `swarmrl run` to the first trained step", "",
             f"Demo config, base model given (`small`, made once), `--trainer.max_steps 1`; {args.runs} runs of "
             "each checkout, alternated. Launch -> first step measured from outside (first metrics.jsonl record).",
             f"Command: `python bench/startup_bench.py --before <checkout> --runs {args.runs}`; "
             f"before: {args.before.name}, after: {args.after.name}.", "",
             "| checkout | run | exit | launch -> first step, s | wall, s | load before (1/5/15 min) | phases, s |",
             "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            lines.append(f"| {name} | {i} | {r['exit']} | {r['first_step_s']} | {r['wall_s']} | {r['load_before']} | "
                         f"{r['phases'] or 'not logged'} |")
    lines += ["", f"Median after / before: {ratio:.2f}" if ratio else "No ratio: a side never reached a step."]
    for name, f in firsts.items():
        if f:
            lines.append(f"- {name}: median {statistics.median(f):.1f} s, min {min(f):.1f}, max {max(f):.1f}")
    (args.out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
