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
from protocol.models import LeaseResponse, WorkerRegistered
from protocol.operator_models import JoinTokenList, JoinTokenMinted

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
            statuses = [c.post(api.LEASE.path, json={"loaded_policy_version": 0},
                headers=bearer(f"w-{i:016x}.forged")).status_code for i in range(10)]
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
    srv = serve(tmp_path, requests_in_flight_per_worker=2, request_timeout_s=5.0, refusal_delay_s=0.05)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            held = []
            for _ in range(2):  # two requests whose bodies never come: both in flight
                s = raw(srv)
                s.sendall(f"POST {api.SUBMIT.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{w.secret}\r\nContent-Length: 100\r\n\r\n".encode())
                held.append(s)
            time.sleep(0.3)
            # Every one refused while both are held: a refusal gives back no slot it never took (it once
            # did, and each refusal let one more request through).
            for _ in range(4):
                r = c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "idle"},
                    headers=bearer(w.secret))
                assert r.status_code == 429 and "in flight" in r.json()["detail"]
            for s in held:
                s.close()  # the client goes away: its slots are free again
            deadline = time.time() + 5
            while (r := c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "idle"},
                headers=bearer(w.secret))).status_code != 200:
                assert time.time() < deadline, r.text
                time.sleep(0.1)
    finally:
        srv.stop()


def test_a_refusal_over_budget_is_held_so_one_connection_cannot_flood(tmp_path):
    """A client that ignores Retry-After gets its 429 only after refusal_delay_s: over one connection it
    can make the server refuse about one request per delay, not thousands per second."""
    srv = serve(tmp_path, rate_limit_per_s=5.0, refusal_delay_s=0.5)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            hb = api.HEARTBEAT.url("", worker_id=w.worker_id)
            codes, held = [], []
            for _ in range(20):
                started = time.monotonic()
                r = c.post(hb, json={"state": "idle"}, headers=bearer(w.secret))
                codes.append(r.status_code)
                if r.status_code == 429:  # held for the delay, or less when the budget frees up sooner
                    held.append(time.monotonic() - started - min(0.5, r.json()["retry_after_s"]))
                    assert "retry-after" in r.headers
            assert held and codes.count(200) >= 5  # the burst passes; then the budget is what it is
            assert min(held) >= -0.01  # every refusal was held (a deliberate sleep, not a measured speed)
            # Forged credentials over the address's budget are held too.
            forged = [c.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(f"w-{i:016x}.forged"))
                for i in range(40)]
            # past the burst of 30: mostly held 429s, a 401 as the budget refills
            late = [r.status_code for r in forged[30:]]
            assert late.count(429) >= 7 and set(late) <= {401, 429}
    finally:
        srv.stop()


