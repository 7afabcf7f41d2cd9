"""The shardcast client: fetch a signed version from several untrusted servers, fast and safely.

- The manifest is trusted only after its ed25519 signature checks out; it then authenticates every shard
  through its sha256, so a bad server is caught per shard, not after the whole download (transfer.py).
- Shards download in parallel, each from the server picked by measured throughput, streamed straight
  into the staging folder and hashed on the fly; a cut transfer resumes elsewhere with `Range`.
- The staging folder becomes `dest_root/v<version>` by one rename, after every shard verified.

No torch here: volunteers import this.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from protocol.models import PolicyManifest, ShardEntry
from shardcast.config import DEFAULTS
from shardcast.store import MANIFEST_FILE, DiskFullError, complete_dir_name, fsync_dir, partial_dir_name
from shardcast.files import file_matches
from shardcast.transfer import ServerPool, ServerStats, ShardcastError

log = logging.getLogger(__name__)


@dataclass
class PulledVersion:
    version: int
    path: Path
    manifest: PolicyManifest


# -------------------------------------------------------------------------------------------------
# The client


class ShardcastClient:
    """Pull signed versions into `dest_root/v<version>` (holds the verified `*.safetensors` + manifest.json).

    durable: fdatasync every shard before the final rename. Off by default because a version folder left
    by an earlier process is re-hashed before it is trusted, so a power cut costs a re-check (and at worst
    a re-download of the damaged shards), never wrong weights. One client per `dest_root` at a time.
    """

    def __init__(
        self,
        urls: list[str],
        public_key_b64: str,
        dest_root: Path,
        parallelism: int = DEFAULTS.client_parallelism,
        retries: int = DEFAULTS.client_retries,
        timeout_s: float = DEFAULTS.request_timeout_s,
        keep_versions: int | None = None,
        durable: bool = False,
        on_progress: Callable[[str, str, int], None] | None = None,
        seed: int | None = None,
        chunk_bytes: int = 1 << 20,
    ):
        self.dest_root = Path(dest_root)
        self.dest_root.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self._pulled: set[int] = set()  # versions this instance downloaded and verified
        self.pool = ServerPool(urls, public_key_b64, parallelism, retries, timeout_s, chunk_bytes=chunk_bytes, durable=durable, on_progress=on_progress, seed=seed)

    @property
    def stats(self) -> dict[str, ServerStats]:
        return self.pool.stats

    def latest_version(self) -> int | None:
        listings = self.pool.list_versions()
        versions = [max(v) for v in listings.values() if v]
        return max(versions) if versions else None

    def pull(self, version: int | None = None) -> PulledVersion:
        """Fetch `version` (default: the newest one any server can prove with a valid manifest)."""
        listings = self.pool.list_versions()
        if version is not None:
            candidates = [version]
        else:
            candidates = sorted({v for vs in listings.values() for v in vs}, reverse=True)
            if not candidates:
                raise ShardcastError(f"no server lists any version (reachable: {sorted(listings)} of {self.pool.urls})")
        errors = []
        for v in candidates:
            holders = [u for u, vs in listings.items() if v in vs]
            try:
                manifest = self.pool.fetch_manifest(v, prefer=holders)
            except ShardcastError as e:
                if version is not None:
                    raise
                errors.append(str(e))
                continue  # a lying server advertised it, or it was just deleted: try the next newest
            pulled = self._download(manifest, holders or None)
            self._prune(keep=pulled.version)
            return pulled
        raise ShardcastError("no listed version could be fetched: " + " | ".join(errors[:5]))

    def _download(self, manifest: PolicyManifest, holders: list[str] | None) -> PulledVersion:
        final = self.dest_root / complete_dir_name(manifest.version)
        staging = self.dest_root / partial_dir_name(manifest.version)
        if final.is_dir():
            if manifest.version in self._pulled:
                return PulledVersion(manifest.version, final, manifest)
            # Written by an earlier process (maybe before a power cut, unsynced): re-check every byte,
            # and resume into it as a staging folder if anything is off.
            if all(file_matches(final / s.name, s) for s in manifest.shards):
                (final / MANIFEST_FILE).write_bytes(manifest.model_dump_json().encode())
                self._pulled.add(manifest.version)
                return PulledVersion(manifest.version, final, manifest)
            shutil.rmtree(staging, ignore_errors=True)
            os.rename(final, staging)
            (staging / MANIFEST_FILE).write_bytes(manifest.model_dump_json().encode())
        body = manifest.model_dump_json().encode()
        if staging.is_dir():  # resume, unless it belongs to another manifest
            old = staging / MANIFEST_FILE
            if not old.is_file() or PolicyManifest.model_validate_json(old.read_bytes()).signing_payload() != manifest.signing_payload():
                shutil.rmtree(staging)
        t0 = time.perf_counter()
        try:
            staging.mkdir(exist_ok=True)
            free = shutil.disk_usage(staging).free
            present = sum((staging / s.name).stat().st_size for s in manifest.shards if (staging / s.name).is_file())
            if free < manifest.total_bytes - present:
                raise DiskFullError(errno.ENOSPC, f"version {manifest.version} needs {manifest.total_bytes - present} more bytes, {staging.parent} has {free} free")
            (staging / MANIFEST_FILE).write_bytes(body)
            todo = [s for s in manifest.shards if not self._already_verified(staging / s.name, s)]
            self.pool.download_shards(manifest, todo, staging, version_holders=holders)
            if self.pool.durable:
                fsync_dir(staging)
            os.rename(staging, final)
            fsync_dir(self.dest_root)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                shutil.rmtree(staging, ignore_errors=True)  # free the space; nothing half-written stays
                if not isinstance(e, DiskFullError):
                    e = DiskFullError(errno.ENOSPC, f"no space left on device under {self.dest_root}")
                raise e from None
            raise
        self._pulled.add(manifest.version)
        seconds = time.perf_counter() - t0
        log.info(
            "pulled version %d: %.1f MB in %.2fs (%.0f MB/s)", manifest.version, manifest.total_bytes / 1e6, seconds,
            manifest.total_bytes / 1e6 / max(seconds, 1e-9), extra={"version": manifest.version},
        )
        return PulledVersion(manifest.version, final, manifest)

    def _already_verified(self, path: Path, entry: ShardEntry) -> bool:
        """A shard under its final name from an earlier run: trust it only after re-hashing."""
        if file_matches(path, entry):
            return True
        path.unlink(missing_ok=True)
        return False

    def _prune(self, keep: int) -> None:
        """Delete older pulled versions beyond `keep_versions` (never `keep`, the one just pulled)."""
        if self.keep_versions is None:
            return
        done = sorted(int(p.name[1:]) for p in self.dest_root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit())
        for v in done[: max(0, len(done) - self.keep_versions)]:
            if v != keep:
                shutil.rmtree(self.dest_root / complete_dir_name(v), ignore_errors=True)
        for p in self.dest_root.glob(".partial-v*"):
            if int(p.name.removeprefix(".partial-v")) < keep:
                shutil.rmtree(p, ignore_errors=True)


def describe_stats(stats: dict[str, ServerStats]) -> str:
    return json.dumps({u: {"MB": round(s.bytes / 1e6, 1), "MB/s": round((s.throughput or 0) / 1e6, 1), "failures": s.failures, "banned": s.banned} for u, s in stats.items()})
