"""Transfers from several untrusted shard servers: the HTTP connections, the server pool that picks a
server per shard and bans liars, and the verified, resumable download of one shard. Used by the client
(client.py) and by relays (relay.py).

- The manifest is trusted only after its ed25519 signature checks out; it then authenticates every shard
  through its sha256, so a bad server is caught per shard, not after the whole download.
- Shards download in parallel threads. Each request picks a server with probability proportional to its
  measured throughput (an EMA), with some exploration; a server that fails is cooled down, one that
  serves bytes not matching the signed hash (or a forged manifest) is banned.
- Each shard streams straight into its file in the staging folder, hashed on the fly (writing to fresh
  memory dominates on these machines, so bytes are written once, from one reused buffer). A cut
  transfer resumes with `Range` from the bytes already on disk, on whichever server is picked next.

Shard bodies use `http.client` rather than httpx: `HTTPResponse.readinto` fills a reused buffer with no
per-chunk allocation, which measured faster on the hot path. No torch here: volunteers import this.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

from protocol import api
from protocol.models import PolicyManifest, ShardEntry, VersionList
from protocol.retry import backoff_delays
from shardcast.config import DEFAULTS
from shardcast.connections import Http, TransferFailed
from shardcast.files import disk_error, hash_prefix, write_all
from shardcast.keys import ManifestError, parse_public_key, parse_verified_manifest

log = logging.getLogger(__name__)

CLIENT_BYTES = Counter("shardcast_client_shard_bytes", "verified shard bytes downloaded")
CLIENT_FAILURES = Counter("shardcast_client_shard_failures", "failed shard transfers", ["reason"])

MAX_MANIFEST_BYTES = 8 << 20
MAX_LISTING_BYTES = 1 << 20


class ShardcastError(RuntimeError):
    """A version could not be fetched from any server."""


class BadServer(Exception):
    """The server sent something the signed manifest proves wrong: ban it."""


@dataclass
class ServerStats:
    url: str
    throughput: float | None = None  # EMA of bytes/s per transfer
    bytes: int = 0
    failures: int = 0
    cooldown_until: float = 0.0
    banned: str | None = None  # reason


# -------------------------------------------------------------------------------------------------
# Server pool: listing, manifests, and shard downloads with throughput-weighted server choice


class ServerPool:
    def __init__(
        self,
        urls: Iterable[str],
        public_key_b64: str,
        parallelism: int = DEFAULTS.client_parallelism,
        retries: int = DEFAULTS.client_retries,
        timeout_s: float = DEFAULTS.request_timeout_s,
        explore: float = 0.1,
        chunk_bytes: int = 1 << 20,
        durable: bool = False,
        on_progress: Callable[[str, str, int], None] | None = None,
        seed: int | None = None,
        max_wait_s: float = 600.0,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("need at least one server URL")
        self.public_key = parse_public_key(public_key_b64)
        self.parallelism = parallelism
        self.retries = retries
        self.explore = explore
        self.chunk_bytes = chunk_bytes
        self.durable = durable
        self.max_wait_s = max_wait_s
        self.on_progress = on_progress
        self.http = Http(timeout_s)
        self.stats = {u: ServerStats(u) for u in self.urls}
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    # -- server choice ----------------------------------------------------------------------------------

    def _eligible(self, exclude: set[str]) -> list[ServerStats]:
        return [s for s in self.stats.values() if s.banned is None and s.url not in exclude]

    def choose(self, exclude: set[str]) -> ServerStats | None:
        """Probability ∝ measured throughput; unmeasured servers count as the best seen (so get tried)."""
        with self._lock:
            candidates = self._eligible(exclude)
            if not candidates:
                return None
            now = time.monotonic()
            warm = [s for s in candidates if s.cooldown_until <= now] or sorted(candidates, key=lambda s: s.cooldown_until)[:1]
            if self._rng.random() < self.explore:
                return self._rng.choice(warm)
            known = [s.throughput for s in warm if s.throughput]
            default = max(known) if known else 1.0
            weights = [s.throughput or default for s in warm]
            return self._rng.choices(warm, weights=weights)[0]

    def _record_success(self, s: ServerStats, nbytes: int, seconds: float) -> None:
        with self._lock:
            s.bytes += nbytes
            if nbytes >= 64 << 10 and seconds > 0:
                rate = nbytes / seconds
                s.throughput = rate if s.throughput is None else 0.7 * s.throughput + 0.3 * rate

    def _record_failure(self, s: ServerStats, reason: str) -> None:
        with self._lock:
            s.failures += 1
            s.cooldown_until = time.monotonic() + min(10.0, 0.5 * 2 ** min(s.failures, 5))
            s.throughput = None if s.throughput is None else s.throughput * 0.5
        CLIENT_FAILURES.labels(reason).inc()

    def ban(self, url: str, reason: str) -> None:
        with self._lock:
            if self.stats[url].banned is None:
                log.warning("banning shard server %s: %s", url, reason, extra={"server": url})
                self.stats[url].banned = reason

    # -- listing and manifests --------------------------------------------------------------------------

    def list_versions(self) -> dict[str, list[int]]:
        """Version lists of every reachable, non-banned server (queried in parallel)."""
        out: dict[str, list[int]] = {}

        def one(url: str) -> None:
            try:
                body = self.http.get_small(url, api.SHARDCAST_VERSIONS, MAX_LISTING_BYTES)
                out[url] = VersionList.model_validate_json(body).versions
            except (TransferFailed, ValueError) as e:
                log.info("cannot list versions on %s: %s", url, e)

        threads = [threading.Thread(target=one, args=(s.url,)) for s in self._eligible(set())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def fetch_manifest(self, version: int, prefer: Iterable[str] = ()) -> PolicyManifest:
        """The signed manifest of `version` from the first server that gives a valid one; forgers are banned."""
        prefer = [u for u in prefer if u in self.stats]
        order = prefer + [u for u in self.urls if u not in prefer]
        errors = []
        for url in order:
            if self.stats[url].banned:
                continue
            path = api.SHARDCAST_MANIFEST.format(version=version)
            try:
                body = self.http.get_small(url, path, MAX_MANIFEST_BYTES)
                return parse_verified_manifest(body, self.public_key, version)
            except ManifestError as e:
                self.ban(url, str(e))
                errors.append(f"{url}: {e}")
            except TransferFailed as e:
                errors.append(f"{url}: {e}")
        raise ShardcastError(f"no server gave a valid signed manifest for version {version}: " + "; ".join(errors))

    # -- shards -----------------------------------------------------------------------------------------

    def download_shards(
        self,
        manifest: PolicyManifest,
        shards: list[ShardEntry],
        folder: Path,
        on_verified: Callable[[ShardEntry], None] | None = None,
        version_holders: Iterable[str] | None = None,
        ordered: bool = False,
    ) -> None:
        """Download `shards` into `folder` (as `.<name>.part`, renamed to `<name>` once verified).

        `ordered` keeps the given order (a relay: the first shards clients wait on come first); otherwise
        the biggest go first, which packs the threads better.
        """
        todo: queue.Queue[ShardEntry] = queue.Queue()
        for s in shards if ordered else sorted(shards, key=lambda s: -s.size):
            todo.put(s)
        failure: list[BaseException] = []
        # Servers known not to have this version are skipped for it (they 404), unless none is left.
        lacking: set[str] = set(self.urls) - set(version_holders) if version_holders is not None else set()

        def worker() -> None:
            buf = bytearray(self.chunk_bytes)
            while not failure:
                try:
                    entry = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._fetch_one(manifest.version, entry, folder, buf, lacking)
                    if on_verified is not None:
                        on_verified(entry)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    failure.append(e)
                    return

        threads = [threading.Thread(target=worker, name=f"shardcast-dl-{i}", daemon=True) for i in range(min(self.parallelism, max(1, len(shards))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failure:
            raise failure[0]

    def _fetch_one(self, version: int, entry: ShardEntry, folder: Path, buf: bytearray, lacking: set[str]) -> None:
        final = folder / entry.name
        part = folder / f".{entry.name}.part"
        tried: set[str] = set()
        errors: list[str] = []
        attempts = 0
        waiting_since: float | None = None
        pauses = backoff_delays(0.1, 2.0, self._rng)  # after every server was tried once (protocol.retry)
        while True:
            server = self.choose(tried | lacking) or self.choose(lacking) or self.choose(set())
            if server is None:
                raise ShardcastError(f"shard {entry.name} of version {version}: every server is banned ({'; '.join(errors[-5:])})")
            try:
                self._transfer(server, version, entry, part, buf)
                os.replace(part, final)
                CLIENT_BYTES.inc(entry.size)
                return
            except BadServer as e:
                self.ban(server.url, str(e))
                CLIENT_FAILURES.labels("bad_hash").inc()
                errors.append(f"{server.url}: {e}")
            except TransferFailed as e:
                errors.append(f"{server.url}: {e}")
                tried.add(server.url)
                if e.not_yet:  # not a failure: the relay will have it soon; wait (bounded) instead
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since > self.max_wait_s:
                        raise ShardcastError(f"shard {entry.name} of version {version}: still not available after {self.max_wait_s:.0f}s") from None
                    if tried >= {s.url for s in self._eligible(lacking)}:
                        tried.clear()
                        time.sleep(next(pauses))
                    continue
                if e.missing:
                    lacking.add(server.url)
                self._record_failure(server, "missing" if e.missing else "transfer")
            tried.add(server.url)
            attempts += 1
            if attempts > self.retries + len(self.urls):
                raise ShardcastError(f"shard {entry.name} of version {version} failed {attempts} times: {'; '.join(errors[-5:])}")
            if tried >= {s.url for s in self._eligible(lacking)}:
                tried.clear()  # every server tried once: go round again after a pause
                time.sleep(next(pauses))

    def _transfer(self, server: ServerStats, version: int, entry: ShardEntry, part: Path, buf: bytearray) -> None:
        """Stream one shard into `part`, resuming what is there, and check its sha256 (raises on mismatch)."""
        url = server.url
        h = hashlib.sha256()
        try:
            fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise disk_error(e, part) from e
        try:
            have = hash_prefix(fd, h, buf, entry.size)
            if have < entry.size:
                headers = {"Range": f"bytes={have}-"} if have else {}
                t0 = time.perf_counter()
                resp = self.http.request(url, api.SHARDCAST_SHARD.format(version=version, name=entry.name), headers)
                got, h, resumed = self._read_body(url, resp, entry, have, fd, h, buf)
                self._record_success(server, got, time.perf_counter() - t0)
            else:
                resumed = True
            if h.hexdigest() != entry.sha256:
                os.ftruncate(fd, 0)
                msg = f"shard {entry.name} of version {version} does not match its signed sha256"
                if resumed:  # bytes from several transfers: no one to blame, start over
                    raise TransferFailed(msg + " (after a resume; starting over)")
                raise BadServer(msg)
            if self.durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read_body(self, url: str, resp: http.client.HTTPResponse, entry: ShardEntry, have: int, fd: int, h, buf: bytearray):
        """Returns (bytes received, running hash, whether earlier bytes were kept)."""
        status = resp.status
        if status not in (200, 206):
            detail = resp.read(4096).decode(errors="replace")[:200]
            raise TransferFailed(f"HTTP {status} for {entry.name}: {detail}", missing=status == 404, not_yet=status == 503)
        if status == 200 and have:  # the server ignored Range: start over
            os.ftruncate(fd, 0)
            h = hashlib.sha256()
            have = 0
        length = resp.getheader("Content-Length")
        if length is None or not length.isdigit() or int(length) != entry.size - have:
            self.http.close(url)
            raise BadServer(f"{entry.name}: Content-Length {length} where {entry.size - have} bytes were expected")
        if status == 206 and not (resp.getheader("Content-Range") or "").startswith(f"bytes {have}-"):
            self.http.close(url)
            raise BadServer(f"{entry.name}: wrong Content-Range {resp.getheader('Content-Range')!r}")
        os.lseek(fd, have, os.SEEK_SET)
        view = memoryview(buf)
        left = entry.size - have
        got = 0
        try:
            while left > 0:
                n = resp.readinto(view[: min(len(view), left)])
                if not n:
                    raise TransferFailed(f"{url}: connection closed after {have + got} of {entry.size} bytes of {entry.name}")
                chunk = view[:n]
                h.update(chunk)
                write_all(fd, chunk)
                got += n
                left -= n
                if self.on_progress is not None:
                    self.on_progress(url, entry.name, have + got)
        except (OSError, http.client.HTTPException) as e:
            self.http.close(url)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise
            raise TransferFailed(f"{url}: transfer of {entry.name} broke after {have + got} bytes: {e!r}") from None
        except TransferFailed:
            self.http.close(url)
            raise
        return got, h, have > 0
