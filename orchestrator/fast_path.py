"""The orchestrator API's fast path, in one place: every route is a `BareRoute` that FastAPI documents
like any other but calls without its per-request machinery, and `BareRouteDispatch` sends the two hot
endpoints (lease and submit, every worker calls both once per task) past Starlette's exception
middleware and router.

Measured (bench/results/orchestrator_bench.md): FastAPI's per-request dependency and body machinery cost
~35 of the ~75 us a lease request spent in the app; the exception middleware and router ~5% of the
server's CPU per lease + submit.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from orchestrator.errors import ApiError
from protocol.models import ErrorCode, WireModel


class BareRoute(APIRoute):
    """A route whose endpoint takes only the `Request` and returns a `Response`: documented like any
    FastAPI route (its body, path parameters and security through `openapi_extra`), but called directly,
    without FastAPI's per-request dependency solving (it parses the query, headers and cookies even for
    an endpoint that declares none) and without the per-route exception wrapper and exit stack: its
    exceptions go to the app's exception handlers through ExceptionMiddleware."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        endpoint = self.endpoint

        async def app(scope: dict, receive: Any, send: Any) -> None:
            response = await endpoint(Request(scope, receive, send))
            await response(scope, receive, send)

        self.app = app


class BareRouteDispatch:
    """Pure ASGI, the innermost of our middlewares: a request for a static-path route registered here
    goes straight to it, and its ApiError to the app's own ApiError handler, as on any other route.
    Every other request passes through."""

    def __init__(self, app: Any, routes: dict[tuple[str, str], Any], api_error_handler: Any):
        self.app = app
        self.routes = routes  # (method, path) -> the route's ASGI app; filled as routes are declared
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


def parse_json_body(model: type[BaseModel], body: bytes, content_type: str | None, optional: bool = False) -> Any:
    """The request body as `model`, refused (422) where FastAPI refuses a body parameter: a body not
    sent as JSON (`application/json` or `application/*+json`), or not valid for the model. An `optional`
    body may be left out (the model's defaults)."""
    if not body and optional:
        return model()
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
