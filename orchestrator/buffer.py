"""The buffer of verified samples: from an accepted submission to GRPO groups, and from the stored groups
to the trainer's batches. Owns the `sample_groups` table (one row per kept group: the unit the trainer
learns from) and the `samples` view (one row per sample, for audits and operators' SQL).

A lease holds whole groups (every sample of each of its prompts), so a group is complete when its
submission is accepted. Advantages come from `trainer.advantages.group_advantages` (their one owner).
Groups whose rewards are all equal carry no signal and are dropped here: online difficulty filtering.
So is every group with a completion that the trusted side could not score (its reward timed out, crashed
or was skipped): trained with a made-up 0 it would teach the policy a wrong advantage.

A group moves ready -> taken (by a batch) -> trained, or ready -> stale; a batch that goes back makes
its groups ready again. Which batch holds which groups, and when a batch counts as trained, is the
business of batches.py: a group is `trained` here only once its batch is committed (in the trainer's
durable checkpoint), so every accepted sample is trained exactly once.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from orchestrator.db import Database
from protocol import staleness
from protocol.arrays import le_bytes
from protocol.batches import GROUP_ARRAYS, Batch, SampleGroup
from protocol.models import RolloutSubmission, TaskLease
from trainer.advantages import group_advantages, has_signal

SCHEMA = """
-- seq is a plain rowid (rows are never deleted, so it only grows); batch_id is indexed only once set.
-- Trained and stale groups keep their row (the audit trail: trained exactly once) without their arrays.
CREATE TABLE IF NOT EXISTS sample_groups (
    seq INTEGER PRIMARY KEY,
    submission_id TEXT NOT NULL,
    prompt_index INTEGER NOT NULL,
    num_samples INTEGER NOT NULL,
    sample_indices TEXT NOT NULL,   -- JSON list: each member's sample index within the group
    behaviour_version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,           -- ready | taken | trained | stale
    batch_id TEXT,
    advantages BLOB NOT NULL,       -- protocol.batches.GROUP_ARRAYS gives each array's layout
    rewards BLOB NOT NULL,
    completion_lengths BLOB NOT NULL,
    prompt_ids BLOB NOT NULL,
    completion_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    env_masks BLOB NOT NULL DEFAULT x''   -- multi-turn episodes only
);
CREATE INDEX IF NOT EXISTS sample_groups_by_status ON sample_groups (status, seq);
CREATE INDEX IF NOT EXISTS sample_groups_by_batch ON sample_groups (batch_id) WHERE batch_id IS NOT NULL;
CREATE VIEW IF NOT EXISTS samples AS
    SELECT g.submission_id || ':' || g.prompt_index || ':' || m.value AS sample_id, g.submission_id, g.prompt_index,
           CAST(m.value AS INTEGER) AS sample_index, g.behaviour_version, g.status, g.batch_id, g.seq AS group_seq
    FROM sample_groups g, json_each(g.sample_indices) m;
