"""Every endpoint over real HTTP (uvicorn on 127.0.0.1, SQLite file), with good and bad inputs."""

from __future__ import annotations

import base64
import hashlib
import re
import socket
import time

import httpx
import numpy as np
import pytest
import zstandard
from orch_fakes import HASH0, encode, make_orchestrator, make_submission, run_config

from orchestrator.admission import parse_submission
from orchestrator.errors import ApiError
from orchestrator.server import OrchestratorServer
from protocol import api, limits
from protocol.models import (
    ErrorBody,
    HeartbeatAck,
    LeaseResponse,
    ReleaseAck,
    SubmissionReceipt,
    TaskLease,
    WorkerRegistered,
)
from protocol.operator_models import (
    RunStatus,
    WorkerList,
    WorkerRecord,
)
from protocol.verdicts import Verdict
from swarmrl.status_view import fetch_status
from swarmrl.status_view import status as print_status

ADMIN = "test-admin-token"
JOIN = "test-join-token"


def bearer(t: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {t}"}


@pytest.fixture
def server(tmp_path):
    cfg = run_config(tmp_path, admin_token=ADMIN, join_tokens=[JOIN, "second-join"], request_timeout_s=2.0,
                     max_open_leases_per_worker=2, strikes_to_ban=2)
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def error(r: httpx.Response, status: int, code: str) -> ErrorBody:
    assert r.status_code == status, r.text
    body = ErrorBody.model_validate_json(r.content)
    assert body.error.value == code and body.detail
    return body


def register(client, name="w1") -> WorkerRegistered:
    r = client.post(api.REGISTER.path, json={"name": name, "device": "cpu"}, headers=bearer(JOIN))
    assert r.status_code == 200, r.text
    return WorkerRegistered.model_validate_json(r.content)


def get_lease(client, w: WorkerRegistered, **kw) -> TaskLease:
    r = client.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 64, **kw},
        headers=bearer(w.secret))
    assert r.status_code == 200, r.text
    lease = LeaseResponse.model_validate_json(r.content).lease
    assert lease is not None
    return lease


def wait_verdict(client, w, sid, timeout=10.0) -> Verdict:
    deadline = time.time() + timeout
    while True:
        r = client.get(api.VERDICT.url("", submission_id=sid), headers=bearer(w.secret))
        assert r.status_code == 200, r.text
        v = Verdict.model_validate_json(r.content)
        if v.status.value != "pending" or time.time() > deadline:
            return v
        time.sleep(0.05)


def test_register(client):
    w = register(client)
    assert w.worker_id and len(w.secret) >= 32 and w.async_level == 2 and w.policy_version == 0
    assert register(client, "w2").worker_id != w.worker_id
    r = client.post(api.REGISTER.path, json={"name": "x"}, headers=bearer("second-join"))
    assert r.status_code == 200
    error(client.post(api.REGISTER.path, json={"name": "x"}), 401, "unauthorized")
    error(client.post(api.REGISTER.path, json={"name": "x"}, headers=bearer("wrong")), 401, "unauthorized")
    error(client.post(api.REGISTER.path, json={"name": "x"}, headers=bearer(ADMIN)), 401, "unauthorized")
    error(client.post(api.REGISTER.path, json={"name": "bad name!"}, headers=bearer(JOIN)), 422, "invalid_request")
    error(client.post(api.REGISTER.path, json={"name": "x", "extra": 1}, headers=bearer(JOIN)), 422, "invalid_request")
    error(client.post(api.REGISTER.path, content=b"{not json",
        headers=bearer(JOIN) | {"content-type": "application/json"}), 422, "invalid_request")
    error(client.post(api.REGISTER.path, json=[1, 2], headers=bearer(JOIN)), 422, "invalid_request")


