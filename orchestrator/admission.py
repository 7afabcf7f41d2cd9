"""Admission of a submission, in the order that spends the least work on a bad one:
size caps -> decompression (bounded) -> schema -> ban -> lease -> policy version -> shape -> replay.
Every accept-side check lives here (`Admission`: `parse`, touching no state, then `accept`, one visit
each); nothing here verifies proofs. A submission that passes is queued for the verifier pool
(orchestrator/verification.py).
"""

from __future__ import annotations

import hashlib
import io
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from pydantic import ValidationError

from orchestrator.errors import ApiError
from orchestrator.leases import LeaseBook, LeaseRow
from orchestrator.versions import PolicyVersions
from orchestrator.workers import Workers
from protocol import limits, staleness
from protocol.models import ErrorCode, RolloutSubmission, SubmissionReceipt, TaskLease

# A zstd frame may ask for a window up to 2 GiB; no honest rollout body needs more than this.
MAX_ZSTD_WINDOW = 16 << 20
READ_CHUNK = 1 << 20


_local = threading.local()


@dataclass
class SubmissionRow:
    submission_id: str
    worker_id: str
    lease_id: str
    policy_version: int
    num_tokens: int
    received_at: float
    status: str
    body: bytes | None
    verdict: str | None


@dataclass
class Pending:
    worker_id: str
    submission: RolloutSubmission
    lease: TaskLease
    prompt_indices: list[int]
    eval_version: int | None = None  # an eval lease: its rollouts are scored for the evaluation, never buffered


def decompress_zstd(body: bytes, max_output: int = limits.MAX_DECOMPRESSED_BODY_BYTES) -> bytes:
    """Stream-decompress, stopping as soon as the output would exceed `max_output` (zstd bombs)."""
    # One decompression context per thread, reused (each stream_reader starts a fresh frame): creating
    # one costs about as much as decompressing a typical submission.
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW)
    out = io.BytesIO()
    try:
        # read_across_frames: a body of several concatenated frames is decompressed whole.
        with dctx.stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while True:
                chunk = reader.read(READ_CHUNK)
                if not chunk:
                    break
                if out.tell() + len(chunk) > max_output:
                    raise ApiError(ErrorCode.payload_too_large, f"body decompresses to more than {max_output} bytes")
                out.write(chunk)
    except zstandard.ZstdError as exc:
        raise ApiError(ErrorCode.invalid_request, f"body is not valid zstd: {exc}", status=400) from None
    return out.getvalue()


