"""The public HTTP API (fastapi): exactly the endpoints of `protocol.api`, plus the operator's
dashboard page at `/` and the JSON it polls.

- Auth: `Authorization: Bearer <token>`: a join token to register, a worker's own secret for worker
  endpoints (a worker acts only as itself), the admin token for operator endpoints (worker secrets are
  refused there).
- Every refusal is a `protocol.ErrorBody` with a 4xx status, including FastAPI's validation errors.
- Limits, enforced before the handlers run (LimitsMiddleware): body size (before and, for zstd
  submissions, while decompressing), and a timeout for the whole request, including a slow body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import Schema
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.dashboard import HTML as DASHBOARD
from orchestrator.errors import ApiError
from orchestrator.group_commit import GroupCommit, GroupCommitMiddleware
from orchestrator.service import Orchestrator
from protocol import api, limits
from protocol.models import (
    BanRequest,
    ErrorBody,
    ErrorCode,
    HealthStatus,
    Heartbeat,
    LeaseRequest,
    ReleaseRequest,
    RolloutSubmission,
    WireModel,
    WorkerRegistration,
)

log = logging.getLogger(__name__)

# Bodies of endpoints other than submit are small JSON objects.
MAX_SMALL_BODY_BYTES = 64 << 10

HISTORY_PATH = "/v1/status/history"

def swagger_assets() -> Path | None:
    """A local copy of Swagger UI, so /docs works without internet. vLLM ships one; find it without
    importing vLLM. None: fall back to FastAPI's CDN links."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(list(spec.submodule_search_locations)[0]) / "entrypoints" / "serve" / "instrumentator" / "static"
    return static if (static / "swagger-ui-bundle.js").is_file() and (static / "swagger-ui.css").is_file() else None


bearer = HTTPBearer(auto_error=False, description="join token, worker secret or admin token, depending on the endpoint")


# Endpoints that take the bare `Request` (see `lease`): their security requirement and request body,
# documented as FastAPI documents a `Security(bearer)` parameter and a pydantic body parameter.
BEARER_SECURITY = [{"HTTPBearer": []}]
BODIES_PARSED_BY_HANDLERS = (LeaseRequest,)


