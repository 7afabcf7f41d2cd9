"""The whole loop at a real size: `swarmrl run --config configs/realsize-cpu.toml`, then the same command
again with more steps (a resume from the run folder's checkpoint), recorded in bench/results/realsize_run.md.

Each session: wall time, launch -> first trained step, every step's record (metrics.jsonl), the peak
memory of every process (the run's memory.json) and its summary.md.

    python bench/realsize_run.py [--model /path/to/made/qwen3-0.6b] [--steps 4] [--resume-steps 2]
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

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
STEP_KEYS = ("step", "version", "reward_mean", "time/train", "time/wait_for_trainer", "rollout_tokens_per_s",
             "trained_samples_per_s", "acceptance_rate", "tokens")


def session(out: Path, name: str, steps: int, args) -> dict:
    cmd = [sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "realsize-cpu.toml"),
           "--output_dir", str(out), "--name", name, "--trainer.max_steps", str(steps), "--orchestrator.port", "0",
           *args.extra]
    if args.model:
        cmd += ["--model.path", str(args.model)]
    run_dir = out / name
    before = len((run_dir / "metrics.jsonl").read_text().splitlines()) if (run_dir / "metrics.jsonl").exists() else 0
    load = os.getloadavg()
    t0 = time.time()
    with (out / f"{name}-{steps}.log").open("wb") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ,
            PYTHONUNBUFFERED="1")).returncode
    wall = time.time() - t0
    records = [json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()[before:]] if (
        run_dir / "metrics.jsonl").exists() else []
    first = min((r["time"] for r in records if "time" in r), default=None)
    return {
        "command": " ".join(cmd[1:]).replace(str(REPO) + "/", ""), "exit_code": code, "wall_s": round(wall, 1),
        "launch_to_first_step_s": None if first is None else round(first - t0, 1), "load_before": [round(x, 2)
        for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()], "steps": [{k: r.get(k) for k in STEP_KEYS if k in r}
        for r in records],
        "memory": json.loads((run_dir / "memory.json").read_text()) if (run_dir / "memory.json").exists() else None,
        "summary": (run_dir / "summary.md").read_text() if (run_dir / "summary.md").exists() else "",
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        if (run_dir / "checkpoints").exists() else [],
    }


def markdown(result: dict) -> str:
    lines = ["# The whole loop at Qwen3-0.6B's shape on this CPU", "",
        f"Machine: {result['machine']}. Model: {result['model']}.", ""]
    for name, s in result["sessions"].items():
        lines += [f"## {name}", "", f"`{s['command']}`", "",
                  f"- exit code {s['exit_code']}, wall {s['wall_s']} s, launch -> first trained step "
                  f"{s['launch_to_first_step_s']} s, "
                  f"load before / after {s['load_before']} / {s['load_after']}", ""]
        if s["steps"]:
            keys = [k for k in STEP_KEYS if any(k in r for r in s["steps"])]
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in s["steps"]]
            lines.append("")
        if s["memory"]:
            lines += ["| process | peak GiB | its child processes' peaks, GiB |", "|---|---|---|"]
            lines += [f"| {n} | {c['peak_gib']} | {c['children_peak_gib']} ({c['child_processes']}) |" for n,
                c in s["memory"]["components"].items()]
            lines += ["",
                f"All of the run's processes at once: {s['memory']['tree_peak_gib']} GiB of "
                f"{s['memory']['machine_gib']} GiB.", ""]
        lines += ["<details><summary>summary.md</summary>", "", s["summary"], "</details>", ""]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path,
        help="a model made by `swarmrl init-model --arch qwen3-0.6b` (default: the run makes one)")
    ap.add_argument("--steps", type=int, default=4, help="trained steps of the first session")
    ap.add_argument("--resume-steps", type=int, default=2, help="more steps of the resumed session")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / ".work" / "realsize")
    ap.add_argument("extra", nargs="*", help="more `swarmrl run` options")
    args = ap.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    model = json.loads((args.model / "swarmrl_model.json").read_text()) if args.model else {"arch": "qwen3-0.6b",
        "made": "by the run"}
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    keys = ("arch", "parameters", "pretrain_steps", "pretrain_final_loss", "made")
    result = {"machine": f"{os.cpu_count()} cores, {memory:.1f} GiB",
              "model": {k: model.get(k) for k in keys if k in model}, "sessions": {}}
    result["sessions"]["first session"] = session(args.out, "realsize", args.steps, args)
    result["sessions"]["resumed"] = session(args.out, "realsize", args.steps + args.resume_steps, args)
    (RESULTS / "realsize_run.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "realsize_run.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
