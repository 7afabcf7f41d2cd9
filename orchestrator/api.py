"""The public HTTP API (fastapi): one route per entry of `protocol.api`'s endpoint table, generated from
the entry (method, path, body model, auth), plus the operator's dashboard page at `/` and the docs.

- Auth, from the table: a join token to register, a worker's own secret for worker endpoints (a worker
  acts only as itself), the admin token for operator endpoints (worker secrets are refused there).
- Every refusal is a `protocol.ErrorBody` with the 4xx status of its code (`protocol.api.HTTP_STATUS`).
- The gate (gate.py) checks the credential from the headers before the body is read, enforces the
  request budgets and reads the body under its cap; group commit (group_commit.py) wraps every request;
  the fast path (fast_path.py) keeps FastAPI's per-request machinery off every route. A submission's
  decompression and parsing run off the event loop when the run's leases allow big bodies.
- A lease request with `wait_s` is held on the event loop while the async bound is full (`lease_held`,
  the long poll; room.py wakes it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.dashboard import HEADERS as DASHBOARD_HEADERS
from orchestrator.dashboard import HTML as DASHBOARD
from orchestrator.errors import ApiError
from orchestrator.fast_path import (
    BareRoute,
    BareRouteDispatch,
    error_response,
    json_response,
    parse_json_body,
)
from orchestrator.gate import CALLER, Gate
from orchestrator.group_commit import GroupCommit, GroupCommitMiddleware
from orchestrator.leases import GenerationBoundReached
from orchestrator.service import Orchestrator
from protocol import api, limits
from protocol.models import ErrorBody, ErrorCode, LeaseRequest, LeaseResponse, WireModel
from protocol.operator_models import HealthStatus

log = logging.getLogger(__name__)

# The endpoints every worker calls once per task: dispatched past Starlette's router (fast_path.py).
HOT = (api.LEASE, api.SUBMIT)
# Bodies that may be left out (their model's defaults apply).
OPTIONAL_BODY = (api.RELEASE, api.BAN, api.UNBAN, api.REVOKE_TOKEN, api.JOIN_CHALLENGE)
# Above this many bytes of honest body, a submission is decompressed and parsed in a thread, so that it
# never holds the event loop (below, inline is cheaper than the two thread hand-offs: ~0.1 ms).
INLINE_PARSE_BYTES = 256 << 10
BEARER_SECURITY = [{"HTTPBearer": []}]

Handler = Callable[[Request, "str | None", Any], "WireModel | Response"]


def swagger_assets() -> Path | None:
    """A local copy of Swagger UI, so /docs works without internet. vLLM ships one; find it without
    importing vLLM. None: fall back to FastAPI's CDN links."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(list(spec.submodule_search_locations)[0]) / "entrypoints" / "serve" / "instrumentator" / "static"
    return static if (static / "swagger-ui-bundle.js").is_file() and (static / "swagger-ui.css").is_file() else None


async def lease_held(orch: Orchestrator, worker_id: str, req: LeaseRequest) -> LeaseResponse:
    """`orch.lease`, held on the event loop for up to `req.wait_s` while the async bound is full (a long
    poll): the worker gets its lease as soon as a verdict, a trained batch or a lease given back makes
    room, instead of sleeping a guessed retry-after. Each wake-up is one more try."""
    deadline = time.monotonic() + min(req.wait_s, orch.cfg.request_timeout_s / 2)
    woken = False
    while True:
        try:
            answer = orch.lease_requests.try_lease(worker_id, req)
        except GenerationBoundReached:
            left = deadline - time.monotonic()
            if left <= 0 or not orch.ready:
                return orch.lease_requests.bound_reached()
        except ApiError:  # e.g. its version is too old: the room it was woken for is someone else's
            if woken:
                orch.leases.room.notify()
            raise
        else:
            if woken:  # there may be room for the next waiter too (room.RoomSignal: one at a time)
                orch.leases.room.notify()
            return answer
        await orch.leases.room.wait(left)
        woken = True