def decode_body(body: bytes, content_encoding: str | None, cap: int = limits.MAX_DECOMPRESSED_BODY_BYTES) -> bytes:
    """The JSON of a submission body, at most `cap` bytes whether it came compressed or not."""
    if len(body) > min(cap, limits.MAX_BODY_BYTES):
        raise ApiError(ErrorCode.payload_too_large, f"body is larger than {min(cap, limits.MAX_BODY_BYTES)} bytes")
    enc = (content_encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc == "zstd":
        return decompress_zstd(body, min(cap, limits.MAX_DECOMPRESSED_BODY_BYTES))
    raise ApiError(ErrorCode.unsupported_encoding,
        f"Content-Encoding {content_encoding!r} is not supported; use zstd or none")


def parse_submission(raw: bytes, vocab_size: int) -> RolloutSubmission:
    try:
        return RolloutSubmission.model_validate_json(raw, context={"vocab_size": vocab_size})
    except ValidationError as exc:
        raise ApiError(ErrorCode.invalid_request, "invalid submission: " + summarize(exc)) from None


def summarize(exc: ValidationError, max_errors: int = 5, max_listed_from: int = 1000) -> str:
    """The first few errors. pydantic builds a dict for every error to list any (about 2 us each), and a
    body under the cap can hold half a million unknown keys: past `max_listed_from` errors only the count
    is given, so a refusal costs the worker's bytes, not seconds of the server's CPU."""
    if exc.error_count() > max_listed_from:
        return f"{exc.error_count()} validation errors (too many to list)"
    parts = []
    for err in exc.errors(include_url=False, include_context=False, include_input=False)[:max_errors]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - max_errors
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def check_version(claimed: int, current: int, async_level: int, what: str = "policy version") -> None:
    """Refuse a policy version that is too old (before any verification work) or not published yet."""
    lowest = staleness.min_policy_version(current, async_level)
    if claimed < lowest:
        raise ApiError(
            ErrorCode.version_too_old,
            f"{what} {claimed} is below {lowest} (current {current}, async_level {async_level}): pull a newer version "
            f"first",
            min_policy_version=lowest,
        )
    if claimed > current:
        raise ApiError(ErrorCode.invalid_request, f"{what} {claimed} has not been published (current {current})")


def check_shape(sub: RolloutSubmission, lease: TaskLease) -> None:
    """A submission carries exactly one completion per (prompt, sample) of its lease."""
    want = {(p, s) for p in range(len(lease.prompts)) for s in range(lease.samples_per_prompt)}
    got = {(c.prompt_index, c.sample_index) for c in sub.completions}
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        raise ApiError(
            ErrorCode.lease_mismatch,
            f"lease {lease.lease_id} needs {len(want)} completions ({len(lease.prompts)} prompts x "
            f"{lease.samples_per_prompt} samples); "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}",
        )
    max_tokens = lease.sampling.max_tokens
    for i, c in enumerate(sub.completions):
        if c.token_ids.size > max_tokens:
            raise ApiError(ErrorCode.lease_mismatch,
                f"completion {i}: {c.token_ids.size} tokens, lease allows {max_tokens}")
        if (c.env_mask is None) != (lease.environment is None):
            raise ApiError(ErrorCode.lease_mismatch, f"completion {i}: " + (
                "a multi-turn episode (env_mask) for a single-turn lease" if lease.environment is None
                else f"lease {lease.lease_id} is a multi-turn episode of environment {lease.environment!r}: env_mask "
                f"and turn_finish_reasons are required"))


def fingerprint(sub: RolloutSubmission) -> str:
    """Hash of what was generated (tokens and proofs), independent of the lease id: the same rollouts
    submitted again, to this lease or another, are a replay."""
    h = hashlib.sha256()
    for c in sorted(sub.completions, key=lambda c: (c.prompt_index, c.sample_index)):
        h.update(np.ascontiguousarray(c.token_ids, dtype="<i4"))  # the same bytes, without a copy
        for p in c.proofs:
            h.update(len(p).to_bytes(2, "little"))
            h.update(p)
        h.update(b"|")
    return h.hexdigest()


