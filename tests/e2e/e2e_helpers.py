"""Helpers for whole-system runs: start `swarmrl run` as a process, read its run folder and database."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Small enough for a CI run of a few minutes on 2 cores, large enough that versions advance while
# workers generate (so reloads and staleness really happen).
FAST = [
    "--model.init_size", "tiny",
    # the tiny model: the demo's 60 fixed steps (its quality bar is for the small one)
    "--model.init_pretrain_target", "null",
    "--orchestrator.port", "0",
    # The tiny model on one thread makes well over 50 tokens/s: a new worker's lease deadline is then the floor
    # (lease_timeout_s), which the fault tests shorten, as it is for workers with accepted work.
    "--orchestrator.new_worker_tokens_per_s", "50",
    "--orchestrator.samples_per_prompt", "4",
    "--orchestrator.prompts_per_lease", "2",
    "--orchestrator.sampling.max_tokens", "8",
    "--trainer.samples_per_step", "16",
    "--trainer.checkpoint_every", "1",
    "--worker.max_prompts_per_lease", "2",
    "--worker.engine.kv_cache_bytes", str(64 << 20),
    "--worker.num_threads", "1",
    "--trainer.num_threads", "1",
    "--shardcast.shard_bytes", str(256 << 10),
    "--log_level", "INFO",
]


def start_run(out: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    log = (out / "driver.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "demo.toml"), "--output_dir",
        str(out), *FAST, *overrides],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
    )
    proc.output_dir = out  # so a failed wait can print the run's logs
    return proc


def log_tails(out: Path, chars: int = 3000) -> str:
    """The end of the driver's log and of every component's log under `out`: what a failed wait prints."""
    logs = [out / "driver.log", *sorted(out.glob("*/logs/*.log"))]
    return "".join(f"\n--- {p.relative_to(out)} ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs
        if p.exists())


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited (code {proc.returncode}) while waiting for {what}{_tails(proc)}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{_tails(proc)}")


def _tails(proc: subprocess.Popen | None) -> str:
    out = getattr(proc, "output_dir", None)
    return log_tails(out) if out is not None else ""


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def pids(run_dir: Path) -> dict:
    path = run_dir / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


def stop_run(proc: subprocess.Popen, timeout_s: float = 90) -> int:
    """SIGINT to the driver (what Ctrl-C sends); it shuts everything down and exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


def db(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True, timeout=30)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
