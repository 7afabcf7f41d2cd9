"""The shardcast client's folders under its `dest_root`, one client at a time:

    v<N>/            a complete version: its safetensors shards and its signed manifest.json
    .partial-v<N>/   a version's files being downloaded, each verified under its final name (a client
                     that stops resumes with them), with the manifest they belong to
    .tmp-v<N>/       weights reached by deltas being written; renamed to v<N> when whole

A folder is trusted only through its signed manifest: a `v<N>` whose manifest does not check out is
deleted, and a file under its final name is re-hashed before it counts.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.manifests import PolicyManifest, ShardEntry
from shardcast import assemble
from shardcast.file_fetch import FileJob
from shardcast.files import file_matches
from shardcast.keys import ManifestError, parse_verified_manifest
from shardcast.plan import Plan, Step
from shardcast.store import MANIFEST_FILE, DiskFullError, complete_dir_name, fsync_dir, partial_dir_name


def signed_folders(dest_root: Path, public_key: Ed25519PublicKey, run_id: str) -> dict[int, PolicyManifest]:
    """version -> manifest of the version folders whose signed manifest checks out (their bytes are checked
    when a plan uses them); a folder whose manifest does not is deleted."""
    manifests: dict[int, PolicyManifest] = {}
    for p in dest_root.iterdir():
        if not (p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and (p / MANIFEST_FILE).is_file()):
            continue
        try:
            m = parse_verified_manifest((p / MANIFEST_FILE).read_bytes(), public_key, int(p.name[1:]), run_id=run_id)
        except (ManifestError, OSError):
            shutil.rmtree(p, ignore_errors=True)  # another run's, or damaged
            continue
        manifests[m.version] = m
    return manifests


def staging_folder(dest_root: Path, manifest: PolicyManifest) -> Path:
    """`.partial-v<N>` for this manifest: kept across restarts (resume), reset if the manifest differs."""
    staging = dest_root / partial_dir_name(manifest.version)
    body = manifest.model_dump_json().encode()
    old = staging / MANIFEST_FILE
    if staging.is_dir():
        try:
            same = PolicyManifest.model_validate_json(old.read_bytes()).signing_payload() == manifest.signing_payload()
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(staging)
    staging.mkdir(exist_ok=True)
    if not old.is_file():
        old.write_bytes(body)
    return staging


def already_verified(path: Path, entry: ShardEntry) -> bool:
    """A file under its final name from an earlier attempt or process: trusted only after re-hashing."""
    if file_matches(path, entry):
        return True
    path.unlink(missing_ok=True)
    return False


def check_space(dest_root: Path, target: PolicyManifest, plan: Plan, jobs: list[FileJob]) -> None:
    need = sum(j.entry.size for j in jobs) + (target.full_bytes if plan.steps[-1].delta is not None else 0)
    free = shutil.disk_usage(dest_root).free
    if free < need:
        raise DiskFullError(errno.ENOSPC,
            f"version {target.version} needs {need} more bytes, {dest_root} has {free} free")


def read_delta(dest_root: Path, step: Step) -> bytes:
    return (dest_root / partial_dir_name(step.version) / step.delta.file).read_bytes()


def finish_full(dest_root: Path, manifest: PolicyManifest, durable: bool) -> None:
    """A version whose full shards are all verified in staging becomes `v<N>` (one rename)."""
    staging = dest_root / partial_dir_name(manifest.version)
    final = dest_root / complete_dir_name(manifest.version)
    for d in manifest.deltas:  # only the model's shards stay in a version folder
        (staging / d.file).unlink(missing_ok=True)
    if durable:
        fsync_dir(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    fsync_dir(dest_root)


def write_version(dest_root: Path, target: PolicyManifest, state: dict, shard_bytes: int, durable: bool) -> Path:
    """Write weights reached by deltas as the folder `v<N>` (through a temp folder; one rename)."""
    final = dest_root / complete_dir_name(target.version)
    free = shutil.disk_usage(dest_root).free
    if free < target.full_bytes:
        raise DiskFullError(errno.ENOSPC,
            f"version {target.version} needs {target.full_bytes} bytes, {dest_root} has {free} free")
    try:
        assemble.write_folder(state, target, dest_root / f".tmp-v{target.version:010d}", final, shard_bytes, durable)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(errno.ENOSPC, f"no space left on device under {dest_root}") from None
        raise
    shutil.rmtree(dest_root / partial_dir_name(target.version), ignore_errors=True)
    return final


def prune_folders(dest_root: Path, keep: int, keep_versions: int, writer: threading.Thread | None) -> list[int]:
    """Delete older version folders beyond `keep_versions` (never `keep`, the one just pulled), staging
    folders below `keep`, and temp folders unless `writer` is writing one. Returns the versions deleted."""
    deleted = []
    done = sorted(int(p.name[1:]) for p in dest_root.iterdir() if p.is_dir() and p.name.startswith("v")
        and p.name[1:].isdigit())
    for v in done[: max(0, len(done) - keep_versions)]:
        if v != keep:
            shutil.rmtree(dest_root / complete_dir_name(v), ignore_errors=True)
            deleted.append(v)
    for p in dest_root.glob(".partial-v*"):
        if int(p.name.removeprefix(".partial-v")) < keep:
            shutil.rmtree(p, ignore_errors=True)
    if writer is None or not writer.is_alive():  # else one of them is being written
        for p in dest_root.glob(".tmp-v*"):
            shutil.rmtree(p, ignore_errors=True)
    return deleted
