"""Crash recovery: kill -9 a real orchestrator process mid-run and start it again on the same SQLite
file. No accepted rollout is lost or trained twice, and workers carry on with their secrets and leases."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from orch_fakes import encode, make_submission

from protocol import api
from protocol.models import LeaseResponse, SubmissionReceipt, WorkerRegistered
from protocol.verdicts import Verdict

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(run_dir: Path, port: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}")
    log = run_dir / "orchestrator.log"
    with log.open("a") as err:
        proc = subprocess.Popen([sys.executable, str(HERE / "orch_proc.py"), "--dir", str(run_dir), "--port",
            str(port)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = proc.stdout.readline().strip()
    if not line.startswith("http://"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"orchestrator did not start: {line!r} {log.read_text()[-3000:]}")
    return proc, line


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the orchestrator we started; kill it if it does not exit in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def lease(c: httpx.Client, w: WorkerRegistered):
    r = c.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 64}, headers=auth(w.secret))
    assert r.status_code == 200, r.text
    return LeaseResponse.model_validate_json(r.content).lease


def test_kill_and_restart(tmp_path):
    port = free_port()
    proc, url = start(tmp_path, port)
    rng = np.random.default_rng(0)
    receipts: list[str] = []
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post(api.REGISTER.path, json={"name": "survivor"}, headers=auth("join"))
            w = WorkerRegistered.model_validate_json(r.content)
            for _ in range(8):
                r = c.post(api.SUBMIT.path, content=encode(make_submission(lease(c, w), rng)), headers=auth(w.secret))
                assert r.status_code == 200, r.text
                receipts.append(SubmissionReceipt.model_validate_json(r.content).submission_id)
            open_lease = lease(c, w)
            # Let the trainer take some batches, but not everything: kill mid-flight.
            deadline = time.time() + 20
            while time.time() < deadline:
                st = c.get(api.STATUS.path, headers=auth("admin")).json()
                if st["step"] >= 1:
                    break
                time.sleep(0.05)
            assert st["submissions_accepted"] < len(
                receipts) or st["buffer_depth"] > 0 or st["step"] < 4, "kill came too late to test anything"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    proc, url = start(tmp_path, port)  # same port: workers reconnect to the same URL
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            # The worker's secret and its open lease survived.
            r = c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "generating",
                "loaded_policy_version": 0},
                       headers=auth(w.secret))
            assert r.status_code == 200, r.text
            r = c.post(api.SUBMIT.path, content=encode(make_submission(open_lease, rng)), headers=auth(w.secret))
            assert r.status_code == 200, r.text
            receipts.append(SubmissionReceipt.model_validate_json(r.content).submission_id)
            # Every receipt gets a verdict; the trainer drains the buffer.
            deadline = time.time() + 60
            while time.time() < deadline:
                verdicts = [Verdict.model_validate_json(c.get(api.VERDICT.url("", submission_id=s),
                    headers=auth(w.secret)).content)
                            for s in receipts]
                st = c.get(api.STATUS.path, headers=auth("admin")).json()
                if all(v.status.value == "accepted" for v in verdicts) and st["buffer_depth"] == 0:
                    break
                time.sleep(0.2)
            assert all(v.status.value == "accepted" for v in verdicts), [v.status for v in verdicts]
    finally:
        stop(proc)

    db = sqlite3.connect(tmp_path / "orchestrator.sqlite")
    statuses = dict(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
    counters = {k: float(v) for k, v in db.execute("SELECT key, value FROM meta").fetchall()}
    staleness = sum(v for k, v in counters.items() if k.startswith("staleness:"))
    kept_groups = counters["groups_kept"]
    # Nothing lost: every kept group's 4 samples are in the buffer table, and all were trained...
    assert sum(statuses.values()) == kept_groups * 4 > 0
    assert statuses.get("trained", 0) == sum(statuses.values()), statuses
    # ...exactly once: the trained counter and the staleness histogram count each sample once.
    assert counters["samples_trained"] == statuses["trained"] == staleness
    assert counters["submissions_accepted"] == len(receipts)
    assert db.execute("SELECT COUNT(*) FROM submissions WHERE status='pending'").fetchone()[0] == 0


def test_serve_runs_in_foreground_and_stops_on_sigterm(tmp_path):
    """`OrchestratorServer.run` (what `swarmrl orchestrator` runs): serves until SIGTERM, exits cleanly."""
    port = free_port()
    code = (
        "from pathlib import Path\n"
        "from orch_fakes import FakeVerifier, make_prompts, run_config\n"
        "from orchestrator.server import OrchestratorServer\n"
        "from swarmrl.actors import build_orchestrator\n"
        f"cfg = run_config(Path({str(tmp_path)!r}), port={port}, admin_token='admin')\n"
        "OrchestratorServer(build_orchestrator(cfg, FakeVerifier(), prompts=make_prompts(cfg))).run()\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}")
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}{api.READY.path}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError((tmp_path / "serve.log").read_text()[-3000:])
        st = httpx.get(f"http://127.0.0.1:{port}{api.STATUS.path}", headers=auth("admin"), timeout=5)
        assert st.status_code == 200 and st.json()["run_name"] == "test"
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert (tmp_path / "orchestrator.sqlite").exists()


def test_submission_acknowledged_with_200_survives_kill_9(tmp_path):
    """Durability of the request path: once a submit returns 200, the submission (body, fingerprint, lease
    status) is in SQLite, even if the process is killed the next instant (WAL checkpoints run in the
    background, so the data may still be only in the WAL file: it must be found there)."""
    port = free_port()
    proc, url = start(tmp_path, port)
    rng = np.random.default_rng(11)
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            w = WorkerRegistered.model_validate_json(c.post(api.REGISTER.path, json={"name": "d"},
                headers=auth("join")).content)
            subs = [make_submission(lease(c, w), rng) for _ in range(3)]
            receipts = []
            for sub in subs:
                r = c.post(api.SUBMIT.path, content=encode(sub), headers=auth(w.secret))
                assert r.status_code == 200, r.text
                receipts.append(SubmissionReceipt.model_validate_json(r.content).submission_id)
            proc.send_signal(signal.SIGKILL)  # right after the last 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    db = sqlite3.connect(tmp_path / "orchestrator.sqlite")
    rows = {sid: (lease_id, status) for sid, lease_id,
        status in db.execute("SELECT submission_id, lease_id, status FROM submissions")}
    assert set(receipts) <= set(rows)
    for sid, sub in zip(receipts, subs):
        assert rows[sid][0] == sub.lease_id and rows[sid][1] in ("pending", "accepted", "rejected")
        assert db.execute("SELECT status FROM leases WHERE lease_id=?", (sub.lease_id,)).fetchone()[0] in ("submitted",
            "done", "rejected")
    assert db.execute("SELECT COUNT(*) FROM fingerprints WHERE submission_id IN (?, ?, ?)", receipts).fetchone()[0] == 3
    db.close()

    # ...and the restarted orchestrator refuses the same rollouts again (the replay fingerprint survived too).
    proc, url = start(tmp_path, port)
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post(api.SUBMIT.path, content=encode(subs[0].model_copy(update={"lease_id": lease(c, w).lease_id})),
                headers=auth(w.secret))
            assert r.status_code == 409 and r.json()["error"] == "duplicate", r.text
    finally:
        stop(proc)
