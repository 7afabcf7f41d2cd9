"""Keeps the newest policy version downloaded, in a background thread, through the shardcast client.

The loop tells the keeper which version the orchestrator is at (`observe`, from registration, every
heartbeat ack and every `version_too_old`). The keeper pulls the newest version the relays serve into
`dest_root/v<N>` (full shards or deltas, verified against the run's signed manifest; the origin as the
fallback) while the engine keeps generating with the version it has loaded. A version reached by deltas
comes with its weights in memory (`PulledVersion.state`), so the engine reloads without reading the disk. The loop
swaps the new version in between two tasks, and only blocks on the download (`wait_for`) when its loaded version is
below what the orchestrator still accepts.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from protocol.retry import backoff_delays

log = logging.getLogger(__name__)

# How long relays may go without listing the version the orchestrator announced (mirroring a delta takes
# a poll and a few seconds) before the keeper asks for that version by number, from the origin if need be.
RELAY_LAG_S = 15.0


class WeightsKeeper:
    def __init__(self, dest_root: Path, *, make_client: Callable[..., object] | None = None,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 10.0, relay_lag_s: float = RELAY_LAG_S):
        self.dest_root = Path(dest_root)
        self._make_client = make_client or _shardcast_client
        self._client = None
        self._sources: tuple[tuple[str, ...], str, str, str] | None = None  # relays, public key, run id, origin
        self._cond = threading.Condition()
        self._wanted = -1  # newest version the orchestrator announced
        self._wanted_hash: str | None = None  # its model hash, as announced
        self._ready = None  # newest PulledVersion on disk
        self._stop = False
        self.downloading = False
        self.last_error: str | None = None
        self._backoff = (backoff_initial_s, backoff_max_s)
        self.relay_lag_s = relay_lag_s
        self._thread = threading.Thread(target=self._run, name="weights-keeper", daemon=True)

    def start(self) -> "WeightsKeeper":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def set_sources(self, relay_urls: list[str], public_key_b64: str, run_id: str, origin_url: str = "") -> None:
        """Where to pull from, which key signs manifests and for which run (from the registration answer);
        the origin is the fallback when relays fail or are too slow."""
        with self._cond:
            key = (tuple(relay_urls), public_key_b64, run_id, origin_url)
            if key != self._sources:
                self._sources = key
                self._client = None
                self._cond.notify_all()

    def observe(self, policy_version: int, model_hash: str | None = None) -> None:
        """The orchestrator's version, and its model hash if announced: that version is pulled only with a
        manifest of that hash (a re-published version's earlier manifest, replayed by a relay, is refused)."""
        with self._cond:
            if policy_version > self._wanted:
                self._wanted, self._wanted_hash = policy_version, model_hash
                self._cond.notify_all()
            elif policy_version == self._wanted and model_hash is not None:
                self._wanted_hash = model_hash

    @property
    def ready(self):
        """The newest verified version on disk (`shardcast.client.PulledVersion`), or None."""
        with self._cond:
            return self._ready

    def wait_for(self, min_version: int, stop: threading.Event, poll_s: float = 0.2):
        """Block until a version >= `min_version` is on disk (returns it), or `stop` is set (None)."""
        self.observe(min_version)
        with self._cond:
            while not stop.is_set():
                if self._ready is not None and self._ready.version >= min_version:
                    return self._ready
                self._cond.wait(poll_s)
        return None

    # ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        delays = backoff_delays(*self._backoff)
        lagging_since: tuple[int, float] | None = None  # (wanted, since when) the relays have not listed it
        while True:
            with self._cond:
                while not self._stop and (self._sources is None or (self._ready is not None
                    and self._ready.version >= self._wanted)):
                    self._cond.wait()
                if self._stop:
                    return
                if self._client is None:
                    relays, public_key, run_id, origin = self._sources
                    self._client = self._make_client(list(relays), public_key, self.dest_root, run_id=run_id,
                        fallback_urls=[origin] if origin else [])
                client = self._client
                have = self._ready.version if self._ready is not None else -1
                wanted, wanted_hash = self._wanted, self._wanted_hash
            self.downloading = True
            try:
                # The orchestrator's version, or the newest the relays have if they lag behind; never a
                # version the orchestrator has not announced yet. Relays list what they like: after
                # `relay_lag_s` without the announced version, ask for it by number (the origin has it).
                latest = client.latest_version()
                target = min(latest, wanted) if latest is not None else None
                if target == wanted:
                    lagging_since = None
                elif lagging_since is None or lagging_since[0] != wanted:
                    lagging_since = (wanted, time.monotonic())
                elif time.monotonic() - lagging_since[1] >= self.relay_lag_s:
                    log.info("relays do not list version %d after %.0f s: pulling it by number", wanted,
                        self.relay_lag_s)
                    target = wanted
                pin = wanted_hash if target == wanted else None
                pulled = client.pull(target, model_hash=pin) if target is not None and target > have else None
            except Exception as exc:  # network, bad servers, disk: try again later
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("weights download failed: %s", self.last_error)
                pulled = None
            finally:
                self.downloading = False
            with self._cond:
                if pulled is not None and pulled.version > have:
                    self._ready = pulled
                    self.last_error = None
                    delays = backoff_delays(*self._backoff)
                    log.info("policy version %d downloaded to %s", pulled.version, pulled.path)
                    self._cond.notify_all()
                    continue
                # Nothing newer yet (relays lag behind the orchestrator) or a failure: wait a little.
                self._cond.wait(next(delays))


def _shardcast_client(urls: list[str], public_key_b64: str, dest_root: Path, *, run_id: str, fallback_urls: list[str]):
    from shardcast.client import ShardcastClient
    from shardcast.config import DEFAULTS

    # keep_state: the last weights stay in memory, the base of the next delta and the source of hot reloads;
    # write_behind: a version reached by deltas is written to disk after vLLM can already reload it.
    return ShardcastClient(
        urls, public_key_b64, dest_root, run_id=run_id, fallback_urls=fallback_urls,
        keep_versions=DEFAULTS.keep_versions, write_behind=True,
    )
