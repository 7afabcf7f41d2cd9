"""Requests are a budget (the HTTP gate, over a real uvicorn server on loopback): credentials before the
body, refused credentials limited per address, requests in flight and bytes per worker, a body cap from
the run's lease shape, a deadline on request heads, parsing off the event loop, the join-token admin API."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import numpy as np
import pytest
import zstandard

from orch_fakes import encode, make_orchestrator, make_submission, run_config
from orchestrator.server import OrchestratorServer
from protocol import api, limits
from protocol.models import JoinTokenList, JoinTokenMinted, LeaseResponse, WorkerRegistered

ADMIN, JOIN = "gate-admin", "gate-join"


def bearer(t: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {t}"}


def serve(tmp_path, **orch) -> OrchestratorServer:
    cfg = run_config(tmp_path, admin_token=ADMIN, join_tokens=[JOIN], **orch)
    return OrchestratorServer(make_orchestrator(cfg), port=0).start()


def register(c: httpx.Client, token: str = JOIN, name: str = "w") -> WorkerRegistered:
    r = c.post(api.REGISTER.path, json={"name": name}, headers=bearer(token))
    assert r.status_code == 200, r.text
    return WorkerRegistered.model_validate_json(r.content)


def raw(srv: OrchestratorServer) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_refused_credentials_are_limited_per_address_but_known_workers_keep_working(tmp_path):
    srv = serve(tmp_path, failed_auth_per_min=6.0)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            statuses = [c.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(f"w-{i:016x}.forged")).status_code for i in range(10)]
            assert statuses[:6] == [401] * 6 and set(statuses[6:]) == {429}  # no more database reads for guesses
            assert c.get(api.STATUS.path, headers=bearer("wrong-admin")).status_code == 429
            # Correct credentials are never refused for their address's sake: a worker that authenticated
            # before, the operator, and a new volunteer with a real join token.
            ok = c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "idle"}, headers=bearer(w.secret))
            assert ok.status_code == 200, ok.text
            assert c.get(api.STATUS.path, headers=bearer(ADMIN)).status_code == 200
            register(c, name="newcomer")
    finally:
        srv.stop()


def test_requests_in_flight_per_worker_are_capped(tmp_path):
    srv = serve(tmp_path, requests_in_flight_per_worker=2, request_timeout_s=5.0)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            held = []
            for _ in range(2):  # two requests whose bodies never come: both in flight
                s = raw(srv)
                s.sendall(f"POST {api.SUBMIT.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {w.secret}\r\nContent-Length: 100\r\n\r\n".encode())
                held.append(s)
            time.sleep(0.3)
            r = c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "idle"}, headers=bearer(w.secret))
            assert r.status_code == 429 and "in flight" in r.json()["detail"]
            for s in held:
                s.close()  # the client goes away: its slots are free again
            deadline = time.time() + 5
            while (r := c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "idle"}, headers=bearer(w.secret))).status_code != 200:
                assert time.time() < deadline, r.text
                time.sleep(0.1)
    finally:
        srv.stop()


def test_body_bytes_are_a_budget_per_worker(tmp_path):
    srv = serve(tmp_path, bytes_per_s_per_worker=1000.0)  # bursts of 4000 bytes
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            junk = b"x" * 3000
            first = c.post(api.SUBMIT.path, content=junk, headers=bearer(w.secret) | {"content-type": "application/json"})
            assert first.status_code == 422  # read, then refused by admission
            second = c.post(api.SUBMIT.path, content=junk, headers=bearer(w.secret) | {"content-type": "application/json"})
            assert second.status_code == 429 and "retry-after" in second.headers
    finally:
        srv.stop()


def test_submission_bodies_are_capped_at_the_largest_honest_one(tmp_path):
    srv = serve(tmp_path)
    cfg = srv.orch.cfg
    cap = limits.submission_bytes_cap(cfg.prompts_per_lease * cfg.samples_per_prompt, cfg.sampling.max_tokens)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            lease = LeaseResponse.model_validate_json(c.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 64}, headers=bearer(w.secret)).content).lease
            # The largest honest submission (every completion max_tokens long) fits...
            sub = make_submission(lease, np.random.default_rng(0))
            longest = [cc.model_copy(update={"token_ids": np.full(cfg.sampling.max_tokens, 5, np.int32),
                                             "logprobs": np.full(cfg.sampling.max_tokens, -1.0, np.float32),
                                             "proofs": [b"p" * limits.MAX_PROOF_BYTES] * -(-cfg.sampling.max_tokens // limits.PROOF_CHUNK_TOKENS)})
                       for cc in sub.completions]
            body = encode(sub.model_copy(update={"completions": longest}))
            assert len(body) <= cap
            r = c.post(api.SUBMIT.path, content=body, headers=bearer(w.secret) | {"content-type": "application/json"})
            assert r.status_code == 200, r.text
            # ...a bigger body is refused from its length, and a small zstd body that expands past it while decompressing.
            assert c.post(api.SUBMIT.path, content=b"{" + b" " * cap + b"}", headers=bearer(w.secret)).status_code == 413
            bomb = zstandard.ZstdCompressor().compress(b" " * (cap + 1))
            r = c.post(api.SUBMIT.path, content=bomb, headers=bearer(w.secret) | {"content-encoding": "zstd"})
            assert len(bomb) < 1000 and r.status_code == 413 and "decompresses to more than" in r.json()["detail"]
    finally:
        srv.stop()


def test_a_request_head_has_a_deadline(tmp_path):
    srv = serve(tmp_path, header_timeout_s=0.5)
    try:
        s = raw(srv)
        s.sendall(b"POST /v1/tasks/lease HTTP/1.1\r\nHost: x\r\n")  # ...and the rest of the headers never comes
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # the server closed the connection
        assert time.monotonic() - t0 < 5
        s.close()
        idle = raw(srv)  # a connection that sends nothing at all is closed too
        assert idle.recv(1024) == b""
        idle.close()
        with httpx.Client(base_url=srv.url, timeout=10) as c:  # and the server still serves
            assert c.get(api.HEALTH.path).status_code == 200
    finally:
        srv.stop()


def test_big_submissions_are_parsed_off_the_event_loop(tmp_path):
    srv = serve(tmp_path, sampling={"max_tokens": 2048, "temperature": 1.0})
    assert srv.orch.submission_cap > 256 << 10
    threads = []
    real = srv.orch.parse_submission

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    srv.orch.parse_submission = recording
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            lease = LeaseResponse.model_validate_json(c.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(w.secret)).content).lease
            r = c.post(api.SUBMIT.path, content=encode(make_submission(lease, np.random.default_rng(0))), headers=bearer(w.secret))
            assert r.status_code == 200, r.text
        assert threads and all(t != "orchestrator-http" for t in threads)
    finally:
        srv.stop()


def test_join_tokens_through_the_admin_api(tmp_path):
    srv = serve(tmp_path)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            body = {"label": "alice", "max_identities": 2}
            assert c.post(api.MINT_TOKEN.path, json=body).status_code == 401
            assert c.post(api.MINT_TOKEN.path, json=body, headers=bearer(w.secret)).status_code == 403
            minted = JoinTokenMinted.model_validate_json(c.post(api.MINT_TOKEN.path, json=body, headers=bearer(ADMIN)).content)
            alice = register(c, minted.token, "alice-1")
            listed = JoinTokenList.model_validate_json(c.get(api.TOKENS.path, headers=bearer(ADMIN)).content).tokens
            rec = next(t for t in listed if t.token_id == minted.token_id)
            assert rec.live_identities == 1 and not hasattr(rec, "token")  # the secret is shown once, at minting
            assert minted.token not in c.get(api.TOKENS.path, headers=bearer(ADMIN)).text
            r = c.post(api.REVOKE_TOKEN.url("", token_id=minted.token_id), json={"reason": "left"}, headers=bearer(ADMIN))
            assert r.status_code == 200 and r.json()["revoked"]
            assert c.post(api.REGISTER.path, json={"name": "alice-2"}, headers=bearer(minted.token)).status_code == 401
            banned = c.post(api.HEARTBEAT.url("", worker_id=alice.worker_id), json={"state": "idle"}, headers=bearer(alice.secret))
            assert banned.status_code == 403 and banned.json()["error"] == "banned"
            assert c.post(api.REVOKE_TOKEN.url("", token_id="t-nope"), json={}, headers=bearer(ADMIN)).status_code == 404
    finally:
        srv.stop()


@pytest.mark.parametrize("host", ["0.0.0.0"])
def test_the_server_refuses_demo_tokens_on_a_reachable_address(tmp_path, host):
    cfg = run_config(tmp_path)  # the demo tokens
    with pytest.raises(ValueError, match="demo or placeholder"):
        OrchestratorServer(make_orchestrator(cfg), host=host, port=0)
