"""A relay: mirrors the newest K versions of its upstreams (the origin or other relays) and serves them.

- A version is listed only once its manifest's signature checked out against the run's key.
- Each shard is downloaded by the same code as the client (parallel, resumable, throughput-weighted over
  several upstreams) into `.<name>.part`, and becomes servable only after its sha256 matched the signed
  manifest (renamed to its final name, then added to the index). Clients asking for a listed shard that
  is still on its way wait for it (bounded; then 503), so a relay serves a version while it arrives.
- A relay can start empty, or restart on its folder: it re-checks the signatures of what it has, keeps
  the verified shards and resumes the rest.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from protocol.models import PolicyManifest
from shardcast.config import DEFAULTS
from shardcast.files import file_matches
from shardcast.transfer import ServerPool, ShardcastError
from shardcast.keys import ManifestError, verify_manifest
from shardcast.store import VersionStore

log = logging.getLogger(__name__)


class RelayStore(VersionStore):
    """A store that re-checks the run's signature on every manifest it finds on disk."""

    def __init__(self, root: Path, keep_versions: int, grace_s: float, public_key_b64: str):
        self.public_key_b64 = public_key_b64
        super().__init__(root, keep_versions, grace_s)

    trust_disk = False

    def check_manifest(self, body: bytes, version: int) -> PolicyManifest:
        manifest = super().check_manifest(body, version)
        try:
            verify_manifest(manifest, self.public_key_b64)
        except ManifestError as e:
            raise ValueError(str(e)) from None
        return manifest


class Relay:
    def __init__(
        self,
        upstream_urls: list[str],
        root: Path,
        public_key_b64: str,
        keep_versions: int = DEFAULTS.keep_versions,
        poll_interval_s: float = DEFAULTS.relay_poll_interval_s,
        parallelism: int = DEFAULTS.relay_parallelism,
        grace_s: float = DEFAULTS.delete_grace_s,
        timeout_s: float = DEFAULTS.request_timeout_s,
    ):
        self.store = RelayStore(root, keep_versions, grace_s, public_key_b64)
        self.upstream = ServerPool(upstream_urls, public_key_b64, parallelism=parallelism, timeout_s=timeout_s)
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def versions(self) -> list[int]:
        return self.store.versions()

    def sync_once(self) -> list[int]:
        """Mirror the newest K upstream versions, newest first; returns the versions now complete here."""
        listings = self.upstream.list_versions()
        upstream_versions = sorted({v for vs in listings.values() for v in vs})
        window = sorted(set(upstream_versions) | set(self.store.versions()))[-self.store.keep_versions :]
        wanted = [v for v in window if v in upstream_versions]
        for v in reversed(wanted):
            if self._stop.is_set():
                break
            try:
                self._mirror(v, [u for u, vs in listings.items() if v in vs])
            except (ShardcastError, OSError) as e:
                log.warning("relay could not mirror version %d yet: %s", v, e, extra={"version": v})
        self.store.prune()
        return self.store.complete_versions()

    def _mirror(self, version: int, holders: list[str]) -> None:
        if self.store.manifest(version) is None:
            manifest = self.upstream.fetch_manifest(version, prefer=holders)
            self.store.begin_partial(version, manifest, manifest.model_dump_json().encode())
            log.info("relay listed version %d (manifest verified)", version, extra={"version": version})
        manifest = self.store.manifest(version)
        missing = set(self.store.missing_shards(version))
        if not missing:
            return
        folder = self.store.folder_of(version)
        for s in manifest.shards:  # left by an earlier run of this relay: serve only after re-hashing
            if s.name in missing and file_matches(folder / s.name, s):
                self.store.add_shard(version, s.name)
                missing.discard(s.name)
        # In manifest order (clients ask in that order too), so the shards they wait on first arrive first.
        entries = [s for s in manifest.shards if s.name in missing]
        self.upstream.download_shards(
            manifest, entries, folder, on_verified=lambda s: self.store.add_shard(version, s.name), version_holders=holders, ordered=True
        )

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # noqa: BLE001 - a relay keeps going; the next poll retries
                log.exception("relay sync failed")
            self._stop.wait(self.poll_interval_s)

    def start(self) -> "Relay":
        self._thread = threading.Thread(target=self.run, name="shardcast-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
