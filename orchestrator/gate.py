"""What every request meets before the app runs: requests are a budget.

- The connection: its request line and headers must arrive within `header_timeout_s` (a slow-loris
  holds nothing); one client address may hold `max_connections_per_address` connections, and uvicorn caps
  all open connections at `max_connections` (`GuardedHttpToolsProtocol`, `uvicorn_config`). The client address
  is the connection's peer, or, behind a reverse proxy the operator named (`trusted_proxies`), what the proxy
  says in X-Forwarded-For; the proxy's own connections are not capped per address.
- Credentials first: the endpoint's credential (protocol.api's table) is checked from the headers before
  one byte of the body is read, so an unauthenticated flood costs a dictionary lookup, not a buffer.
  Refused credentials are counted per client address; an address over `failed_auth_per_min` gets 429
  for anything not already known good, without a database lookup.
- Budgets per worker and per join token: requests per second, body bytes per second, requests in flight.
- A refusal for being over a budget (429) is answered only after `refusal_delay_s` (at most its
  retry-after): a well-behaved client would have waited that long anyway, and a client that ignores
  Retry-After gets one request per connection per delay instead of as many as the server can refuse. With
  the per-address connection cap this bounds what one address can make the server do, whatever it sends.
- The body: read under the endpoint's cap (a submission: the largest honest body for the run's leases,
  protocol.limits.submission_bytes_cap) and the whole request under `request_timeout_s`.

Pure ASGI (no task or stream per request). The caller it authenticated travels in the scope's state.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator.admission import RateLimiter
from orchestrator.errors import ApiError
from orchestrator.fast_path import error_response
from orchestrator.service import Orchestrator
from protocol import api, limits
from protocol.models import ErrorCode
from protocol.proxies import Network, is_proxy, proxy_networks

log = logging.getLogger(__name__)

# Bodies of endpoints other than submit are small JSON objects.
MAX_SMALL_BODY_BYTES = 64 << 10
# A request head (line and headers): ours and httpx's are well under 1 KiB; nginx's default buffers allow 32 KiB.
MAX_HEAD_BYTES = 32 << 10
MAX_HEADERS = 100
CALLER = "swarmrl_caller"  # scope["state"] key: the worker id (worker endpoints) or the join token's row (register)


class Gate:
    def __init__(self, app: Any, orch: Orchestrator):
        self.app = app
        self.orch = orch
        self.admin_token = orch.cfg.admin_token.get_secret_value().encode()
        cfg = orch.cfg
        self.timeout_s = cfg.request_timeout_s
        self.refusal_delay_s = cfg.refusal_delay_s
        self.submit_cap = limits.submission_bytes_cap(cfg.prompts_per_lease * cfg.samples_per_prompt,
                                                      cfg.sampling.max_tokens, episodes=cfg.environment is not None)
        self.failed = RateLimiter(cfg.failed_auth_per_min / 60.0, burst=max(5.0, cfg.failed_auth_per_min))
        self.bytes = RateLimiter(cfg.bytes_per_s_per_worker, burst=4 * cfg.bytes_per_s_per_worker)
        # A join token's identities share half of what as many independent workers could send: a Sybil
        # crowd costs its token, a group of honest machines under one token still has room.
        token_rate = cfg.rate_limit_per_s * max(1.0, cfg.max_identities_per_token / 2)
        self.token_requests = RateLimiter(token_rate, burst=2 * token_rate)
        self.in_flight: dict[str, int] = {}
        self.routes = [(ep, re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", ep.path) + "$"))
            for ep in api.ALL_ENDPOINTS]

    def endpoint(self, method: str, path: str) -> api.Endpoint | None:
        for ep, pattern in self.routes:
            if ep.method == method and pattern.match(path):
                return ep
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        ep = self.endpoint(scope["method"], scope["path"])
        worker_id = None
        try:
            async with asyncio.timeout(self.timeout_s):
                caller = self.authorize(ep, scope) if ep is not None else None
                if isinstance(caller, str):
                    if self.in_flight.get(caller, 0) >= self.orch.cfg.requests_in_flight_per_worker:
                        raise ApiError(ErrorCode.rate_limited, "too many requests in flight", retry_after_s=1.0)
                    self.in_flight[caller] = self.in_flight.get(caller, 0) + 1
                    worker_id = caller  # only now: the finally below gives back what was taken, never more
                scope.setdefault("state", {})[CALLER] = caller
                body = await self.read_body(scope, receive, self.submit_cap if ep is api.SUBMIT
                    else MAX_SMALL_BODY_BYTES, worker_id)
                if body is None:
                    return  # the client went away
                await self.app(scope, _replay(body, receive), tracked_send)
        except ApiError as exc:
            self.orch.metrics.requests_refused.labels(exc.code.value).inc()
            if not started:
                if exc.code is ErrorCode.rate_limited and self.refusal_delay_s > 0:
                    # A refusal after the worker's in-flight slot was taken (its byte budget) keeps the slot
                    # while held; parallel requests are bounded by the per-address connection cap.
                    await asyncio.sleep(min(self.refusal_delay_s, exc.retry_after_s or self.refusal_delay_s))
                await error_response(exc)(scope, receive, send)
        except TimeoutError:
            log.warning("request timed out", extra={"path": scope.get("path")})
            if not started:
                await error_response(ApiError(ErrorCode.timeout, f"request not completed within {self.timeout_s:g} s",
                    retry_after_s=1.0))(scope, receive, send)
        finally:
            if worker_id is not None:
                left = self.in_flight[worker_id] - 1
                if left:
                    self.in_flight[worker_id] = left
                else:
                    del self.in_flight[worker_id]

    def authorize(self, ep: api.Endpoint, scope: dict) -> Any:
        """The endpoint's credential, from the headers. A correct credential is never refused here; an
        address that sent too many wrong ones gets 429 instead of the lookups a wrong one costs (a
        database read for an unknown worker id), and every refusal is counted against its address."""
        if ep.auth is api.Auth.none:
            return None
        address = (scope.get("client") or ("?",))[0]
        token = bearer_token(scope)
        try:
            if ep.auth is api.Auth.join:
                return self.orch.tokens.authenticate(token)  # a hash and a dict lookup; a read only for a real token
            if ep.auth is api.Auth.admin:
                if hmac.compare_digest(token.encode(), self.admin_token):
                    return None
                self.over_budget(address)
                if self.orch.workers.is_secret(token):
                    raise ApiError(ErrorCode.forbidden, "operator endpoints refuse worker tokens")
                raise ApiError(ErrorCode.unauthorized, "invalid admin token")
            if not self.orch.workers.is_cached(token):
                self.over_budget(address)
            worker_id = self.orch.authenticate(token)
        except ApiError as exc:
            if exc.code in (ErrorCode.unauthorized, ErrorCode.forbidden):
                self.failed.take(address)
            raise
        self.token_budget(worker_id)
        return worker_id

    def over_budget(self, address: str) -> None:
        if not self.failed.has(address):
            raise ApiError(ErrorCode.rate_limited, "too many refused credentials from this address", retry_after_s=10.0)

    def token_budget(self, worker_id: str) -> None:
        token_id = self.orch.workers.token_of(worker_id)
        if token_id is not None:
            self.token_requests.check(f"token:{token_id}")

    async def read_body(self, scope: dict, receive: Any, cap: int, worker_id: str | None) -> bytes | None:
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
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise ApiError(ErrorCode.payload_too_large, f"body larger than {cap} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        if worker_id is not None and size:
            self.bytes.check(worker_id, cost=size)
        return b"".join(chunks)


def bearer_token(scope: dict) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credentials.strip():
                return credentials.strip()
            break
    raise ApiError(ErrorCode.unauthorized, "missing 'Authorization: Bearer <token>' header")


def _replay(body: bytes, receive: Any) -> Any:
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head that was already answered with 431."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's head: from the connection (or the
    end of the previous response's keep-alive wait) to the end of the headers, at most `header_timeout_s`;
    otherwise the connection is closed. The head is also bounded in size: more than MAX_HEAD_BYTES or
    MAX_HEADERS headers get 431 and the connection is closed (uvicorn keeps every header as Python objects,
    about 15 times the bytes sent for many small ones, before the app sees any). A client address holding
    `max_per_address` connections has any further one closed at once. (Class attributes, set per server by
    `uvicorn_protocol`.)"""

    header_timeout_s = 10.0
    max_per_address = 128
    per_address: dict[str, int] = {}
    trusted_proxies: tuple[Network, ...] = ()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = self._header_count = 0
        self._head_refused = False
        self._address = (self.client or ("?",))[0]
        count = self.per_address[self._address] = self.per_address.get(self._address, 0) + 1
        if count > self.max_per_address and not is_proxy(self._address, self.trusted_proxies):
            log.info("closing a connection over its address's cap", extra={"client": self._address,
                "cap": self.max_per_address})
            self.transport.close()
            return
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        log.info("closing a connection whose request head did not arrive in time", extra={"client": self.client})
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        in_head = self._head_timer is not None
        super().data_received(data)
        # A read that began and ended inside one incomplete head is all head bytes. Counted after parsing,
        # so a read that completes the head (and carries body bytes), or one that began with the previous
        # request's body, is not: the bound is MAX_HEAD_BYTES plus at most two reads.
        if in_head and self._head_timer is not None and not self._head_refused:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head(f"request head larger than {MAX_HEAD_BYTES} bytes")

    def _refuse_head(self, reason: str) -> None:
        self._head_refused = True
        log.info("closing a connection whose request head is too large", extra={"client": self.client,
            "reason": reason})
        body = reason.encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if not self._head_refused:  # a head refused with 431 stopped the parser: uvicorn calls this next
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        self._arm_head_timer()
        self._head_bytes = self._header_count = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADERS:
            self._refuse_head(f"more than {MAX_HEADERS} request headers")
            raise HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        left = self.per_address.get(self._address, 1) - 1
        if left > 0:
            self.per_address[self._address] = left
        else:
            self.per_address.pop(self._address, None)
        super().connection_lost(exc)


def uvicorn_protocol(header_timeout_s: float, max_per_address: int,
                     trusted_proxies: list[str] = ()) -> type[GuardedHttpToolsProtocol]:
    """The protocol class of one server: its own connection counts. Connections from `trusted_proxies` carry
    many clients each (their addresses come in X-Forwarded-For): they are not capped per address."""
    return type("GuardedHttp", (GuardedHttpToolsProtocol,), {"header_timeout_s": header_timeout_s,
        "max_per_address": max_per_address, "per_address": {}, "trusted_proxies": proxy_networks(trusted_proxies)})


def _now() -> float:
    return time.monotonic()
