"""The HTTP API contract: one definition of paths, methods, models and auth, and of the HTTP status of
each error code, used by the orchestrator's server and by the worker's client.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel

from protocol import models as m
from protocol import operator_models as ops
from protocol import verdicts


class Auth(str, Enum):
    none = "none"
    join = "join"  # Authorization: Bearer <join token>
    worker = "worker"  # Authorization: Bearer <worker secret>; the worker acts only as itself
    admin = "admin"  # Authorization: Bearer <admin token>; worker secrets are refused


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    request: type[BaseModel] | None
    response: type[BaseModel] | None
    auth: Auth
    summary: str

    def url(self, base: str, **params: str) -> str:
        return base.rstrip("/") + self.path.format(**params)


# The HTTP status of each refusal. A 4xx body is always a `models.ErrorBody` naming its code; a client
# that gets a 4xx without one (a proxy in between) falls back to `code_for_status`.
HTTP_STATUS: dict[m.ErrorCode, int] = {
    m.ErrorCode.invalid_request: 422,
    m.ErrorCode.unauthorized: 401,
    m.ErrorCode.forbidden: 403,
    m.ErrorCode.banned: 403,
    m.ErrorCode.not_found: 404,
    m.ErrorCode.lease_expired: 410,
    m.ErrorCode.lease_mismatch: 409,
    m.ErrorCode.version_too_old: 409,
    m.ErrorCode.duplicate: 409,
    m.ErrorCode.payload_too_large: 413,
    m.ErrorCode.rate_limited: 429,
    m.ErrorCode.too_many_leases: 429,
    m.ErrorCode.unsupported_encoding: 415,
    m.ErrorCode.timeout: 503,
    m.ErrorCode.too_many_identities: 429,
}
# Statuses several codes share map back to the most general of them.
_CODE_FOR_STATUS = {400: m.ErrorCode.invalid_request, 403: m.ErrorCode.forbidden, 409: m.ErrorCode.duplicate,
    429: m.ErrorCode.rate_limited}


def code_for_status(status: int) -> m.ErrorCode:
    """The error code an error status stands for when its body does not say."""
    if status in _CODE_FOR_STATUS:
        return _CODE_FOR_STATUS[status]
    return next((code for code, s in HTTP_STATUS.items() if s == status), m.ErrorCode.invalid_request)


AUTH_HEADER = "Authorization"
# The submit body may be zstd-compressed (Content-Encoding: zstd); it is capped before and after.
SUBMIT_CONTENT_ENCODING = "zstd"

REGISTER = Endpoint("POST", "/v1/workers", m.WorkerRegistration, m.WorkerRegistered, Auth.join,
    "Register a worker with a join token")
HEARTBEAT = Endpoint("POST", "/v1/workers/{worker_id}/heartbeat", m.Heartbeat, m.HeartbeatAck, Auth.worker,
    "Worker heartbeat")
LEASE = Endpoint("POST", "/v1/tasks/lease", m.LeaseRequest, m.LeaseResponse, Auth.worker, "Lease a task")
RELEASE = Endpoint("POST", "/v1/tasks/{lease_id}/release", m.ReleaseRequest, m.ReleaseAck, Auth.worker,
    "Give a leased task back")
SUBMIT = Endpoint("POST", "/v1/rollouts", m.RolloutSubmission, m.SubmissionReceipt, Auth.worker,
    "Submit rollouts for a lease")
VERDICT = Endpoint("GET", "/v1/rollouts/{submission_id}", None, verdicts.Verdict, Auth.worker,
    "Verdict of one of your submissions")
# The base model's config and tokenizer (orchestrator/model_files.py): a worker with no --model builds its engine
# from them; the weights come from shardcast.
MODEL_FILES = Endpoint("GET", "/v1/model/files", None, m.ModelFiles, Auth.worker,
    "The base model's files other than weights (config, tokenizer), with sizes and sha256")
MODEL_FILE = Endpoint("GET", "/v1/model/files/{name}", None, None, Auth.worker, "One base model file, as bytes")

STATUS = Endpoint("GET", "/v1/status", None, ops.RunStatus, Auth.admin, "Run status")
WORKERS = Endpoint("GET", "/v1/workers", None, ops.WorkerList, Auth.admin, "All workers")
BAN = Endpoint("POST", "/v1/workers/{worker_id}/ban", ops.BanRequest, ops.WorkerRecord, Auth.admin, "Ban a worker")
UNBAN = Endpoint("POST", "/v1/workers/{worker_id}/unban", ops.BanRequest, ops.WorkerRecord, Auth.admin,
    "Unban a worker")
METRICS = Endpoint("GET", "/metrics", None, None, Auth.admin, "Prometheus metrics")
MINT_TOKEN = Endpoint("POST", "/v1/join-tokens", ops.JoinTokenRequest, ops.JoinTokenMinted, Auth.admin,
    "Mint a join token (its secret is shown once)")
TOKENS = Endpoint("GET", "/v1/join-tokens", None, ops.JoinTokenList, Auth.admin, "All join tokens")
REVOKE_TOKEN = Endpoint("POST", "/v1/join-tokens/{token_id}/revoke", ops.BanRequest, ops.JoinTokenRecord, Auth.admin,
    "Revoke a join token and ban its workers")
STATUS_HISTORY = Endpoint("GET", "/v1/status/history", None, None, Auth.admin,
    "Dashboard data: status, workers and time series")

HEALTH = Endpoint("GET", "/healthz", None, ops.HealthStatus, Auth.none, "Liveness")
READY = Endpoint("GET", "/readyz", None, ops.HealthStatus, Auth.none, "Readiness: 503 until the run is serving")

# Open join (orchestrator.open_join.enabled): a worker without a join token claims one for a solved puzzle.
JOIN_CHALLENGE = Endpoint("POST", "/v1/join/challenge", m.JoinChallengeRequest, m.JoinChallenge, Auth.none,
                          "Open join: a proof-of-work puzzle")
JOIN_CLAIM = Endpoint("POST", "/v1/join/claim", m.JoinClaim, m.JoinTokenClaimed, Auth.none,
                      "Open join: a join token of one's own for a solved puzzle (on probation until work is accepted)")

WORKER_ENDPOINTS = (REGISTER, HEARTBEAT, LEASE, RELEASE, SUBMIT, VERDICT, MODEL_FILES, MODEL_FILE)
OPERATOR_ENDPOINTS = (STATUS, WORKERS, BAN, UNBAN, MINT_TOKEN, TOKENS, REVOKE_TOKEN, METRICS, STATUS_HISTORY)
OPEN_JOIN_ENDPOINTS = (JOIN_CHALLENGE, JOIN_CLAIM)
ALL_ENDPOINTS = WORKER_ENDPOINTS + OPERATOR_ENDPOINTS + OPEN_JOIN_ENDPOINTS + (HEALTH, READY)

# shardcast servers (origin and relays) serve this read-only API.
SHARDCAST_VERSIONS = "/v1/versions"  # -> VersionList
SHARDCAST_MANIFEST = "/v1/versions/{version}/manifest"  # -> PolicyManifest
SHARDCAST_SHARD = "/v1/versions/{version}/shards/{name}"  # -> bytes, supports Range
