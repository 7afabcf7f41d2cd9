"""`swarmrl run` end to end: real Ray actors, real HTTP, real vLLM workers in their own processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import numpy as np
import pytest
from e2e_helpers import db, metrics, pid_alive, pids, start_run, stop_run, wait_for

pytestmark = pytest.mark.e2e


def test_short_run_advances_versions_and_trains_only_verified_samples(short_run):
    run_dir, code, log = short_run  # conftest.py: also observed by test_eval_run.py
    assert code == 0, log[-4000:]

    # The run folder has everything a person needs.
    for name in ("config.toml", "metrics.jsonl", "reward.png", "summary.md", "checkpoints", "logs/worker-0.log",
        "logs/relay-0.log"):
        assert (run_dir / name).exists(), name
    assert tomllib.loads((run_dir / "config.toml").read_text())["trainer"]["max_steps"] == 6

    # Versions advance one per optimizer step.
    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == list(range(1, 7))
    assert all(r["reward_mean"] is not None and np.isfinite(r["loss"]) for r in rows)

    with db(run_dir) as con:
        trained = con.execute(
            "SELECT s.behaviour_version, sub.status, sub.verdict FROM samples s JOIN submissions sub ON "
            "sub.submission_id = s.submission_id WHERE s.status = 'trained'"
        ).fetchall()
    assert len(trained) == 6 * 16
    # Every trained sample came from a submission that the verifier accepted.
    assert {status for _, status, _ in trained} == {"accepted"}
    assert all('"accepted"' in verdict for _, _, verdict in trained)
    # Workers really reloaded new versions: the verifier accepted samples whose proofs match version >= 3
    # weights, and the worker says it hot-reloaded them.
    behaviour = [v for v, _, _ in trained]
    assert max(behaviour) >= 3
    reloads = [int(m) for m in re.findall(r"reloaded policy version (\d+)",
        (run_dir / "logs" / "worker-0.log").read_text())]
    assert max(reloads) >= 3 and reloads == sorted(reloads)
    # Staleness stays within async_level: a sample trained at step k (version k-1 -> k) was generated
    # by a version >= k-1-async_level.
    for r in rows:
        assert all(int(gap) <= 1 for gap in r["staleness"]), r["staleness"]


def reissued_prompts_done(run_dir: Path) -> bool:
    """local-0's expired leases exist, and every prompt in them is in a lease another worker completed."""
    with db(run_dir) as con:
        expired = con.execute(
            "SELECT prompt_indices FROM leases WHERE status='expired' AND worker_id IN (SELECT worker_id FROM workers "
            "WHERE name='local-0')"
        ).fetchall()
        done = con.execute(
            "SELECT prompt_indices FROM leases WHERE status='done' AND worker_id NOT IN (SELECT worker_id FROM "
            "workers WHERE name='local-0')"
        ).fetchall()
    done_prompts = {i for (row,) in done for i in json.loads(row)}
    return bool(expired) and {i for (row,) in expired for i in json.loads(row)} <= done_prompts


