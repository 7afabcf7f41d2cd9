"""The orchestrator client against a real HTTP server (the contract server) on loopback."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import zstandard
from contract_server import JOIN_TOKEN, ContractServer, Knobs, free_port

from inference_worker import client as c
from protocol import limits
from protocol.models import Completion, FinishReason, Heartbeat, RolloutSubmission, WorkerState


@pytest.fixture
def server():
    s = ContractServer(Knobs(prompts=1, samples=2)).start()
    yield s
    s.stop()


def completions(lease, n_tokens=5):
    out = []
    for pi, _ in enumerate(lease.prompts):
        for si in range(lease.samples_per_prompt):
            out.append(Completion(prompt_index=pi, sample_index=si, token_ids=np.full(n_tokens, 7, np.int32),
                logprobs=np.full(n_tokens, -1.0, np.float32), finish_reason=FinishReason.length,
                proofs=[b"\x01\x02"] * ((n_tokens + 31) // 32)))
    return out


def test_register_lease_submit_verdict(server):
    cl = c.OrchestratorClient(server.url)
    reg = cl.register(JOIN_TOKEN, "tester")
    assert cl.secret == reg.secret and reg.worker_id
    ack = cl.heartbeat(Heartbeat(state=WorkerState.idle, loaded_policy_version=0))
    assert ack.min_policy_version == 0
    lease = cl.lease(0, max_prompts=1).lease
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash="a" * 64,
        completions=completions(lease))
    receipt = cl.submit(sub)
    assert receipt.lease_id == lease.lease_id
    got = server.record.submissions[lease.lease_id]
    assert got.completions[1].token_ids.tolist() == [7] * 5  # the zstd body decoded to the same rollouts
    assert cl.verdict(receipt.submission_id).status.value == "accepted"
    with pytest.raises(c.Duplicate):
        cl.submit(sub)
    cl.close()


def test_submission_is_zstd_compressed():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["encoding"] = request.headers.get("content-encoding")
        seen["auth"] = request.headers.get("authorization")
        seen["body"] = zstandard.ZstdDecompressor().decompressobj().decompress(request.content)
        return httpx.Response(200, json={"submission_id": "s1", "lease_id": "l1", "num_completions": 1})

    cl = c.OrchestratorClient("http://test", secret="s" * 32, transport=httpx.MockTransport(handler))
    lease_like = type("L", (), {"prompts": [0], "samples_per_prompt": 1})
    cl.submit(RolloutSubmission(lease_id="l1", policy_version=0, model_hash="a" * 64,
        completions=completions(lease_like)))
    assert seen["encoding"] == "zstd" and seen["auth"] == "Bearer " + "s" * 32
    assert RolloutSubmission.model_validate_json(seen["body"]).lease_id == "l1"


def test_typed_errors(server):
    cl = c.OrchestratorClient(server.url)
    with pytest.raises(c.Unauthorized):
        cl.register("wrong-token", "tester")
    cl.register(JOIN_TOKEN, "tester")
    server.knobs.policy_version, server.knobs.async_level = 5, 1
    with pytest.raises(c.VersionTooOld) as e:
        cl.lease(0)
    assert e.value.min_policy_version == 4 and e.value.status == 409
    server.knobs.policy_version = 0
    lease = cl.lease(0).lease
    server.knobs.expire_submissions = 1
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash="a" * 64,
        completions=completions(lease))
    with pytest.raises(c.LeaseExpired):
        cl.submit(sub)
    with pytest.raises(c.NotFound):
        cl.release("lease-unknown")
    cl.secret = "x" * 32
    with pytest.raises(c.Unauthorized):
        cl.lease(0)


def test_non_errorbody_4xx_and_rate_limit_retry():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0.01"}, text="slow down")
        return httpx.Response(413, text="<html>too big</html>")

    sleeps = []
    cl = c.OrchestratorClient("http://test", secret="s" * 32, transport=httpx.MockTransport(handler),
        sleep=sleeps.append)
    with pytest.raises(c.PayloadTooLarge):
        cl.lease(0)
    assert len(calls) == 2 and sleeps == [0.01]


def test_network_errors_retry_with_backoff_then_give_up():
    sleeps = []
    cl = c.OrchestratorClient(f"http://127.0.0.1:{free_port()}", retries=4, backoff_initial_s=0.1, backoff_max_s=0.3,
        sleep=sleeps.append)
    with pytest.raises(c.OrchestratorUnavailable, match="5 attempts"):
        cl.register(JOIN_TOKEN, "tester")
    assert len(sleeps) == 4
    caps = [min(0.3, 0.1 * 2**i) for i in range(4)]
    assert all(0 <= s <= cap for s, cap in zip(sleeps, caps))


def test_oversized_submission_is_refused_before_sending(monkeypatch):
    def handler(request):
        raise AssertionError("nothing should be sent")

    cl = c.OrchestratorClient("http://test", secret="s" * 32, transport=httpx.MockTransport(handler))
    monkeypatch.setattr(limits, "MAX_BODY_BYTES", 50)
    lease_like = type("L", (), {"prompts": [0], "samples_per_prompt": 1})
    sub = RolloutSubmission(lease_id="l1", policy_version=0, model_hash="a" * 64, completions=completions(lease_like,
        300))
    with pytest.raises(c.PayloadTooLarge):
        cl.submit(sub)


def test_fields_a_newer_orchestrator_added_are_ignored_but_a_wrong_answer_is_not(caplog):
    """A registration answer with fields this client does not know (a newer orchestrator) still registers, with
    a warning; a known field with a wrong value is still refused."""
    base = {"worker_id": "w-1", "secret": "w-1." + "s" * 40, "heartbeat_interval_s": 5.0, "async_level": 2,
            "policy_version": 3, "relay_urls": ["http://relay"], "manifest_public_key": "k", "run_id": "run-1"}
    answers = [dict(base, future_field=1, credit={"accepted": 2, "rejected": 0, "verified_tokens": 9, "stars": 5}),
               dict(base, policy_version=-1, future_field=1)]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, json=answers.pop(0))

    cl = c.OrchestratorClient("http://test", transport=httpx.MockTransport(handler), retries=0)
    with caplog.at_level("WARNING"):
        reg = cl.register("join-token", "w")
    assert reg.policy_version == 3 and reg.credit.accepted == 2 and reg.credit.verified_tokens == 9
    assert "future_field" in caplog.text and "credit.stars" in caplog.text
    with pytest.raises(c.OrchestratorUnavailable, match="invalid WorkerRegistered"):
        cl.register("join-token", "w")