def handlers(orch: Orchestrator) -> dict[api.Endpoint, Handler]:
    """What each endpoint does, given the request, its caller (the gate's: a worker id for worker
    endpoints, the join token's row for register) and the parsed body."""
    parse_lock = asyncio.Semaphore(2)  # parses in threads at once: bounds their memory

    def register(request: Request, token: Any, body: Any) -> WireModel:
        # Registrations are also rate-limited per client address: a leaked join token cannot flood the table.
        orch.limiter.check(f"register@{_address(request)}")
        return orch.register(body, token)

    async def submit(request: Request, worker: Any, body: bytes) -> WireModel:
        encoding = request.headers.get("content-encoding")
        if orch.admission.cap <= INLINE_PARSE_BYTES:
            parsed = orch.admission.parse(body, encoding)
        else:
            async with parse_lock:
                parsed = await asyncio.get_running_loop().run_in_executor(None, orch.admission.parse, body, encoding)
        return orch.admission.accept(worker, parsed, body, encoding)

    def history(*_: Any) -> Response:
        return JSONResponse(
            {
                "status": orch.status().model_dump(mode="json"),
                "workers": orch.operators.worker_list().model_dump(mode="json")["workers"],
                "history": list(orch.windows.history),
            }
        )

    def model_file(request: Request, worker: Any, _: Any) -> Response:
        token_id = orch.workers.token_of(worker)
        token = orch.tokens.get(token_id) if token_id else None
        data = orch.model_files.read(request.path_params["name"], worker, token_id,
                                     token.max_identities if token else 1)
        return Response(data, media_type="application/octet-stream")

    def ready(*_: Any) -> Response:
        if orch.ready:
            return json_response(HealthStatus(ok=True))
        return json_response(HealthStatus(ok=False, detail="not serving yet"), status=503)

    return {
        api.REGISTER: register,
        api.HEARTBEAT: lambda r, worker, body: orch.heartbeat(worker, r.path_params["worker_id"], body),
        api.LEASE: lambda r, worker, body: lease_held(orch, worker, body) if body.wait_s > 0 else orch.lease(worker,
        body),
        api.RELEASE: lambda r, worker, body: orch.release(worker, r.path_params["lease_id"]),
        api.SUBMIT: submit,
        api.VERDICT: lambda r, worker, body: orch.verification.verdict(worker, r.path_params["submission_id"]),
        api.MODEL_FILES: lambda *_: orch.model_files.listing(),
        api.MODEL_FILE: model_file,
        api.STATUS: lambda *_: orch.status(),
        api.WORKERS: lambda *_: orch.operators.worker_list(),
        api.BAN: lambda r, _, body: orch.operators.set_ban(r.path_params["worker_id"], True, body.reason, body.scope),
        api.UNBAN: lambda r, _, body: orch.operators.set_ban(r.path_params["worker_id"], False, body.reason),
        api.MINT_TOKEN: lambda r, _, body: orch.operators.mint_token(body),
        api.TOKENS: lambda *_: orch.operators.token_list(),
        api.REVOKE_TOKEN: lambda r, _, body: orch.operators.revoke_token(r.path_params["token_id"], body.reason),
        api.METRICS: lambda *_: Response(generate_latest(orch.metrics.registry), media_type=CONTENT_TYPE_LATEST),
        api.STATUS_HISTORY: history,
        api.JOIN_CHALLENGE: lambda r, _, body: orch.open_join.challenge(_address(r)),
        api.JOIN_CLAIM: lambda r, _, body: orch.open_join.claim(_address(r), body),
        api.HEALTH: lambda *_: HealthStatus(ok=True),
        api.READY: ready,
    }


