"""Limits every request meets before the app sees it: the body is read whole under a size cap (before
and, for zstd submissions, while decompressing, see admission.py), and the whole request, a slow body
included, under a timeout. Pure ASGI (not BaseHTTPMiddleware): it adds no task or stream per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from orchestrator.errors import ApiError
from orchestrator.fast_path import error_response
from protocol import api, limits
from protocol.models import ErrorCode

log = logging.getLogger(__name__)

# Bodies of endpoints other than submit are small JSON objects.
MAX_SMALL_BODY_BYTES = 64 << 10


class LimitsMiddleware:
    """Reads the whole body under a size cap and the request under a timeout, before the app sees it.

    Pure ASGI (not BaseHTTPMiddleware): it adds no task or stream per request.
    """

    def __init__(self, app: Any, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def refuse(exc: ApiError) -> None:
            if not started:
                resp = error_response(exc)
                await resp(scope, receive, send)

        cap = limits.MAX_BODY_BYTES if scope["path"] == api.SUBMIT.path else MAX_SMALL_BODY_BYTES
        try:
            async with asyncio.timeout(self.timeout_s):
                for name, value in scope.get("headers", []):
                    if name == b"content-length":
                        try:
                            length = int(value)
                        except ValueError:
                            raise ApiError(ErrorCode.invalid_request, "Content-Length is not a number", status=400) from None
                        if length > cap:
                            raise ApiError(ErrorCode.payload_too_large, f"body of {length} bytes; the limit is {cap}")
                chunks, size, more = [], 0, True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        raise ApiError(ErrorCode.payload_too_large, f"body larger than {cap} bytes")
                    chunks.append(chunk)
                    more = message.get("more_body", False)
                body = b"".join(chunks)
                replayed = False

                async def replay() -> dict:
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    return await receive()

                await self.app(scope, replay, tracked_send)
        except ApiError as exc:
            await refuse(exc)
        except TimeoutError:
            log.warning("request timed out", extra={"path": scope.get("path")})
            await refuse(ApiError(ErrorCode.timeout, f"request not completed within {self.timeout_s:g} s", status=503, retry_after_s=1.0))