"""
# Samples ready or taken: the buffer's share of the untrained work behind the async bound.
BUFFERED_SAMPLES = "untrained:buffered_samples"
COUNTERS = ("groups_kept", "groups_dropped_zero_signal", "groups_dropped_unscored", "samples_dropped_stale",
    "samples_trained", "step")

GROUP_COLUMNS = ", ".join(SampleGroup.__dataclass_fields__)
INSERT_GROUP = (
    f"INSERT INTO sample_groups ({GROUP_COLUMNS}, num_samples, created_at, status) "
    f"VALUES ({', '.join('?' * (len(SampleGroup.__dataclass_fields__) + 2))}, 'ready')"
)
CLEARED_ARRAYS = ", ".join(f"{name}=x''" for name in ("completion_lengths", "prompt_ids", "completion_ids", "logprobs",
    "env_masks"))


@dataclass
class Groups:
    rows: list[SampleGroup]  # the groups with a learning signal, for the buffer
    dropped_zero_signal: int
    dropped_unscored: int = 0  # groups with a completion whose reward could not be computed

    @property
    def num_samples(self) -> int:
        return sum(g.num_samples for g in self.rows)


def build_groups(
    submission_id: str, sub: RolloutSubmission, lease: TaskLease, rewards: list[float], use_std: bool = True,
    behaviour_logprobs: list[np.ndarray] | None = None, unscored: list[bool] | None = None,
) -> Groups:
    """Every group with a learning signal, with its advantages, behaviour version and logprobs.

    `unscored` (per completion, submission order): True where the trusted reward could not be computed;
    such a completion's whole group is dropped, whatever its other rewards.

    `behaviour_logprobs` (per completion, submission order) are the verifier's tempered logprobs: the
    trusted behaviour logprobs. Without them (a submission that was not spot-checked) the worker's own
    raw logprobs stand in; the config allows that only where the two agree (temperature 1).

    Each array kind is made for all groups at once (one numpy call for the submission, then byte
    slices per group): a submission has many small groups, so per-group numpy calls would dominate."""
    comps = sub.completions
    if len(rewards) != len(comps):
        raise ValueError(f"{len(rewards)} rewards for {len(comps)} completions")
    if unscored is not None and len(unscored) != len(comps):
        raise ValueError(f"{len(unscored)} reward statuses for {len(comps)} completions")
    by_prompt: dict[int, list[int]] = {}
    for i, c in enumerate(comps):
        by_prompt.setdefault(c.prompt_index, []).append(i)
    prompts = sorted(by_prompt)
    k = len(by_prompt[prompts[0]])
    if any(len(m) != k for m in by_prompt.values()):  # admission.check_shape guarantees it for real submissions
        raise ValueError("every group of a submission must have the same number of samples")
    order = [i for p in prompts for i in by_prompt[p]]  # group by group, in submission order within one
    ordered = [comps[i] for i in order]
    group_rewards = np.asarray(rewards, dtype=np.float64)[order].reshape(len(prompts), k)
    advantages = group_advantages(group_rewards, use_std=use_std).astype(np.float64)  # all groups in one pass
    signal = has_signal(advantages).tolist()
    bad = {comps[i].prompt_index for i, u in enumerate(unscored or ()) if u}
    lengths = np.array([c.token_ids.size for c in ordered], dtype=np.int32)
    size = {name: np.dtype(dtype).itemsize for name, dtype in GROUP_ARRAYS.items()}
    ends = np.cumsum(lengths.reshape(len(prompts), k).sum(axis=1)).tolist()
    completion_ids = le_bytes(np.concatenate([c.token_ids for c in ordered]), GROUP_ARRAYS["completion_ids"])
    if behaviour_logprobs is not None:
        if len(behaviour_logprobs) != len(comps) or any(lp is None or lp.size != c.token_ids.size for lp,
            c in zip(behaviour_logprobs, comps)):
            raise ValueError("the verifier's behaviour logprobs do not match the completions")
        mu = [behaviour_logprobs[i] for i in order]
    else:
        mu = [c.logprobs if c.env_mask is None else _episode_logprobs(c) for c in ordered]
    logprobs = le_bytes(np.concatenate(mu), GROUP_ARRAYS["logprobs"])
    # Multi-turn: the env masks, so that the trainer learns only from the model's tokens (behaviour logprobs
    # cover the whole episode, the verifier's at environment positions too; the trainer masks them).
    episodes = any(c.env_mask is not None for c in ordered)
    if episodes:
        masks = le_bytes(np.concatenate([c.env_mask if c.env_mask is not None else np.zeros(c.token_ids.size, np.uint8)
            for c in ordered]), GROUP_ARRAYS["env_masks"])
    rows: list[SampleGroup] = []
    for g, (p, start, end) in enumerate(zip(prompts, [0, *ends], ends)):
        if not signal[g] or p in bad:
            continue
        rows.append(
            SampleGroup(
                submission_id,
                p,
                [c.sample_index for c in ordered[g * k : (g + 1) * k]],
                sub.policy_version,
                le_bytes(advantages[g], GROUP_ARRAYS["advantages"]),
                le_bytes(group_rewards[g], GROUP_ARRAYS["rewards"]),
                le_bytes(lengths[g * k : (g + 1) * k], GROUP_ARRAYS["completion_lengths"]),
                le_bytes(lease.prompts[p].token_ids, GROUP_ARRAYS["prompt_ids"]),
                completion_ids[start * size["completion_ids"] : end * size["completion_ids"]],
                logprobs[start * size["logprobs"] : end * size["logprobs"]],
                masks[start:end] if episodes else b"",
            )
        )
    return Groups(rows, len(prompts) - len(rows) - len(bad), len(bad))


def _episode_logprobs(c) -> np.ndarray:
    """An episode's logprobs cover its model positions: spread over all its tokens (0 where the environment
    wrote, which the trainer masks), the layout of the verifier's behaviour logprobs."""
    out = np.zeros(c.token_ids.size, dtype=np.float32)
    out[np.asarray(c.env_mask) == 0] = c.logprobs
    return out


