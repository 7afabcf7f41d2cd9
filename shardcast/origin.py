"""The origin: turns a state dict into a signed version folder (full shards and/or a delta), atomically.

publish(v, state_dict):
  1. encode a delta against the previous published state (kept in memory, a copy), if there is one;
  2. decide (below) whether v is an anchor: full safetensors shards, plus that delta if any, so workers that
     follow the chain never download the full model; otherwise the delta alone;
  3. write each file into a fresh temp folder, hashing the exact bytes written;
  4. write the signed manifest (run id, files with size, sha256 and blake3, deltas with their bases' model hashes,
     the anchor, the full size) last, fsync, and rename the folder to `v<version>` (one atomic step);
  5. prune versions outside the window (the newest K and the chain back to their anchor).
A failure at any step (a full disk included) removes the temp folder and raises; no version appears.

The anchor policy: v is an anchor when there is no previous state (the first version, or after a restart
or a withdrawn version), when the codec refuses (the tensor set changed), every `anchor_every` versions,
or when the deltas since the anchor, this one included, would weigh more than `max_chain_fraction` of a
full version. So a worker that holds nothing fetches at most 1 + max_chain_fraction full versions.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import Counter, Gauge

from protocol.manifests import DeltaRef, PolicyManifest, ShardEntry
from shardcast.config import DEFAULTS, ShardcastConfig
from shardcast.files import signed_entry
from shardcast.keys import public_key_b64, sign_manifest
from shardcast.store import MANIFEST_FILE, DiskFullError, VersionStore

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PUBLISHED_BYTES = Counter("shardcast_origin_published_bytes", "bytes of published files", ["kind"])
DELTA_FRACTION = Gauge("shardcast_origin_delta_fraction", "the last delta's size over a full version's")


def write_file_durably(path: Path, data: bytes | memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def delta_file_name(base_version: int) -> str:
    return f"delta-from-v{base_version:010d}.swdelta"


@dataclass
class _Previous:
    """The last published state (our own copy: the trainer keeps changing its tensors) and its chain."""

    version: int
    model_hash: str
    state: dict
    anchor_version: int
    full_bytes: int
    chain_bytes: int  # deltas since the anchor along the chain: what a worker holding only the anchor needs


class Origin(VersionStore):
    def __init__(
        self,
        root: Path,
        signing_key: Ed25519PrivateKey,
        *,
        run_id: str,
        keep_versions: int = DEFAULTS.keep_versions,
        shard_bytes: int = DEFAULTS.shard_bytes,
        grace_s: float = DEFAULTS.delete_grace_s,
        deltas: bool = DEFAULTS.deltas,
        anchor_every: int = DEFAULTS.anchor_every,
        max_chain_fraction: float = DEFAULTS.max_chain_fraction,
        delta_level: int = DEFAULTS.delta_level,
        delta_workers: int = DEFAULTS.delta_workers,
    ):
        if shard_bytes < 1:
            raise ValueError("shard_bytes must be >= 1")
        if not run_id:
            raise ValueError("an origin needs the run id it signs into every manifest")
        super().__init__(root, keep_versions, grace_s, run_id=run_id)  # other runs' versions on disk are deleted
        self.signing_key = signing_key
        self.public_key_b64 = public_key_b64(signing_key)
        self.shard_bytes = shard_bytes
        self.deltas, self.anchor_every, self.max_chain_fraction = deltas, anchor_every, max_chain_fraction
        self.delta_level, self.delta_workers = delta_level, delta_workers
        self._prev: _Previous | None = None

    @classmethod
    def from_config(cls, root: Path, signing_key: Ed25519PrivateKey, config: ShardcastConfig) -> "Origin":
        return cls(
            root, signing_key, run_id=config.run_id, keep_versions=config.keep_versions, shard_bytes=config.shard_bytes,
            grace_s=config.delete_grace_s, deltas=config.deltas, anchor_every=config.anchor_every,
            max_chain_fraction=config.max_chain_fraction, delta_level=config.delta_level,
            delta_workers=config.delta_workers,
        )

    def publish(self, version: int, state_dict: Mapping[str, "torch.Tensor"]) -> PolicyManifest:
        from shardcast.weights import model_hash

        if self.manifest(version) is not None:
            raise FileExistsError(f"version {version} is already published")
        if not state_dict:
            raise ValueError("cannot publish an empty state dict")
        t0 = time.perf_counter()
        new_hash = model_hash(state_dict)
        prev = self._prev if self._prev is not None and self._prev.version < version and self.manifest(
            self._prev.version) is not None else None
        delta = self._encode(prev, state_dict, new_hash)
        full = (
            prev is None or delta is None or version - prev.anchor_version >= self.anchor_every
            or prev.chain_bytes + len(delta) > self.max_chain_fraction * prev.full_bytes
        )
        tmp = self.new_temp_dir()
        try:
            entries = self._write_full(tmp, state_dict) if full else []
            full_bytes = sum(e.size for e in entries) if full else prev.full_bytes
            refs = []
            if delta is not None:
                name = delta_file_name(prev.version)
                write_file_durably(tmp / name, delta)
                entries.append(signed_entry(name, delta))
                refs.append(DeltaRef(base_version=prev.version, base_model_hash=prev.model_hash, file=name))
            manifest = sign_manifest(
                PolicyManifest(
                    run_id=self.run_id, version=version, model_hash=new_hash, anchor_version=version if full
                    else prev.anchor_version, full_bytes=full_bytes, shards=entries, deltas=refs,
                    created_at=time.time(),
                ),
                self.signing_key,
            )
            body = manifest.model_dump_json().encode()
            write_file_durably(tmp / MANIFEST_FILE, body)  # last: a folder with a manifest is complete
            self.add_complete(version, tmp, manifest, body)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                raise DiskFullError(errno.ENOSPC,
                    f"no space left on device under {self.root} while publishing version {version}; nothing was "
                    f"published") from e
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        chain = 0 if full else prev.chain_bytes + len(delta)
        self._keep(version, new_hash, state_dict, manifest.anchor_version, full_bytes, chain)
        self._account(manifest, delta)
        deleted = self.prune()
        log.info(
            "published version %d (%s): %.2f MB of files for a %.2f MB model in %.2fs",
            version, "anchor" if full else f"delta from {prev.version}", manifest.total_bytes / 1e6, full_bytes / 1e6,
            time.perf_counter() - t0, extra={"version": version, "deleted": deleted, "delta_bytes": len(delta)
            if delta is not None else None},
        )
        return manifest

    def drop(self, version: int) -> None:
        """Withdraw a version (a restarted trainer re-publishes it): the chain restarts with an anchor."""
        if self._prev is not None and self._prev.version >= version:
            self._prev = None
        super().drop(version)

    def version_dir(self, version: int) -> Path:
        path = self.path_of(version)
        if path is None:
            raise KeyError(f"version {version} is not published here")
        return path

    def latest(self) -> int | None:
        versions = self.complete_versions()
        return versions[-1] if versions else None

    # ----------------------------------------------------------------------------------------------

    def _encode(self, prev: _Previous | None, state: Mapping[str, "torch.Tensor"], new_hash: str) -> bytes | None:
        if prev is None or not self.deltas:
            return None
        from shardcast.delta import DeltaError, encode_delta

        try:
            return encode_delta(prev.state, state, level=self.delta_level, workers=self.delta_workers,
                base_hash=prev.model_hash, new_hash=new_hash)
        except (DeltaError, TypeError) as e:  # a changed tensor set or an unsupported dtype: a full version
            log.warning("publishing a full version instead of a delta: %s", e)
            return None

    def _write_full(self, folder: Path, state: Mapping[str, "torch.Tensor"]) -> list[ShardEntry]:
        from shardcast.weights import plan_shards, serialize_shard, shard_file_name, split_aliases

        tensors, aliases = split_aliases(state)
        plan = plan_shards(tensors, self.shard_bytes)
        entries = []
        for i, names in enumerate(plan):
            name = shard_file_name(i, len(plan))
            data = serialize_shard({n: tensors[n] for n in names}, aliases)
            write_file_durably(folder / name, data)
            entries.append(signed_entry(name, data))
            del data
        return entries

    def _keep(self, version: int, model_hash: str, state: Mapping[str, "torch.Tensor"], anchor: int, full_bytes: int,
        chain: int) -> None:
        """Copy the published state for the next delta, into the previous copy's memory where shapes match
        (fresh memory is what costs most on these machines)."""
        if not self.deltas:
            return
        from shardcast.weights import split_aliases

        tensors, aliases = split_aliases(state)
        old = self._prev.state if self._prev is not None else {}
        copy = {}
        for name, t in tensors.items():
            buf = old.get(name)
            if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
                copy[name] = buf.copy_(t.detach())
            else:
                copy[name] = t.detach().to("cpu", copy=True).contiguous()
        self._prev = _Previous(version, model_hash, {n: copy[aliases.get(n, n)] for n in state}, anchor, full_bytes,
            chain)

    @staticmethod
    def _account(manifest: PolicyManifest, delta: bytes | None) -> None:
        full = manifest.full_shards
        PUBLISHED_BYTES.labels("full").inc(sum(s.size for s in full))
        if delta is not None:
            PUBLISHED_BYTES.labels("delta").inc(len(delta))
            DELTA_FRACTION.set(len(delta) / max(1, manifest.full_bytes))
