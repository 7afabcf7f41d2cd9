"""A small orchestrator that serves the worker half of `protocol.api` exactly (paths, auth, models,
`ErrorBody` 4xx codes), with in-memory state and knobs for failure cases. Tests run it with uvicorn on
127.0.0.1 in a thread and can stop and restart it on the same port (a restart forgets every worker,
as a crashed orchestrator without state would).
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import uvicorn
import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from protocol import api, limits
from protocol import models as m
from protocol.operator_models import HealthStatus
from protocol.verdicts import Rejection, RejectionCode, Verdict, VerdictStatus

JOIN_TOKEN = "join-token-for-tests"


class Refused(Exception):
    STATUS = {
        m.ErrorCode.invalid_request: 422, m.ErrorCode.unauthorized: 401, m.ErrorCode.banned: 403,
        m.ErrorCode.not_found: 404, m.ErrorCode.lease_expired: 410, m.ErrorCode.lease_mismatch: 409,
        m.ErrorCode.version_too_old: 409, m.ErrorCode.duplicate: 409, m.ErrorCode.payload_too_large: 413,
        m.ErrorCode.rate_limited: 429, m.ErrorCode.unsupported_encoding: 415,
    }

    def __init__(self, code: m.ErrorCode, detail: str, **extra):
        self.body = m.ErrorBody(error=code, detail=detail, **extra)
        self.status = self.STATUS[code]


@dataclass
class Knobs:
    """What the server does; tests change these while it runs."""

    policy_version: int = 0
    async_level: int = 1
    prompts: int = 2  # prompts per lease (at most the worker's max_prompts)
    samples: int = 2
    max_tokens: int = 16
    lease_seconds: float = 60.0
    expire_submissions: int = 0  # answer lease_expired to this many submissions
    reject_verdicts: int = 0  # reject this many (schema-valid) submissions at verification
    payload_too_large: int = 0  # answer payload_too_large to this many submissions
    ban_after_submissions: int | None = None
    max_leases: int | None = None  # then no more tasks (retry_after)
    heartbeat_interval_s: float = 0.3
    relay_urls: list[str] = field(default_factory=list)
    public_key: str = ""
    run_id: str = "test-run"  # the run the shardcast manifests are signed for
    vocab_size: int = 64

    @property
    def min_policy_version(self) -> int:
        return max(0, self.policy_version - self.async_level)


@dataclass
class Record:
    """What the server saw, for the tests' assertions."""

    registrations: list[str] = field(default_factory=list)
    heartbeats: list[m.Heartbeat] = field(default_factory=list)
    leases: dict[str, m.TaskLease] = field(default_factory=dict)
    submissions: dict[str, m.RolloutSubmission] = field(default_factory=dict)  # lease_id -> accepted body
    released: dict[str, str] = field(default_factory=dict)  # lease_id -> reason
    refused: list[tuple[str, str]] = field(default_factory=list)  # (lease_id, code)
    verdicts: dict[str, Verdict] = field(default_factory=dict)