def test_heartbeat(client):
    w = register(client)
    other = register(client, "w2")
    url = api.HEARTBEAT.url("", worker_id=w.worker_id)
    r = client.post(url, json={"state": "generating", "loaded_policy_version": 0, "tokens_per_s": 3.5},
        headers=bearer(w.secret))
    assert r.status_code == 200
    ack = HeartbeatAck.model_validate_json(r.content)
    # pins what the worker pulls
    assert ack.policy_version == 0 and ack.heartbeat_interval_s > 0 and ack.policy_model_hash == HASH0
    error(client.post(url, json={"state": "idle"}, headers=bearer(other.secret)), 403, "forbidden")
    error(client.post(url, json={"state": "idle"}), 401, "unauthorized")
    error(client.post(url, json={"state": "idle"}, headers=bearer(JOIN)), 401, "unauthorized")
    error(client.post(url, json={"state": "dancing"}, headers=bearer(w.secret)), 422, "invalid_request")
    error(client.post(url, json={"state": "idle", "tokens_per_s": -1}, headers=bearer(w.secret)), 422,
        "invalid_request")


def test_lease_release(client):
    w = register(client)
    lease = get_lease(client, w)
    assert len(lease.prompts) == 2 and lease.samples_per_prompt == 4 and lease.deadline > time.time()
    assert get_lease(client, w, max_prompts=1).prompts[0].prompt_id not in {p.prompt_id for p in lease.prompts}
    error(client.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(w.secret)), 429,
        "too_many_leases")
    rel = api.RELEASE.url("", lease_id=lease.lease_id)
    other = register(client, "w2")
    error(client.post(rel, json={}, headers=bearer(other.secret)), 404, "not_found")
    r = client.post(rel, json={"reason": "shutting down"}, headers=bearer(w.secret))
    assert r.status_code == 200 and ReleaseAck.model_validate_json(r.content).released
    r = client.post(rel, headers=bearer(w.secret))  # no body is fine; already released
    assert r.status_code == 200 and not ReleaseAck.model_validate_json(r.content).released
    error(client.post(api.RELEASE.url("", lease_id="nope"), json={}, headers=bearer(w.secret)), 404, "not_found")
    error(client.post(api.LEASE.path, json={"loaded_policy_version": -1}, headers=bearer(w.secret)), 422,
        "invalid_request")
    error(client.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 0}, headers=bearer(w.secret)),
        422, "invalid_request")
    error(client.post(api.LEASE.path, json={"loaded_policy_version": 9}, headers=bearer(w.secret)), 422,
        "invalid_request")


