"""What became of every accepted sample of a run, counted from the run's own files: the exactly-once audit
that the fault test and the fault benchmark share.

    audit = audit_run(run_dir)      # after the run (or while it is stopped)
    audit.problems                  # [] when nothing was lost or trained twice

Sources, all durable: the latest checkpoint's lineage (the take sequences of every batch the final
weights include, `protocol.batches.Lineage`), and the orchestrator's SQLite file: the accepted
submissions (their verdicts), `sample_groups` (every kept group and its status), `batches` and
`batch_groups` (which groups each batch held, kept after a batch went back) and the `versions` table.

Per kept group: in exactly one lineage batch, trained once; in two or more, trained twice; in none, it is
dropped as stale, still buffered (ready, or taken by a batch that a reconciliation will give back), or,
if the orchestrator says it was trained, lost. Accepted samples that never became a group are the
zero-signal ones and those of groups with an unscored reward (checked against the counters of dropped groups).
"""

from __future__ import annotations

import json
import sqlite3
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from protocol.batches import Lineage
from trainer import checkpoint as ckpt


@dataclass
class Audit:
    accepted: int = 0  # samples of accepted submissions
    zero_signal: int = 0  # of those, in groups dropped for having no signal
    unscored: int = 0  # in groups dropped for a reward that timed out, crashed or was skipped
    trained_once: int = 0
    trained_twice: int = 0
    dropped_stale: int = 0
    buffered: int = 0  # ready, or taken by a batch the trainer's lineage does not hold
    lost: int = 0  # the orchestrator says trained, the weights do not hold it; or accepted and nowhere
    durable_not_committed: int = 0  # trained once, in the weights, not yet committed (the next start commits them)
    batches: dict[str, int] = field(default_factory=dict)  # batch status -> count
    versions: int = 0  # versions announced (0..N)
    versions_consecutive: bool = True
    checkpoint_version: int = 0
    metrics_versions_repeat: int = 0  # metrics.jsonl rows whose version is not above the previous one
    reconcile_conflicts: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _final_lineage(run_dir: Path) -> tuple[Lineage, int]:
    latest = ckpt.latest_checkpoint(ckpt.checkpoint_root(run_dir))
    if latest is None:
        return Lineage(), 0
    state = json.loads((latest / "trainer_state.json").read_text())
    return Lineage(state.get("data_cursor", {}).get("lineage")), int(state["step"])


def audit_run(run_dir: Path, db_path: Path | None = None) -> Audit:
    run_dir = Path(run_dir)
    lineage, ckpt_version = _final_lineage(run_dir)
    a = Audit(checkpoint_version=ckpt_version)
    con = sqlite3.connect(f"file:{db_path or run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        meta = {k: float(v) for k, v in con.execute("SELECT key, value FROM meta")}
        a.accepted = int(con.execute(
            "SELECT COALESCE(SUM(json_array_length(json_extract(verdict, '$.rewards'))), 0) FROM submissions WHERE "
            "status='accepted'"
        ).fetchone()[0])
        # Which lineage batches hold each group.
        in_lineage: dict[int, int] = {}
        for batch_seq, group_seq in con.execute("SELECT batch_seq, group_seq FROM batch_groups"):
            if batch_seq in lineage:
                in_lineage[group_seq] = in_lineage.get(group_seq, 0) + 1
        kept = 0
        for seq, status, size in con.execute("SELECT seq, status, num_samples FROM sample_groups"):
            kept += size
            n = in_lineage.get(seq, 0)
            if status == "stale":
                a.dropped_stale += size
            elif n == 1:
                a.trained_once += size
                if status != "trained":
                    a.durable_not_committed += size
            elif n > 1:
                a.trained_twice += size
            elif status in ("ready", "taken"):
                a.buffered += size
            else:
                a.lost += size
        a.batches = {s: int(n) for s, n in con.execute("SELECT status, COUNT(*) FROM batches GROUP BY status")}
        versions = [r[0] for r in con.execute("SELECT version FROM versions ORDER BY version")]
    finally:
        con.close()
    group_size = _group_size(run_dir)
    a.unscored = int(meta.get("groups_dropped_unscored", 0)) * group_size
    a.zero_signal = int(meta.get("groups_dropped_zero_signal", 0)) * group_size if group_size else a.accepted - kept
    a.lost += max(0, a.accepted - a.zero_signal - a.unscored - kept)
    a.reconcile_conflicts = int(meta.get("reconcile_conflicts", 0))
    a.versions = len(versions)
    a.versions_consecutive = versions == list(range(len(versions)))
    a.metrics_versions_repeat = _metric_repeats(run_dir)
    _judge(a, kept)
    return a


def _group_size(run_dir: Path) -> int:
    try:
        return int(tomllib.loads((run_dir / "config.toml").read_text())["orchestrator"]["samples_per_prompt"])
    except (OSError, KeyError, ValueError):
        return 0


def _metric_repeats(run_dir: Path) -> int:
    last, repeats = -1, 0
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            version = json.loads(line)["version"]
        except (ValueError, KeyError):
            continue
        repeats += version <= last
        last = max(last, version)
    return repeats


def _judge(a: Audit, kept: int) -> None:
    if a.trained_twice:
        a.problems.append(f"{a.trained_twice} samples trained twice")
    if a.lost:
        a.problems.append(f"{a.lost} samples lost")
    accounted = a.zero_signal + a.unscored + a.trained_once + a.trained_twice + a.dropped_stale + a.buffered + a.lost
    if a.accepted != accounted:
        a.problems.append(f"accepted {a.accepted} != zero-signal {a.zero_signal} + unscored {a.unscored} + kept {kept}")
    if not a.versions_consecutive:
        a.problems.append("the announced versions are not consecutive from 0")
    if a.versions and a.checkpoint_version < a.versions - 1:
        a.problems.append(f"version {a.versions - 1} was announced but the last checkpoint is version "
            f"{a.checkpoint_version}")
    if a.metrics_versions_repeat:
        a.problems.append(f"{a.metrics_versions_repeat} metrics.jsonl rows repeat a version")
    if a.reconcile_conflicts:
        a.problems.append(f"{a.reconcile_conflicts} reconciliation conflicts")
