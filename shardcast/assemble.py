"""Weights in memory on the client side: a version folder checked against its signed model hash, a delta
chain applied (each step checked against the base's and the result's signed hashes), and a result written
out as a plain version folder (safetensors shards that vLLM, transformers and the verifier read).

torch is imported here, only when a client meets a delta or has to re-check a written folder: a pull of
full versions alone needs none.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.manifests import PolicyManifest
from shardcast.files import file_matches
from shardcast.plan import Step
from shardcast.store import MANIFEST_FILE, fsync_dir

if TYPE_CHECKING:
    import torch


class FolderMismatch(ValueError):
    """A version folder on disk does not hold the weights its signed manifest names."""


def folder_state(folder: Path, manifest: PolicyManifest, *, need_state: bool) -> dict[str, "torch.Tensor"] | None:
    """Check a version folder against the signed manifest; return its tensors if `need_state`.

    A folder of the version's own full shards is checked file by file (sha256); a folder written from a
    delta chain (its shards are ours, not signed) by loading it and comparing its model hash.
    """
    full = manifest.full_shards
    if full and all(file_matches(folder / s.name, s) for s in full):
        if not need_state:
            return None
        from shardcast.weights import load_version_dir

        return load_version_dir(folder)
    from shardcast.weights import load_version_dir, model_hash

    try:
        state = load_version_dir(folder)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors included: a damaged folder is a mismatch
        raise FolderMismatch(f"{folder}: {e}") from None
    if model_hash(state) != manifest.model_hash:
        raise FolderMismatch(f"{folder} does not hold the weights of version {manifest.version}")
    return state


def apply_steps(state: dict, state_hash: str, steps: list[Step], read: "callable", workers: int = 1) -> dict:
    """Apply delta steps in order; `read(step)` gives a step's (sha256-verified) delta bytes.

    Raises shardcast.delta.DeltaBaseMismatch if the first base is not `state_hash`'s weights, and DeltaError
    (carrying `.step`) for a delta that does not yield its signed result: never returns other weights.
    """
    from shardcast.delta import DeltaError, apply_delta

    for step in steps:
        try:
            state = apply_delta(state, read(step), base_hash=state_hash, expected_hash=step.model_hash, workers=workers)
        except DeltaError as e:
            e.step = step  # type: ignore[attr-defined]
            raise
        state_hash = step.model_hash
    return state


def write_folder(state: dict, manifest: PolicyManifest, temp: Path, final: Path, shard_bytes: int,
    durable: bool) -> None:
    """Write `state` as safetensors shards + the signed manifest into `temp`, then rename it to `final`."""
    from shardcast.weights import plan_shards, serialize_shard, shard_file_name, split_aliases

    tensors, aliases = split_aliases(state)
    plan = plan_shards(tensors, shard_bytes)
    # A temp folder of this version left by a process killed mid-write (at 0.6B a write takes seconds, and
    # a run's end stops its workers): only this writer writes this version now.
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        for i, names in enumerate(plan):
            data = serialize_shard({n: tensors[n] for n in names}, aliases)
            with open(temp / shard_file_name(i, len(plan)), "wb") as f:
                f.write(data)
                if durable:
                    os.fdatasync(f.fileno())
            del data
        (temp / MANIFEST_FILE).write_bytes(manifest.model_dump_json().encode())
        if durable:
            fsync_dir(temp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(temp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
