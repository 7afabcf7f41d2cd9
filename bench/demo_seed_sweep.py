"""Does the default demo learn for any seed? The real `swarmrl run` on configs/demo.toml, one run per seed.

Each seed also makes the base model and seeds the trainer (`--seed S --model.init_seed S --trainer.seed S`).
A run ends as the demo ends it (mean reward >= 0.9 for 5 steps, `stop_reward`), or at `--minutes` of wall time
from its launch, start-up included (then SIGINT, the demo's clean stop). Per seed it records the time to the
first step with reward >= 0.9 and to the demo's stop rule, from launch and from the first training step, the
final and peak reward, the steps, the start-up (base model, then the rest), the base model's pretraining steps,
and the machine's load average while it ran (the machine is shared; say how busy it was).

    python bench/demo_seed_sweep.py              # seeds 0..9, up to 10 minutes each
    python bench/demo_seed_sweep.py 7 3 --minutes 10
    python bench/demo_seed_sweep.py 7 -- --trainer.lr 3e-4     # more `swarmrl run` flags after `--`

Every run is added to bench/results/demo_seed_sweep.json (with `--fresh`, the file starts over) and the
table in demo_seed_sweep.md is rewritten from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

from swarmrl.run_dir import RunDir  # noqa: E402

TARGET = 0.9
WINDOW = 5  # the driver's stop rule: the reward stays >= stop_reward for this many steps


def log_times(log: Path) -> dict[str, float]:
    """Timestamps of the driver's start-up milestones, from its JSON log lines."""
    marks = {"making the base model": "model_start", "run started": "run_started"}
    out: dict[str, float] = {}
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        key = marks.get(rec.get("msg", ""))
        if key and key not in out:
            out[key] = rec["ts"]
    return out


def run_seed(seed: int, out: Path, minutes: float, extra: list[str], env_extra: dict[str, str]) -> dict:
    name = f"seed-{seed}"
    run_dir = out / name
    if run_dir.exists():  # a fresh run: an old folder would be resumed from its checkpoint
        shutil.rmtree(run_dir)
    cmd = [
        sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "demo.toml"),
        "--output_dir", str(out), "--name", name, "--orchestrator.port", "0",
        "--seed", str(seed), "--model.init_seed", str(seed), "--trainer.seed", str(seed),
        "--max_minutes", str(minutes), *extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), SWARMRL_LOG_FORMAT="json", **env_extra)
    log_path = out / f"{name}.log"
    loads: list[float] = []
    t0 = time.time()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        stopped_by_sweep = False
        try:
            while proc.poll() is None:
                loads.append(os.getloadavg()[0])
                if time.time() - t0 > minutes * 60 and not stopped_by_sweep:
                    proc.send_signal(signal.SIGINT)  # the demo's clean stop: last steps made durable
                    stopped_by_sweep = True
                if time.time() - t0 > minutes * 60 + 240:  # it did not stop cleanly: end its whole group
                    os.killpg(proc.pid, signal.SIGKILL)
                time.sleep(2.0)
        finally:
            if proc.poll() is None:  # the sweep itself was interrupted
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
    wall = time.time() - t0
    return summarize(seed, run_dir, log_path, t0, wall, loads, proc.returncode, stopped_by_sweep, minutes)


def summarize(seed: int, run_dir: Path, log_path: Path, t0: float, wall: float, loads: list[float],
              returncode: int | None, stopped_by_sweep: bool, minutes: float) -> dict:
    rd = RunDir(run_dir, create=False)
    rows = [r for r in rd.read_metrics() if r.get("reward_mean") is not None]
    rewards = [r["reward_mean"] for r in rows]
    first_step_t = rows[0]["time"] if rows else None
    first_hit = next((r for r in rows if r["reward_mean"] >= TARGET), None)
    held = next((rows[i + WINDOW - 1] for i in range(len(rows) - WINDOW + 1)
                 if min(rewards[i : i + WINDOW]) >= TARGET), None)
    summary = (run_dir / "summary.md").read_text() if (run_dir / "summary.md").exists() else ""
    stop_event = f"reward >= {TARGET} for {WINDOW} steps" in summary  # also counts steps without a batch
    marks = log_times(log_path)
    model_info = rd.read_json(run_dir / "base_model" / "swarmrl_model.json")
    since = lambda t: None if t is None else round(t - t0, 1)  # noqa: E731
    return {
        "seed": seed,
        "reached": bool(stop_event or held),
        "first_0_9_s": since(first_hit and first_hit["time"]),
        "first_0_9_after_first_step_s": None if first_hit is None else round(first_hit["time"] - first_step_t, 1),
        "held_0_9_s": since(held and held["time"]),
        "held_0_9_after_first_step_s": None if held is None else round(held["time"] - first_step_t, 1),
        "first_0_9_step": first_hit and first_hit["step"],
        "steps": len(rows),
        "reward_first": rewards[0] if rewards else None,
        "reward_final": rewards[-1] if rewards else None,
        "reward_final_5": sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]) if rewards else None,
        "reward_peak": max(rewards) if rewards else None,
        "startup_model_s": round(marks["run_started"] - marks["model_start"], 1) if {"run_started",
        "model_start"} <= marks.keys() else None,
        "startup_s": since(marks.get("run_started")),
        "first_step_s": since(first_step_t),
        "pretrain_steps": model_info.get("pretrain_steps"),
        "pretrain_echo_accuracy": model_info.get("pretrain_echo_accuracy"),
        "wall_s": round(wall, 1),
        "limit_min": minutes,
        "stopped_by_sweep": stopped_by_sweep,
        "returncode": returncode,
        "load_avg_1min": {"mean": round(sum(loads) / len(loads), 2), "max": round(max(loads), 2)} if loads else None,
        "curve": [(round(r["time"] - t0, 1), round(r["reward_mean"], 4)) for r in rows],
    }


