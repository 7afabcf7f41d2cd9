"""Crash safety of the whole system: kill -9 each component of a real `swarmrl run` (the orchestrator
actor, the trainer actor, a verifier actor, the relay, a worker, and the driver itself, which is then
started again with the same command) at random instants, then count from the run's own files what became
of every accepted sample: each one trained exactly once, dropped as stale, or still buffered; none lost,
none trained twice; the announced versions consecutive.

The CI version kills each component once; the slow one (pytest -m slow) three times each.
"""

from __future__ import annotations

import os
import random
import sqlite3

import pytest
from e2e_helpers import log_tails, start_run, stop_run

from swarmrl.audit import audit_run
from tools.chaos import Chaos, restart_counts

pytestmark = pytest.mark.e2e

TARGETS = ["orchestrator", "trainer", "verifier-0", "relay-0", "worker-0", "driver"]
RUN = [
    "--name", "chaos", "--trainer.max_steps", "100000", "--max_minutes", "60", "--num_workers", "2",
    "--orchestrator.async_level", "2", "--trainer.max_staleness", "2",
    # A killed worker's leases come back quickly, so the async bound is not held by the dead.
    "--orchestrator.lease_timeout_s", "10", "--resources.max_restarts", "20",
]


def chaos_run(tmp_path, rounds: int, seed: int):
    start = lambda: start_run(tmp_path, *RUN)  # noqa: E731 - the same command every time
    run_dir = tmp_path / "chaos"
    lines: list[str] = []
    # Each wait gives up well before pytest's timeout, so a stall fails with the logs below, not bare.
    chaos = Chaos(run_dir, start(), start, seed=seed, log=lines.append, timeout_s=240)
    try:
        kills = chaos.run(TARGETS, rounds=rounds)
        base = chaos.steps()
        chaos.wait_for(lambda: chaos.steps() >= base + 2, "two steps after the last recovery")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{chr(10).join(lines)}{log_tails(tmp_path)}") from None
    finally:
        code = stop_run(chaos.driver)
    assert code == 130, (tmp_path / "driver.log").read_text(errors="replace")[-4000:]  # a clean stop on Ctrl-C
    return run_dir, kills, lines


def check(run_dir, kills, lines):
    audit = audit_run(run_dir)
    report = f"{audit.as_dict()}\n" + "\n".join(lines)
    print(report)
    assert audit.problems == [], report
    assert audit.trained_twice == 0 and audit.lost == 0, report
    assert audit.accepted == (audit.zero_signal + audit.unscored + audit.trained_once + audit.dropped_stale
                              + audit.buffered), report
    assert audit.trained_once > 0 and audit.versions_consecutive and audit.versions >= len(kills), report
    # Every kill is counted where operators look (/v1/status reads the same counters). A driver killed
    # right after it saw a restart may take that count with it, hence at most, and at least one.
    recorded = restart_counts(run_dir)
    for target in set(k.target for k in kills):
        n = sum(k.target == target for k in kills)
        assert 1 <= recorded.get(target, (0, 0.0))[0] <= n, (target, recorded, report)
    # Workers reconnect by themselves: after each orchestrator restart, a worker identity registered
    # before the kill submitted again (with the secret it had).
    con = sqlite3.connect(f"file:{run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True)
    for k in kills:
        if k.target == "orchestrator":
            back = con.execute(
                "SELECT COUNT(*) FROM submissions s JOIN workers w ON w.worker_id = s.worker_id WHERE w.created_at < "
                "? AND s.received_at > ?",
                (k.wall, k.wall),
            ).fetchone()[0]
            assert back > 0, ("no worker came back after the orchestrator restart", report)
    con.close()
    return audit


@pytest.mark.timeout(1500)  # 6 kills of at most 4 waits of 240 s each: a stall fails with its logs
def test_every_component_killed_at_random_instants_nothing_lost_nothing_twice(tmp_path):
    seed = int(os.environ.get("SWARMRL_CHAOS_SEED", random.randrange(1 << 16)))
    print(f"chaos seed {seed} (SWARMRL_CHAOS_SEED={seed} repeats this schedule)")
    run_dir, kills, lines = chaos_run(tmp_path, rounds=1, seed=seed)
    check(run_dir, kills, lines)


@pytest.mark.slow
def test_every_component_killed_three_times(tmp_path):
    seed = int(os.environ.get("SWARMRL_CHAOS_SEED", random.randrange(1 << 16)))
    print(f"chaos seed {seed}")
    run_dir, kills, lines = chaos_run(tmp_path, rounds=3, seed=seed)
    check(run_dir, kills, lines)
