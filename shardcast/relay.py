"""A relay: mirrors the newest K versions of its upstreams (the origin or other relays), with the delta chains
back to their anchors, and serves them.

- A version is listed only once its manifest's signature and run id checked out against the run's key.
- Each file (full shard or delta object: both are opaque signed files here) is downloaded by the same code
  as the client (parallel, resumable, throughput-weighted over several upstreams, no upstream can stall
  it) into `.<name>.part`, and becomes servable only after its digest matched the signed manifest
  (renamed to its final name, then added to the index). Clients asking for a listed file that is still
  on its way wait for it (bounded; then 503), so a relay serves a version while it arrives.
- A relay can start empty, or restart on its folder: it re-checks the signatures and run ids of what it
  has, keeps the verified files (re-hashed) and resumes the rest.
- The run: given (`run_id`), or, if not, followed: the run of the manifest upstream signed last. A relay
  that follows drops what it holds of an earlier run as soon as the key signs a new one, and, restarted on its
  folder, what its own run signed after the newest version upstream (the run resumed from an earlier
  checkpoint). Workers check the run id and model hash themselves (they learn both from the orchestrator), so
  this is hygiene, not their protection.
- A run that resumes from an earlier checkpoint signs some version numbers again. A relay that kept running
  drops what it holds of the abandoned line once upstream's newest manifest is numbered at or below a version
  it holds but signed later, and mirrors the new line (before, it served the old one until it aged out); it does
  not mirror that old line from an upstream that still serves it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from protocol import api
from protocol.manifests import PolicyManifest
from shardcast.config import DEFAULTS
from shardcast.file_fetch import FileJob, ShardcastError, StaleManifest
from shardcast.files import file_matches
from shardcast.keys import ManifestError, check_run, verify_manifest
from shardcast.sources import TransferPolicy
from shardcast.store import VersionStore
from shardcast.transfer import MAX_MANIFEST_BYTES, ServerPool

log = logging.getLogger(__name__)


class RelayStore(VersionStore):
    """A store that re-checks the run's signature (and run id, once known) on every manifest it finds on disk."""

    trust_disk = False

    def __init__(self, root: Path, keep_versions: int, grace_s: float, public_key_b64: str, run_id: str | None):
        self.public_key_b64 = public_key_b64
        super().__init__(root, keep_versions, grace_s, run_id=run_id)

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
        *,
        run_id: str | None,
        keep_versions: int = DEFAULTS.keep_versions,
        poll_interval_s: float = DEFAULTS.relay_poll_interval_s,
        parallelism: int = DEFAULTS.relay_parallelism,
        grace_s: float = DEFAULTS.delete_grace_s,
        policy: TransferPolicy | None = None,
    ):
        self.store = RelayStore(root, keep_versions, grace_s, public_key_b64, run_id)
        self.follow = run_id is None
        self.upstream = ServerPool(upstream_urls, public_key_b64, run_id=run_id or "", parallelism=parallelism,
            policy=policy)
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._latest: PolicyManifest | None = None  # upstream's most recently signed newest version, this sync

    @property
    def run_id(self) -> str | None:
        return self.store.run_id

    def versions(self) -> list[int]:
        return self.store.versions()

    def sync_once(self) -> list[int]:
        """Mirror the window of upstream versions, newest first; returns the versions now complete here."""
        listed = {u: set(vs) for u, vs in self.upstream.list_versions(fallback=True).items()}
        self._latest = latest = self._newest_signed(listed)
        if latest is not None:
            if self.follow:
                self._follow(latest)
            self._drop_abandoned(latest)
        if self.run_id is None:
            return self.store.complete_versions()
        # Upstreams list what they like. A version no server can prove (a signed manifest of this run) costs
        # its listers their listing for this sync: a liar listing 100k fake versions costs one manifest
        # request, not one per fake version, and cannot push the real versions out of the newest K.
        distrusted: set[str] = set()

        def holders(v: int) -> list[str]:
            return [u for u, vs in listed.items() if v in vs and u not in distrusted]

        def listed_ok(v: int) -> bool:
            hs = holders(v)
            if not hs:
                return False
            if not self._try(self._list, v, hs):
                distrusted.update(hs)
                return False
            return True

        # The newest K first (their manifests name their anchors), then every version back to the oldest anchor.
        held = set(self.store.versions())
        newest = 0
        for v in sorted(held.union(*listed.values()), reverse=True):
            if newest >= self.store.keep_versions:
                break
            newest += v in held or listed_ok(v)
        floor = self.store.window_floor()
        for v in sorted({v for u, vs in listed.items() for v in vs if floor is not None and v >= floor}, reverse=True):
            if self._stop.is_set():
                break
            if listed_ok(v):
                self._try(self._mirror, v, holders(v))
        self.store.prune()
        return self.store.complete_versions()

    @staticmethod
    def _try(step, version: int, holders: list[str]) -> bool:
        try:
            step(version, holders)
            return True
        except (ShardcastError, ManifestError, OSError) as e:
            log.warning("relay could not mirror version %d yet: %s", version, e, extra={"version": version})
            return False

    def _newest_signed(self, listed: dict[str, set[int]]) -> PolicyManifest | None:
        """The most recently signed manifest among each upstream's newest version (signature checked; of this
        relay's run unless it follows). By signing time, not version number: with a key reused across runs, an
        upstream replaying an earlier run's higher-numbered versions does not take the relay over (nor hide the
        others' newest by listing versions it cannot prove)."""
        pool = self.upstream
        latest: PolicyManifest | None = None
        for url, newest in ((u, max(vs)) for u, vs in listed.items() if vs):
            try:
                body = pool.http.get_small(url, api.SHARDCAST_MANIFEST.format(version=newest), MAX_MANIFEST_BYTES,
                    time.monotonic() + pool.policy.request_timeout_s)
                manifest = PolicyManifest.model_validate_json(body)
                verify_manifest(manifest, pool.public_key)
                if not self.follow:
                    check_run(manifest, self.store.run_id or "")
            except Exception as e:  # noqa: BLE001 - a bad upstream answer: ask the next one
                log.info("cannot learn the run from %s: %s", url, e)
                continue
            if latest is None or manifest.created_at > latest.created_at:
                latest = manifest
        return latest

    def _follow(self, latest: PolicyManifest) -> None:
        """Adopt `latest`'s run; drop versions of another run."""
        if latest.run_id == self.store.run_id:
            return
        held = [m for m in map(self.store.manifest, self.store.versions()) if m is not None]
        later = [m for m in held if m.created_at >= latest.created_at]
        if later and not (self.store.run_id is None and all(m.run_id == latest.run_id for m in held)):
            log.warning("an upstream serves run %s, signed before what this relay holds: not followed", latest.run_id)
            return
        # This relay restarted (it knows no run yet) on versions of the run upstream serves, some signed after that
        # run's newest: the run resumed from an earlier checkpoint since, and will sign those numbers again.
        for m in later:
            if m.created_at > latest.created_at:
                log.warning("dropping version %d: signed before its run resumed from version %d", m.version,
                            latest.version, extra={"version": m.version})
                self.store.drop(m.version)
        log.warning("relay now follows run %s", latest.run_id)
        self.store.run_id = self.upstream.run_id = latest.run_id
        for v in self.store.versions():
            m = self.store.manifest(v)
            if m is not None and m.run_id != latest.run_id:
                self.store.drop(v)

    def _drop_abandoned(self, latest: PolicyManifest) -> None:
        """A version numbered at or after `latest` but signed before it was abandoned: the run resumed from an
        earlier checkpoint while this relay ran, and signed that number again (or will). Only a real resume can
        make such a pair (signatures cannot be forged, and within one run's line versions are signed in order),
        so an upstream replaying old manifests cannot make the relay drop a current version."""
        if latest.run_id != self.store.run_id:
            return
        for v in self.store.versions():
            m = self.store.manifest(v)
            if m is not None and self._abandoned(m):
                log.warning("dropping version %d: signed before version %d, which its run signed after resuming from "
                            "an earlier checkpoint", v, latest.version, extra={"version": v})
                self.store.drop(v)

    def _abandoned(self, m: PolicyManifest) -> bool:
        latest = self._latest
        return (latest is not None and m.run_id == latest.run_id and m.version >= latest.version
                and m.created_at < latest.created_at)

    def _list(self, version: int, holders: list[str]) -> None:
        if self.store.manifest(version) is None:
            manifest = self.upstream.fetch_manifest(version, prefer=holders)
            check_run(manifest, self.store.run_id or "")
            if self._abandoned(manifest):  # served by an upstream that missed the resume (or replays it)
                raise ManifestError(f"version {version} belongs to the line its run abandoned when it resumed")
            self.store.begin_partial(version, manifest, manifest.model_dump_json().encode())
            log.info("relay listed version %d (manifest verified)", version, extra={"version": version})

    def _mirror(self, version: int, holders: list[str]) -> None:
        manifest = self.store.manifest(version)
        missing = set(self.store.missing_shards(version))
        if manifest is None or not missing:
            return
        folder = self.store.folder_of(version)
        for s in manifest.shards:  # left by an earlier run of this relay: serve only after re-hashing
            if s.name in missing and file_matches(folder / s.name, s):
                self.store.add_shard(version, s.name)
                missing.discard(s.name)
        # Deltas first (small, and what most clients want), then shards in manifest order (clients ask in
        # that order too), so the files they wait on first arrive first.
        delta_files = {d.file for d in manifest.deltas}
        entries = sorted((s for s in manifest.shards if s.name in missing), key=lambda s: s.name not in delta_files)
        jobs = [FileJob(version, s, folder, frozenset(holders), manifest.created_at) for s in entries]
        try:
            self.upstream.download_files(jobs, on_verified=lambda j: self.store.add_shard(version, j.entry.name),
                ordered=True)
        except StaleManifest:  # re-published upstream since we listed it: list it again next sync
            log.warning("version %d was re-published upstream: dropping what this relay has of it", version,
                extra={"version": version})
            self.store.drop(version)
            raise

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

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