class Admission:
    """What a submission must pass before it is queued for verification, all of it: `parse` (decompress and
    validate; no state, so the HTTP app may run it off the event loop), then `accept` (the worker, its lease,
    the policy version, the shape, a replay), which hands it to the verification queue."""

    def __init__(self, *, async_level: int, vocab_size: int, cap: int, workers: Workers, leases: LeaseBook,
                 versions: PolicyVersions, verification: Any):
        self.async_level, self.vocab_size, self.cap = async_level, vocab_size, cap
        self.workers, self.leases, self.versions, self.verification = workers, leases, versions, verification

    def submit(self, worker_id: str, body: bytes, content_encoding: str | None) -> SubmissionReceipt:
        return self.accept(worker_id, self.parse(body, content_encoding), body, content_encoding)

    def parse(self, body: bytes, content_encoding: str | None) -> tuple[bytes, RolloutSubmission]:
        """Decompress and validate, at most the largest honest body for this run's leases."""
        raw = decode_body(body, content_encoding, self.cap)
        return raw, parse_submission(raw, self.vocab_size)

    def accept(self, worker_id: str, parsed: tuple[bytes, RolloutSubmission], body: bytes,
        content_encoding: str | None) -> SubmissionReceipt:
        raw, sub = parsed
        self.workers.refuse_if_banned(worker_id)
        now = time.time()
        row, lease = self.lease_for(sub.lease_id, worker_id, now)
        current = self.versions.current
        check_version(sub.policy_version, current, self.async_level)
        if sub.policy_version < lease.min_policy_version:
            raise ApiError(
                ErrorCode.version_too_old,
                f"policy version {sub.policy_version} is below the lease's minimum {lease.min_policy_version}",
                min_policy_version=max(lease.min_policy_version, staleness.min_policy_version(current,
                self.async_level)),
            )
        if lease.generation_version is not None and sub.policy_version != lease.generation_version:
            raise ApiError(
                ErrorCode.lease_mismatch,
                f"generated with policy version {sub.policy_version}; this lease was issued for version "
                f"{lease.generation_version}, "
                "the one the worker said it had loaded",
            )
        if self.versions.is_superseded(sub.policy_version, sub.model_hash):
            # Weights of a version that a trainer crash undid (a relay served them before they were
            # replaced): the worker is honest, so no strike; it moves on to a newer version.
            raise ApiError(
                ErrorCode.version_too_old,
                f"version {sub.policy_version} was re-published with other weights after a trainer restart",
                min_policy_version=sub.policy_version + 1,
            )
        check_shape(sub, lease)
        submission_id = f"S{secrets.token_hex(8)}"
        stored = body if (content_encoding
            or "").strip().lower() == "zstd" else zstandard.ZstdCompressor(level=1).compress(raw)
        dup = self.verification.enqueue(
            SubmissionRow(submission_id, worker_id, sub.lease_id, sub.policy_version, sub.num_tokens, now, "pending",
            stored, None),
            fingerprint(sub),
            Pending(worker_id, sub, lease, list(row.prompt_indices), row.eval_version),
        )
        if dup == "lease":
            raise ApiError(ErrorCode.duplicate, f"lease {sub.lease_id} already has a submission")
        if dup == "replay":
            raise ApiError(ErrorCode.duplicate, "these rollouts were submitted before (replay)")
        return SubmissionReceipt(submission_id=submission_id, lease_id=sub.lease_id,
            num_completions=len(sub.completions))

    def lease_for(self, lease_id: str, worker_id: str, now: float) -> tuple[LeaseRow, TaskLease]:
        """The open lease a submission is for, or the reason it cannot be submitted."""
        row = self.leases.get(lease_id)
        if row is None or row.worker_id != worker_id:
            # Not yours: indistinguishable from a lease that does not exist, so ids cannot be probed.
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        if row.status in ("submitted", "done", "rejected"):
            raise ApiError(ErrorCode.duplicate, f"lease {lease_id} already has a submission")
        if row.status in ("expired", "released") or row.deadline < now:
            raise ApiError(ErrorCode.lease_expired,
                f"lease {lease_id} is {row.status if row.status != 'open' else 'past its deadline'}")
        return row, self.leases.parsed(row)


class RateLimiter:
    """Token bucket per key: `rate` units per second on average, bursts up to `burst`. Keys idle long
    enough to have refilled are forgotten, so a flood of new keys cannot grow it without bound."""

    def __init__(self, rate: float, burst: float | None = None):
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, 2 * rate)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def _tokens(self, key: str, now: float) -> float:
        tokens, last = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def check(self, key: str, now: float | None = None, cost: float = 1.0) -> None:
        """Take `cost` units, or raise rate_limited (with how long until they are there)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens = self._tokens(key, now)
            if tokens < cost:
                self._buckets[key] = (tokens, now)
                raise ApiError(ErrorCode.rate_limited, f"more than {self.rate:g}/s",
                    retry_after_s=(cost - tokens) / self.rate)
            self._buckets[key] = (tokens - cost, now)
            self._sweep(now)

    def has(self, key: str, now: float | None = None) -> bool:
        """Whether one unit is there, without taking it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._tokens(key, now) >= 1.0

    def take(self, key: str, now: float | None = None) -> None:
        """Take one unit even if that leaves the bucket empty (a refusal counted after the fact)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._buckets[key] = (max(0.0, self._tokens(key, now) - 1.0), now)
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        refill_s = self.burst / self.rate
        if now - self._swept > refill_s and len(self._buckets) > 1024:
            self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < refill_s}
            self._swept = now
