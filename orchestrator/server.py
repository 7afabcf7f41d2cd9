"""Serve the orchestrator's HTTP API with uvicorn: in a background thread (`start`, used inside the Ray
actor, the tests and the benchmark) or in the foreground until a signal (`run`, what `swarmrl
orchestrator` runs).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import uvicorn

from orchestrator.api import create_app
from orchestrator.config import OrchestratorConfig, refuse_exposed_demo_secrets
from orchestrator.gate import uvicorn_protocol
from orchestrator.service import Orchestrator

log = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 10_000


def uvicorn_config(app: Any, host: str, port: int, cfg: OrchestratorConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        # head deadline, per-address cap (gate.py)
        http=uvicorn_protocol(cfg.header_timeout_s, cfg.max_connections_per_address, cfg.trusted_proxies),
        # A client's address is its connection's peer unless that peer is a proxy the operator named: uvicorn's
        # default takes X-Forwarded-For from any loopback peer (the default host, behind any local proxy or tunnel
        # that passes the header on), and every per-address budget would then be the client's to name.
        proxy_headers=bool(cfg.trusted_proxies),
        forwarded_allow_ips=list(cfg.trusted_proxies),
        limit_concurrency=cfg.max_connections,  # beyond: 503, so a flood of connections cannot exhaust the host
        log_level="warning",
        access_log=False,
        timeout_keep_alive=max(5, int(cfg.request_timeout_s)),
        timeout_graceful_shutdown=5,
        lifespan="off",
    )


class OrchestratorServer:
    """The API served by uvicorn in a background thread. `port=0` picks a free port (see `url`)."""

    def __init__(self, orch: Orchestrator, host: str | None = None, port: int | None = None):
        self.orch = orch
        cfg = orch.cfg
        refuse_exposed_demo_secrets(cfg.model_copy(update={"host": host or cfg.host}))
        self.app = create_app(orch)
        self.server = uvicorn.Server(uvicorn_config(self.app, host or cfg.host, cfg.port if port is None else port,
            cfg))
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
        self.orch.stop_holding()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.orch.stop()
        self.orch.db.close()
