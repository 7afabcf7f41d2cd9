"""Transfers from several untrusted shard servers: version listings, signed manifests, and verified,
resumable downloads of files (full shards and delta objects alike). Used by the client and by relays.

- A manifest is trusted only after its ed25519 signature and its run id check out; it then authenticates
  every file through its digest (blake3, or sha256 in older manifests: `files.file_hash`), so a bad server
  is caught per file, not after the whole download.
- Files download in parallel threads, each from a server picked by `sources.Sources` (throughput-weighted,
  the origin as fallback). Each file streams straight into `.<name>.part` in its folder, hashed on the fly,
  and is renamed to its name once its digest matched.
- No source can stall a pull (`TransferPolicy`): every wait is bounded by the stall timeout, a transfer
  slower than the floor rate over a window is moved to another source (its bytes are kept and resumed with
  `Range`), each file has a deadline over all its attempts, and the caller gives a deadline for the pull.
  A file whose bytes came from several sources and fail the hash is started over from one source, so a
  liar cannot hide behind a resume; a single source whose bytes fail the hash is banned.

No torch here: volunteers import this.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

from protocol import api
from protocol.manifests import PolicyManifest, ShardEntry, VersionList
from protocol.retry import backoff_delays
from shardcast.config import DEFAULTS
from shardcast.connections import Http, TransferFailed
from shardcast.files import disk_error, file_hash, hash_prefix, write_all
from shardcast.keys import ManifestError, parse_public_key, parse_verified_manifest
from shardcast.sources import ServerStats, Sources, TransferPolicy

log = logging.getLogger(__name__)

CLIENT_BYTES = Counter("shardcast_client_shard_bytes", "verified shard bytes downloaded")

MAX_MANIFEST_BYTES = 8 << 20
MAX_LISTING_BYTES = 1 << 20
# Body reads of 64 KiB: with 1 MiB reads and on-the-fly hashing, 4 concurrent clients on one loopback box
# took 15-17 s for 4 x 1 GiB where 64 KiB reads took 3.7-4.2 s (128 KiB: 5.1-5.9 s).
CHUNK_BYTES = 64 << 10
SPLICE_BYTES = 1 << 20  # per splice call (the pipe's size)
_THREAD = threading.local()


class ShardcastError(RuntimeError):
    """A version could not be fetched from any server (or not in time)."""


class BadServer(Exception):
    """The server sent something the signed manifest proves wrong: ban it."""


class StaleManifest(ShardcastError):
    """Our manifest of a version is not the one the servers have now: the version was re-published (a trainer
    restart) and a server proves it with a manifest signed later. Nobody lied; read the manifest again."""

    def __init__(self, version: int, url: str):
        super().__init__(f"version {version} was re-published: {url} serves a manifest signed later than ours")
        self.version = version


@dataclass(frozen=True)
class FileJob:
    """One signed file of one version, to be verified into `folder/<name>`."""

    version: int
    entry: ShardEntry
    folder: Path
    holders: frozenset[str] | None = None  # servers that list the version (None: unknown)
    signed_at: float | None = None  # the created_at of the manifest the entry comes from


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

        threads = [threading.Thread(target=one, args=(s.url,), daemon=True) for s in self.sources.usable() if fallback or not s.fallback]
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
                errors.append(f"{url}: version {version} has model hash {manifest.model_hash[:12]}, not the announced {model_hash[:12]}")
            except ManifestError as e:
                self.ban(url, str(e))
                errors.append(f"{url}: {e}")
            except TransferFailed as e:
                if e.slow:
                    self.sources.record_failure(url, "slow")
                errors.append(f"{url}: {e}")
        raise ShardcastError(f"no server gave a valid signed manifest for version {version} of run {self.run_id}: " + "; ".join(errors[-6:]))

    def manifest_from(self, url: str, version: int) -> PolicyManifest:
        """`version`'s manifest as `url` serves it, signature, run and version checked (raises ManifestError
        or TransferFailed)."""
        body = self.http.get_small(url, api.SHARDCAST_MANIFEST.format(version=version), MAX_MANIFEST_BYTES, time.monotonic() + self.policy.request_timeout_s)
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
                    _FileFetch(self, job, buf, deadline).run()
                    if on_verified is not None:
                        on_verified(job)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    failure.append(e)
                    return

        threads = [threading.Thread(target=worker, name=f"shardcast-dl-{i}", daemon=True) for i in range(min(self.parallelism, max(1, len(jobs))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failure:
            raise failure[0]


class _FileFetch:
    """One file: pick a server, stream, check, and on failure move to another server within the policy."""

    def __init__(self, pool: ServerPool, job: FileJob, buf: bytearray, pull_deadline: float):
        self.pool, self.job, self.buf = pool, job, buf
        self.entry = job.entry
        self.deadline = min(pull_deadline, time.monotonic() + pool.policy.shard_deadline_s)
        self.final = job.folder / job.entry.name
        self.part = job.folder / f".{job.entry.name}.part"
        self.sources_of_part: set[str] = {"disk"} if self.part.exists() else set()  # who wrote the bytes in .part
        self.fresh_only = False  # after a mixed-source hash mismatch: whole-file transfers only

    def run(self) -> None:
        pool, entry, version = self.pool, self.entry, self.job.version
        # Servers that 404 this file are skipped for it. A listing is no reason to skip one: relays list a
        # version moments after each other, and a server that lacks it answers a 404 in one round trip.
        lacking: set[str] = set()
        tried: set[str] = set()
        errors: list[str] = []
        attempts = 0
        waiting_since: float | None = None
        pauses = backoff_delays(0.1, 2.0)  # after every server was tried once (protocol.retry)
        while True:
            if time.monotonic() >= self.deadline:
                raise ShardcastError(f"file {entry.name} of version {version} not verified before its deadline: {'; '.join(errors[-4:])}")
            # While relays only say "not yet", wait for them a little before falling back to the origin.
            patient = waiting_since is not None and time.monotonic() - waiting_since < pool.policy.stall_timeout_s
            server = pool.sources.choose(tried | lacking, allow_fallback=not patient) or pool.sources.choose(lacking) or pool.sources.choose(set())
            if server is None:
                raise ShardcastError(f"file {entry.name} of version {version}: every server is banned ({'; '.join(errors[-4:])})")
            try:
                self._transfer(server)
                os.replace(self.part, self.final)
                CLIENT_BYTES.inc(entry.size)
                return
            except BadServer as e:
                errors.append(f"{server.url}: {e}")
                other = pool.other_manifest(server.url, version, self.job.signed_at) if self.job.signed_at is not None else None
                if other is not None and other.created_at > self.job.signed_at:
                    raise StaleManifest(version, server.url) from None
                if other is not None:  # it holds the version as first published (a relay that mirrored it before): stale, not lying
                    lacking.add(server.url)
                    pool.sources.record_failure(server.url, "transfer")
                else:
                    pool.ban(server.url, str(e))
            except TransferFailed as e:
                errors.append(f"{server.url}: {e}")
                if e.not_yet:  # not a failure: the relay will have it soon
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since >= pool.policy.stall_timeout_s:
                        # Waited as long as for a stalled source: skip it for this file and cool it down like
                        # one, so this file and the next go to the fallback (a relay that says "not yet"
                        # forever would otherwise hold every file to its deadline).
                        lacking.add(server.url)
                        pool.sources.record_failure(server.url, "slow")
                    tried.add(server.url)
                    if tried >= {s.url for s in pool.sources.usable(lacking) if not s.fallback}:
                        tried.clear()
                        time.sleep(min(next(pauses), max(0.0, self.deadline - time.monotonic())))
                    continue
                if e.missing:
                    lacking.add(server.url)
                    if lacking >= {s.url for s in pool.sources.usable()}:  # every server says 404: pruned
                        raise ShardcastError(f"file {entry.name} of version {version}: no server has it ({'; '.join(errors[-4:])})")
                pool.sources.record_failure(server.url, "slow" if e.slow else "missing" if e.missing else "transfer", getattr(e, "rate", None))
            tried.add(server.url)
            attempts += 1
            if attempts > pool.retries + len(pool.urls):
                raise ShardcastError(f"file {entry.name} of version {version} failed {attempts} times: {'; '.join(errors[-4:])}")
            if tried >= {s.url for s in pool.sources.usable(lacking)}:
                tried.clear()  # every server tried once: go round again after a pause
                time.sleep(min(next(pauses), max(0.0, self.deadline - time.monotonic())))

    def _transfer(self, server: ServerStats) -> None:
        """Stream the file into `.part`, resuming what is there, and check its digest (raises on mismatch)."""
        pool, entry, url = self.pool, self.entry, server.url
        h, want = file_hash(entry)
        try:
            fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise disk_error(e, self.part) from e
        try:
            if self.fresh_only:
                os.ftruncate(fd, 0)
                self.sources_of_part.clear()
            have = hash_prefix(fd, h, self.buf, entry.size)
            if have == 0:
                self.sources_of_part.clear()
            elif have == entry.size and self.sources_of_part == {"disk"} and h.hexdigest() != want:
                # A whole-length `.part` that an earlier process left (the splice path sizes the file before the
                # bytes arrive, so a killed download looks complete): nobody's bytes. Start over; blame no one.
                os.ftruncate(fd, 0)
                self.sources_of_part.clear()
                h, have = file_hash(entry)[0], 0
            if have < entry.size:
                headers = {"Range": f"bytes={have}-"} if have else {}
                resp = pool.http.request(url, api.SHARDCAST_SHARD.format(version=self.job.version, name=entry.name), self.deadline, headers)
                have, h = self._check_head(url, resp, have, fd, h)
                self.sources_of_part.add(url)
                t0 = time.monotonic()  # rates count from the head: a relay may hold a request for a file on its way
                got = self._read_body(url, resp, have, fd, h, t0)
                pool.sources.record_success(url, got, time.monotonic() - t0)
            if h.hexdigest() != want:
                os.ftruncate(fd, 0)
                mixed = len(self.sources_of_part) > 1
                self.sources_of_part.clear()
                msg = f"file {entry.name} of version {self.job.version} does not match its signed {h.name}"
                if mixed:  # bytes from several sources: no one to blame yet; start over from one source
                    self.fresh_only = True
                    raise TransferFailed(msg + " (bytes from several sources; starting over from one)")
                raise BadServer(msg)
            if pool.durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _check_head(self, url: str, resp, have: int, fd: int, h):
        size = self.entry.size
        if resp.status not in (200, 206):
            resp.discard()
            raise TransferFailed(f"HTTP {resp.status} for {self.entry.name}", missing=resp.status == 404, not_yet=resp.status == 503)
        if resp.status == 200 and have:  # the server ignored Range: start over
            os.ftruncate(fd, 0)
            h = file_hash(self.entry)[0]
            have = 0
            self.sources_of_part.clear()
        if resp.length != size - have:
            resp.discard()
            raise BadServer(f"{self.entry.name}: Content-Length {resp.length} where {size - have} bytes were expected")
        if resp.status == 206 and not (resp.header("Content-Range") or "").startswith(f"bytes {have}-{size - 1}/"):
            resp.discard()
            raise BadServer(f"{self.entry.name}: wrong Content-Range {(resp.header('Content-Range') or '')[:80]!r}")
        return have, h

    def _read_body(self, url: str, resp, have: int, fd: int, h, t0: float) -> int:
        """Receive the body into the file, hashing as it comes; leave a source slower than the floor rate.

        On plain HTTP the bytes go socket -> pipe -> file in the kernel and are hashed from the file's pages
        (mapped): one copy of each byte instead of two (recv, then write). Measured with 4 concurrent
        clients of 1 GiB each: 1.07 vs 1.45 CPU-s per client."""
        pool, policy = self.pool, self.pool.policy
        size = self.entry.size
        left = size - have
        got = 0
        mark_t, mark_got = t0, 0
        spliced = resp.can_splice and left > 0
        if spliced:
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
            pages = memoryview(mapped)
        else:
            os.lseek(fd, have, os.SEEK_SET)
            view = memoryview(self.buf)
        try:
            while left > 0:
                if spliced:
                    n = resp.splice_into(fd, have + got, min(SPLICE_BYTES, left), self._pipe(), self.deadline)
                    h.update(pages[have + got : have + got + n])
                else:
                    n = resp.readinto(view[: min(len(view), left)], self.deadline)
                    chunk = view[:n]
                    h.update(chunk)
                    write_all(fd, chunk)
                got += n
                left -= n
                if pool.on_progress is not None:
                    pool.on_progress(url, self.entry.name, have + got)
                now = time.monotonic()
                if left and now - mark_t >= policy.rate_window_s:
                    rate = (got - mark_got) / (now - mark_t)
                    floor = pool.sources.floor_rate(url)
                    if rate < floor:
                        e = TransferFailed(f"{url}: {rate / 1e3:.1f} kB/s for {self.entry.name}, below {floor / 1e3:.1f} kB/s", slow=True)
                        e.rate = rate  # type: ignore[attr-defined]
                        raise e
                    mark_t, mark_got = now, got
        except BaseException:
            resp.discard()
            pool.sources.add_bytes(url, got)
            if spliced:
                os.ftruncate(fd, have + got)  # the file holds what arrived, for a resume
                for end in _THREAD.__dict__.pop("pipe", ()):  # it may hold bytes of this body: a new one next time
                    os.close(end)
            raise
        finally:
            if spliced:
                pages.release()
                mapped.close()
        return got

    def _pipe(self) -> tuple[int, int]:
        """This thread's pipe for splice, made once (1 MiB where the system allows)."""
        pipe = getattr(_THREAD, "pipe", None)
        if pipe is None:
            pipe = _THREAD.pipe = os.pipe()
            try:
                fcntl.fcntl(pipe[1], 1031, SPLICE_BYTES)  # F_SETPIPE_SZ
            except OSError:
                pass
        return pipe
