"""Transfers from several untrusted shard servers: version listings, signed manifests, and verified,
resumable downloads of files (full shards and delta objects alike). Used by the client and by relays.

- A manifest is trusted only after its ed25519 signature and its run id check out; it then authenticates
  every file through its digest (blake3, or sha256 in older manifests: `files.file_hash`), so a bad server
  is caught per file, not after the whole download.
- Files download in parallel threads, each a `file_fetch.FileFetch`: from servers picked by `sources.Sources`
  (throughput-weighted, the origin as fallback), streamed into its folder and checked against its signed
  digest, within the stall and rate rules of `TransferPolicy` (file_fetch.py).

No torch here: volunteers import this.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

from protocol import api
from protocol.manifests import PolicyManifest, VersionList
from shardcast.config import DEFAULTS
from shardcast.connections import Http, TransferFailed
from shardcast.file_fetch import FileFetch, FileJob, ShardcastError
from shardcast.keys import ManifestError, parse_public_key, parse_verified_manifest
from shardcast.sources import Sources, TransferPolicy

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 8 << 20
MAX_LISTING_BYTES = 1 << 20
# Body reads of 64 KiB: with 1 MiB reads and on-the-fly hashing, 4 concurrent clients on one loopback box
# took 15-17 s for 4 x 1 GiB where 64 KiB reads took 3.7-4.2 s (128 KiB: 5.1-5.9 s).
CHUNK_BYTES = 64 << 10


class ServerPool:
    def __init__(
        self,
        urls: Iterable[str],
        public_key_b64: str,
        *,
        run_id: str,
        fallback_urls: Iterable[str] = (),
        parallelism: int = DEFAULTS.client_parallelism,
        retries: int = DEFAULTS.client_retries,
        policy: TransferPolicy | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        durable: bool = False,
        on_progress: Callable[[str, str, int], None] | None = None,
        seed: int | None = None,
    ):
        self.sources = Sources(urls, fallback_urls, policy, seed=seed)
        self.policy = self.sources.policy
        self.urls = self.sources.urls
        self.stats = self.sources.stats
        self.public_key = parse_public_key(public_key_b64)
        self.run_id = run_id
        self.parallelism = parallelism
        self.retries = retries
        self.chunk_bytes = chunk_bytes
        self.durable = durable
        self.on_progress = on_progress
        self.http = Http(self.policy.stall_timeout_s)

    def ban(self, url: str, reason: str) -> None:
        self.sources.ban(url, reason)

    # -- listing and manifests --------------------------------------------------------------------------

    def list_versions(self, fallback: bool = False) -> dict[str, list[int]]:
        """Version lists of the usable servers that answer within the request deadline (asked in parallel).
        Fallback servers are asked only with `fallback=True` (relays carry the load)."""
        out: dict[str, list[int]] = {}
        deadline = time.monotonic() + self.policy.request_timeout_s

        def one(url: str) -> None:
            try:
                body = self.http.get_small(url, api.SHARDCAST_VERSIONS, MAX_LISTING_BYTES, deadline)
                out[url] = VersionList.model_validate_json(body).versions
            except (TransferFailed, ValueError) as e:
                if isinstance(e, TransferFailed) and e.slow:
                    self.sources.record_failure(url, "slow")
                log.info("cannot list versions on %s: %s", url, e)

        threads = [threading.Thread(target=one, args=(s.url,), daemon=True) for s in self.sources.usable() if fallback
            or not s.fallback]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 0.5)
        return dict(out)

    def fetch_manifest(self, version: int, prefer: Iterable[str] = (), model_hash: str | None = None) -> PolicyManifest:
        """The signed manifest of `version` (of this run) from the first server that gives one; liars are banned.
        With `model_hash`, a manifest of another hash is passed over: signed, but of weights this version no
        longer names (a trainer restart re-published it), which an honest relay may still hold."""
        errors = []
        for url in self.sources.ordered(prefer):
            try:
                manifest = self.manifest_from(url, version)
                if model_hash is None or manifest.model_hash == model_hash:
                    return manifest
                errors.append(f"{url}: version {version} has model hash {manifest.model_hash[:12]}, not the announced "
                    f"{model_hash[:12]}")
            except ManifestError as e:
                self.ban(url, str(e))
                errors.append(f"{url}: {e}")
            except TransferFailed as e:
                if e.slow:
                    self.sources.record_failure(url, "slow")
                errors.append(f"{url}: {e}")
        raise ShardcastError(
            f"no server gave a valid signed manifest for version {version} of run {self.run_id}: " + "; ".join(
            errors[-6:]))

    def manifest_from(self, url: str, version: int) -> PolicyManifest:
        """`version`'s manifest as `url` serves it, signature, run and version checked (raises ManifestError
        or TransferFailed)."""
        body = self.http.get_small(url, api.SHARDCAST_MANIFEST.format(version=version), MAX_MANIFEST_BYTES,
            time.monotonic() + self.policy.request_timeout_s)
        return parse_verified_manifest(body, self.public_key, version, run_id=self.run_id)

    def other_manifest(self, url: str, version: int, signed_at: float) -> PolicyManifest | None:
        """The server's own signed manifest of `version` for this run, if it is not the one signed at
        `signed_at`: after a file failed its digest, whether the server is stale (or we are) rather than lying."""
        try:
            manifest = self.manifest_from(url, version)
        except (ManifestError, TransferFailed):
            return None
        return manifest if manifest.created_at != signed_at else None

    def fetch_manifests(self, versions: Iterable[int], listings: dict[str, list[int]]) -> dict[int, PolicyManifest]:
        """Several manifests at once; versions no server can prove are left out (a missing link)."""
        out: dict[int, PolicyManifest] = {}
        todo: queue.Queue[int] = queue.Queue()
        for v in versions:
            todo.put(v)

        def worker() -> None:
            while True:
                try:
                    v = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    out[v] = self.fetch_manifest(v, prefer=[u for u, vs in listings.items() if v in vs])
                except ShardcastError as e:
                    log.info("%s", e)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(8, todo.qsize()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    # -- files ------------------------------------------------------------------------------------------

    def download_files(
        self,
        jobs: list[FileJob],
        on_verified: Callable[[FileJob], None] | None = None,
        ordered: bool = False,
        deadline: float | None = None,
    ) -> None:
        """Verify every job's file into its folder (in parallel). `ordered` keeps the given order (a relay:
        the files clients wait on first come first); otherwise the biggest go first (better packing)."""
        deadline = deadline if deadline is not None else time.monotonic() + self.policy.pull_deadline_s
        todo: queue.Queue[FileJob] = queue.Queue()
        for j in jobs if ordered else sorted(jobs, key=lambda j: -j.entry.size):
            todo.put(j)
        failure: list[BaseException] = []

        def worker() -> None:
            buf = bytearray(self.chunk_bytes)
            while not failure:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    FileFetch(self, job, buf, deadline).run()
                    if on_verified is not None:
                        on_verified(job)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    failure.append(e)
                    return

        threads = [threading.Thread(target=worker, name=f"shardcast-dl-{i}", daemon=True)
            for i in range(min(self.parallelism, max(1, len(jobs))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failure:
            raise failure[0]