class BareRoute(APIRoute):
    """A route whose endpoint takes only the `Request` and returns a `Response`: documented like any
    FastAPI route (its body and security through `openapi_extra`), but called directly, without
    FastAPI's per-request dependency solving (it parses the query, headers and cookies even for an
    endpoint that declares none) and without the per-route exception wrapper and exit stack: its
    exceptions go to the app's exception handlers through ExceptionMiddleware, as before."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        endpoint = self.endpoint

        async def app(scope: dict, receive: Any, send: Any) -> None:
            response = await endpoint(Request(scope, receive, send))
            await response(scope, receive, send)

        self.app = app


def json_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}, "required": True}


def parse_json_body(model: type[BaseModel], body: bytes, content_type: str | None) -> Any:
    """The request body as `model`, refused (422) where FastAPI refuses a body parameter: a body not
    sent as JSON (`application/json` or `application/*+json`), or not valid for the model."""
    if body:
        kind, _, subtype = (content_type or "").partition(";")[0].strip().lower().partition("/")
        if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
            raise ApiError(ErrorCode.invalid_request, "body: expected JSON (Content-Type: application/json)")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        parts = [".".join(["body", *map(str, err["loc"])]) + f": {err['msg']}" for err in exc.errors()[:5]]
        raise ApiError(ErrorCode.invalid_request, "; ".join(parts)) from None


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, int(exc.retry_after_s + 0.999)))} if exc.retry_after_s else None
    return JSONResponse(exc.body().model_dump(mode="json", exclude_none=True), status_code=exc.status, headers=headers)


def json_response(model: WireModel, status: int = 200) -> Response:
    return Response(model.to_json(), status_code=status, media_type="application/json")


class BareRouteDispatch:
    """Pure ASGI, the innermost of our middlewares: a request for a BareRoute (by method and static
    path) goes straight to it, past Starlette's exception middleware and router (together ~5% of the
    server's CPU per lease + submit, measured live), and its ApiError to the app's own ApiError handler,
    as on any other route. Every other request passes through."""

    def __init__(self, app: Any, routes: dict[tuple[str, str], Any], api_error_handler: Any):
        self.app = app
        self.routes = routes  # (method, path) -> the route's ASGI app; filled as bare routes are declared
        self.api_error_handler = api_error_handler

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = self.routes.get((scope.get("method"), scope["path"])) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            await route(scope, receive, send)
        except ApiError as exc:  # raised before the handler's response started: it returns the response
            response = await self.api_error_handler(Request(scope, receive), exc)
            await response(scope, receive, send)


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


def create_app(orch: Orchestrator) -> FastAPI:
    """Handlers run on the event loop itself: their work is CPU under the GIL plus SQLite statements,
    and their writes join one transaction per loop iteration (group_commit.py), committed before any
    of them answers. (A thread pool would add two context switches and a lock hand-off per request
    and buy no parallelism.)"""
    cfg = orch.cfg
    join_tokens = [t.encode() for t in cfg.join_tokens]
    admin_token = cfg.admin_token.encode()
    errors = {code: {"model": ErrorBody} for code in (401, 403, 404, 409, 410, 413, 415, 422, 429)}

    assets = swagger_assets()
    app = FastAPI(
        title="swarmrl orchestrator",
        version="1",
        description="Workers register, lease tasks and submit rollouts; operators watch and ban. See protocol/api.py.",
        docs_url=None if assets else "/docs",
    )
    if assets is not None:
        from fastapi.openapi.docs import get_swagger_ui_html
        from fastapi.staticfiles import StaticFiles

        app.mount("/docs/static", StaticFiles(directory=assets), name="docs-static")

        @app.get("/docs", include_in_schema=False)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(
                openapi_url="/openapi.json",
                title="swarmrl orchestrator - API",
                swagger_js_url="/docs/static/swagger-ui-bundle.js",
                swagger_css_url="/docs/static/swagger-ui.css",
                swagger_favicon_url="data:,",
            )

    # -- errors -----------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        orch.metrics.requests_refused.labels(exc.code.value).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ())) or "request"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        orch.metrics.requests_refused.labels(ErrorCode.invalid_request.value).inc()
        return error_response(ApiError(ErrorCode.invalid_request, "; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {401: ErrorCode.unauthorized, 403: ErrorCode.forbidden, 404: ErrorCode.not_found}.get(exc.status_code, ErrorCode.invalid_request)
        return error_response(ApiError(code, str(exc.detail), status=exc.status_code if exc.status_code < 500 else 400))

    # -- middleware, added innermost first: a request's body is read under the limits, then it joins
    # the shared transaction, then lease and submit go straight to their bare route.
    bare_routes: dict[tuple[str, str], Any] = {}
    app.add_middleware(BareRouteDispatch, routes=bare_routes, api_error_handler=_api_error)
    app.state.group_commit = group = GroupCommit(orch.state)
    app.add_middleware(GroupCommitMiddleware, group=group)
    app.add_middleware(LimitsMiddleware, timeout_s=cfg.request_timeout_s)
    app.state.orchestrator = orch

    # -- auth -------------------------------------------------------------------------------------

    def token(creds: HTTPAuthorizationCredentials | None) -> str:
        if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
            raise ApiError(ErrorCode.unauthorized, "missing 'Authorization: Bearer <token>' header")
        return creds.credentials

    def require_join(creds: HTTPAuthorizationCredentials | None) -> None:
        t = token(creds).encode()
        if not any(hmac.compare_digest(t, j) for j in join_tokens):
            raise ApiError(ErrorCode.unauthorized, "invalid join token")

    def require_worker(creds: HTTPAuthorizationCredentials | None, allow_banned: bool = False) -> str:
        return orch.authenticate(token(creds), allow_banned)

    def require_admin(creds: HTTPAuthorizationCredentials | None) -> None:
        t = token(creds)
        if hmac.compare_digest(t.encode(), admin_token):
            return
        if orch.is_worker_secret(t):
            raise ApiError(ErrorCode.forbidden, "operator endpoints refuse worker tokens")
        raise ApiError(ErrorCode.unauthorized, "invalid admin token")

    # -- worker endpoints -------------------------------------------------------------------------

    def bare_post(endpoint: api.Endpoint, openapi_extra: dict[str, Any]) -> Any:
        def register(fn: Any) -> Any:
            app.router.add_api_route(
                endpoint.path, fn, methods=["POST"], route_class_override=BareRoute, response_model=endpoint.response,
                responses=errors, summary=endpoint.summary, tags=["worker"], openapi_extra=openapi_extra,
            )
            route = app.router.routes[-1]
            assert isinstance(route, BareRoute) and "{" not in endpoint.path
            bare_routes[("POST", endpoint.path)] = route.app
            return fn

        return register

    @app.post(api.REGISTER.path, response_model=api.REGISTER.response, responses=errors, summary=api.REGISTER.summary, tags=["worker"])
    async def register(request: Request, body: WorkerRegistration, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        require_join(creds)
        # Registrations are rate-limited per client address: a leaked join token cannot flood the table.
        orch.limiter.check(f"register@{request.client.host if request.client else '?'}")
        return json_response(orch.register(body))

    @app.post(api.HEARTBEAT.path, response_model=api.HEARTBEAT.response, responses=errors, summary=api.HEARTBEAT.summary, tags=["worker"])
    async def heartbeat(worker_id: str, body: Heartbeat, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        return json_response(orch.heartbeat(require_worker(creds), worker_id, body))

    # The two hot endpoints (every worker calls both once per task) take the bare request and parse
    # their body and bearer token themselves: FastAPI's per-request dependency and body machinery cost
    # ~35 of the ~75 us a lease request spent in the app. `openapi_extra` documents them as before.
    @bare_post(api.LEASE, openapi_extra={"requestBody": json_body_schema(LeaseRequest), "security": BEARER_SECURITY})
    async def lease(request: Request) -> Response:
        body = parse_json_body(LeaseRequest, await request.body(), request.headers.get("content-type"))
        return json_response(orch.lease(require_worker(await bearer(request)), body))

    @app.post(api.RELEASE.path, response_model=api.RELEASE.response, responses=errors, summary=api.RELEASE.summary, tags=["worker"])
    async def release(lease_id: str, body: ReleaseRequest | None = None, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        return json_response(orch.release(require_worker(creds), lease_id))

    @bare_post(
        api.SUBMIT,
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": f"JSON RolloutSubmission; may be zstd-compressed (Content-Encoding: zstd). "
                f"At most {limits.MAX_BODY_BYTES} bytes as sent and {limits.MAX_DECOMPRESSED_BODY_BYTES} decompressed.",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RolloutSubmission"}}},
            },
            "security": BEARER_SECURITY,
        },
    )
    async def submit(request: Request) -> Response:
        worker_id = require_worker(await bearer(request))
        body = await request.body()
        return json_response(orch.submit(worker_id, body, request.headers.get("content-encoding")))

    @app.get(api.VERDICT.path, response_model=api.VERDICT.response, responses=errors, summary=api.VERDICT.summary, tags=["worker"])
    async def verdict(submission_id: str, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        return json_response(orch.verdict(require_worker(creds, allow_banned=True), submission_id))

    # -- operator endpoints -----------------------------------------------------------------------

    @app.get(api.STATUS.path, response_model=api.STATUS.response, responses=errors, summary=api.STATUS.summary, tags=["operator"])
    async def status(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        require_admin(creds)
        return json_response(orch.status())

    @app.get(api.WORKERS.path, response_model=api.WORKERS.response, responses=errors, summary=api.WORKERS.summary, tags=["operator"])
    async def workers(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        require_admin(creds)
        return json_response(orch.worker_list())

    @app.post(api.BAN.path, response_model=api.BAN.response, responses=errors, summary=api.BAN.summary, tags=["operator"])
    async def ban(worker_id: str, body: BanRequest | None = None, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        require_admin(creds)
        return json_response(orch.set_ban(worker_id, True, body.reason if body else ""))

    @app.post(api.UNBAN.path, response_model=api.UNBAN.response, responses=errors, summary=api.UNBAN.summary, tags=["operator"])
    async def unban(worker_id: str, body: BanRequest | None = None, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        require_admin(creds)
        return json_response(orch.set_ban(worker_id, False, body.reason if body else ""))

    @app.get(api.METRICS.path, responses=errors, summary=api.METRICS.summary, tags=["operator"], response_class=Response)
    async def metrics(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> Response:
        require_admin(creds)
        return Response(generate_latest(orch.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(HISTORY_PATH, responses=errors, summary="Dashboard data: status, workers and time series", tags=["operator"])
    async def history(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> JSONResponse:
        require_admin(creds)
        return JSONResponse(
            {
                "status": orch.status().model_dump(mode="json"),
                "workers": orch.worker_list().model_dump(mode="json")["workers"],
                "history": list(orch.history),
            }
        )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD)

    # -- health -----------------------------------------------------------------------------------

    @app.get(api.HEALTH.path, response_model=api.HEALTH.response, summary=api.HEALTH.summary, tags=["health"])
    async def healthz() -> Response:
        return json_response(HealthStatus(ok=True))

    @app.get(api.READY.path, response_model=api.READY.response, responses={503: {"model": HealthStatus}}, summary=api.READY.summary, tags=["health"])
    async def readyz() -> Response:
        if orch.ready:
            return json_response(HealthStatus(ok=True))
        return json_response(HealthStatus(ok=False, detail="not serving yet"), status=503)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            sub = RolloutSubmission.model_json_schema(ref_template="#/components/schemas/{model}")
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.update(sub.pop("$defs", {}))
            comps["RolloutSubmission"] = sub
            for model in BODIES_PARSED_BY_HANDLERS:  # as get_openapi renders a body parameter's model
                body_schema = Schema.model_validate(model.model_json_schema(ref_template="#/components/schemas/{model}"))
                comps.setdefault(model.__name__, jsonable_encoder(body_schema, by_alias=True, exclude_none=True))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
