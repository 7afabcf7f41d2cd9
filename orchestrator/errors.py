"""The one exception type the orchestrator raises for a refused request; the API turns it into a
`protocol.ErrorBody` with the HTTP status below."""

from __future__ import annotations

from protocol.models import ErrorBody, ErrorCode

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.invalid_request: 422,
    ErrorCode.unauthorized: 401,
    ErrorCode.forbidden: 403,
    ErrorCode.banned: 403,
    ErrorCode.not_found: 404,
    ErrorCode.lease_expired: 410,
    ErrorCode.lease_mismatch: 409,
    ErrorCode.version_too_old: 409,
    ErrorCode.duplicate: 409,
    ErrorCode.payload_too_large: 413,
    ErrorCode.rate_limited: 429,
    ErrorCode.too_many_leases: 429,
    ErrorCode.unsupported_encoding: 415,
}


class ApiError(Exception):
    def __init__(
        self,
        code: ErrorCode,
        detail: str,
        *,
        status: int | None = None,
        min_policy_version: int | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail[:2048]
        self.status = status or HTTP_STATUS[code]
        self.min_policy_version = min_policy_version
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorBody:
        return ErrorBody(
            error=self.code, detail=self.detail, min_policy_version=self.min_policy_version, retry_after_s=self.retry_after_s
        )
