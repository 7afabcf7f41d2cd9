"""Kill the components of a running `swarmrl run` with SIGKILL at random instants, one at a time, and
time how long the run takes to train again: what the fault test (tests/e2e/test_faults.py) and the fault
benchmark (bench/fault_bench.py) do, before `swarmrl.audit.audit_run` counts the samples.

Targets are the names in the run's pids.json (orchestrator, trainer, verifier-0, relay-0, worker-0, ...)
plus "driver", which is killed and then started again with the same command (`start_driver`).

Before each kill the run must have committed `min_steps` more steps since the last recovery (so every
kill hits a run that works), then a random delay of up to `max_delay_s` picks the instant. After the kill
we wait until the target is back (a new pid in pids.json, or a new driver) and the run has committed
one more step: that time is the kill's recovery time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Kill:
    target: str
    pid: int
    at_s: float  # since the chaos began
    step_at_kill: int  # committed steps when it was killed
    recovery_s: float  # from the kill until the run committed a step again
    wall: float = 0.0  # time.time() of the kill

    def as_dict(self) -> dict:
        return asdict(self)


class RunExited(AssertionError):
    pass


class Chaos:
    def __init__(
        self, run_dir: Path, driver: subprocess.Popen, start_driver: Callable[[], subprocess.Popen], *, seed: int = 0,
        min_steps: int = 2, max_delay_s: float = 3.0, timeout_s: float = 600.0, log: Callable[[str], None] = print,
    ):
        self.run_dir = Path(run_dir)
        self.driver = driver
        self.start_driver = start_driver
        self.rng = random.Random(seed)
        self.min_steps, self.max_delay_s, self.timeout_s = min_steps, max_delay_s, timeout_s
        self.log = log
        self.kills: list[Kill] = []
        self.t0 = time.monotonic()

    # ---------------------------------------------------------------- reading the run

    def pids(self) -> dict:
        try:
            return json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, ValueError):
            return {}

    def steps(self) -> int:
        """Committed steps, from the orchestrator's SQLite file (durable, whoever is up)."""
        try:
            con = sqlite3.connect(f"file:{self.run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True, timeout=30)
            try:
                row = con.execute("SELECT value FROM meta WHERE key='step'").fetchone()
            finally:
                con.close()
            return int(float(row[0])) if row else 0
        except sqlite3.Error:
            return 0

    def wait_for(self, predicate: Callable[[], object], what: str, timeout_s: float | None = None) -> object:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.driver.poll() is not None:
                raise RunExited(f"the run exited (code {self.driver.returncode}) while waiting for {what}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    # ---------------------------------------------------------------- killing

    def kill(self, target: str) -> Kill:
        base = self.steps()
        self.wait_for(lambda: self.steps() >= base + self.min_steps, f"{self.min_steps} steps before killing {target}")
        self.wait_for(lambda: _alive(self.pids().get(target if target != "driver" else "driver", 0)),
            f"{target} to be running")
        time.sleep(self.rng.uniform(0, self.max_delay_s))
        pid = int(self.pids()[target]) if target != "driver" else self.driver.pid
        step = self.steps()
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self.log(f"[chaos {t_kill - self.t0:7.1f}s] killed {target} (pid {pid}) at step {step}")
        if target == "driver":
            self.driver.wait(30)
            self.driver = self.start_driver()  # the same command resumes the run
            # The old run's actors may still commit a step while they die: count only the new run's.
            self.wait_for(lambda: self.pids().get("driver") == self.driver.pid, "the new driver to start")
            step = self.steps()
        else:
            self.wait_for(lambda: self.pids().get(target) not in (None, pid) and _alive(self.pids()[target]),
                f"{target} to come back")
        self.wait_for(lambda: self.steps() > step, f"a step after killing {target}")
        k = Kill(target, pid, t_kill - self.t0, step, time.monotonic() - t_kill,
            wall=time.time() - (time.monotonic() - t_kill))
        self.log(f"[chaos {time.monotonic() - self.t0:7.1f}s] {target} recovered: a step {k.recovery_s:.1f} s after "
            f"the kill")
        self.kills.append(k)
        return k

    def run(self, targets: list[str], rounds: int = 1) -> list[Kill]:
        """Each target `rounds` times, in a random order."""
        schedule = [t for _ in range(rounds) for t in targets]
        self.rng.shuffle(schedule)
        self.log(f"[chaos] schedule: {schedule}")
        for target in schedule:
            self.kill(target)
        return self.kills


def _alive(pid: int) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    return True


def restart_counts(run_dir: Path) -> dict[str, tuple[int, float]]:
    """What the run itself recorded (what /v1/status shows): component -> (restarts, seconds lost)."""
    con = sqlite3.connect(f"file:{Path(run_dir) / 'orchestrator.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        meta = {k: float(v) for k, v in con.execute("SELECT key, value FROM meta WHERE key LIKE 'restart%'")}
    finally:
        con.close()
    names = {k.split(":", 1)[1] for k in meta}
    return {n: (int(meta.get(f"restarts:{n}", 0)), meta.get(f"restart_s:{n}", 0.0)) for n in sorted(names)}
