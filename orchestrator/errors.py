"""The one exception type the orchestrator raises for a refused request; the API turns it into a
`protocol.ErrorBody` with the code's HTTP status from `protocol.api.HTTP_STATUS`."""

from __future__ import annotations

from protocol.api import HTTP_STATUS
from protocol.models import ErrorBody, ErrorCode


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
            error=self.code, detail=self.detail, min_policy_version=self.min_policy_version,
            retry_after_s=self.retry_after_s
        )
