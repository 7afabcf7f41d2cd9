"""The verifier actors of a run, owned by the driver, grown and shrunk to the size that
`verifier_scaling.VerifierAutoscaler` decides.

An actor is requested with its Ray resources (CPUs, GPUs, custom resources per actor, from the run's
resources config). Until Ray has placed it and its constructor has run it is *pending*: on KubeRay the
autoscaler sees the unmet request and adds a node; on a laptop it waits for a free core. A pending actor
is no error and gets no jobs; it becomes *live* once it answers `ping`. The orchestrator verifies on the
live actors only (`OrchestratorActor.set_verifiers`).

Shrinking drops pending actors first, then the newest live ones. A live actor leaves the orchestrator's
list at once and is killed `retire_after_s` later, so the calls it has in flight finish; a call that
does not is split and retried on the others (orchestrator/verification.py).

Ray is imported inside methods: importing this module does not need Ray.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmrl.actors import VerifierActor
from swarmrl.verifier_scaling import PoolLoad, VerifierAutoscaler

log = logging.getLogger(__name__)


@dataclass
class Member:
    name: str  # verifier-<i>, never reused within a run: its log file and the supervisor's key
    handle: Any
    ping: Any = None  # the first ping, in flight while the actor is pending


class VerifierPool:
    def __init__(
        self,
        config: Any,  # VerifierConfig
        weights_for_version: Any,
        tokenizer_dir: str,
        *,
        num_cpus: float = 0.0,
        num_gpus: float = 0.0,
        resources: dict[str, float] | None = None,
        max_restarts: int = -1,
        cpus: list[int] | None = None,
        run_dir: str | None = None,
        retire_after_s: float | None = None,
    ):
        import ray

        self.config = config
        self.args = (config, weights_for_version, tokenizer_dir)
        self.cpus, self.run_dir = cpus, run_dir
        # max_restarts=-1: Ray restarts a dead actor every time (the driver's supervisor decides when it
        # died too often); max_task_retries=1: the call it had in flight runs again on the new process.
        self.remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None,
            max_restarts=max_restarts, max_task_retries=1)(VerifierActor)
        self.retire_after_s = config.timeout_s if retire_after_s is None else retire_after_s
        self.live: list[Member] = []
        self.pending: list[Member] = []
        self._retiring: list[tuple[float, Any]] = []  # (kill at, handle)
        self._next = 0

    # ---------------------------------------------------------------- size

    @property
    def size(self) -> int:
        return len(self.live) + len(self.pending)

    def handles(self) -> list[Any]:
        """The live actors: what the orchestrator verifies on."""
        return [m.handle for m in self.live]

    def requested_handles(self) -> list[Any]:
        """Every actor, live or pending: the orchestrator's first list, made while the first actors start (a
        call to an actor still in its constructor waits for it; the driver waits for them to be live)."""
        return [m.handle for m in self.live + self.pending]

    def grow(self, n: int) -> None:
        """Request n more actors (pending until Ray places them and they answer)."""
        for _ in range(n):
            name = f"verifier-{self._next}"
            self._next += 1
            log_to = (self.run_dir, name) if self.run_dir else None
            handle = self.remote.remote(*self.args, cpus=self.cpus, log_to=log_to)
            self.pending.append(Member(name, handle, handle.ping.remote()))
            log.info("verifier actor requested", extra={"actor": name})

    def shrink(self, n: int) -> list[str]:
        """Remove n actors, pending ones first, then the newest live ones. Returns the live ones removed."""
        import ray

        removed: list[str] = []
        for _ in range(n):
            if self.pending:
                m = self.pending.pop()
                ray.kill(m.handle, no_restart=True)
            elif self.live:
                m = self.live.pop()
                self._retiring.append((time.time() + self.retire_after_s, m.handle))
                removed.append(m.name)
            else:
                break
            log.info("verifier actor removed", extra={"actor": m.name})
        return removed

    def resize(self, target: int) -> list[str]:
        """Grow or shrink to `target` actors. Returns the names of live actors removed."""
        if target > self.size:
            self.grow(target - self.size)
            return []
        return self.shrink(self.size - target) if target < self.size else []

    # ---------------------------------------------------------------- watching

    def refresh(self) -> tuple[list[tuple[Member, int, float]], list[tuple[str, str]]]:
        """Move the pending actors that answered to live, and kill retired actors whose time is up.
        Returns (newly live: (member, pid, ready at)), (failed: (name, why)): a pending actor whose
        constructor failed is dropped (the caller decides whether that ends the run)."""
        import ray

        now = time.time()
        for when, handle in [r for r in self._retiring if r[0] <= now]:
            ray.kill(handle, no_restart=True)
        self._retiring = [r for r in self._retiring if r[0] > now]
        ready: list[tuple[Member, int, float]] = []
        failed: list[tuple[str, str]] = []
        if not self.pending:
            return ready, failed
        done, _ = ray.wait([m.ping for m in self.pending], num_returns=len(self.pending), timeout=0)
        for m in [m for m in self.pending if m.ping in done]:
            self.pending.remove(m)
            try:
                pid, started_at = ray.get(m.ping)
            except Exception as exc:  # its constructor failed (Ray will not bring it back)
                failed.append((m.name, str(exc).splitlines()[0][:300]))
                ray.kill(m.handle, no_restart=True)
                continue
            m.ping = None
            self.live.append(m)
            ready.append((m, pid, started_at))
            log.info("verifier actor live", extra={"actor": m.name, "pid": pid})
        return ready, failed

    def wait_live(self, n: int, timeout_s: float | None = None) -> list[tuple[Member, int, float]]:
        """Block until n actors are live (the run's first min_actors): a constructor error surfaces now."""
        deadline = None if timeout_s is None else time.time() + timeout_s
        ready: list[tuple[Member, int, float]] = []
        while len(self.live) < n:
            new, failed = self.refresh()
            ready += new
            if failed:
                raise RuntimeError(f"{failed[0][0]} could not start: {failed[0][1]}")
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"{len(self.live)} of {n} verifier actors live after {timeout_s:g} s")
            if len(self.live) < n:
                time.sleep(0.05)
        return ready

    def shutdown(self) -> None:
        import ray

        for h in [m.handle for m in self.live + self.pending] + [h for _, h in self._retiring]:
            ray.kill(h, no_restart=True)
        self.live, self.pending, self._retiring = [], [], []


