"""Signed policy manifests: what shardcast publishes for each policy version, and its listing.

A manifest names every file of a version with its sha256, its blake3 and its size and is signed by the run's
key, so a relay can serve the files but never change them (`shardcast.keys` signs and checks `signing_payload()`).
"""

from __future__ import annotations

import base64
import json
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from protocol import limits
from protocol.models import RunId, Sha256Hex, Version, WireModel

Blake3Hex = Sha256Hex  # both are 32-byte digests in lowercase hex

ShardName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=limits.MAX_SHARD_NAME_CHARS,
        # A bare file name: no separators, no leading dot, so it can never escape its version folder.
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
    ),
]


class ShardEntry(WireModel):
    name: ShardName
    sha256: Sha256Hex
    size: Annotated[int, Field(ge=0, le=1 << 40)]
    # What receivers check the file with when it is there (shardcast.files.file_hash): blake3 hashes 6x faster
    # than sha256 on one core here (9.6 vs 1.5 GB/s, AVX-512), and every relay and client hashes every byte.
    # Signed with the rest, so a relay cannot strip it to force the slower check; absent in older manifests.
    blake3: Blake3Hex | None = None

    @field_validator("name")
    @classmethod
    def _no_dotdot(cls, v: str) -> str:
        if ".." in v:
            raise ValueError(f"shard name {v!r} contains '..'")
        return v


class DeltaRef(WireModel):
    """A delta object of a version: turns `base_version` (whose model hash must be `base_model_hash`)
    into this version, bit for bit. `file` is one of the manifest's `shards` (sha256 and size signed there)."""

    base_version: Version
    base_model_hash: Sha256Hex
    file: ShardName


class PolicyManifest(WireModel):
    """One version of a run's policy, as files: the full safetensors shards (an anchor) and/or delta objects.

    Every file is in `shards` with its signed sha256 and size, so servers treat them all alike; `deltas` says
    which of them are deltas. A version with full shards is an anchor (`anchor_version == version`); any
    other names the newest anchor at or below it. `full_bytes` is what the full shards weigh (the cost a
    delta saves), and `model_hash` (shardcast.weights.model_hash) is what any path to this version must yield.
    """

    run_id: RunId
    version: Version
    model_hash: Sha256Hex
    anchor_version: Version
    full_bytes: Annotated[int, Field(ge=0, le=1 << 50)]
    shards: Annotated[list[ShardEntry], Field(min_length=1, max_length=limits.MAX_SHARDS_PER_MANIFEST)]
    deltas: Annotated[list[DeltaRef], Field(max_length=limits.MAX_DELTAS_PER_MANIFEST)] = []
    created_at: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    # base64 ed25519 signature over `signing_payload()`; empty until signed.
    signature: Annotated[str, Field(max_length=128)] = ""

    @model_validator(mode="after")
    def _consistent(self) -> "PolicyManifest":
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise ValueError("shard names are not unique")
        files = [d.file for d in self.deltas]
        if len(set(files)) != len(files) or not set(files) <= set(names):
            raise ValueError("every delta must name its own file among the shards")
        if any(d.base_version >= self.version for d in self.deltas):
            raise ValueError("a delta's base must be an earlier version")
        full = len(names) > len(files)
        if full != (self.anchor_version == self.version) or self.anchor_version > self.version:
            raise ValueError("anchor_version must be the version itself exactly when it has full shards")
        return self

    def signing_payload(self) -> bytes:
        """Canonical bytes that the signature covers: every field but the signature, sorted, compact."""
        # exclude_none: an entry without blake3 signs the same bytes as before the field existed
        body = self.model_dump(mode="json", exclude={"signature"}, exclude_none=True)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def total_bytes(self) -> int:
        """Every file of the version (full shards and deltas): what a relay mirrors."""
        return sum(s.size for s in self.shards)

    @property
    def full_shards(self) -> list[ShardEntry]:
        """The safetensors shards of the whole model (empty unless this version is an anchor)."""
        files = {d.file for d in self.deltas}
        return [s for s in self.shards if s.name not in files]

    def file(self, name: str) -> ShardEntry:
        return next(s for s in self.shards if s.name == name)

    def signature_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.signature, validate=True)
        except ValueError:
            return b""


class VersionList(WireModel):
    versions: list[Version]  # ascending; every listed version has a complete manifest