def test_lease_bad_inputs(client):
    # lease parses its own body and token (no FastAPI body parameter): refused as FastAPI refused them.
    w = register(client)
    h = bearer(w.secret)
    good = b'{"loaded_policy_version": 0}'
    for content, headers, reason in [
        (good, {"content-type": "text/plain"}, "expected JSON"),
        (good, {}, "expected JSON"),  # no Content-Type
        (b"{not json", {"content-type": "application/json"}, "Invalid JSON"),
        (b"", {"content-type": "application/json"}, "body"),
        (b"[1, 2]", {"content-type": "application/json"}, "body"),
        (b'{"loaded_policy_version": "x"}', {"content-type": "application/json"}, "body.loaded_policy_version"),
        (b'{"loaded_policy_version": 0, "max_prompts": 65}', {"content-type": "application/json"}, "body.max_prompts"),
        (b'{"loaded_policy_version": 0, "worker": "w2"}', {"content-type": "application/json"}, "body.worker"),
        (b'{"loaded_policy_version": 0, "request_id": "bad id"}', {"content-type": "application/vnd.x+json"},
        "body.request_id"),
    ]:
        assert reason in error(client.post(api.LEASE.path, content=content, headers=h | headers), 422,
            "invalid_request").detail
    # Authentication comes first, on every endpoint: a bad body without a token is refused as unauthorized.
    error(client.post(api.LEASE.path, content=b"{not json", headers={"content-type": "application/json"}), 401,
        "unauthorized")
    for headers in ({}, {"Authorization": w.secret}, {"Authorization": "Basic " + w.secret},
                    {"Authorization": "Bearer"}, bearer(ADMIN), bearer(w.secret + "x")):
        error(client.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=headers), 401, "unauthorized")
    # Charset parameters and case are fine.
    r = client.post(api.LEASE.path, content=good, headers=h | {"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and LeaseResponse.model_validate_json(r.content).lease is not None


def test_hot_endpoints_documented_like_the_others(client):
    spec = client.get("/openapi.json").json()
    for ep, model in ((api.LEASE, "LeaseRequest"), (api.SUBMIT, "RolloutSubmission")):
        op = spec["paths"][ep.path]["post"]
        assert op["security"] == [{"HTTPBearer": []}]
        assert op["requestBody"]["required"] is True
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{ep.response.__name__}"}
        assert op["responses"]["422"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"}
    lease_request = spec["components"]["schemas"]["LeaseRequest"]
    assert lease_request["required"] == ["loaded_policy_version"] and lease_request["additionalProperties"] is False
    assert set(lease_request["properties"]) == {"loaded_policy_version", "max_prompts", "request_id", "wait_s"}


def test_submit_and_verdict(client, server):
    w = register(client)
    lease = get_lease(client, w)
    sub = make_submission(lease, np.random.default_rng(0))
    body = zstandard.ZstdCompressor().compress(encode(sub))
    r = client.post(api.SUBMIT.path, content=body, headers=bearer(w.secret) | {"content-encoding": "zstd",
        "content-type": "application/json"})
    assert r.status_code == 200, r.text
    receipt = SubmissionReceipt.model_validate_json(r.content)
    assert receipt.lease_id == lease.lease_id and receipt.num_completions == 8
    v = wait_verdict(client, w, receipt.submission_id)
    assert v.status.value == "accepted" and len(v.rewards) == 8
    # Replays: same body again, and to another lease.
    error(client.post(api.SUBMIT.path, content=body, headers=bearer(w.secret) | {"content-encoding": "zstd"}), 409,
        "duplicate")
    lease2 = get_lease(client, w)
    replay = sub.model_copy(update={"lease_id": lease2.lease_id})
    error(client.post(api.SUBMIT.path, content=encode(replay), headers=bearer(w.secret)), 409, "duplicate")
    # Verdicts are private to their worker.
    other = register(client, "w2")
    error(client.get(api.VERDICT.url("", submission_id=receipt.submission_id), headers=bearer(other.secret)), 404,
        "not_found")
    error(client.get(api.VERDICT.url("", submission_id="Snope"), headers=bearer(w.secret)), 404, "not_found")


def test_submit_bad_inputs(client, server):
    w = register(client)
    lease = get_lease(client, w)
    h = bearer(w.secret)
    good = make_submission(lease, np.random.default_rng(1))
    # schema
    error(client.post(api.SUBMIT.path, content=b"{}", headers=h), 422, "invalid_request")
    error(client.post(api.SUBMIT.path, content=b"\xff\xfe garbage", headers=h), 422, "invalid_request")
    doc = good.model_dump(mode="json")
    doc["completions"][0]["logprobs"] = "!!notbase64"
    error(client.post(api.SUBMIT.path, json=doc, headers=h), 422, "invalid_request")
    doc = good.model_dump(mode="json")
    doc["completions"][0]["token_ids"] = "AAAA////"  # -1 as int32: negative token id
    error(client.post(api.SUBMIT.path, json=doc, headers=h), 422, "invalid_request")
    big = make_submission(lease, np.random.default_rng(1)).model_dump(mode="json")
    from protocol.arrays import pack

    big["completions"][0]["token_ids"] = pack([70] * 1, "int32")  # outside the 64-token vocabulary
    big["completions"][0]["logprobs"] = pack([-1.0], "float32")
    big["completions"][0]["proofs"] = big["completions"][0]["proofs"][:1]
    error(client.post(api.SUBMIT.path, json=big, headers=h), 422, "invalid_request")
    # Arrays are checked for all completions at once: a bad value in the last completion is refused and named.
    last = len(good.completions) - 1
    n = good.completions[last].token_ids.size
    for field, values, reason in [
        ("logprobs", [-0.5] * (n - 1) + [float("nan")], f"completion {last}: logprobs contain NaN"),
        ("logprobs", [0.5] + [-0.5] * (n - 1), f"completion {last}: logprobs must be <= 0"),
        ("token_ids", [3] * (n - 1) + [64], f"completion {last}: token id 64 is outside the vocabulary"),
    ]:
        doc = good.model_dump(mode="json")
        doc["completions"][last][field] = pack(values, "float32" if field == "logprobs" else "int32")
        assert reason in error(client.post(api.SUBMIT.path, json=doc, headers=h), 422, "invalid_request").detail
    # lease / version
    error(client.post(api.SUBMIT.path, content=encode(good.model_copy(update={"lease_id": "L-unknown"})), headers=h),
        404, "not_found")
    error(client.post(api.SUBMIT.path, content=encode(good.model_copy(update={"completions": good.completions[:3]})),
        headers=h), 409, "lease_mismatch")
    # encodings and size caps
    error(client.post(api.SUBMIT.path, content=encode(good), headers=h | {"content-encoding": "gzip"}), 415,
        "unsupported_encoding")
    error(client.post(api.SUBMIT.path, content=b"not zstd at all", headers=h | {"content-encoding": "zstd"}), 400,
        "invalid_request")
    error(client.post(api.SUBMIT.path, content=b"x" * (limits.MAX_BODY_BYTES + 1), headers=h), 413, "payload_too_large")
    # No auth / wrong auth
    error(client.post(api.SUBMIT.path, content=encode(good)), 401, "unauthorized")
    error(client.post(api.SUBMIT.path, content=encode(good), headers=bearer(ADMIN)), 401, "unauthorized")
    # After all that, the good submission still goes through.
    r = client.post(api.SUBMIT.path, content=encode(good), headers=h)
    assert r.status_code == 200, r.text


def test_zstd_bomb_is_cut_off(client, server):
    import resource

    w = register(client)
    # 1 GiB of zeros compresses to ~32 KiB: far below the compressed cap.
    cctx = zstandard.ZstdCompressor(level=3)
    chunk = b"\0" * (16 << 20)
    bomb = b"".join(cctx.compress(chunk) for _ in range(64))
    assert len(bomb) < limits.MAX_BODY_BYTES
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = client.post(api.SUBMIT.path, content=bomb, headers=bearer(w.secret) | {"content-encoding": "zstd"})
    error(r, 413, "payload_too_large")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 512 << 10  # far less than the 1 GiB the bomb expands to
    assert client.get(api.HEALTH.path).status_code == 200


def read_response(s: socket.socket) -> str:
    """One whole HTTP response: headers and body may arrive in separate TCP segments."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := s.recv(4096)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := s.recv(4096)):
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_credentials_first_then_the_body_cap_from_the_header(server, client):
    """Announce a huge body and send none of it: without a valid credential it is refused as
    unauthorized, and with one as too large, both from the headers alone, without reading the body."""
    host, port = server.url.removeprefix("http://").split(":")
    w = register(client)
    for token, status, code in (("w-nobody.x", "401", "unauthorized"), (w.secret, "413", "payload_too_large")):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(
                f"POST {api.SUBMIT.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Length: {limits.MAX_BODY_BYTES * 4}\r\n\r\n".encode()
            )
            reply = read_response(s)
        assert reply.startswith(f"HTTP/1.1 {status}") and code in reply, reply


def test_a_request_head_is_bounded_in_headers_and_bytes(server, client):
    """uvicorn keeps every header as Python objects (about 15 times the bytes for many small ones), before
    any credential is looked at: too many headers, or too many head bytes however slowly sent, get 431."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"GET {api.HEALTH.path} HTTP/1.1\r\nHost: x\r\n".encode() + b"X-P: a\r\n" * 5000)
        reply = read_response(s)
    assert reply.startswith("HTTP/1.1 431") and "more than 100 request headers" in reply, reply
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"GET {api.HEALTH.path} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode())
        try:
            for _ in range(64):  # 64 KiB of one header value, in pieces: the parser buffers it whole
                s.sendall(b"a" * 1024)
                time.sleep(0.005)
        except OSError:  # closed by the server while we were still sending
            pass
        reply = read_response(s)
    assert reply.startswith("HTTP/1.1 431") and "request head larger than" in reply, reply
    # An honest request with a body that arrives in the same read as its head is not counted as head bytes.
    w = register(client)
    big = b'{"name": "w2", "device": "cpu", "client_version": "' + b"1" * 20 + b'"}' + b" " * 60_000
    r = client.post(api.REGISTER.path, content=big, headers=bearer(JOIN) | {"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert client.get(api.HEALTH.path).status_code == 200 and w.worker_id


def test_a_body_of_many_unknown_keys_is_refused_without_listing_them():
    """A 6 MB body under a real run's cap can hold half a million unknown keys: listing them all would cost
    the server seconds of CPU (the test server's cap is too small for this, so admission is called directly)."""
    with pytest.raises(ApiError) as refused:
        parse_submission(b"{" + b",".join(b'"k%d":0' % i for i in range(50_000)) + b"}", vocab_size=100)
    assert "50004 validation errors (too many to list)" in refused.value.detail
    with pytest.raises(ApiError) as refused:
        parse_submission(b'{"lease_id": 5, "x": 1}', vocab_size=100)
    assert "lease_id: Input should be a valid string" in refused.value.detail
    assert "x: Extra inputs are not permitted" in refused.value.detail


def test_slow_body_times_out(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST {api.REGISTER.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {JOIN}\r\nContent-Length: "
            f"100\r\n\r\n{{".encode())
        reply = read_response(s)  # never send the rest: the server gives up after request_timeout_s
    assert reply.startswith("HTTP/1.1 503") and "not completed within" in reply


def test_version_too_old_over_http(client, server):
    w = register(client)
    lease = get_lease(client, w)
    for v in (1, 2, 3):
        server.orch.versions.announce({v: f"{v}" * 64})
    r = client.post(api.SUBMIT.path, content=encode(make_submission(lease, np.random.default_rng(0))),
        headers=bearer(w.secret))
    body = error(r, 409, "version_too_old")
    assert body.min_policy_version == 1
    body = error(client.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(w.secret)), 409,
        "version_too_old")
    assert body.min_policy_version == 1


def test_refusals_of_lease_and_submit_are_counted(client, server):
    """Lease and submit skip the router (BareRouteDispatch): their refusals still take the app's ApiError
    path, the same error body and the same count by code as any other endpoint's."""
    w = register(client)
    error(client.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer("w-nobody.secret")), 401,
        "unauthorized")
    error(client.post(api.LEASE.path, content=b"{", headers=bearer(w.secret) | {"content-type": "application/json"}),
        422, "invalid_request")
    error(client.post(api.SUBMIT.path, content=b"x", headers=bearer(w.secret) | {"content-encoding": "br"}), 415,
        "unsupported_encoding")
    m = client.get(api.METRICS.path, headers=bearer(ADMIN)).text
    for code in ("unauthorized", "invalid_request", "unsupported_encoding"):
        assert f'swarmrl_requests_refused_total{{code="{code}"}} 1.0' in m, code


def test_operator_endpoints(client, server):
    w = register(client)
    lease = get_lease(client, w)
    client.post(api.SUBMIT.path, content=encode(make_submission(lease, np.random.default_rng(0))),
        headers=bearer(w.secret))
    for ep in (api.STATUS, api.WORKERS, api.METRICS):
        error(client.get(ep.path), 401, "unauthorized")
        error(client.get(ep.path, headers=bearer("nope")), 401, "unauthorized")
        error(client.get(ep.path, headers=bearer(w.secret)), 403, "forbidden")  # worker tokens refused
    r = client.get(api.STATUS.path, headers=bearer(ADMIN))
    assert r.status_code == 200
    st = RunStatus.model_validate_json(r.content)
    assert st.run_name == "test" and st.workers_online == 1
    wl = WorkerList.model_validate_json(client.get(api.WORKERS.path, headers=bearer(ADMIN)).content)
    assert [x.worker_id for x in wl.workers] == [w.worker_id]
    m = client.get(api.METRICS.path, headers=bearer(ADMIN))
    assert m.status_code == 200 and "swarmrl_submissions_total 1.0" in m.text and "swarmrl_requests_refused" in m.text
    hist = client.get("/v1/status/history", headers=bearer(ADMIN))
    assert hist.status_code == 200 and set(hist.json()) == {"status", "workers", "history"}
    error(client.get("/v1/status/history", headers=bearer(w.secret)), 403, "forbidden")


def test_ban_unban(client):
    w = register(client)
    ban = api.BAN.url("", worker_id=w.worker_id)
    error(client.post(ban, json={"reason": "x"}, headers=bearer(w.secret)), 403, "forbidden")
    r = client.post(ban, json={"reason": "cheating"}, headers=bearer(ADMIN))
    assert r.status_code == 200 and WorkerRecord.model_validate_json(r.content).banned
    error(client.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(w.secret)), 403, "banned")
    r = client.post(api.UNBAN.url("", worker_id=w.worker_id), headers=bearer(ADMIN))
    assert r.status_code == 200 and not WorkerRecord.model_validate_json(r.content).banned
    get_lease(client, w)
    error(client.post(api.BAN.url("", worker_id="w-missing"), json={}, headers=bearer(ADMIN)), 404, "not_found")
    error(client.post(ban, json={"reason": "x" * 5000}, headers=bearer(ADMIN)), 422, "invalid_request")


def test_a_ban_lands_on_requests_whose_headers_came_before_it(server, client):
    """Credentials are checked from the headers; a ban that lands while a body is still arriving must refuse
    the request all the same: no new identity under the banned token, no lease, no heartbeat, no rollouts."""
    host, port = server.url.removeprefix("http://").split(":")
    w = register(client)
    held = get_lease(client, w)
    submission = encode(make_submission(held, np.random.default_rng(0)))
    bodies = {
        (api.REGISTER.path, JOIN): b'{"name": "w9", "device": "cpu"}',
        (api.LEASE.path, w.secret): b'{"loaded_policy_version": 0, "max_prompts": 64}',
        (api.HEARTBEAT.url("", worker_id=w.worker_id),
        w.secret): b'{"state": "generating", "loaded_policy_version": 0}',
        (api.SUBMIT.path, w.secret): submission,
    }
    sockets = {}
    for (path, token), body in bodies.items():  # everything but the body's last byte
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:-1])
        sockets[path] = s
    time.sleep(0.3)  # the gate has authenticated all four
    r = client.post(api.BAN.url("", worker_id=w.worker_id), json={"reason": "cheating", "scope": "token"},
        headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    for (path, _), body in bodies.items():
        with sockets[path] as s:
            s.sendall(body[-1:])
            reply = read_response(s)
        assert reply.startswith("HTTP/1.1 403") and "banned" in reply, (path, reply)
    workers = WorkerList.model_validate_json(client.get(api.WORKERS.path, headers=bearer(ADMIN)).content).workers
    assert [x.worker_id for x in workers] == [w.worker_id] and workers[0].banned
    status = RunStatus.model_validate_json(client.get(api.STATUS.path, headers=bearer(ADMIN)).content)
    assert status.submissions_accepted == 0 and status.buffer_depth == 0


def test_ban_after_strikes_over_http(client):
    w = register(client)
    receipts = []
    for i in range(2):
        lease = get_lease(client, w)
        r = client.post(api.SUBMIT.path, content=encode(make_submission(lease, np.random.default_rng(i), bad=True)),
            headers=bearer(w.secret))
        assert r.status_code == 200
        receipts.append(SubmissionReceipt.model_validate_json(r.content).submission_id)
        if i == 0:
            assert wait_verdict(client, w, receipts[0]).status.value == "rejected"
    # The second strike bans: from then on the secret can do nothing, not even read its verdicts.
    deadline = time.time() + 10
    while (r := client.get(api.VERDICT.url("", submission_id=receipts[1]),
        headers=bearer(w.secret))).status_code == 200 and time.time() < deadline:
        time.sleep(0.05)
    error(r, 403, "banned")
    error(client.post(api.LEASE.path, json={"loaded_policy_version": 0}, headers=bearer(w.secret)), 403, "banned")
    rec = WorkerList.model_validate_json(client.get(api.WORKERS.path, headers=bearer(ADMIN)).content).workers[0]
    assert rec.banned and rec.strikes == 2 and rec.submissions_rejected == 2


def test_rate_limit_over_http(tmp_path):
    cfg = run_config(tmp_path, rate_limit_per_s=2.0, admin_token=ADMIN, join_tokens=[JOIN])
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            w = register(c)
            codes = [c.post(api.HEARTBEAT.url("", worker_id=w.worker_id), json={"state": "idle"},
                headers=bearer(w.secret)) for _ in range(10)]
            limited = [r for r in codes if r.status_code == 429]
            assert limited and "retry-after" in limited[0].headers
            error(limited[0], 429, "rate_limited")
    finally:
        srv.stop()


def test_health_docs_dashboard(client, server):
    assert client.get(api.HEALTH.path).json() == {"ok": True, "detail": ""}
    assert client.get(api.READY.path).status_code == 200
    server.orch.ready = False
    assert client.get(api.READY.path).status_code == 503
    server.orch.ready = True
    spec = client.get("/openapi.json").json()
    for ep in api.ALL_ENDPOINTS:
        assert ep.method.lower() in spec["paths"][ep.path], ep.path
    assert "RolloutSubmission" in spec["components"]["schemas"]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text
    from orchestrator.api import swagger_assets

    if swagger_assets() is not None:  # served locally: works without internet
        assert "cdn" not in docs.text and client.get("/docs/static/swagger-ui-bundle.js").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and "<svg" not in page.text and "/v1/status/history" in page.text
    text = page.text.replace("http://www.w3.org/2000/svg", "")  # an XML namespace name, not a download
    assert "http://" not in text and "https://" not in text  # self-contained: no CDN
    error(client.get("/no/such/path"), 404, "not_found")
    error(client.delete(api.STATUS.path, headers=bearer(ADMIN)), 405, "invalid_request")


def test_no_redirect_to_the_request_host(server, client):
    """Starlette's slash redirect answered `GET /v1/status/` with `Location: http://<Host header>/v1/status`:
    an open redirect. Every such path is a plain 404 naming itself, and nothing points at the forged host."""
    evil = "evil.example"
    paths = ["/v1/status/", "/v1/workers/", "/docs/", "/openapi.json/", "/docs/static"]
    paths += [ep.url("", **{p: "x" for p in re.findall(r"\{(\w+)\}", ep.path)}) + "/" for ep in api.ALL_ENDPOINTS]
    for path in paths:
        for method in ("GET", "POST"):
            for headers in ({"Host": evil}, {"Host": evil, **bearer(ADMIN)}):
                r = client.request(method, path, headers=headers)
                assert "location" not in r.headers, (method, path, r.headers["location"])
                assert evil not in r.text
                assert path in error(r, 404, "not_found").detail
    body = error(client.get("/v1/status/", headers={"Host": evil}), 404, "not_found")
    assert "trailing slash" in body.detail
    # The same with the target in absolute form (the host in the request line, not the header).
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"GET http://{evil}/v1/workers/ HTTP/1.1\r\nHost: {evil}\r\n\r\n".encode())
        reply = read_response(s)
    assert reply.startswith("HTTP/1.1 404") and "location:" not in reply.lower(), reply


def test_dashboard_content_security_policy(client):
    """The dashboard runs only its own inline script and style, allowed by hash (no 'unsafe-inline'), and
    fetches only from its own origin; the hashes are those of the script and style actually served."""
    page = client.get("/")
    assert page.status_code == 200
    csp = {d.split()[0]: d.split()[1:] for d in page.headers["content-security-policy"].split(";") if d.strip()}
    assert "'unsafe-inline'" not in page.headers["content-security-policy"]
    assert "'unsafe-eval'" not in page.headers["content-security-policy"]
    assert csp["default-src"] == ["'none'"] and csp["connect-src"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"]
    assert csp["base-uri"] == ["'none'"] and csp["form-action"] == ["'none'"]
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        bodies = re.findall(rf"<{tag}\b[^>]*>(.*?)</{tag}>", page.text, flags=re.S)
        assert bodies, tag
        served = sorted(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)
        assert sorted(csp[directive]) == served, (directive, csp[directive], served)
    # Hashes cover <script> and <style> elements only: inline handlers and style attributes would be blocked.
    markup = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", page.text, flags=re.S)
    assert not re.search(r"\s(on\w+|style)\s*=", markup, flags=re.I), markup
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["x-frame-options"] == "DENY"


def test_status_helper(server):
    st = fetch_status(server.url, ADMIN)
    assert st.policy_version == 0
    from rich.console import Console

    console = Console(record=True, width=100)
    print_status(server.url, ADMIN, console)
    text = console.export_text()
    assert "policy version" in text and "verifier actors" in text and "verification queue" in text
    with pytest.raises(RuntimeError, match="401"):
        fetch_status(server.url, "wrong")
