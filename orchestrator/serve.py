"""Run the orchestrator's HTTP API: standalone (`serve`, blocking; what `swarmrl orchestrator` runs),
or in a background thread (`OrchestratorServer`, used inside the Ray actor, the tests and the
benchmark). `status` fetches `/v1/status` and renders it with rich (what `swarmrl status` runs).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from orchestrator.config import RunConfig
from orchestrator.data import PromptSet
from orchestrator.service import Orchestrator, Verification
from orchestrator.state import State
from protocol import api
from protocol.models import RunStatus

log = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 10_000


def db_path(config: RunConfig) -> Path:
    return Path(config.orchestrator.db_path) if config.orchestrator.db_path else config.run_dir / "orchestrator.sqlite"


def model_dir(config: RunConfig) -> Path:
    return Path(config.model.path) if config.model.path else config.run_dir / "base_model"


def build_orchestrator(
    config: RunConfig,
    verifier: Verification,
    *,
    prompts: PromptSet | None = None,
    model: str | Path | None = None,
    relay_urls: list[str] | None = None,
    manifest_public_key: str = "",
    **kwargs: Any,
) -> Orchestrator:
    """The orchestrator core over the run's SQLite file; prompts from the config unless given."""
    if prompts is None:
        prompts = PromptSet.from_config(config.data, model or model_dir(config), config.seed)
    state = State(db_path(config))
    return Orchestrator(config, state, prompts, verifier, relay_urls=relay_urls, manifest_public_key=manifest_public_key, **kwargs)


def uvicorn_config(app: Any, host: str, port: int, timeout_s: float) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=max(5, int(timeout_s)),
        timeout_graceful_shutdown=5,
        lifespan="off",
    )


class OrchestratorServer:
    """The API served by uvicorn in a background thread. `port=0` picks a free port (see `url`)."""

    def __init__(self, orch: Orchestrator, host: str | None = None, port: int | None = None):
        from orchestrator.api import create_app

        self.orch = orch
        cfg = orch.cfg
        self.app = create_app(orch)
        self.server = uvicorn.Server(uvicorn_config(self.app, host or cfg.host, cfg.port if port is None else port, cfg.request_timeout_s))
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> "OrchestratorServer":
        # Everything that exists now (imports, app, prompt set) lives as long as the process: move it
        # out of the cyclic GC's view. Without this, each full collection walks every object of
        # FastAPI, pydantic, numpy... (~130 ms in the benchmark, every few thousand requests: a stall
        # of every request in flight, and ~0.25 ms of CPU per submission on average). Reference counting
        # still frees these objects; only cycles among them would no longer be collected.
        gc.collect()
        gc.freeze()
        # Requests free what they allocate by reference counting; young-generation passes every 700
        # container allocations (the default) cost ~0.05 ms per submission in the benchmark.
        gc.set_threshold(max(gc.get_threshold()[0], GC_YOUNG_THRESHOLD), *gc.get_threshold()[1:])
        self.orch.start()
        self._thread = threading.Thread(target=self.server.run, name="orchestrator-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.orch.stop()
                raise RuntimeError("the orchestrator's HTTP server did not start (port in use?)")
            time.sleep(0.02)
        log.info("orchestrator serving", extra={"url": self.url})
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = self.server.config.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve in the foreground until Ctrl-C / SIGTERM, then stop cleanly (verification thread joined,
        last-seen times flushed, SQLite closed). uvicorn runs in its thread; the signals are ours, because
        uvicorn would re-raise them after its own shutdown and skip ours."""
        import signal

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        try:
            while not stop.wait(0.5) and self._thread is not None and self._thread.is_alive():
                pass
        finally:
            self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.orch.stop()
        self.orch.state.close()


def serve(
    config: RunConfig,
    verifier: Verification | None = None,
    *,
    prompts: PromptSet | None = None,
    origin_urls: list[str] | None = None,
    relay_urls: list[str] | None = None,
    manifest_public_key: str = "",
) -> None:
    """Run the API in the foreground until interrupted (Ctrl-C / SIGTERM).

    Without a `verifier`, starts a Ray verifier pool (config.verifier.num_actors actors) whose actors
    pull each claimed version's weights from the shardcast servers at `origin_urls`.
    """
    pool = None
    if verifier is None:
        from orchestrator.ray_actors import RayVerifierPool, ShardcastWeights, init_ray

        if not origin_urls:
            raise ValueError("serve() without a verifier needs origin_urls (shardcast) for the verifier pool's weights")
        init_ray(config.ray_address)
        weights = ShardcastWeights(origin_urls, manifest_public_key, str(config.run_dir / "verifier_weights"))
        verifier = pool = RayVerifierPool.start(config.verifier, weights, str(model_dir(config)))
    orch = build_orchestrator(
        config, verifier, prompts=prompts, relay_urls=relay_urls or origin_urls, manifest_public_key=manifest_public_key
    )
    try:
        OrchestratorServer(orch).run()
    finally:
        if pool is not None:
            pool.shutdown()


def fetch_status(url: str, admin_token: str, timeout_s: float = 10.0) -> RunStatus:
    r = httpx.get(api.STATUS.url(url), headers={api.AUTH_HEADER: f"Bearer {admin_token}"}, timeout=timeout_s)
    if r.status_code != 200:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise RuntimeError(f"GET {api.STATUS.path}: HTTP {r.status_code}: {detail}")
    return RunStatus.model_validate_json(r.content)


def render_status(st: RunStatus, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"swarmrl run '{st.run_name}'", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [
        ("step", st.step),
        ("policy version", st.policy_version),
        ("async level", st.async_level),
        ("workers online", st.workers_online),
        ("buffer depth", st.buffer_depth),
        ("acceptance rate", f"{st.acceptance_rate:.1%} ({st.submissions_accepted} accepted, {st.submissions_rejected} rejected)"),
        ("mean reward", "–" if st.mean_reward is None else f"{st.mean_reward:.3f}"),
        ("rollout tokens/s", f"{st.rollout_tokens_per_s:.1f}"),
        ("trained samples/s", f"{st.trained_samples_per_s:.2f}"),
        ("zero-signal groups dropped", st.groups_dropped_zero_signal),
        ("stale samples dropped", st.samples_dropped_stale),
        ("staleness (gap: samples)", ", ".join(f"{k}: {v}" for k, v in st.staleness_histogram.items()) or "–"),
    ]
    if st.finished:
        rows.append(("finished", "yes"))
    if st.error:
        rows.append(("error", f"[red]{st.error}[/]"))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


def status(url: str, admin_token: str, console: Any = None) -> RunStatus:
    """Fetch and print the run status (what `swarmrl status` shows)."""
    st = fetch_status(url, admin_token)
    render_status(st, console)
    return st
