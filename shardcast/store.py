"""A folder of policy versions that a shard server can serve: the origin's and every relay's storage.

Layout under `root`:
    v0000000042/                 a complete version: manifest.json + its *.safetensors shards
    .partial-v0000000042/        (relays) a version being mirrored: its verified manifest.json, the shards
                                 verified so far under their final names, `.<name>.part` files in flight
    .tmp-*, .trash-*             being written / being deleted; removed at start-up
    .lock                        held (flock) by the relay process that owns the folder (`lock_folder`)

No marker files: a version appears by renaming a finished folder (the manifest is written last), and a
relay's shard appears by renaming a verified file. Everything the server can see is in the in-memory
index, which changes under one lock.

Versions form delta chains (a version may be only a delta against an earlier one), so the newest K are
kept together with every version back to the oldest anchor they need: pruning never breaks a chain.

Deleting old versions never breaks a download:
- a shard is opened under the index lock, and POSIX keeps an open file readable after its folder is
  renamed away and unlinked, so a transfer in flight always completes;
- between two requests of one client there is no open file, so a version that left the newest K is kept
  until nobody has touched it for `grace_s` seconds (and no response is in flight).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from protocol.manifests import PolicyManifest, ShardEntry

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class FolderInUse(RuntimeError):
    """Another process holds the folder (`lock_folder`)."""


def lock_folder(root: Path, wait_s: float, what: str) -> int:
    """Hold an exclusive lock on `root` for the rest of this process's life; returns its fd. The kernel drops
    it when the process exits, SIGKILL included. Why: two processes on one folder write the same `.part`
    files, each sees bytes that fail the signed digest, and bans the honest server that sent them (a relay
    still shutting down after its driver was killed, beside the one the new driver started, banned the
    origin, its only upstream, and the run stalled). Waits up to `wait_s` for the previous holder to exit."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise FolderInUse(
                    f"{root} is in use by another {what} (pid {holder}); one process per folder") from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd

MANIFEST_FILE = "manifest.json"
_COMPLETE = re.compile(r"^v(\d{10})$")
_PARTIAL = re.compile(r"^\.partial-v(\d{10})$")


def complete_dir_name(version: int) -> str:
    return f"v{version:010d}"


def partial_dir_name(version: int) -> str:
    return f".partial-v{version:010d}"


class DiskFullError(OSError):
    """No space left on the device while writing a version; no version was made visible."""


class ShardUnavailable(Exception):
    """Why a request cannot be served: maps to an HTTP status and a protocol ErrorCode."""

    def __init__(self, status: int, code: str, detail: str, retry_after_s: float | None = None):
        super().__init__(detail)
        self.status, self.code, self.detail, self.retry_after_s = status, code, detail, retry_after_s


