"""HTTP client of the orchestrator's worker API (`protocol.api`), with typed errors and retries.

- Auth: `Authorization: Bearer <join token>` to register, `Bearer <worker secret>` afterwards.
- Submissions travel as zstd-compressed JSON (`Content-Encoding: zstd`); the compressed size is checked
  against `protocol.limits.MAX_BODY_BYTES` before anything is sent.
- Every 4xx carries a `protocol.ErrorBody`; it becomes one exception class per error code, so the loop
  can act on it (`except LeaseExpired: ...`).
- Network errors, 5xx and 429 are retried with exponential backoff and full jitter; when the retries
  run out, `OrchestratorUnavailable` (or `RateLimited`) is raised and the caller decides what next.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Callable, TypeVar

import httpx
import zstandard
from pydantic import BaseModel, ValidationError

from protocol import api, limits
from protocol import models as m
from protocol.retry import backoff_delays
from protocol.verdicts import Verdict

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)
CLIENT_VERSION = "0.1.0"
_UNKNOWN_WARNED: set[tuple[str, str]] = set()  # (model, fields) already warned about


class OrchestratorError(Exception):
    """A 4xx answer: the request was understood and refused. Retrying the same request will not help."""

    def __init__(self, status: int, body: m.ErrorBody):
        super().__init__(f"{status} {body.error.value}: {body.detail}")
        self.status = status
        self.body = body

    @property
    def code(self) -> m.ErrorCode:
        return self.body.error


class InvalidRequest(OrchestratorError): ...
class Unauthorized(OrchestratorError): ...  # unknown or revoked secret (e.g. the orchestrator lost its state)
class Forbidden(OrchestratorError): ...
class Banned(OrchestratorError): ...
class NotFound(OrchestratorError): ...
class LeaseExpired(OrchestratorError): ...
class LeaseMismatch(OrchestratorError): ...
class Duplicate(OrchestratorError): ...
class PayloadTooLarge(OrchestratorError): ...
class TooManyLeases(OrchestratorError): ...
class UnsupportedEncoding(OrchestratorError): ...


class VersionTooOld(OrchestratorError):
    @property
    def min_policy_version(self) -> int | None:
        return self.body.min_policy_version


class RateLimited(OrchestratorError):
    @property
    def retry_after_s(self) -> float | None:
        return self.body.retry_after_s


class OrchestratorUnavailable(Exception):
    """Could not get an answer (connection refused, timeouts, 5xx) after all retries."""


ERRORS: dict[m.ErrorCode, type[OrchestratorError]] = {
    m.ErrorCode.invalid_request: InvalidRequest,
    m.ErrorCode.unauthorized: Unauthorized,
    m.ErrorCode.forbidden: Forbidden,
    m.ErrorCode.banned: Banned,
    m.ErrorCode.not_found: NotFound,
    m.ErrorCode.lease_expired: LeaseExpired,
    m.ErrorCode.lease_mismatch: LeaseMismatch,
    m.ErrorCode.version_too_old: VersionTooOld,
    m.ErrorCode.duplicate: Duplicate,
    m.ErrorCode.payload_too_large: PayloadTooLarge,
    m.ErrorCode.rate_limited: RateLimited,
    m.ErrorCode.too_many_leases: TooManyLeases,
    m.ErrorCode.unsupported_encoding: UnsupportedEncoding,
    m.ErrorCode.too_many_identities: RateLimited,  # the token's other identity is still live: wait as told
}


def error_from_response(resp: httpx.Response) -> OrchestratorError:
    try:
        body = m.ErrorBody.model_validate_json(resp.content)
    except ValidationError:
        code = api.code_for_status(resp.status_code)  # not an ErrorBody (a proxy in between, say)
        retry_after = resp.headers.get("Retry-After")
        body = m.ErrorBody(
            error=code,
            detail=resp.text[: limits.MAX_MESSAGE_CHARS] or resp.reason_phrase,
            retry_after_s=float(retry_after) if retry_after and retry_after.replace(".", "", 1).isdigit() else None,
        )
    return ERRORS[body.error](resp.status_code, body)


class OrchestratorClient:
    def __init__(
        self,
        base_url: str,
        *,
        secret: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.base_url = base_url.rstrip("/")
        self.secret = secret
        self.worker_id: str | None = None
        self.retries = retries
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._http = httpx.Client(timeout=timeout_s, transport=transport,
            headers={"User-Agent": f"swarmrl-worker/{CLIENT_VERSION}"})
        self._zstd = zstandard.ZstdCompressor(level=3)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "OrchestratorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------

    def _request(self, endpoint: api.Endpoint, *, token: str | None, body: bytes | None = None,
        headers: dict | None = None, retries: int | None = None, **params: str) -> httpx.Response:
        url = endpoint.url(self.base_url, **params)
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        hdrs.update(headers or {})
        if token:
            hdrs[api.AUTH_HEADER] = f"Bearer {token}"
        delays = backoff_delays(self.backoff_initial_s, self.backoff_max_s)
        attempts = (self.retries if retries is None else retries) + 1
        last: str = ""
        for attempt in range(attempts):
            try:
                resp = self._http.request(endpoint.method, url, content=body, headers=hdrs)
            except httpx.TransportError as exc:  # connection refused / reset, timeouts, DNS
                last = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code == 429:
                    err = error_from_response(resp)
                    if attempt + 1 >= attempts:
                        raise err
                    wait = err.body.retry_after_s if err.body.retry_after_s is not None else next(delays)
                    log.info("rate limited on %s; retrying in %.1f s", endpoint.path, wait)
                    self._sleep(min(wait, self.backoff_max_s))
                    continue
                if resp.status_code < 500:
                    raise error_from_response(resp)
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if attempt + 1 < attempts:
                wait = next(delays)
                log.debug("%s %s failed (%s); retry %d in %.2f s", endpoint.method, endpoint.path, last, attempt + 1,
                    wait)
                self._sleep(wait)
        raise OrchestratorUnavailable(f"{endpoint.method} {url}: {last} (after {attempts} attempts)")

    @staticmethod
    def _parse(resp: httpx.Response, model: type[T]) -> T:
        """The answer as `model`. Fields this client does not know (a newer orchestrator's additions) are left out,
        with a warning once, so a volunteer's worker keeps working across a protocol addition; anything else
        invalid is refused. (The orchestrator stays strict about what workers send it.)"""
        try:
            return model.model_validate_json(resp.content)
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not unknown or len(unknown) != exc.error_count():
                raise OrchestratorUnavailable(f"orchestrator sent an invalid {model.__name__}: {exc}") from None
        data = json.loads(resp.content)
        for loc in unknown:
            parent = data
            for part in loc[:-1]:
                parent = parent[part]
            parent.pop(loc[-1], None)
        names = ", ".join(".".join(map(str, loc)) for loc in unknown)
        if (model.__name__, names) not in _UNKNOWN_WARNED:
            _UNKNOWN_WARNED.add((model.__name__, names))
            log.warning("the orchestrator sent %s fields this worker does not know (%s): it is newer; they are "
                        "ignored, and upgrading the worker is advised", model.__name__, names)
        try:
            return model.model_validate_json(json.dumps(data))
        except ValidationError as exc:
            raise OrchestratorUnavailable(f"orchestrator sent an invalid {model.__name__}: {exc}") from None

    def _worker_token(self) -> str:
        if not self.secret:
            raise RuntimeError("not registered: call register() first")
        return self.secret

    # ----------------------------------------------------------------------------------------------
    # Endpoints

    def health(self) -> bool:
        try:
            return self._request(api.HEALTH, token=None, retries=0).status_code == 200
        except (OrchestratorUnavailable, OrchestratorError):
            return False

    def join_challenge(self) -> m.JoinChallenge:
        """Open join: a puzzle to solve for a join token of our own (protocol.join_puzzle)."""
        resp = self._request(api.JOIN_CHALLENGE, token=None, body=m.JoinChallengeRequest().model_dump_json().encode())
        return self._parse(resp, m.JoinChallenge)

    def join_claim(self, challenge: str, solution: str) -> m.JoinTokenClaimed:
        body = m.JoinClaim(challenge=challenge, solution=solution).model_dump_json().encode()
        return self._parse(self._request(api.JOIN_CLAIM, token=None, body=body), m.JoinTokenClaimed)

    def register(self, join_token: str, name: str, device: str = "cpu",
        retries: int | None = None) -> m.WorkerRegistered:
        req = m.WorkerRegistration(name=name, client_version=CLIENT_VERSION, device=device)
        resp = self._request(api.REGISTER, token=join_token, body=req.model_dump_json().encode(), retries=retries)
        reg = self._parse(resp, m.WorkerRegistered)
        self.secret, self.worker_id = reg.secret, reg.worker_id
        return reg

    def heartbeat(self, beat: m.Heartbeat, retries: int | None = None) -> m.HeartbeatAck:
        if self.worker_id is None:
            raise RuntimeError("not registered: call register() first")
        resp = self._request(api.HEARTBEAT, token=self._worker_token(), body=beat.model_dump_json().encode(),
            retries=retries, worker_id=self.worker_id)
        return self._parse(resp, m.HeartbeatAck)

    def lease(self, loaded_policy_version: int, max_prompts: int = 1, wait_s: float = 0.0) -> m.LeaseResponse:
        """`wait_s`: how long the orchestrator may hold the request for room under the async bound."""
        # One idempotency key per lease call: the body (and so the key) is the same on every retry.
        req = m.LeaseRequest(loaded_policy_version=loaded_policy_version, max_prompts=max_prompts,
            request_id=f"r{secrets.token_hex(8)}", wait_s=wait_s)
        resp = self._request(api.LEASE, token=self._worker_token(), body=req.model_dump_json().encode())
        return self._parse(resp, m.LeaseResponse)

    def release(self, lease_id: str, reason: str = "") -> m.ReleaseAck:
        body = m.ReleaseRequest(reason=reason[: limits.MAX_MESSAGE_CHARS]).model_dump_json().encode()
        resp = self._request(api.RELEASE, token=self._worker_token(), body=body, lease_id=lease_id)
        return self._parse(resp, m.ReleaseAck)

    def encode_submission(self, submission: m.RolloutSubmission) -> bytes:
        """zstd of the JSON body; raises PayloadTooLarge (without sending) above the server's caps."""
        raw = submission.model_dump_json().encode()
        if len(raw) > limits.MAX_DECOMPRESSED_BODY_BYTES:
            raise PayloadTooLarge(413, m.ErrorBody(error=m.ErrorCode.payload_too_large,
                detail=f"submission is {len(raw)} bytes uncompressed; the limit is "
                       f"{limits.MAX_DECOMPRESSED_BODY_BYTES}"))
        packed = self._zstd.compress(raw)
        if len(packed) > limits.MAX_BODY_BYTES:
            raise PayloadTooLarge(413, m.ErrorBody(error=m.ErrorCode.payload_too_large,
                detail=f"submission is {len(packed)} bytes compressed; the limit is {limits.MAX_BODY_BYTES}"))
        return packed

    def submit(self, submission: m.RolloutSubmission) -> m.SubmissionReceipt:
        body = self.encode_submission(submission)
        resp = self._request(api.SUBMIT, token=self._worker_token(), body=body,
            headers={"Content-Encoding": api.SUBMIT_CONTENT_ENCODING})
        return self._parse(resp, m.SubmissionReceipt)

    def verdict(self, submission_id: str) -> Verdict:
        resp = self._request(api.VERDICT, token=self._worker_token(), submission_id=submission_id)
        return self._parse(resp, Verdict)

    def model_files(self) -> m.ModelFiles:
        """The run's base model files other than weights (config, tokenizer): names, sizes, sha256."""
        return self._parse(self._request(api.MODEL_FILES, token=self._worker_token()), m.ModelFiles)

    def model_file(self, name: str) -> bytes:
        return self._request(api.MODEL_FILE, token=self._worker_token(), name=name).content
