"""The client's plan: the cheapest way, in bytes on the wire, from what it holds to a version.

Nodes are (version, model hash): what the client holds (cost 0) and every version whose signed manifest
it fetched. Edges: a version's full shards (from nothing, cost = their bytes), and each of its deltas (from
the base version *with the base's model hash*, cost = the delta's bytes). A delta from a version the
client holds under another hash (a version re-published after a trainer restart) is no edge, so a delta is
never planned onto the wrong base. Edges only go up in version, so one pass in version order finds the
cheapest path (ties: fewer steps). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.manifests import DeltaRef, PolicyManifest, ShardEntry

FULL = "full"  # the edge name of a version's full shards in `avoid`


@dataclass(frozen=True)
class Step:
    version: int
    model_hash: str  # what this step must yield (the manifest's)
    files: tuple[ShardEntry, ...]  # to download
    delta: DeltaRef | None  # None: the full shards

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Plan:
    start: tuple[int, str] | None  # a held (version, hash) the path starts from; None: a full download
    steps: tuple[Step, ...]

    @property
    def wire_bytes(self) -> int:
        return sum(s.bytes for s in self.steps)


def plan_path(
    target: PolicyManifest,
    manifests: dict[int, PolicyManifest],
    held: dict[int, str],
    avoid: frozenset[tuple[int, str]] | set[tuple[int, str]] = frozenset(),
) -> Plan | None:
    """The cheapest path to `target` (a verified manifest), or None if there is none.

    manifests: verified manifests by version (target's included or not); held: version -> model hash of
    what the client holds; avoid: (version, file or FULL) edges known bad (e.g. a delta that failed).
    """
    manifests = {**manifests, target.version: target}
    best: dict[tuple[int, str], tuple[int, int, tuple[int, str] | None, Step | None]] = {}
    for v, h in held.items():
        best[(v, h)] = (0, 0, None, None)
    for v in sorted(manifests):
        if v > target.version:
            break
        m = manifests[v]
        key = (v, m.model_hash)
        if key in best:  # held already
            continue
        options = []
        full = m.full_shards
        if full and (v, FULL) not in avoid:
            options.append((sum(s.size for s in full), 1, None, Step(v, m.model_hash, tuple(full), None)))
        for d in m.deltas:
            base = best.get((d.base_version, d.base_model_hash))
            if base is None or (v, d.file) in avoid:
                continue
            f = m.file(d.file)
            options.append((base[0] + f.size, base[1] + 1, (d.base_version, d.base_model_hash), Step(v, m.model_hash,
                (f,), d)))
        if options:
            best[key] = min(options, key=lambda o: (o[0], o[1]))
    key = (target.version, target.model_hash)
    if key not in best:
        return None
    steps: list[Step] = []
    while True:
        _, _, prev, step = best[key]
        if step is None:  # a held node
            return Plan(key, tuple(reversed(steps)))
        steps.append(step)
        if prev is None:  # a full download
            return Plan(None, tuple(reversed(steps)))
        key = prev


def explain_no_path(target: PolicyManifest, manifests: dict[int, PolicyManifest], held: dict[int, str]) -> str:
    """Why no path exists: which chain versions no server could prove, and what the client holds."""
    lo = min([target.anchor_version, *[v for v in held if v < target.version]], default=target.anchor_version)
    missing = [v for v in range(lo, target.version) if v not in manifests]
    why = "no server has versions " + _ranges(missing) if missing else "no full version or usable delta chain is served"
    return (
        f"no way to version {target.version} (anchor {target.anchor_version}): {why}; "
        f"held here: {sorted(held)[-5:] or 'nothing'}"
    )


def _ranges(vs: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(vs):
        start = v if start is None else start
        if i + 1 == len(vs) or vs[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out[:8])