def scale(pool: VerifierPool, scaler: VerifierAutoscaler, orch: Any, supervisor: Any, logs: Path, now: float) -> None:
    """One step of the driver's pool (driver.Run._scale_verifiers, every verifier.scale_period_s): actors
    that became live join the supervisor's watch, one that could not start ends the run, the pool is
    resized to what the orchestrator's load needs, and the orchestrator gets the live actors. The list is
    sent every time, so an orchestrator that Ray restarted with its first arguments gets the pool as it is."""
    import ray

    ready, failed = pool.refresh()
    for m, pid, started_at in ready:
        supervisor.watch_actor(m.name, m.handle, logs / f"{m.name}.log", pid, started_at)
    for name, why in failed:
        supervisor.fail(name, logs / f"{name}.log", f"{name} could not start: {why}")
    try:
        st = ray.get(orch.status.remote(), timeout=2)
    except Exception:  # restarting: decide next time
        st = None
    if st is not None:
        load = PoolLoad(st.verify_queue, st.verify_in_per_s, st.verify_out_per_s, len(pool.live), len(pool.pending))
        target = scaler.desired(load, now)
        if target != pool.size:
            log.info("resizing the verifier pool", extra={"from": pool.size, "to": target, "queue": load.queue,
                                                          "in_per_s": round(load.arrivals_per_s, 2),
                                                          "out_per_s": round(load.drained_per_s, 2)})
        for name in pool.resize(target):
            supervisor.unwatch(name)
    orch.set_verifiers.remote(pool.handles(), len(pool.pending))
