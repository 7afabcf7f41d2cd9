"""The volunteer loop against a real HTTP server (the contract server) and a real shardcast origin,
generating with the session's in-process vLLM engine. The SIGTERM test runs the CLI as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from contract_server import JOIN_TOKEN, ContractServer, Knobs, free_port

from inference_worker.config import WorkerConfig
from inference_worker.loop import EXIT_BANNED, Worker
from protocol.models import WorkerState

RUN = "test-run"  # the run id signed into the test origin's manifests

HERE = Path(__file__).resolve().parent


def wait_until(cond, timeout=90.0, what="condition"):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def origin(tmp_path_factory, tiny_model_dir):
    """A shardcast origin serving version 0 (the base weights) and version 1 (perturbed)."""
    from transformers import AutoModelForCausalLM

    from shardcast.keys import generate_signing_key
    from shardcast.origin import Origin
    from shardcast.server import serve_origin

    root = tmp_path_factory.mktemp("origin")
    org = Origin(root / "store", generate_signing_key(root / "key.pem"), run_id=RUN, keep_versions=4,
        shard_bytes=50_000)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    m0 = org.publish(0, model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m1 = org.publish(1, model.state_dict())
    server = serve_origin(org, "127.0.0.1", 0)
    yield {"url": server.url, "key": org.public_key_b64, "hashes": {0: m0.model_hash, 1: m1.model_hash}}
    server.stop()


@pytest.fixture
def knobs(origin):
    return Knobs(relay_urls=[origin["url"]], public_key=origin["key"], heartbeat_interval_s=0.2)


@pytest.fixture
def engine(tied_engine, tiny_model_dir):
    yield tied_engine
    tied_engine.reload(tiny_model_dir, 0, "0" * 64)  # base weights again for the other tests


def config(url: str, tmp_path: Path, model_dir, **kw) -> WorkerConfig:
    return WorkerConfig(
        orchestrator_url=url, join_token=JOIN_TOKEN, name="test-worker", model=str(model_dir),
        work_dir=str(tmp_path / "work"), display=False, backoff_initial_s=0.05, backoff_max_s=0.3, retries=1,
        request_timeout_s=5, **kw,
    )


class Running:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.code = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.code = self.worker.run()

    def stop(self) -> int:
        self.worker.stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "worker did not stop"
        return self.code


def start_worker(url, tmp_path, model_dir, engine, **kw) -> Running:
    return Running(Worker(config(url, tmp_path, model_dir, **kw), engine_factory=lambda model, cfg: engine))


def test_loop_submits_and_handles_refusals(knobs, origin, engine, tiny_model_dir, tmp_path):
    knobs.expire_submissions, knobs.reject_verdicts = 1, 1
    server = ContractServer(knobs).start()
    run = start_worker(server.url, tmp_path, tiny_model_dir, engine)
    try:
        wait_until(lambda: len(server.record.submissions) >= 3 and run.worker.stats.accepted >= 2,
            what="3 submissions with verdicts")
    finally:
        code = run.stop()
        server.stop()
    rec, stats = server.record, run.worker.stats
    assert code == 0
    assert stats.expired == 1 and stats.rejected == 1 and stats.accepted >= 2
    assert [code for _, code in rec.refused] == ["lease_expired"]
    for sub in rec.submissions.values():  # it reports the weights it generated with
        assert sub.policy_version == 0 and sub.model_hash == origin["hashes"][0]
        assert all(len(c.proofs) == (c.token_ids.size + 31) // 32 for c in sub.completions)
    assert rec.heartbeats and rec.heartbeats[-1].loaded_policy_version == 0
    assert rec.heartbeats[-1].state is WorkerState.stopped  # it told the run it left
    # Every lease was submitted, released or refused (nothing left dangling).
    handled = set(rec.submissions) | set(rec.released) | {lid for lid, _ in rec.refused}
    assert set(rec.leases) <= handled


def test_server_down_at_start_then_restart(knobs, engine, tiny_model_dir, tmp_path):
    server = ContractServer(knobs, port=free_port())  # not started yet
    run = start_worker(server.url, tmp_path, tiny_model_dir, engine)
    try:
        time.sleep(1.0)
        assert run.worker.stats.tasks_submitted == 0 and run.thread.is_alive()
        server.start()
        wait_until(lambda: len(server.record.submissions) >= 1, what="first submission")
        server.stop()  # crash: the new server has no state and does not know the worker's secret
        time.sleep(0.5)
        server.start()
        wait_until(lambda: len(server.record.submissions) >= 1, what="submission after restart")
    finally:
        code = run.stop()
        server.stop()
    assert code == 0
    assert server.record.registrations == ["test-worker"]  # registered again with the new server
    assert run.worker.stats.reconnects >= 1


def test_version_too_old_moves_to_newer_weights(knobs, origin, engine, tiny_model_dir, tmp_path):
    server = ContractServer(knobs).start()
    run = start_worker(server.url, tmp_path, tiny_model_dir, engine)
    try:
        wait_until(lambda: len(server.record.submissions) >= 1, what="a submission at version 0")
        knobs.policy_version, knobs.async_level = 1, 0  # version 0 is now too old
        wait_until(lambda: any(s.policy_version == 1 for s in server.record.submissions.values()),
            what="a submission at version 1")
    finally:
        code = run.stop()
        server.stop()
    assert code == 0
    v1 = [s for s in server.record.submissions.values() if s.policy_version == 1]
    assert all(s.model_hash == origin["hashes"][1] for s in v1)
    assert run.worker.stats.loaded_version == 1 and engine.policy_version == 1


def test_payload_too_large_halves_leases_and_ban_stops(knobs, engine, tiny_model_dir, tmp_path):
    knobs.prompts, knobs.payload_too_large, knobs.ban_after_submissions = 4, 1, 1
    server = ContractServer(knobs).start()
    run = start_worker(server.url, tmp_path, tiny_model_dir, engine, max_prompts_per_lease=4)
    try:
        run.thread.join(timeout=90)
        assert not run.thread.is_alive(), "a banned worker must stop"
    finally:
        run.stop()
        server.stop()
    rec = server.record
    assert run.code == EXIT_BANNED
    first, *rest = list(rec.leases.values())
    assert len(first.prompts) == 4 and first.lease_id in rec.released  # refused as too large, released
    assert rest and all(len(lease.prompts) == 2 for lease in rest)


def test_sigterm_mid_task_finishes_or_releases(knobs, origin, tiny_model_dir, tmp_path):
    # A big task so that the signal arrives while vLLM generates it.
    knobs.prompts, knobs.samples, knobs.max_tokens = 8, 16, 200
    server = ContractServer(knobs).start()
    # vLLM's sockets: ours to delete
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]), VLLM_RPC_BASE_PATH=str(tmp_path))
    cmd = [
        sys.executable, "-m", "swarmrl", "worker", "--orchestrator", server.url, "--join-token", JOIN_TOKEN,
        "--name", "sigterm-worker", "--model", str(tiny_model_dir), "--work-dir", str(tmp_path / "w"), "--no-display",
        "--engine.max_model_len", "256", "--engine.kv_cache_bytes", str(64 << 20), "--max_prompts_per_lease", "8",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(server.record.leases) >= 1 or proc.poll() is not None, timeout=180,
            what="the worker's first lease")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        in_hand = [lid for lid in list(server.record.leases) if lid not in server.record.submissions]
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
    assert proc.returncode == 0, out[-3000:]
    rec = server.record
    assert "lease-1" in rec.leases
    # The task in hand at SIGTERM was finished and submitted, or explicitly released; and every lease
    # handed out (even one whose request crossed the signal) is accounted for.
    for lease_id in rec.leases:
        assert lease_id in rec.submissions or lease_id in rec.released, (lease_id, out[-3000:])
    assert len(rec.leases) <= 2
    print("leases in hand at SIGTERM:", in_hand, "submitted:", sorted(rec.submissions), "released:", rec.released)
