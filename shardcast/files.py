"""File helpers of verified downloads: the signed digests of a file and how to check them, hash what a file
already holds, write all of a buffer, tell a full disk apart from other errors, and check a file against its
signed size and digest."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import blake3

from protocol.manifests import ShardEntry
from shardcast.store import DiskFullError


def signed_entry(name: str, data: bytes | memoryview) -> ShardEntry:
    """What the origin signs for a file: size, sha256 (the ETag; what older receivers check) and blake3."""
    return ShardEntry(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
        blake3=blake3.blake3(data).hexdigest())


def file_hash(entry: ShardEntry):
    """(a fresh hasher, the hex digest it must end with) for a file of the manifest: blake3 where the signed
    entry has one, sha256 otherwise. Both hashers take `update(buffer)` and give `hexdigest()`."""
    if entry.blake3 is not None:
        return blake3.blake3(), entry.blake3
    return hashlib.sha256(), entry.sha256


def file_matches(path: Path, entry: ShardEntry) -> bool:
    """Whether a file on disk has exactly the shard's size and signed digest."""
    h, want = file_hash(entry)
    try:
        if path.stat().st_size != entry.size:
            return False
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return False
    return h.hexdigest() == want


def disk_error(e: OSError, where: Path) -> OSError:
    if e.errno == errno.ENOSPC:
        return DiskFullError(errno.ENOSPC, f"no space left on device writing {where}")
    return e


def write_all(fd: int, data: memoryview) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except OSError as e:
            raise disk_error(e, Path(f"/proc/self/fd/{fd}")) from e
        data = data[n:]


def hash_prefix(fd: int, h, buf: bytearray, size: int) -> int:
    """Feed what a previous attempt left in the file into the hash; returns its length (truncated to size)."""
    have = os.fstat(fd).st_size
    if have > size:
        os.ftruncate(fd, 0)
        return 0
    view = memoryview(buf)
    done = 0
    os.lseek(fd, 0, os.SEEK_SET)
    while done < have:
        n = os.readv(fd, [view[: min(len(view), have - done)]])
        if n <= 0:
            break
        h.update(view[:n])
        done += n
    return done
