"""File helpers of verified downloads: hash what a file already holds, write all of a buffer, tell a full
disk apart from other errors, and check a file against its signed size and sha256."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from protocol.manifests import ShardEntry
from shardcast.store import DiskFullError


def file_matches(path: Path, entry: ShardEntry) -> bool:
    """Whether a file on disk has exactly the shard's size and sha256."""
    try:
        if path.stat().st_size != entry.size:
            return False
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return False
    return h.hexdigest() == entry.sha256


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