def git_rev() -> str:
    """The commit the runs used; `+changes` when tracked files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
            text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
            text=True).stdout.strip()
    except OSError:
        return "?"
    return rev + ("+changes" if dirty else "")


def table(runs: list[dict]) -> str:
    fmt = lambda v: "—" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = [
        "# Demo seed sweep: `bench/demo_seed_sweep.py`",
        "",
        "The real `swarmrl run --config configs/demo.toml --seed S --model.init_seed S --trainer.seed S`, one run per",
        f"seed, ended by the demo's own rule (reward >= {TARGET} for {WINDOW} steps) or at the limit, start-up "
        f"included.",
        "Times are seconds from launch (and from the end of the first training step). Load: the 1-minute load",
        "average of the machine while the run ran (2 cores: above 2, the run shared them).",
        "",
        "| when | rev | seed | reached | first >= 0.9 s (after 1st step) | held 5 steps s (after 1st step) | steps | "
        "reward first / final / peak | start-up s (base model) | pretrain steps (echo acc) | wall s | load mean / max "
        "| flags |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['when']} | {r['rev']} | {r['seed']} | {'yes' if r['reached'] else 'no'} "
            f"| {fmt(r['first_0_9_s'])} ({fmt(r['first_0_9_after_first_step_s'])}) | {fmt(r['held_0_9_s'])} "
            f"({fmt(r['held_0_9_after_first_step_s'])}) "
            f"| {r['steps']} | {fmt(r['reward_first'])} / {fmt(r['reward_final'])} / {fmt(r['reward_peak'])} "
            f"| {fmt(r['startup_s'])} ({fmt(r['startup_model_s'])}) | {fmt(r['pretrain_steps'])} "
            f"({fmt(r['pretrain_echo_accuracy'])}) "
            f"| {fmt(r['wall_s'])} | {fmt((r['load_avg_1min'] or {}).get('mean'))} "
            f"/ {fmt((r['load_avg_1min'] or {}).get('max'))} "
            f"| {' '.join([*(f'{k}={v}' for k, v in r.get('env', {}).items()), *r.get('extra', [])]) or '—'} |"
        )
    # added by hand to the JSON
    lines += [f"- {r['when']}, seed {r['seed']}: {r['note']}" for r in runs if r.get("note")]
    by_rev: dict[str, list[dict]] = {}
    for r in runs:
        by_rev.setdefault(r["rev"], []).append(r)
    lines.append("")
    for rev, rs in by_rev.items():
        lines.append(f"- rev {rev}: reached in {sum(r['reached'] for r in rs)} of {len(rs)} runs (seeds "
            f"{sorted({r['seed'] for r in rs})})")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seeds", nargs="*", type=int, default=list(range(10)))
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-time limit of one run, start-up included")
    ap.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary folder, removed)")
    ap.add_argument("--fresh", action="store_true", help="start the results file over instead of adding to it")
    ap.add_argument("--results", default="demo_seed_sweep", help="bench/results/<name>.{json,md}")
    ap.add_argument("--one-thread", action="store_true",
                    help="OMP_NUM_THREADS=1 for the whole run (the runs before the base model was made on one thread "
                    "used it "
                         "to keep start-up short while other jobs held the cores)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after `--`: more `swarmrl run` flags
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    json_path, md_path = RESULTS / f"{args.results}.json", RESULTS / f"{args.results}.md"
    runs = [] if args.fresh or not json_path.exists() else json.loads(json_path.read_text())["runs"]
    rev = git_rev()
    with tempfile.TemporaryDirectory(prefix="seed-sweep-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            env_extra = {"OMP_NUM_THREADS": "1"} if args.one_thread else {}
            res = run_seed(seed, out, args.minutes, extra, env_extra)
            res = {"when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rev": rev, "extra": extra,
                "env": env_extra, **res}
            print(json.dumps({k: v for k, v in res.items() if k != "curve"}), flush=True)
            runs.append(res)
            json_path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
            md_path.write_text(table(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