@dataclass
class _Entry:
    manifest: PolicyManifest
    manifest_bytes: bytes
    path: Path
    complete: bool
    available: set[str] = field(default_factory=set)  # shards verified and on disk
    active: int = 0  # responses in flight
    last_access: float = 0.0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VersionStore:
    # The origin wrote (and fsynced) its own files. A relay re-hashes what it finds on disk at start-up
    # before serving it, so nothing unverified is ever served, even after a crash (see Relay._mirror).
    trust_disk = True

    def __init__(self, root: Path, keep_versions: int, grace_s: float = 120.0, run_id: str | None = None):
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.run_id = run_id  # if set, versions of another run found on disk are deleted
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[int, _Entry] = {}
        self._load()

    # -- start-up -----------------------------------------------------------------------------------

    def _load(self) -> None:
        for child in self.root.iterdir():
            if child.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(child, ignore_errors=True)
                continue
            m = _COMPLETE.match(child.name) or _PARTIAL.match(child.name)
            if not m or not (child / MANIFEST_FILE).is_file():
                continue
            version = int(m.group(1))
            body = (child / MANIFEST_FILE).read_bytes()
            try:
                manifest = self.check_manifest(body, version)
            except ValueError as e:
                log.warning("dropping version folder %s: %s", child, e)
                shutil.rmtree(child, ignore_errors=True)
                continue
            complete = bool(_COMPLETE.match(child.name)) and self.trust_disk
            available = {s.name for s in manifest.shards} if complete else set()
            self._entries[version] = _Entry(manifest, body, child, complete, available)

    def check_manifest(self, body: bytes, version: int) -> PolicyManifest:
        """Parse a manifest read from our own disk; relays override this to re-check the signature."""
        manifest = PolicyManifest.model_validate_json(body)
        if manifest.version != version:
            raise ValueError(f"manifest says version {manifest.version}")
        if self.run_id is not None and manifest.run_id != self.run_id:
            raise ValueError(f"manifest belongs to run {manifest.run_id!r}, not {self.run_id!r}")
        return manifest

    # -- what the server reads ----------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Versions with a verified manifest, ascending (a relay lists a version before all its shards arrived)."""
        with self._lock:
            return sorted(self._entries)

    def complete_versions(self) -> list[int]:
        with self._lock:
            return sorted(v for v, e in self._entries.items() if e.complete)

    def manifest(self, version: int) -> PolicyManifest | None:
        with self._lock:
            e = self._entries.get(version)
            return e.manifest if e else None

    def manifest_bytes(self, version: int) -> bytes:
        with self._lock:
            e = self._entries.get(version)
            if e is None:
                raise ShardUnavailable(404, "not_found", f"version {version} is not here")
            e.last_access = time.monotonic()
            return e.manifest_bytes

    def folder_of(self, version: int) -> Path | None:
        """Where a listed version's files are (complete or not)."""
        with self._lock:
            e = self._entries.get(version)
            return e.path if e else None

    def path_of(self, version: int) -> Path | None:
        """A complete version's folder. Counts as a use: a local reader gets the same grace period."""
        with self._lock:
            e = self._entries.get(version)
            if e is None or not e.complete:
                return None
            e.last_access = time.monotonic()
            return e.path

    @contextmanager
    def hold(self, version: int) -> Iterator[Path]:
        """Keep a complete version from deletion while a local reader (e.g. a verifier loading it) uses it."""
        with self._lock:
            e = self._entries.get(version)
            if e is None or not e.complete:
                raise KeyError(f"version {version} is not here")
            e.active += 1
        try:
            yield e.path
        finally:
            with self._lock:
                e.active -= 1
                e.last_access = time.monotonic()

    @contextmanager
    def open_shard(self, version: int, name: str, wait_s: float = 0.0) -> Iterator[tuple[BinaryIO, ShardEntry]]:
        """Open a verified shard for reading; wait up to `wait_s` for a relay to finish verifying it."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                e = self._entries.get(version)
                if e is None:
                    raise ShardUnavailable(404, "not_found", f"version {version} is not here")
                entry = next((s for s in e.manifest.shards if s.name == name), None)
                if entry is None:
                    raise ShardUnavailable(404, "not_found", f"version {version} has no shard {name!r}")
                if name in e.available:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardUnavailable(503, "rate_limited",
                        f"shard {name!r} of version {version} is not verified here yet", retry_after_s=1.0)
                self._changed.wait(left)
            f = open(e.path / name, "rb")
            e.active += 1
            e.last_access = time.monotonic()
        try:
            yield f, entry
        finally:
            f.close()
            with self._lock:
                e.active -= 1
                e.last_access = time.monotonic()

    # -- what the origin / relay write ----------------------------------------------------------------

    def new_temp_dir(self) -> Path:
        path = self.root / f".tmp-{uuid.uuid4().hex}"
        path.mkdir()
        return path

    def add_complete(self, version: int, folder: Path, manifest: PolicyManifest, manifest_bytes: bytes) -> Path:
        """Rename a finished folder (manifest written last) into place and list it."""
        final = self.root / complete_dir_name(version)
        with self._lock:
            if version in self._entries and self._entries[version].complete:
                raise FileExistsError(f"version {version} already exists")
            os.rename(folder, final)
            fsync_dir(self.root)
            names = {s.name for s in manifest.shards}
            self._entries[version] = _Entry(manifest, manifest_bytes, final, True, names, last_access=time.monotonic())
            self._changed.notify_all()
        return final

    def begin_partial(self, version: int, manifest: PolicyManifest, manifest_bytes: bytes) -> Path:
        """(relay) List a version whose manifest is verified; its shards become servable one by one."""
        with self._lock:
            e = self._entries.get(version)
            if e is not None:
                return e.path
            tmp = self.new_temp_dir()
            (tmp / MANIFEST_FILE).write_bytes(manifest_bytes)
            final = self.root / partial_dir_name(version)
            os.rename(tmp, final)
            self._entries[version] = _Entry(manifest, manifest_bytes, final, False, set(), last_access=time.monotonic())
            self._changed.notify_all()
            return final

    def missing_shards(self, version: int) -> list[str]:
        with self._lock:
            e = self._entries.get(version)
            if e is None:
                return []
            return [s.name for s in e.manifest.shards if s.name not in e.available]

    def add_shard(self, version: int, name: str) -> None:
        """(relay) A shard was verified and renamed to its final name: serve it; finish the version if last."""
        with self._lock:
            e = self._entries.get(version)
            if e is None:
                return
            e.available.add(name)
            if len(e.available) == len(e.manifest.shards) and not e.complete:
                final = self.root / complete_dir_name(version)
                if e.path != final:
                    os.rename(e.path, final)  # open files stay valid across the rename
                e.path, e.complete = final, True
            self._changed.notify_all()

    # -- deletion -------------------------------------------------------------------------------------

    def window_floor(self) -> int | None:
        """The oldest version to keep: the oldest anchor that the newest `keep_versions` need."""
        with self._lock:
            newest = sorted(self._entries)[-self.keep_versions :]
            return min((self._entries[v].manifest.anchor_version for v in newest), default=None)

    def prune(self) -> list[int]:
        """Delete versions below the window (the newest `keep_versions` and the chains back to their
        anchors), unless in use or touched within grace_s."""
        now = time.monotonic()
        doomed: list[tuple[int, Path]] = []
        floor = self.window_floor()
        with self._lock:
            for v, e in list(self._entries.items()):
                if floor is None or v >= floor or e.active > 0 or now - e.last_access < self.grace_s:
                    continue
                del self._entries[v]
                trash = self.root / f".trash-{uuid.uuid4().hex}"
                os.rename(e.path, trash)
                doomed.append((v, trash))
        for v, trash in doomed:
            shutil.rmtree(trash, ignore_errors=True)
            log.info("deleted version %d", v, extra={"version": v})
        return [v for v, _ in doomed]

    def drop(self, version: int) -> None:
        """Forget a version now (a relay gives up on a version that fell out of the window)."""
        with self._lock:
            e = self._entries.pop(version, None)
            if e is None:
                return
            trash = self.root / f".trash-{uuid.uuid4().hex}"
            os.rename(e.path, trash)
            self._changed.notify_all()
        shutil.rmtree(trash, ignore_errors=True)
