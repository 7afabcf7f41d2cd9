"""The origin: turns a state dict into a signed, sharded version folder, atomically.

publish(v, state_dict):
  1. split tied aliases, pack tensors into safetensors shards of about `shard_bytes`;
  2. write each shard into a fresh temp folder, hashing the exact bytes written;
  3. write the signed manifest last, fsync, and rename the folder to `v<version>` (one atomic step);
  4. prune versions beyond the newest K (see store.py for why that never breaks a download).
A failure at any step (a full disk included) removes the temp folder and raises; no version appears.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.models import PolicyManifest, ShardEntry
from shardcast.config import DEFAULTS, ShardcastConfig
from shardcast.keys import public_key_b64, sign_manifest
from shardcast.store import MANIFEST_FILE, DiskFullError, VersionStore

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


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


class Origin(VersionStore):
    def __init__(
        self,
        root: Path,
        signing_key: Ed25519PrivateKey,
        keep_versions: int = DEFAULTS.keep_versions,
        shard_bytes: int = DEFAULTS.shard_bytes,
        grace_s: float = DEFAULTS.delete_grace_s,
    ):
        if shard_bytes < 1:
            raise ValueError("shard_bytes must be >= 1")
        super().__init__(root, keep_versions, grace_s)
        self.signing_key = signing_key
        self.public_key_b64 = public_key_b64(signing_key)
        self.shard_bytes = shard_bytes

    def publish(self, version: int, state_dict: Mapping[str, "torch.Tensor"]) -> PolicyManifest:
        from shardcast.weights import model_hash, plan_shards, serialize_shard, shard_file_name, split_aliases

        if self.manifest(version) is not None:
            raise FileExistsError(f"version {version} is already published")
        if not state_dict:
            raise ValueError("cannot publish an empty state dict")
        t0 = time.perf_counter()
        tensors, aliases = split_aliases(state_dict)
        plan = plan_shards(tensors, self.shard_bytes)
        tmp = self.new_temp_dir()
        try:
            entries = []
            for i, names in enumerate(plan):
                name = shard_file_name(i, len(plan))
                data = serialize_shard({n: tensors[n] for n in names}, aliases)
                write_file_durably(tmp / name, data)
                entries.append(ShardEntry(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data)))
                del data
            manifest = sign_manifest(
                PolicyManifest(version=version, model_hash=model_hash(state_dict), shards=entries, created_at=time.time()),
                self.signing_key,
            )
            body = manifest.model_dump_json().encode()
            write_file_durably(tmp / MANIFEST_FILE, body)  # last: a folder with a manifest is complete
            self.add_complete(version, tmp, manifest, body)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                raise DiskFullError(errno.ENOSPC, f"no space left on device under {self.root} while publishing version {version}; nothing was published") from e
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        deleted = self.prune()
        log.info(
            "published version %d: %d shards, %.1f MB in %.2fs",
            version, len(entries), manifest.total_bytes / 1e6, time.perf_counter() - t0,
            extra={"version": version, "deleted": deleted},
        )
        return manifest

    @classmethod
    def from_config(cls, root: Path, signing_key: Ed25519PrivateKey, config: ShardcastConfig) -> "Origin":
        return cls(root, signing_key, config.keep_versions, config.shard_bytes, config.delete_grace_s)

    def version_dir(self, version: int) -> Path:
        path = self.path_of(version)
        if path is None:
            raise KeyError(f"version {version} is not published here")
        return path

    def latest(self) -> int | None:
        versions = self.complete_versions()
        return versions[-1] if versions else None
