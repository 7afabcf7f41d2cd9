"""Property-based fuzzing of the HTTP API from its own OpenAPI spec (schemathesis): whatever the
generated request, the answer is never a 5xx (except /readyz's documented 503) and never a hang."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from orch_fakes import make_orchestrator, run_config  # noqa: E402

from orchestrator.server import OrchestratorServer  # noqa: E402
from protocol import api  # noqa: E402
from protocol.models import ErrorBody, WorkerRegistration  # noqa: E402

ADMIN = "fuzz-admin"
JOIN = "fuzz-join"
AUTH = {(ep.method, ep.path): ep.auth for ep in api.ALL_ENDPOINTS}
AUTH[("GET", "/v1/status/history")] = api.Auth.admin


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    cfg = run_config(tmp_path_factory.mktemp("fuzz"), admin_token=ADMIN, join_tokens=[JOIN], rate_limit_per_s=1e6,
                     max_open_leases_per_worker=100_000, request_timeout_s=5.0)
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    reg = srv.orch.register(WorkerRegistration(name="fuzzer"), JOIN)
    yield srv, reg.secret
    srv.stop()


def _spec() -> dict:
    """The spec exactly as the server serves it (create_app on a throwaway in-memory orchestrator)."""
    import tempfile
    from pathlib import Path

    from orchestrator.api import create_app

    orch = make_orchestrator(run_config(Path(tempfile.mkdtemp(prefix="swarmrl-fuzz-spec-")), db_path=":memory:"))
    return create_app(orch).openapi()


schema = schemathesis.openapi.from_dict(_spec())


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_server_errors_no_hangs(case, fuzz_server):
    srv, secret = fuzz_server
    auth = AUTH.get((case.method.upper(), case.path))
    token = {api.Auth.join: JOIN, api.Auth.worker: secret, api.Auth.admin: ADMIN}.get(auth)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # A valid credential, so that generated bodies get past auth and into validation and handlers.
    response = case.call(base_url=srv.url, headers=headers, timeout=15)
    status = response.status_code
    if case.path == api.READY.path and status == 503:
        return  # documented: not serving yet
    assert status < 500, f"{case.method} {case.path} -> {status}: {response.text[:500]}"
    if 400 <= status < 500:
        ErrorBody.model_validate_json(response.content)  # every refusal is an ErrorBody with a reason