def make_app(knobs: Knobs, rec: Record) -> FastAPI:
    app = FastAPI()
    workers: dict[str, str] = {}  # secret -> worker id
    banned: set[str] = set()
    lease_owner: dict[str, str] = {}
    counter = itertools.count()
    lock = threading.Lock()

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused):
        return JSONResponse(exc.body.model_dump(mode="json", exclude_none=True), status_code=exc.status)

    def worker_of(request: Request) -> str:
        auth = request.headers.get(api.AUTH_HEADER, "")
        secret = auth.removeprefix("Bearer ").strip()
        for s, wid in workers.items():
            if hmac.compare_digest(s, secret):
                if wid in banned:
                    raise Refused(m.ErrorCode.banned, "you are banned")
                return wid
        raise Refused(m.ErrorCode.unauthorized, "unknown worker secret")

    async def parse(request: Request, model, context=None):
        body = await request.body()
        if len(body) > limits.MAX_BODY_BYTES:
            raise Refused(m.ErrorCode.payload_too_large, "body too large")
        enc = request.headers.get("content-encoding", "")
        if enc == "zstd":
            try:
                body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
            except zstandard.ZstdError as exc:
                raise Refused(m.ErrorCode.invalid_request, f"bad zstd: {exc}")
        elif enc not in ("", "identity"):
            raise Refused(m.ErrorCode.unsupported_encoding, enc)
        try:
            return model.model_validate_json(body, context=context)
        except ValidationError as exc:
            raise Refused(m.ErrorCode.invalid_request, str(exc)[:2000])

    def ok(model) -> Response:
        return Response(model.model_dump_json(), media_type="application/json")

    @app.get(api.HEALTH.path)
    async def health():
        return ok(HealthStatus(ok=True))

    @app.post(api.REGISTER.path)
    async def register(request: Request):
        if request.headers.get(api.AUTH_HEADER, "") != f"Bearer {JOIN_TOKEN}":
            raise Refused(m.ErrorCode.unauthorized, "bad join token")
        reg = await parse(request, m.WorkerRegistration)
        wid, secret = f"w{next(counter)}", secrets.token_hex(16)
        workers[secret] = wid
        rec.registrations.append(reg.name)
        return ok(m.WorkerRegistered(
            worker_id=wid, secret=secret, heartbeat_interval_s=knobs.heartbeat_interval_s,
            async_level=knobs.async_level, policy_version=knobs.policy_version, relay_urls=knobs.relay_urls,
            manifest_public_key=knobs.public_key, run_id=knobs.run_id,
        ))

    @app.post(api.HEARTBEAT.path)
    async def heartbeat(worker_id: str, request: Request):
        if worker_of(request) != worker_id:
            raise Refused(m.ErrorCode.unauthorized, "not you")
        rec.heartbeats.append(await parse(request, m.Heartbeat))
        return ok(m.HeartbeatAck(policy_version=knobs.policy_version, min_policy_version=knobs.min_policy_version,
            heartbeat_interval_s=knobs.heartbeat_interval_s))

    @app.post(api.LEASE.path)
    async def lease(request: Request):
        wid = worker_of(request)
        req = await parse(request, m.LeaseRequest)
        if req.loaded_policy_version < knobs.min_policy_version:
            raise Refused(m.ErrorCode.version_too_old, "load a newer version",
                min_policy_version=knobs.min_policy_version)
        with lock:
            if knobs.max_leases is not None and len(rec.leases) >= knobs.max_leases:
                return ok(m.LeaseResponse(lease=None, retry_after_s=0.2))
            n = next(counter)
            rng = np.random.default_rng(n)
            lease_id = f"lease-{n}"
            task = m.TaskLease(
                lease_id=lease_id,
                prompts=[
                    m.TaskPrompt(prompt_id=f"p{n}-{i}", token_ids=rng.integers(3, knobs.vocab_size,
                    size=6).astype(np.int32), seeds=[int(s) for s in rng.integers(0, 2**31, size=knobs.samples)])
                    for i in range(min(knobs.prompts, req.max_prompts))
                ],
                samples_per_prompt=knobs.samples,
                sampling=m.SamplingParams(temperature=1.0, max_tokens=knobs.max_tokens),
                policy_version=knobs.policy_version,
                min_policy_version=knobs.min_policy_version,
                deadline=time.time() + knobs.lease_seconds,
            )
            rec.leases[lease_id] = task
            lease_owner[lease_id] = wid
        return ok(m.LeaseResponse(lease=task))

    @app.post(api.RELEASE.path)
    async def release(lease_id: str, request: Request):
        wid = worker_of(request)
        body = await parse(request, m.ReleaseRequest)
        if lease_owner.get(lease_id) != wid:
            raise Refused(m.ErrorCode.not_found, "no such lease of yours")
        if lease_id in rec.submissions or lease_id in rec.released:
            return ok(m.ReleaseAck(lease_id=lease_id, released=False))
        rec.released[lease_id] = body.reason
        return ok(m.ReleaseAck(lease_id=lease_id, released=True))

    @app.post(api.SUBMIT.path)
    async def submit(request: Request):
        wid = worker_of(request)
        sub = await parse(request, m.RolloutSubmission, context={"vocab_size": knobs.vocab_size})

        def refuse(code, detail, **extra):
            rec.refused.append((sub.lease_id, code.value))
            return Refused(code, detail, **extra)

        task = rec.leases.get(sub.lease_id)
        if task is None or lease_owner.get(sub.lease_id) != wid:
            raise refuse(m.ErrorCode.lease_mismatch, "no such lease of yours")
        if sub.lease_id in rec.submissions:
            raise refuse(m.ErrorCode.duplicate, "already submitted")
        if sub.lease_id in rec.released:
            raise refuse(m.ErrorCode.lease_expired, "you released it")
        if knobs.expire_submissions > 0 or time.time() > task.deadline:
            knobs.expire_submissions = max(0, knobs.expire_submissions - 1)
            raise refuse(m.ErrorCode.lease_expired, "lease deadline passed")
        if knobs.payload_too_large > 0:
            knobs.payload_too_large -= 1
            raise refuse(m.ErrorCode.payload_too_large, "too big for this test")
        if sub.policy_version < knobs.min_policy_version:
            raise refuse(m.ErrorCode.version_too_old, "generated with a version that is too old",
                min_policy_version=knobs.min_policy_version)
        if len(sub.completions) != task.num_completions:
            raise refuse(m.ErrorCode.lease_mismatch, f"{len(sub.completions)} completions for {task.num_completions}")
        rec.submissions[sub.lease_id] = sub
        sid = f"s-{sub.lease_id}"
        if knobs.reject_verdicts > 0:
            knobs.reject_verdicts -= 1
            verdict = Verdict(submission_id=sid, status=VerdictStatus.rejected,
                rejections=[Rejection(code=RejectionCode.proof_mismatch, message="test server says no")])
        else:
            verdict = Verdict(submission_id=sid, status=VerdictStatus.accepted, rewards=[0.5] * len(sub.completions),
                verified_tokens=sub.num_tokens)
        rec.verdicts[sid] = verdict
        if knobs.ban_after_submissions is not None and len(rec.submissions) >= knobs.ban_after_submissions:
            banned.add(wid)
        return ok(m.SubmissionReceipt(submission_id=sid, lease_id=sub.lease_id, num_completions=len(sub.completions)))

    @app.get(api.VERDICT.path)
    async def verdict(submission_id: str, request: Request):
        worker_of(request)
        v = rec.verdicts.get(submission_id)
        if v is None:
            raise Refused(m.ErrorCode.not_found, "no such submission")
        return ok(v)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ContractServer:
    """uvicorn in a thread; `stop()` then `start()` again is an orchestrator restart with empty state."""

    def __init__(self, knobs: Knobs, port: int | None = None):
        self.knobs = knobs
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record = Record()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "ContractServer":
        self.record = Record()
        config = uvicorn.Config(make_app(self.knobs, self.record), host="127.0.0.1", port=self.port,
            log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("contract server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

