"""The HTTP contract is one table that both the server and the client read."""

from __future__ import annotations

from pydantic import BaseModel

from protocol import api


def test_endpoints_are_unique_and_typed():
    seen = set()
    for ep in api.ALL_ENDPOINTS:
        assert (ep.method, ep.path) not in seen
        seen.add((ep.method, ep.path))
        assert ep.path.startswith("/")
        for model in (ep.request, ep.response):
            assert model is None or issubclass(model, BaseModel)
        if ep.method == "POST":
            assert ep.request is not None, ep.path


def test_operator_endpoints_need_admin_and_worker_endpoints_need_worker_auth():
    assert {ep.auth for ep in api.OPERATOR_ENDPOINTS} == {api.Auth.admin}
    assert api.REGISTER.auth is api.Auth.join
    assert all(ep.auth is api.Auth.worker for ep in api.WORKER_ENDPOINTS if ep is not api.REGISTER)
    # Open join's two endpoints take no credential (they hand one out); nothing else is open but health.
    assert {ep for ep in api.ALL_ENDPOINTS if ep.auth is api.Auth.none} == {*api.OPEN_JOIN_ENDPOINTS, api.HEALTH,
        api.READY}


def test_url_formatting():
    assert api.HEARTBEAT.url("http://h:1/", worker_id="w1") == "http://h:1/v1/workers/w1/heartbeat"