def test_faults_worker_killed_trainer_killed_tampering_worker(tmp_path):
    """The run continues when a worker dies mid-task, when the trainer dies, and when a worker cheats."""
    from inference_worker.client import Banned, OrchestratorClient, OrchestratorError, VersionTooOld
    from protocol import limits
    from protocol.models import Completion, RolloutSubmission

    proc = start_run(
        tmp_path, "--name", "faults", "--trainer.max_steps", "100000", "--max_minutes", "5", "--num_workers", "2",
        "--orchestrator.lease_timeout_s", "8", "--orchestrator.strikes_to_ban", "2",
        # The tiny trainer publishes several versions a second; leave a slow test client time to submit.
        "--orchestrator.async_level", "6", "--trainer.max_staleness", "6",
    )
    run_dir = tmp_path / "faults"
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 240, "two training steps", proc)
        info = pids(run_dir)
        url = info["url"]
        # An operator watches the run through the HTTP API.
        out = subprocess.run([sys.executable, "-m", "swarmrl", "status", "--orchestrator", url, "--admin-token",
            "demo-admin-token", "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["policy_version"] >= 1
        refused = subprocess.run([sys.executable, "-m", "swarmrl", "status", "--orchestrator", url, "--admin-token",
            "wrong"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "401" in refused.stderr

        # 1. A worker killed mid-task: its lease expires and the prompts are done by the other worker.
        victim = info["worker-0"]

        def victim_open_leases() -> int:
            with db(run_dir) as con:
                return con.execute("SELECT COUNT(*) FROM leases WHERE status='open' AND worker_id IN (SELECT "
                    "worker_id FROM workers WHERE name='local-0')").fetchone()[0]

        # Freeze the worker first, then make sure it still holds an open lease: a submission already on
        # the wire when we looked would otherwise close the lease we meant to orphan.
        deadline = time.time() + 60
        while True:
            wait_for(lambda: victim_open_leases() > 0, 60, "worker 0 to hold a lease", proc, poll_s=0.05)
            os.kill(victim, signal.SIGSTOP)
            time.sleep(1.0)  # a request sent before the stop has landed by now
            if victim_open_leases() > 0 or time.time() > deadline:
                break
            os.kill(victim, signal.SIGCONT)
        os.kill(victim, signal.SIGKILL)

        # 2. A cheating worker: valid shape, forged proofs and tokens. It is rejected, then banned.
        # A join token of its own: bans reach every worker of the cheater's token (ban_scope = token).
        minted = httpx.post(f"{url}/v1/join-tokens", json={"label": "cheater"},
            headers={"Authorization": "Bearer demo-admin-token"}, timeout=30)
        assert minted.status_code == 200, minted.text
        cheater = OrchestratorClient(url)
        reg = cheater.register(minted.json()["token"], "cheater")
        version, banned, deadline = reg.policy_version, False, time.time() + 120
        rng = np.random.default_rng(0)
        while time.time() < deadline and not banned:
            try:
                resp = cheater.lease(version, max_prompts=1)
                if resp.lease is None:
                    time.sleep(0.2)
                    continue
                lease = resp.lease
                # Fresh random tokens each time: identical rollouts would be refused as a replay instead.
                comps = [
                    Completion(prompt_index=i, sample_index=j, token_ids=rng.integers(3, 50, 8), logprobs=[-0.01] * 8,
                    finish_reason="length", proofs=[b"\x00" * limits.MAX_PROOF_BYTES])
                    for i in range(len(lease.prompts)) for j in range(lease.samples_per_prompt)
                ]
                # the pinned one
                claimed = lease.generation_version if lease.generation_version is not None else lease.policy_version
                with db(run_dir) as con:
                    model_hash = con.execute("SELECT model_hash FROM versions WHERE version=?", (claimed,
                        )).fetchone()[0]
                try:
                    cheater.submit(RolloutSubmission(lease_id=lease.lease_id, policy_version=claimed,
                        model_hash=model_hash, completions=comps))
                except VersionTooOld:
                    cheater.release(lease.lease_id)
                    raise
                time.sleep(0.5)
            except Banned:
                banned = True
            except VersionTooOld as exc:  # versions move fast here: claim the current one (min + async_level)
                version = (exc.min_policy_version or version) + 6
            except OrchestratorError:
                time.sleep(0.2)
        assert banned, "the cheating worker was never banned"

        # 3. The trainer killed mid-run: Ray restarts it from its last checkpoint.
        before = len(metrics(run_dir))
        trainer_pid = pids(run_dir)["trainer"]
        os.kill(trainer_pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(trainer_pid), 30, "the trainer to die")
        wait_for(lambda: len(metrics(run_dir)) >= before + 3, 300, "three more steps after the trainer restarted", proc)
        assert pids(run_dir)["trainer"] != trainer_pid
        # The killed worker's lease expires after lease_timeout_s; its prompts then go to the queue of
        # re-issued prompts (the cheater may draw them first, and lose them again): wait for an honest finish.
        wait_for(lambda: reissued_prompts_done(run_dir), 120,
            "the killed worker's prompts to be done by another worker", proc)
    finally:
        stop_run(proc)

    rows = metrics(run_dir)
    versions = [r["version"] for r in rows]
    # Versions continue without a gap or a repeat across the trainer restart.
    assert versions == list(range(1, len(versions) + 1)), versions
    with db(run_dir) as con:
        victim_id = con.execute("SELECT worker_id FROM workers WHERE name='local-0'").fetchone()[0]
        expired = con.execute("SELECT prompt_indices FROM leases WHERE worker_id=? AND status='expired'", (victim_id,
            )).fetchall()
        cheater_row = con.execute("SELECT worker_id, banned, strikes FROM workers WHERE name='cheater'").fetchone()
        cheater_trained = con.execute(
            "SELECT COUNT(*) FROM samples s JOIN submissions sub ON sub.submission_id = s.submission_id WHERE "
            "sub.worker_id = ?", (cheater_row[0],)
        ).fetchone()[0]
        rejected = con.execute("SELECT COUNT(*) FROM submissions WHERE worker_id=? AND status='rejected'",
            (cheater_row[0],)).fetchone()[0]
        # The killed worker's prompts were re-issued and completed by another worker.
        other_leases = con.execute("SELECT prompt_indices FROM leases WHERE worker_id != ? AND status='done'",
            (victim_id,)).fetchall()
        twice = con.execute("SELECT sample_id, COUNT(*) c FROM samples GROUP BY sample_id HAVING c > 1").fetchall()
    assert expired, "the killed worker's lease never expired"
    done_prompts = {i for (row,) in other_leases for i in json.loads(row)}
    assert {i for (row,) in expired for i in json.loads(row)} <= done_prompts
    assert cheater_row[1] == 1 and rejected >= 2
    assert cheater_trained == 0
    assert not twice