def test_one_address_holds_at_most_its_cap_of_connections(tmp_path):
    srv = serve(tmp_path, max_connections_per_address=3)
    try:
        held = [raw(srv) for _ in range(3)]
        for s in held:  # each is served: a request on it is answered
            s.sendall(f"GET {api.HEALTH.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        extra = raw(srv)  # the fourth is closed at once, before it can send anything
        extra.settimeout(5)
        assert extra.recv(4096) == b""
        extra.close()
        held.pop().close()
        deadline = time.time() + 5
        while True:  # a slot freed is a slot again (once the server saw the close)
            s = raw(srv)
            s.settimeout(5)
            s.sendall(f"GET {api.HEALTH.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            try:
                if s.recv(4096).startswith(b"HTTP/1.1 200"):
                    break
            except OSError:
                pass
            finally:
                s.close()
            assert time.time() < deadline
            time.sleep(0.05)
        for s in held:
            s.close()
    finally:
        srv.stop()



def test_a_trusted_proxy_carries_many_clients_not_one(tmp_path):
    """Behind a reverse proxy the operator named (a Kubernetes ingress), the proxy's connections are not capped per
    address, and refused credentials are counted against the address it names in X-Forwarded-For: one client
    sending forged secrets does not lock every other volunteer behind the same proxy out."""
    srv = serve(tmp_path, max_connections_per_address=2, failed_auth_per_min=3, trusted_proxies=["127.0.0.0/8"])
    try:
        held = [raw(srv) for _ in range(4)]
        for s in held:
            s.sendall(f"GET {api.HEALTH.path} HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\n\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        for s in held:
            s.close()
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            forged = {"Authorization": "Bearer w-forged.secret", "X-Forwarded-For": "198.51.100.7"}
            codes = [c.get(api.STATUS.path, headers=forged).status_code for _ in range(6)]
            assert codes[-1] == 429, codes  # the forger is refused outright ...
            other = {"Authorization": "Bearer w-unknown.secret", "X-Forwarded-For": "198.51.100.8"}
            assert c.get(api.STATUS.path, headers=other).status_code == 401  # ... another client is not
    finally:
        srv.stop()


def test_forwarded_for_is_ignored_from_a_peer_that_is_not_a_trusted_proxy(tmp_path):
    srv = serve(tmp_path, failed_auth_per_min=3)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            codes = [c.get(api.STATUS.path, headers={"Authorization": "Bearer w-forged.secret",
                                                     "X-Forwarded-For": f"198.51.100.{i}"}).status_code
                     for i in range(6)]
            assert codes[-1] == 429, codes  # a new forwarded address per request is the same client
    finally:
        srv.stop()

def test_body_bytes_are_a_budget_per_worker(tmp_path):
    srv = serve(tmp_path, bytes_per_s_per_worker=1000.0)  # bursts of 4000 bytes
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            junk = b"x" * 3000
            first = c.post(api.SUBMIT.path, content=junk,
                headers=bearer(w.secret) | {"content-type": "application/json"})
            assert first.status_code == 422  # read, then refused by admission
            second = c.post(api.SUBMIT.path, content=junk,
                headers=bearer(w.secret) | {"content-type": "application/json"})
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
            lease = LeaseResponse.model_validate_json(c.post(api.LEASE.path, json={"loaded_policy_version": 0,
                "max_prompts": 64}, headers=bearer(w.secret)).content).lease
            # The largest honest submission (every completion max_tokens long) fits...
            sub = make_submission(lease, np.random.default_rng(0))
            longest = [cc.model_copy(update={"token_ids": np.full(cfg.sampling.max_tokens, 5, np.int32),
                                             "logprobs": np.full(cfg.sampling.max_tokens, -1.0, np.float32),
                                             "proofs": [b"p" * limits.MAX_PROOF_BYTES] * -(
                                             -cfg.sampling.max_tokens // limits.PROOF_CHUNK_TOKENS)})
                       for cc in sub.completions]
            body = encode(sub.model_copy(update={"completions": longest}))
            assert len(body) <= cap
            r = c.post(api.SUBMIT.path, content=body, headers=bearer(w.secret) | {"content-type": "application/json"})
            assert r.status_code == 200, r.text
            # ...a bigger body is refused from its length, and a small zstd body that expands past it while
            # decompressing.
            assert c.post(api.SUBMIT.path, content=b"{" + b" " * cap + b"}",
                headers=bearer(w.secret)).status_code == 413
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
    assert srv.orch.admission.cap > 256 << 10
    threads = []
    real = srv.orch.admission.parse

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    srv.orch.admission.parse = recording
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            lease = LeaseResponse.model_validate_json(c.post(api.LEASE.path, json={"loaded_policy_version": 0},
                headers=bearer(w.secret)).content).lease
            r = c.post(api.SUBMIT.path, content=encode(make_submission(lease, np.random.default_rng(0))),
                headers=bearer(w.secret))
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
            minted = JoinTokenMinted.model_validate_json(c.post(api.MINT_TOKEN.path, json=body,
                headers=bearer(ADMIN)).content)
            alice = register(c, minted.token, "alice-1")
            listed = JoinTokenList.model_validate_json(c.get(api.TOKENS.path, headers=bearer(ADMIN)).content).tokens
            rec = next(t for t in listed if t.token_id == minted.token_id)
            assert rec.live_identities == 1 and not hasattr(rec, "token")  # the secret is shown once, at minting
            assert minted.token not in c.get(api.TOKENS.path, headers=bearer(ADMIN)).text
            r = c.post(api.REVOKE_TOKEN.url("", token_id=minted.token_id), json={"reason": "left"},
                headers=bearer(ADMIN))
            assert r.status_code == 200 and r.json()["revoked"]
            assert c.post(api.REGISTER.path, json={"name": "alice-2"}, headers=bearer(minted.token)).status_code == 401
            banned = c.post(api.HEARTBEAT.url("", worker_id=alice.worker_id), json={"state": "idle"},
                headers=bearer(alice.secret))
            assert banned.status_code == 403 and banned.json()["error"] == "banned"
            assert c.post(api.REVOKE_TOKEN.url("", token_id="t-nope"), json={},
                headers=bearer(ADMIN)).status_code == 404
    finally:
        srv.stop()


@pytest.mark.parametrize("host", ["0.0.0.0"])
def test_the_server_refuses_demo_tokens_on_a_reachable_address(tmp_path, host):
    cfg = run_config(tmp_path)  # the demo tokens
    with pytest.raises(ValueError, match="demo or placeholder"):
        OrchestratorServer(make_orchestrator(cfg), host=host, port=0)


def test_a_lease_request_is_held_until_the_async_bound_has_room(tmp_path):
    """A long poll: with the generation budget full, a request with wait_s is answered with a lease as soon
    as a lease is given back, not after a retry-after guessed by the worker; with nothing freeing room it
    is held for wait_s and answered "none now"; wait_s=0 is answered at once."""
    cfg = run_config(tmp_path, admin_token=ADMIN, join_tokens=[JOIN], async_level=0, max_open_leases_per_worker=8)
    # the bound: 2 prompts
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 8})})
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    stopped = False
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            w = register(c)

            def ask(wait_s: float) -> tuple[LeaseResponse, float]:
                started = time.monotonic()
                r = c.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 2, "wait_s": wait_s},
                    headers=bearer(w.secret))
                assert r.status_code == 200, r.text
                return LeaseResponse.model_validate_json(r.content), time.monotonic() - started

            held = ask(0)[0].lease
            assert held is not None
            none_now, _ = ask(0)
            assert none_now.lease is None and none_now.retry_after_s > 0
            timed_out, took = ask(0.6)
            assert timed_out.lease is None and took >= 0.6 - 0.01  # held for its wait (a deliberate hold)

            got: list = []
            with httpx.Client(base_url=srv.url, timeout=30) as other:  # the poll holds its own connection
                def poll() -> None:
                    r = other.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 2, "wait_s": 5.0},
                        headers=bearer(w.secret))
                    got.append((r, time.monotonic()))

                waiter = threading.Thread(target=poll)
                waiter.start()
                time.sleep(0.5)
                released_at = time.monotonic()
                r = c.post(api.RELEASE.url("", lease_id=held.lease_id), json={"reason": "test"},
                    headers=bearer(w.secret))
                assert r.status_code == 200 and r.json()["released"]
                waiter.join(10)
            resp, answered_at = got[0]
            lease = LeaseResponse.model_validate_json(resp.content).lease
            assert lease is not None and answered_at >= released_at
            assert answered_at - released_at < 4.0  # woken by the release, not by its 5 s running out

            # A request held when the server stops is answered ("none now"), not left to hold up the shutdown.
            got.clear()
            with httpx.Client(base_url=srv.url, timeout=30) as other:
                waiter = threading.Thread(target=poll)
                waiter.start()
                time.sleep(0.5)
                stop_asked = time.monotonic()
                srv.stop()
                stopped = True
                waiter.join(10)
            resp, answered_at = got[0]
            assert resp.status_code == 200 and LeaseResponse.model_validate_json(resp.content).lease is None
            assert answered_at - stop_asked < 4.0
    finally:
        if not stopped:
            srv.stop()


def test_a_freed_prompt_wakes_one_held_request_not_all_of_them():
    """RoomSignal: each notification wakes the longest-waiting request only (the others keep waiting, no
    herd of retries); `everyone` wakes them all (the run finished, the server stops)."""
    import asyncio

    from orchestrator.room import RoomSignal

    async def scenario() -> tuple[list[int], list[int]]:
        room, woken = RoomSignal(), []

        async def waiter(i: int) -> None:
            await room.wait(5.0)
            woken.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
        await asyncio.sleep(0.05)
        room.notify()  # as the verification thread would (call_soon_threadsafe)
        await asyncio.sleep(0.05)
        after_one = list(woken)
        room.notify(everyone=True)
        await asyncio.gather(*tasks)
        return after_one, woken

    after_one, everyone = asyncio.run(scenario())
    assert after_one == [0]
    assert sorted(everyone) == [0, 1, 2, 3]