class RolloutBuffer:
    def __init__(self, db: Database, max_staleness: int | None = None):
        self.db = db
        self.max_staleness = max_staleness
        self.room_freed: Callable[[], None] = lambda: None  # the lease book's long poll (room.RoomSignal)
        db.create(SCHEMA, counters=COUNTERS)
        with db.tx() as conn:
            # Taken groups stay taken over a restart: only the trainer knows whether it trained them
            # (Orchestrator.reconcile_trainer decides).
            buffered = conn.execute("SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE status IN "
                "('ready', 'taken')").fetchone()[0]
            db.set(conn, BUFFERED_SAMPLES, int(buffered))
        # Wakes a trainer waiting in `wait_for` once enough samples are ready (see `added`).
        self._changed = threading.Condition()
        self._ready = 0  # samples ready, as counted by the waiting trainer plus those added since
        self._want: int | None = None  # how many a waiting trainer waits for (None: nobody waits)

    # ---------------------------------------------------------------------------------------------
    # in: accepted groups

    def add(self, db: sqlite3.Connection, groups: Groups) -> None:
        """In the verdict's transaction: store the kept groups and count the dropped ones (whose prompts are
        done, like their lease: they hold no room under the async bound)."""
        now = time.time()
        Database.add(db, "groups_kept", len(groups.rows))
        Database.add(db, "groups_dropped_zero_signal", groups.dropped_zero_signal)
        Database.add(db, "groups_dropped_unscored", groups.dropped_unscored)
        db.executemany(
            INSERT_GROUP,
            [(g.submission_id, g.prompt_index, json.dumps(g.sample_indices), g.behaviour_version, g.advantages,
              g.rewards, g.completion_lengths, g.prompt_ids, g.completion_ids, g.logprobs, g.env_masks, g.num_samples,
              now) for g in groups.rows],
        )
        Database.add(db, BUFFERED_SAMPLES, groups.num_samples)

    def added(self, samples: int) -> None:
        """After the verdicts' commit: wake a waiting trainer once the samples it waits for are ready."""
        if samples:
            with self._changed:
                self._ready += samples
                if self._want is not None and self._ready >= self._want:
                    self._changed.notify_all()

    # ---------------------------------------------------------------------------------------------
    # out: batches for the trainer

    def depth(self) -> int:
        return int(self.db.one("SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE status='ready'")[0])

    def wait_for(self, n: int, wait_s: float, stop: threading.Event) -> None:
        """Wait up to wait_s until n samples are ready. The verification thread counts what it adds and
        wakes us only once n are ready (each wake-up costs a thread switch); every 0.5 s we recount
        from SQLite, so nothing is missed."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._ready = self.depth()
            while self._ready < n and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._want = n if self._want is None else min(self._want, n)
                if not self._changed.wait(min(left, 0.5)):
                    self._ready = self.depth()
            self._want = None

    def take(self, n: int, trainer_version: int | None = None, new_batch=None) -> Batch:
        """The oldest ready groups, whole, until they hold n samples (n exactly when n is a multiple of
        the group size, as RunConfig requires; otherwise up to one group more, so groups of another size
        from an earlier config never leave a batch short), marked as taken by a new batch id.

        Groups that the step starting at `trainer_version` would drop as stale are marked stale here and
        counted (`_drop_stale`), instead of travelling to the trainer.

        `new_batch(db, groups, samples) -> (batch_id, seq)` numbers the batch in the same transaction
        (batches.py); without it the batch gets a random id and no sequence (tests of the buffer alone)."""
        with self.db.tx() as db:
            dropped = 0
            if self.max_staleness is not None and trainer_version is not None:
                dropped = self._drop_stale(db, "status='ready'", (), trainer_version).num_dropped
                if dropped:
                    self.room_freed()
            # Ready groups are taken in seq order, so a batch is every ready group up to the last one it needs.
            last, total = None, 0
            for seq, size in db.execute("SELECT seq, num_samples FROM sample_groups WHERE status='ready' ORDER BY seq "
                "LIMIT ?", (max(1, n),)):
                last, total = seq, total + size
                if total >= n:
                    break
            if last is None:
                return Batch(f"B{secrets.token_hex(6)}", [], dropped)
            seqs = [r[0]
                for r in db.execute("SELECT seq FROM sample_groups WHERE status='ready' AND seq<=? ORDER BY seq",
                (last,))]
            batch_id, batch_seq = new_batch(db, seqs, total) if new_batch else (f"B{secrets.token_hex(6)}", 0)
            db.execute("UPDATE sample_groups SET status='taken', batch_id=? WHERE status='ready' AND seq<=?",
                (batch_id, last))
            rows = db.execute(f"SELECT {GROUP_COLUMNS} FROM sample_groups WHERE batch_id=? ORDER BY seq", (batch_id,
                )).fetchall()
        return Batch(batch_id, [SampleGroup(r[0], r[1], json.loads(r[2]), *r[3:]) for r in rows], dropped, batch_seq)

    def commit(self, db: sqlite3.Connection, batch_id: str, trained_from_version: int) -> dict[int, int]:
        """In the commit's transaction: the step that started at `trained_from_version` trained the batch.
        Marks its groups trained and returns their staleness (version gap -> samples); committing a batch
        that is not taken (twice, or unknown) changes nothing and returns {}.

        Groups the step dropped as too stale are marked stale, not trained, so the table says exactly what the
        weights saw. The tally is made here from the stored groups and the step's start version, by the rule
        the trainer's step uses (`protocol.staleness.tally`): after a crash that is all a batch is settled by."""
        taken = db.execute("SELECT 1 FROM sample_groups WHERE batch_id=? AND status='taken' LIMIT 1", (batch_id,))
        if taken.fetchone() is None:
            return {}
        tally = self._drop_stale(db, "batch_id=? AND status='taken'", (batch_id,), trained_from_version)
        db.execute(f"UPDATE sample_groups SET status='trained', {CLEARED_ARRAYS} WHERE batch_id=? AND status='taken'",
            (batch_id,))
        for gap, n in tally.trained.items():
            Database.add(db, f"staleness:{gap}", n)
        Database.add(db, "samples_trained", tally.num_trained)
        Database.add(db, BUFFERED_SAMPLES, -tally.num_trained)
        self.room_freed()
        Database.add(db, "step", 1)
        return dict(tally.trained)

    def _drop_stale(
        self, db: sqlite3.Connection, where: str, args: tuple, start_version: int
    ) -> staleness.StalenessTally:
        """The staleness tally of the step starting at `start_version` over the groups `where` selects: the
        groups it drops are marked stale (their arrays cleared) and counted. The buffer's one use of the rule."""
        by_version = db.execute(
            f"SELECT behaviour_version, SUM(num_samples) FROM sample_groups WHERE {where} GROUP BY behaviour_version",
            args,
        ).fetchall()
        tally = staleness.tally(start_version, self.max_staleness, by_version)
        stale = [int(version) for version, _ in by_version if not tally.trains(version)]
        if stale:
            versions = ",".join("?" * len(stale))
            db.execute(
                f"UPDATE sample_groups SET status='stale', {CLEARED_ARRAYS} "
                f"WHERE {where} AND behaviour_version IN ({versions})",
                (*args, *stale),
            )
            Database.add(db, "samples_dropped_stale", tally.num_dropped)
            Database.add(db, BUFFERED_SAMPLES, -tally.num_dropped)
        return tally

    def give_back(self, db: sqlite3.Connection, batch_id: str) -> int:
        """In the caller's transaction: a batch went back untrained; its groups are ready again. Returns
        how many samples."""
        n = db.execute("SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE batch_id=? AND status='taken'",
            (batch_id,)).fetchone()[0]
        db.execute("UPDATE sample_groups SET status='ready', batch_id=NULL WHERE batch_id=? AND status='taken'",
            (batch_id,))
        return int(n)

    # ---------------------------------------------------------------------------------------------
    # audit views

    def status_counts(self) -> dict[str, int]:
        """Samples by buffer status (ready, taken, trained, stale)."""
        return {r["status"]: int(r["n"])
            for r in self.db.all("SELECT status, SUM(num_samples) AS n FROM sample_groups GROUP BY status")}

    def trained_sample_ids(self) -> list[str]:
        return [r[0]
            for r in self.db.all(
            "SELECT sample_id FROM samples WHERE status='trained' ORDER BY group_seq, sample_index")]

    def staleness_histogram(self) -> dict[str, int]:
        rows = self.db.all("SELECT key, value FROM meta WHERE key LIKE 'staleness:%'")
        return {r["key"].split(":", 1)[1]: int(float(r["value"])) for r in sorted(rows,
            key=lambda r: int(r["key"].split(":", 1)[1]))}
