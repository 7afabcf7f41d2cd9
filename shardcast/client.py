"""The shardcast client: get a signed version of this run from several untrusted servers, fast and safely.

- A manifest is trusted only after its ed25519 signature and run id check out; it then authenticates every
  file through its signed digest (file_fetch.py), and names the model hash that any path to the version must yield.
- The plan (plan.py): the cheapest path in bytes from what the client holds (the last pulled weights in
  memory, verified version folders on disk) to the version: its full shards, or deltas applied in turn,
  or an anchor's full shards and then deltas. Manifests of the chain are fetched first, in parallel.
- The files of the path download in parallel, each verified into a staging folder (`.partial-v<N>`), so a
  client that stops mid-chain resumes with what it has. Deltas apply in memory, each checked against its
  base's and its result's signed hashes; a failed step is avoided and the path planned again. A version
  reached by deltas is written out as a plain folder `dest_root/v<N>` (safetensors + its signed manifest).
- Nothing waits without bound (sources.TransferPolicy): a pull has a deadline; sources that stall or drip
  are left within seconds; fallback URLs (the origin) are used when relays fail.

No torch here unless a delta is met (assemble.py): a pull of full versions needs none.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protocol.manifests import PolicyManifest
from shardcast import assemble
from shardcast.client_folders import (
    already_verified,
    check_space,
    finish_full,
    prune_folders,
    read_delta,
    signed_folders,
    staging_folder,
    write_version,
)
from shardcast.config import DEFAULTS
from shardcast.file_fetch import FileJob, ShardcastError, StaleManifest
from shardcast.plan import Plan, Step, explain_no_path, plan_path
from shardcast.sources import ServerStats, TransferPolicy
from shardcast.store import DiskFullError, complete_dir_name, partial_dir_name
from shardcast.transfer import CHUNK_BYTES, ServerPool

log = logging.getLogger(__name__)

MAX_CHAIN_MANIFESTS = 64  # versions below the target whose manifests a plan may look at
MAX_CANDIDATES = 8  # listed versions tried, newest first, when no version is asked for


@dataclass
class PulledVersion:
    version: int
    path: Path
    manifest: PolicyManifest
    state: dict | None = None  # the weights in memory, when the pull made or loaded them (a delta path)
    wire_bytes: int = 0  # bytes this pull downloaded
    steps: list[str] = field(default_factory=list)  # e.g. ["held 41", "delta 42"]
    written: threading.Event = field(default_factory=lambda: _set(threading.Event()))  # `path` holds the weights
    write_error: BaseException | None = None

    def wait_written(self, timeout: float | None = None) -> Path:
        """`path`, once it holds the weights (with write_behind, the folder is written after the pull returns)."""
        if not self.written.wait(timeout):
            raise TimeoutError(f"version {self.version} is still being written to {self.path}")
        if self.write_error is not None:
            raise self.write_error
        return self.path


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


class ShardcastClient:
    """Pull signed versions of one run into `dest_root/v<version>` (`*.safetensors` + manifest.json).

    durable: fdatasync every file before the final rename. Off by default because a version folder left by
    an earlier process is re-checked (per-file digest, or the model hash) before it is trusted, so a power
    cut costs a re-check (at worst a re-download), never wrong weights. One client per `dest_root` at a time.
    keep_state: keep the last pulled weights in memory, as the base of the next delta (and for hot reload).
    write_behind: a version reached by deltas is written to its folder in the background, after `pull`
    returns its weights in memory (a worker reloads vLLM from those meanwhile); `PulledVersion.wait_written`
    waits for the folder. Measured for a 104M-parameter bf16 model: the write took 0.37-1.1 s of the pull.
    """

    def __init__(
        self,
        urls: list[str],
        public_key_b64: str,
        dest_root: Path,
        *,
        run_id: str,
        fallback_urls: list[str] = (),
        parallelism: int = DEFAULTS.client_parallelism,
        retries: int = DEFAULTS.client_retries,
        policy: TransferPolicy | None = None,
        keep_versions: int | None = None,
        keep_state: bool = True,
        write_behind: bool = False,
        durable: bool = False,
        shard_bytes: int = DEFAULTS.shard_bytes,
        delta_workers: int = DEFAULTS.delta_workers,
        on_progress: Callable[[str, str, int], None] | None = None,
        seed: int | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        self.dest_root = Path(dest_root)
        self.dest_root.mkdir(parents=True, exist_ok=True)
        self.keep_versions, self.keep_state, self.shard_bytes = keep_versions, keep_state, shard_bytes
        self.delta_workers, self.write_behind = delta_workers, write_behind and keep_state
        self._writer: threading.Thread | None = None
        self.pool = ServerPool(
            urls, public_key_b64, run_id=run_id, fallback_urls=fallback_urls, parallelism=parallelism, retries=retries,
            policy=policy, chunk_bytes=chunk_bytes, durable=durable, on_progress=on_progress, seed=seed,
        )
        self.run_id = run_id
        self._verified: dict[int, str] = {}  # version folders this instance verified or wrote -> model hash
        self._state: tuple[int, str, dict] | None = None  # (version, model hash, tensors) of the last pull
        self._lock = threading.Lock()

    @property
    def stats(self) -> dict[str, ServerStats]:
        return self.pool.stats

    def latest_version(self) -> int | None:
        """The newest version the relays list (the fallback servers' listing if no relay answers)."""
        listings = self.pool.list_versions() or self.pool.list_versions(fallback=True)
        versions = [max(v) for v in listings.values() if v]
        return max(versions) if versions else None

    def pull(self, version: int | None = None, model_hash: str | None = None) -> PulledVersion:
        """Fetch `version` (default: the newest one a server can prove with a valid manifest of this run);
        with `model_hash` (as the orchestrator announced it), only a manifest of that hash is taken."""
        with self._lock:
            self._join_writer()  # the previous version's folder is complete before this pull looks at the disk
            deadline = time.monotonic() + self.pool.policy.pull_deadline_s
            listings = self.pool.list_versions() or self.pool.list_versions(fallback=True)
            if version is not None:
                manifest = self.pool.fetch_manifest(version, prefer=[u for u, vs in listings.items() if version in vs],
                    model_hash=model_hash)
                return self._pull_manifest(manifest, listings, deadline)
            errors: list[str] = []

            def views():
                yield listings
                yield self.pool.list_versions(fallback=True)  # the origin's word too, if the relays' failed

            for listed in views():
                # A version no server can prove costs its listers their listing: a relay listing fake
                # versions above the real ones costs one manifest request, and the real newest is found.
                distrusted: set[str] = set()
                tried = 0
                for v in sorted({v for vs in listed.values() for v in vs}, reverse=True):
                    holders = [u for u, vs in listed.items() if v in vs and u not in distrusted]
                    if not holders:
                        continue
                    if tried >= MAX_CANDIDATES:
                        break
                    tried += 1
                    try:
                        manifest = self.pool.fetch_manifest(v, prefer=holders)
                    except ShardcastError as e:  # a lying server advertised it, or it was just deleted
                        errors.append(str(e))
                        distrusted.update(holders)
                        continue
                    return self._pull_manifest(manifest, listed, deadline)
            if not errors:
                raise ShardcastError(f"no server lists any version (reachable: {sorted(listings)} of {self.pool.urls})")
            raise ShardcastError("no listed version could be fetched: " + " | ".join(errors[:5]))

    def _pull_manifest(self, manifest: PolicyManifest, listings: dict[str, list[int]],
        deadline: float) -> PulledVersion:
        pulled = self._get(manifest, listings, deadline)
        self._prune(keep=pulled.version)
        return pulled

    # -- the path ---------------------------------------------------------------------------------------

    def _get(self, target: PolicyManifest, listings: dict[str, list[int]], deadline: float) -> PulledVersion:
        t0 = time.perf_counter()
        held = self._held()
        # The common case, a delta from what is held (or nothing to do), needs no other manifest: the chain's
        # manifests are fetched only when that is not there, or on a re-plan.
        manifests: dict[int, PolicyManifest] | None = None
        quick = plan_path(target, {}, {v: h for v, (h, _) in held.items()})
        if quick is not None and quick.start is not None and len(quick.steps) <= 1:
            manifests = {target.version: target}
        avoid: set[tuple[int, str]] = set()
        for attempt in range(4):
            if manifests is None or (attempt and len(manifests) == 1):
                manifests = self._chain_manifests(target, held, listings)
            plan = plan_path(target, manifests, {v: h for v, (h, _) in held.items()}, avoid)
            if plan is None:
                raise ShardcastError(explain_no_path(target, manifests, {v: h for v, (h, _) in held.items()}))
            try:
                pulled = self._execute(target, plan, manifests, listings, held, deadline)
            except _Replan as e:
                log.warning("re-planning version %d: %s", target.version, e)
                if e.drop_held is not None:
                    held.pop(e.drop_held, None)
                    self._verified.pop(e.drop_held, None)  # its folder is re-checked before any later use
                if e.reheld is not None:
                    held[e.reheld[0]] = (e.reheld[1], "disk")
                if e.avoid is not None:
                    avoid.add(e.avoid)
                continue
            except StaleManifest as e:  # a step's manifest was re-published: read the chain's manifests again
                if e.version == target.version:
                    raise  # the target's own manifest: the caller asks for it again
                log.warning("re-planning version %d: %s", target.version, e)
                manifests = None
                continue
            seconds = time.perf_counter() - t0
            log.info(
                "pulled version %d via %s: %.2f MB on the wire (full %.2f MB) in %.2fs",
                target.version, " > ".join(pulled.steps), pulled.wire_bytes / 1e6, target.full_bytes / 1e6, seconds,
                extra={"version": target.version},
            )
            return pulled
        raise ShardcastError(f"version {target.version}: every path failed")

    def _execute(self, target, plan: Plan, manifests, listings, held, deadline) -> PulledVersion:
        final = self.dest_root / complete_dir_name(target.version)
        steps = [f"held {plan.start[0]}"] if plan.start else []
        if not plan.steps:  # held already
            state = self._base(plan.start, held, manifests, need_state=False)
            return PulledVersion(target.version, final if final.is_dir() else self._write(target, state), target,
                state, 0, steps)
        # Every file of the path at once (deltas are small; an anchor's shards are many).
        jobs = []
        for step in plan.steps:
            manifest = manifests.get(step.version) or target
            folder = staging_folder(self.dest_root, manifest)
            holders = frozenset(u for u, vs in listings.items() if step.version in vs) or None
            jobs += [FileJob(step.version, f, folder, holders, manifest.created_at) for f in step.files
                if not already_verified(folder / f.name, f)]
        try:
            check_space(self.dest_root, target, plan, jobs)
            self.pool.download_files(jobs, deadline=deadline)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            for step in plan.steps:  # free the space; nothing half-written stays
                shutil.rmtree(self.dest_root / partial_dir_name(step.version), ignore_errors=True)
            raise e if isinstance(e, DiskFullError) else DiskFullError(errno.ENOSPC,
                f"no space left on device under {self.dest_root}") from None
        wire = sum(j.entry.size for j in jobs)
        first, rest = plan.steps[0], list(plan.steps[1:])
        if first.delta is None:  # a full download: a complete version folder of its own
            m = manifests.get(first.version) or target
            finish_full(self.dest_root, m, self.pool.durable)
            self._pulled(m.version, m.model_hash)
            steps.append(f"full {first.version}")
            if not rest:
                self._pulled(target.version, target.model_hash)
                return PulledVersion(target.version, final, target, None, wire, steps)
            start, state = (first.version, first.model_hash), None
        else:
            start, state = plan.start, None
            rest = list(plan.steps)
        state = self._base(start, held, manifests, need_state=True)
        from shardcast.delta import DeltaBaseMismatch, DeltaError

        try:
            state = assemble.apply_steps(state, start[1], rest, functools.partial(read_delta, self.dest_root),
                self.delta_workers)
        except DeltaBaseMismatch as e:
            raise self._bad_base(start, f"held version {start[0]} is not the base it claims: {e}") from None
        except DeltaError as e:
            # The delta's bytes are the signed ones, so a first step that does not yield its signed result
            # had a wrong base: stop trusting the held weights. A later step's base was checked: avoid it.
            bad: Step = e.step  # type: ignore[attr-defined]
            if bad is rest[0]:
                raise self._bad_base(start, f"version {bad.version}'s delta did not yield its signed result "
                    f"from held {start[0]}: {e}") from None
            (self.dest_root / partial_dir_name(bad.version) / bad.delta.file).unlink(missing_ok=True)
            raise _Replan(f"delta {bad.delta.file} of version {bad.version}: {e}", avoid=(bad.version,
                bad.delta.file)) from None
        steps += [f"delta {s.version}" for s in rest]
        for s in rest:  # intermediate versions' delta files are spent
            if s.version != target.version:
                shutil.rmtree(self.dest_root / partial_dir_name(s.version), ignore_errors=True)
        if not self.write_behind:
            return PulledVersion(target.version, self._write(target, state), target, state, wire, steps)
        self._pulled(target.version, target.model_hash, state, on_disk=False)
        pulled = PulledVersion(target.version, final, target, state, wire, steps, written=threading.Event())
        self._writer = threading.Thread(target=self._write_behind, args=(pulled,), name="shardcast-write", daemon=True)
        self._writer.start()
        return pulled

    def _write_behind(self, pulled: PulledVersion) -> None:
        try:
            self._write(pulled.manifest, pulled.state)
        except BaseException as e:  # noqa: BLE001 - kept for wait_written; the weights stay in memory
            log.warning("could not write version %d to %s: %s", pulled.version, pulled.path, e)
            pulled.write_error = e
        finally:
            pulled.written.set()

    def _join_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _bad_base(self, start: tuple[int, str], why: str) -> "_Replan":
        """Held weights that are not what their hash says: weights in memory are dropped (the version's
        folder, if any, is then re-checked before use); a folder is dropped from this pull's plans."""
        if self._state is not None and self._state[:2] == start:
            self._state = None
            self._verified.pop(start[0], None)
            if start[0] in self._local_manifests:
                return _Replan(why, reheld=(start[0], self._local_manifests[start[0]].model_hash))
        return _Replan(why, drop_held=start[0])

    def _chain_manifests(self, target: PolicyManifest, held: dict, listings) -> dict[int, PolicyManifest]:
        """Manifests of the versions a path to `target` may pass: from the newest held version below it (or
        the target's anchor, if lower) up to it, at most MAX_CHAIN_MANIFESTS."""
        below = [v for v in held if v < target.version]
        lo = min(target.anchor_version, max(below) + 1) if below else target.anchor_version
        lo = min(max(lo, target.version - MAX_CHAIN_MANIFESTS), target.anchor_version)  # the anchor always
        # Always from the servers: a version held here may have been re-published (another model hash).
        out = self.pool.fetch_manifests(range(lo, target.version), listings)
        out[target.version] = target
        return out

    # -- what the client holds ----------------------------------------------------------------------------

    def _held(self) -> dict[int, tuple[str, str]]:
        """version -> (model hash, where): the weights in memory, and version folders on disk whose signed
        manifest checks out (their bytes are checked when a plan uses them)."""
        self._local_manifests: dict[int, PolicyManifest] = signed_folders(self.dest_root, self.pool.public_key,
            self.run_id)
        held: dict[int, tuple[str, str]] = {v: (m.model_hash, "disk") for v, m in self._local_manifests.items()}
        if self._state is not None:
            held[self._state[0]] = (self._state[1], "memory")
        return held

    def _base(self, start: tuple[int, str], held, manifests, need_state: bool) -> dict | None:
        """The weights of a held version: from memory, or its folder checked against its signed manifest."""
        v, h = start
        if self._state is not None and self._state[:2] == (v, h):
            return self._state[2]
        m = self._local_manifests.get(v) or manifests.get(v)
        folder = self.dest_root / complete_dir_name(v)
        if self._verified.get(v) == h:  # checked (or written) by this instance
            if not need_state:
                return None
            from shardcast.weights import load_version_dir

            return load_version_dir(folder)
        try:
            state = assemble.folder_state(folder, m, need_state=need_state)
        except assemble.FolderMismatch as e:
            staging = self.dest_root / partial_dir_name(v)
            shutil.rmtree(staging, ignore_errors=True)
            if m.full_shards:  # its own signed shards: keep the good ones (re-hashed) for the re-download
                os.rename(folder, staging)
            else:
                shutil.rmtree(folder, ignore_errors=True)
            raise _Replan(str(e), drop_held=v) from None
        self._pulled(v, h, state)
        return state

    # -- folders written and pruned (client_folders.py) ------------------------------------------------

    def _write(self, target: PolicyManifest, state: dict) -> Path:
        """Write weights reached by deltas as the folder `v<N>` (client_folders.write_version)."""
        final = write_version(self.dest_root, target, state, self.shard_bytes, self.pool.durable)
        self._pulled(target.version, target.model_hash, state)
        return final

    def _pulled(self, version: int, model_hash: str, state: dict | None = None, on_disk: bool = True) -> None:
        if on_disk:
            self._verified[version] = model_hash
        if state is not None and self.keep_state and (self._state is None or version >= self._state[0]):
            self._state = (version, model_hash, state)

    def _prune(self, keep: int) -> None:
        """Delete older version folders beyond `keep_versions` (never `keep`, the one just pulled)."""
        if self.keep_versions is None:
            return
        for v in prune_folders(self.dest_root, keep, self.keep_versions, self._writer):
            self._verified.pop(v, None)


class _Replan(Exception):
    def __init__(self, msg: str, drop_held: int | None = None, avoid: tuple[int, str] | None = None, reheld: tuple[int,
        str] | None = None):
        super().__init__(msg)
        self.drop_held, self.avoid, self.reheld = drop_held, avoid, reheld

