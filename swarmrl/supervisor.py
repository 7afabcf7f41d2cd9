"""Watches the components of a run and brings back what dies, under one restart policy for all of them.

- Ray actors (orchestrator, verifiers): Ray restarts them itself (max_restarts=-1); we notice by their
  `ping()` answering with another pid, and count the restart and the time it was gone.
- Local processes (relays, workers): we restart them, with the same arguments (a relay on the same port).
- The trainer actor: the driver's own `train_step` call notices its death; it reports here (`restarted`).

The policy: a component may restart `max_restarts` times within any `window_s` seconds. One more, or an
actor that Ray gave up on (its constructor failed), or one that stays unreachable for `down_timeout_s`,
fails the run with an error that names the component and quotes the last lines of its log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.processes import Proc, RunFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 600.0
    down_timeout_s: float = 300.0

    def allows(self, restarts: deque, now: float) -> bool:
        """Whether one more restart is within budget (restarts: the times of the earlier ones)."""
        return sum(1 for t in restarts if now - t <= self.window_s) < self.max_restarts


@dataclass
class Component:
    name: str
    log_path: Path
    handle: Any = None  # a Ray actor
    proc: Proc | None = None  # a local process
    start: Callable[[], Proc] | None = None  # how to start the process again
    pid: int = 0
    started_at: float = 0.0
    restarts: deque = field(default_factory=deque)
    seconds_lost: float = 0.0
    down_since: float | None = None
    last_ok: float = field(default_factory=time.time)
    ping: Any = None  # the ping in flight (an ObjectRef)
    ping_sent: float = 0.0


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


class Supervisor:
    def __init__(self, policy: RestartPolicy, on_restart: Callable[[str, float], None], period_s: float = 1.0):
        self.policy = policy
        self.on_restart = on_restart  # (component, seconds lost): the driver records it
        self.period_s = period_s
        self.components: dict[str, Component] = {}
        self.failure: str | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks: list[Callable[[], None]] = []  # also run every period (e.g. the driver's heartbeat)

    # ---------------------------------------------------------------- registration

    def watch_actor(self, name: str, handle: Any, log_path: Path, pid: int, started_at: float) -> None:
        with self._lock:
            self.components[name] = Component(name, log_path, handle=handle, pid=pid, started_at=started_at)

    def watch_process(self, name: str, start: Callable[[], Proc]) -> Proc:
        proc = start()
        with self._lock:
            self.components[name] = Component(name, proc.log_path, proc=proc, start=start, pid=proc.popen.pid,
                started_at=time.time())
        return proc

    def unwatch(self, name: str) -> None:
        """Stop watching a component that was removed on purpose (a verifier actor the pool shrank away)."""
        with self._lock:
            self.components.pop(name, None)

    def processes(self, prefix: str) -> list[Proc]:
        with self._lock:
            return [c.proc for n, c in sorted(self.components.items()) if n.startswith(prefix) and c.proc is not None]

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {n: c.pid for n, c in self.components.items()}

    def summary(self) -> dict[str, tuple[int, float]]:
        with self._lock:
            return {n: (len(c.restarts), c.seconds_lost) for n, c in self.components.items() if c.restarts}

    # ---------------------------------------------------------------- events

    def restarted(self, name: str, pid: int, started_at: float, down_since: float) -> None:
        """A component came back as `pid` (ready at `started_at`) after being gone since `down_since`."""
        with self._lock:
            c = self.components[name]
            if pid == c.pid:
                return
            now = time.time()
            lost = max(0.0, started_at - down_since)
            if not self.policy.allows(c.restarts, now):
                self._fail(c, f"{name} died {len(c.restarts) + 1} times within {self.policy.window_s:.0f} s")
            c.restarts.append(now)
            c.seconds_lost += lost
            c.pid, c.started_at, c.down_since, c.last_ok = pid, started_at, None, now
        log.warning("%s restarted", name, extra={"pid": pid, "seconds_lost": round(lost, 2),
            "restarts": len(c.restarts)})
        try:
            self.on_restart(name, lost)
        except Exception:  # counting must not take the run down
            log.exception("could not record the restart of %s", name)

    def check(self) -> None:
        """Raise RunFailed if a component died for good."""
        if self.failure:
            raise RunFailed(self.failure)

    def fail(self, name: str, log_path: Path, why: str) -> None:
        """A component that is not (yet) watched failed for good (a verifier actor that could not start)."""
        with self._lock:
            self._fail(Component(name, log_path), why)

    def _fail(self, c: Component, why: str) -> None:
        if self.failure is None:
            self.failure = f"{why}; last lines of {c.log_path}:\n{tail(c.log_path)}"
            log.error("%s", why)

    # ---------------------------------------------------------------- the watch loop

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the components are stopped, so that none is restarted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for fn in self.ticks:
                try:
                    fn()
                except Exception:
                    log.exception("supervisor tick failed")
            with self._lock:
                components = list(self.components.values())
            for c in components:
                if self._stop.is_set() or self.failure:
                    return
                try:
                    if c.proc is not None:
                        self._check_process(c)
                    elif c.handle is not None:
                        self._check_actor(c)
                except RunFailed as exc:
                    with self._lock:
                        self.failure = self.failure or str(exc)
                except Exception:
                    log.exception("supervisor check of %s failed", c.name)

    def _check_process(self, c: Component) -> None:
        assert c.proc is not None and c.start is not None
        if c.proc.alive():
            c.last_ok = time.time()
            return
        down_since = c.last_ok
        log.warning("%s exited with code %s; restarting it", c.name, c.proc.popen.returncode)
        with self._lock:
            if not self.policy.allows(c.restarts, time.time()):
                self._fail(c,
                    f"{c.name} died {len(c.restarts) + 1} times within {self.policy.window_s:.0f} s (last exit code "
                    f"{c.proc.popen.returncode})")
                return
        c.proc = c.start()
        self.restarted(c.name, c.proc.popen.pid, time.time(), down_since)

    def _check_actor(self, c: Component) -> None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        now = time.time()
        if c.ping is None:
            c.ping, c.ping_sent = c.handle.ping.remote(), now
            return
        done, _ = ray.wait([c.ping], timeout=0)
        if not done:  # busy (a verifier in a long batch) or restarting: Ray holds calls until it is back
            if now - c.ping_sent > self.policy.down_timeout_s:
                self._fail(c, f"{c.name} has not answered for {now - c.ping_sent:.0f} s")
            return
        ref, c.ping = c.ping, None
        try:
            pid, started_at = ray.get(ref)
        except ActorDiedError as exc:  # Ray will not bring it back (e.g. its constructor failed)
            self._fail(c, f"{c.name} died and cannot be restarted: {str(exc).splitlines()[0][:300]}")
            return
        except RayActorError:  # died with a call in flight; Ray is restarting it
            c.down_since = c.down_since or c.last_ok
            return
        if pid != c.pid:
            self.restarted(c.name, pid, started_at, c.down_since or c.last_ok)
        c.last_ok = now