def create_app(orch: Orchestrator) -> FastAPI:
    """Handlers run on the event loop itself: their work is CPU under the GIL plus SQLite statements,
    and their writes join one transaction per loop iteration (group_commit.py), committed before any of
    them answers. (A thread pool would add two context switches and a lock hand-off per request and buy
    no parallelism.)"""
    errors = {status: {"model": ErrorBody} for status in sorted(set(api.HTTP_STATUS.values()))}

    assets = swagger_assets()
    app = FastAPI(
        title="swarmrl orchestrator",
        version="1",
        description="Workers register, lease tasks and submit rollouts; operators watch and ban. See protocol/api.py.",
        docs_url=None if assets else "/docs",
        # Starlette's slash redirect builds an absolute Location from the request's Host header (an open
        # redirect); no route of ours ends in "/", so such a path is a plain 404.
        redirect_slashes=False,
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
        parts = [f"{'.'.join(str(p) for p in err.get('loc', ())) or 'request'}: {err.get('msg', 'invalid')}"
            for err in exc.errors()[:5]]
        orch.metrics.requests_refused.labels(ErrorCode.invalid_request.value).inc()
        return error_response(ApiError(ErrorCode.invalid_request, "; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = api.code_for_status(exc.status_code)
        detail = str(exc.detail)
        if exc.status_code == 404 and exc.detail == "Not Found":  # the router's: say which path
            path = request.scope.get("path", "")
            detail = f"no such path {path[:200]!r}" + (" (paths take no trailing slash)" if len(path) > 1
                and path.endswith("/") else "")
        return error_response(ApiError(code, detail, status=exc.status_code if exc.status_code < 500 else 400))

    # -- middleware, added innermost first: the gate checks the credential and reads the body under the
    # budgets, then the request joins the shared transaction, then the hot endpoints go straight to their route.
    bare_routes: dict[tuple[str, str], Any] = {}
    app.add_middleware(BareRouteDispatch, routes=bare_routes, api_error_handler=_api_error)
    app.state.group_commit = group = GroupCommit(orch.db)
    app.add_middleware(GroupCommitMiddleware, group=group)
    app.add_middleware(Gate, orch=orch)
    app.state.orchestrator = orch

    # -- routes: one per endpoint of the table --------------------------------------------------------

    def add_route(ep: api.Endpoint, handler: Handler) -> None:
        raw_body = ep is api.SUBMIT  # parsed by admission, after its size and decompression checks
        optional = ep in OPTIONAL_BODY

        async def endpoint(request: Request) -> Response:
            caller = request.scope["state"].get(CALLER)  # the gate authenticated it (nothing reaches here otherwise)
            body = None
            if ep.request is not None:
                data = await request.body()
                body = data if raw_body else parse_json_body(ep.request, data, request.headers.get("content-type"),
                    optional)
            out = handler(request, caller, body)
            if inspect.isawaitable(out):
                out = await out
            return out if isinstance(out, Response) else json_response(out)

        extra: dict[str, Any] = {}
        if ep.auth is not api.Auth.none:
            extra["security"] = BEARER_SECURITY
        if ep.request is not None:
            body_doc: dict[str,
                Any] = {"content": {"application/json": {"schema": {
                "$ref": f"#/components/schemas/{ep.request.__name__}"}}}, "required": not optional}
            if raw_body:
                body_doc["description"] = (
                    f"JSON {ep.request.__name__}; may be zstd-compressed (Content-Encoding: "
                    f"{api.SUBMIT_CONTENT_ENCODING}). "
                    f"At most {limits.MAX_BODY_BYTES} bytes as sent and {limits.MAX_DECOMPRESSED_BODY_BYTES} "
                    f"decompressed."
                )
            extra["requestBody"] = body_doc
        params = [p.strip("{}") for p in ep.path.split("/") if p.startswith("{")]
        if params:
            extra["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                for p in params]
        responses = dict(errors) if ep.auth is not api.Auth.none or ep in api.OPEN_JOIN_ENDPOINTS else {}
        if ep is api.READY:
            responses[503] = {"model": HealthStatus}
        app.router.add_api_route(
            ep.path, endpoint, methods=[ep.method], route_class_override=BareRoute, response_model=ep.response,
            responses=responses, summary=ep.summary, tags=[_tag(ep)], openapi_extra=extra or None,
        )
        if ep in HOT:
            bare_routes[(ep.method, ep.path)] = app.router.routes[-1].app

    table = handlers(orch)
    for ep in api.ALL_ENDPOINTS:
        add_route(ep, table[ep])

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD, headers=DASHBOARD_HEADERS)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            comps = schema.setdefault("components", {})
            schemas = comps.setdefault("schemas", {})
            for model in {ep.request for ep in api.ALL_ENDPOINTS if ep.request is not None}:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in body.pop("$defs", {}).items():
                    schemas.setdefault(name, sub)
                schemas[model.__name__] = body
            comps.setdefault("securitySchemes", {})["HTTPBearer"] = {
                "type": "http", "scheme": "bearer",
                "description": "join token, worker secret or admin token, depending on the endpoint",
            }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _address(request: Request) -> str:
    return request.client.host if request.client else "?"


def _tag(ep: api.Endpoint) -> str:
    if ep in api.WORKER_ENDPOINTS or ep in api.OPEN_JOIN_ENDPOINTS:
        return "worker"
    return "operator" if ep in api.OPERATOR_ENDPOINTS else "health"
