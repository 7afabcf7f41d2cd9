"""The dashboard page in headless Chromium (Debian's `chromium`): it loads without internet, polls the
orchestrator with the admin token from the URL fragment, and draws its charts."""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
import pytest
from orch_fakes import encode, make_orchestrator, make_submission, run_config

from orchestrator.server import OrchestratorServer
from protocol.models import LeaseRequest, WorkerRegistration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(args: list[str], profile, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
        timeout=timeout)


def dump_dom(url: str, profile, budget_ms: int) -> str:
    """The rendered DOM, checked to have run with nothing blocked by the page's CSP (Chromium logs each
    violation to the console, which --enable-logging sends to stderr)."""
    res = chromium(["--dump-dom", "--enable-logging=stderr", "--v=0", f"--virtual-time-budget={budget_ms}", url],
        profile)
    assert "Content Security Policy" not in res.stderr, [line for line in res.stderr.splitlines()
        if "Content Security" in line]
    return res.stdout


@pytest.fixture
def busy_server(tmp_path):
    """A server with some history: accepted and rejected submissions over several housekeeping ticks."""
    cfg = run_config(tmp_path, admin_token="dash-admin", max_open_leases_per_worker=100)
    # No trainer consumes the buffer here: steps big enough that the async bound never refuses a lease.
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 4096})})
    orch = make_orchestrator(cfg)
    srv = OrchestratorServer(orch, port=0).start()
    rng = np.random.default_rng(0)
    workers = [orch.authenticate(orch.register(WorkerRegistration(name=f"volunteer-{i}"),
        orch.cfg.join_tokens[0].get_secret_value()).secret) for i in range(3)]
    for tick in range(12):
        for j, wid in enumerate(workers):
            lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
            orch.admission.submit(wid, encode(make_submission(lease, rng, bad=(tick + j) % 7 == 6)), None)
        while orch.verification.verify_pending():
            pass
        orch.housekeeping(now=time.time() + 2 * tick)
    yield srv
    srv.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_dashboard_screenshot(busy_server, tmp_path):
    shot = tmp_path / "dashboard.png"
    url = f"{busy_server.url}/#token=dash-admin"
    res = chromium([f"--screenshot={shot}", "--window-size=1280,900", "--virtual-time-budget=5000", url],
        tmp_path / "profile")
    assert shot.exists() and shot.stat().st_size > 10_000, res.stderr[-2000:]
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape[:2] == (900, 1280)
    # Not blank: many distinct colours, including the chart line colours.
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50
    keep = tmp_path.parent / "dashboard-latest.png"
    shutil.copy(shot, keep)

    # The rendered DOM: tiles filled from /v1/status/history and one SVG path per chart with data.
    dom = dump_dom(url, tmp_path / "profile2", 5000)
    assert 'data-rendered="1"' in dom
    assert dom.count("<svg") == 8 and dom.count("<path") >= 5
    assert "verification queue" in dom and "verifier actors (pending)" in dom
    assert "<td>volunteer-2</td>" in dom and '<div id="err"></div>' in dom


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_dashboard_without_token_asks_for_it(busy_server, tmp_path):
    dom = dump_dom(busy_server.url + "/", tmp_path / "profile", 3000)
    assert '<div id="err">admin token needed</div>' in dom and 'data-rendered="1"' not in dom
