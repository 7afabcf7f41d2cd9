"""Evaluation during training: held-out prompts, leased to the swarm as ordinary tasks pinned to the
version being evaluated, verified like any task, and never trained on. Owns the `eval_rounds`,
`eval_queue` and `eval_results` tables, the held-out split and the pass@k estimator.

How a round goes:
- When a version that is a multiple of `eval.every_steps` is announced (version 0 included), a round opens
  with every held-out prompt queued (`announce`).
- A worker whose lease request says it has exactly that version loaded gets the round's prompts before
  any training prompt (orchestrator/leases.py), in a lease pinned to that version (`generation_version`)
  and outside the async bound: eval samples never enter the buffer, so they take no room from training.
- Each held-out prompt's seeds are a keyed hash of (version, prompt), not of the lease: a worker that lets
  an eval lease go (to hope for better draws) gets the same draws back, so it cannot bias the result by
  choosing which leases come back. The prompts of an expired, released or rejected eval lease are queued
  again for the same version.
- An accepted submission's trusted rewards and completion lengths are recorded per prompt; the round is
  done when every prompt has them. A version left behind (below the oldest one a submission may still
  claim) before that closes the round as partial, with what it has.

`RunEvaluation` is the orchestrator's side: it opens rounds as versions are announced (orchestrator/
versions.py), closes those left behind, logs and exports the finished ones, and does nothing for a run
that does not evaluate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sqlite3
import time
from typing import Any

import numpy as np

from orchestrator import eval_leases
from orchestrator.config import DataConfig, EvalConfig, OrchestratorConfig
from orchestrator.data import DataError, Prompt, PromptSet
from orchestrator.db import Database
from orchestrator.versions import PolicyVersions
from protocol import staleness
from protocol.operator_models import EvalResult

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS eval_rounds (
    version INTEGER PRIMARY KEY,    -- the policy version evaluated: every eval lease of the round is pinned to it
    planned INTEGER NOT NULL,       -- held-out prompts
    k INTEGER NOT NULL,             -- samples per prompt
    status TEXT NOT NULL,           -- open | done | partial
    created_at REAL NOT NULL,
    finished_at REAL
);
-- held-out prompts of open rounds still to be leased (again, after an expired or rejected eval lease)
CREATE TABLE IF NOT EXISTS eval_queue (version INTEGER NOT NULL, prompt_index INTEGER NOT NULL, \
PRIMARY KEY (version, prompt_index)) WITHOUT ROWID;
-- per held-out prompt of a round: the trusted rewards and the lengths (tokens) of its k verified completions
CREATE TABLE IF NOT EXISTS eval_results (
    version INTEGER NOT NULL, prompt_index INTEGER NOT NULL, rewards TEXT NOT NULL, tokens TEXT NOT NULL,
    PRIMARY KEY (version, prompt_index)
) WITHOUT ROWID;
"""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c pass (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k). Exact integer binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class HeldOutPrompts(PromptSet):
    """The run's prompts with held-out ones appended: indices below `num_train` are the training prompts,
    which alone make the lease order; the others are only ever leased for evaluation."""

    def __init__(self, train: PromptSet, held_out: list[Prompt]):
        held_ids = {p.prompt_id for p in held_out}
        kept = [p for p in train.prompts if p.prompt_id not in held_ids]  # a prompt in both is held out
        if not kept:
            raise DataError("no training prompts left after holding out the evaluation prompts")
        self.train = train if len(kept) == len(train.prompts) else PromptSet(kept, train.seed, train.vocab_size)
        super().__init__(self.train.prompts + list(held_out), train.seed, train.vocab_size)
        self.dropped = dict(getattr(train, "dropped", {}))
        self.num_train = len(self.train.prompts)
        self.held_out = list(range(self.num_train, len(self.prompts)))

    def order(self, position: int) -> int:
        return self.train.order(position)


def hold_out(prompts: PromptSet, num: int, seed: int) -> HeldOutPrompts:
    """A seeded choice of `num` prompts held out of training (the same on every restart of the run); a stream's
    are made from a seed of their own (orchestrator.data.PromptStream.holding_out)."""
    if prompts.streamed:
        return prompts.holding_out(num)  # type: ignore[attr-defined,return-value]
    if num >= len(prompts):
        raise DataError(f"eval.num_prompts ({num}) must be below the number of prompts ({len(prompts)}): training "
            f"needs some")
    chosen = set(np.random.default_rng([seed, 0xE7A1]).choice(len(prompts), size=num, replace=False).tolist())
    return HeldOutPrompts(prompts, [p for i, p in enumerate(prompts.prompts) if i in chosen])


def evaluated_prompts(prompts: PromptSet, config: EvalConfig | None, eval_prompts: list[Prompt] | None) -> PromptSet:
    """The prompts a run leases: when it evaluates, with held-out prompts (from eval.path, or a seeded slice
    of the run's) that are never in the training order."""
    if config is None or not config.every_steps:
        return prompts
    if prompts.streamed:  # a stream has no end to hold prompts out of: they are made (or given) apart
        return prompts.holding_out(eval_prompts or config.num_prompts)  # type: ignore[attr-defined]
    return HeldOutPrompts(prompts, eval_prompts) if eval_prompts else hold_out(prompts, config.num_prompts,
        prompts.seed)


def held_out_data(data: DataConfig, config: EvalConfig) -> DataConfig | None:
    """Where held-out prompts of their own come from (eval.path and/or eval.split, read like the run's data),
    or None: a seeded slice of the run's prompts (`hold_out`)."""
    if not config.path and not config.split:
        return None
    if not (config.path or data.path):
        raise DataError("eval.split names a split of a dataset: set data.path or eval.path")
    return data.model_copy(update={"path": config.path or data.path, "split": config.split or data.split})


class EvalBook:
    def __init__(self, db: Database, prompts: HeldOutPrompts, config: EvalConfig, *, train_k: int,
        prompts_per_lease: int, seed_key: bytes):
        db.create(SCHEMA)
        self.db, self.prompts, self.config = db, prompts, config
        self.k = config.samples_per_prompt or train_k
        # An eval lease holds no more completions than a training one: the submission size cap holds.
        self.prompts_per_lease = max(1, prompts_per_lease * train_k // self.k)
        if prompts_per_lease * train_k < self.k:
            raise ValueError(f"eval.samples_per_prompt ({self.k}) is above a training lease's completions "
                f"({prompts_per_lease * train_k})")
        self._seed_key = seed_key
        self.pass_ks = sorted({k for k in [*config.pass_at, self.k] if 1 <= k <= self.k})

    def seeds(self, version: int, prompt_index: int) -> list[int]:
        """The k sample seeds of a held-out prompt in a round: a keyed hash of (version, prompt), so a
        re-issued prompt draws the same samples. The suffix is 12 bytes ("eval" + 4 + 4), training prompt
        instances' 22 ("train-instance" + 8, leases.sample_seeds): the two never share an input."""
        msg = self._seed_key + b"eval" + version.to_bytes(4, "little") + prompt_index.to_bytes(4, "little")
        words = hashlib.shake_128(msg).digest(8 * self.k)
        return (np.frombuffer(words, dtype="<u8") >> np.uint64(1)).tolist()

    # ---------------------------------------------------------------------------------------------
    # rounds (each call inside the caller's transaction)

    def announce(self, db: sqlite3.Connection, version: int) -> bool:
        """Open the round of a newly announced version, if it is one to evaluate. Idempotent."""
        every = self.config.every_steps
        if not every or version % every:
            return False
        opened = db.execute(
            "INSERT OR IGNORE INTO eval_rounds (version, planned, k, status, created_at) VALUES (?, ?, ?, 'open', ?)",
            (version, len(self.prompts.held_out), self.k, time.time()),
        ).rowcount == 1
        if opened:
            db.executemany("INSERT OR IGNORE INTO eval_queue (version, prompt_index) VALUES (?, ?)", [(version, i)
                for i in self.prompts.held_out])
        return opened

    def waiting(self, db: sqlite3.Connection, version: int) -> bool:
        return db.execute("SELECT 1 FROM eval_queue WHERE version=? LIMIT 1", (version,)).fetchone() is not None

    def take(self, db: sqlite3.Connection, version: int, n: int) -> list[int]:
        """Up to n queued held-out prompts of the round of `version`, for one eval lease."""
        rows = db.execute("SELECT prompt_index FROM eval_queue WHERE version=? ORDER BY prompt_index LIMIT ?",
            (version, n)).fetchall()
        db.executemany("DELETE FROM eval_queue WHERE version=? AND prompt_index=?", [(version, r[0]) for r in rows])
        return [int(r[0]) for r in rows]

    def give_back(self, db: sqlite3.Connection, version: int, indices: list[int]) -> None:
        """An eval lease ended without an accepted submission: its prompts wait again (same seeds)."""
        if self._status(db, version) == "open":
            db.executemany("INSERT OR IGNORE INTO eval_queue (version, prompt_index) VALUES (?, ?)", [(version, i)
                for i in indices])

    def record(self, db: sqlite3.Connection, version: int, per_prompt: dict[int, tuple[list[float],
        list[int]]]) -> bool:
        """Trusted rewards and completion lengths of an accepted eval submission. Returns True when this
        finished the round. A round already closed keeps the numbers it was closed with."""
        if self._status(db, version) != "open":
            return False
        db.executemany(
            "INSERT OR IGNORE INTO eval_results (version, prompt_index, rewards, tokens) VALUES (?, ?, ?, ?)",
            [(version, i, json.dumps(r), json.dumps(t)) for i, (r, t) in per_prompt.items()],
        )
        done = db.execute("SELECT COUNT(*) FROM eval_results WHERE version=?", (version,)).fetchone()[0]
        planned = db.execute("SELECT planned FROM eval_rounds WHERE version=?", (version,)).fetchone()[0]
        if done < planned:
            return False
        db.execute("UPDATE eval_rounds SET status='done', finished_at=? WHERE version=?", (time.time(), version))
        return True

    def close_left_behind(self, db: sqlite3.Connection, min_version: int, in_flight: set[int]) -> list[int]:
        """Rounds of versions below `min_version` (no submission may claim them any more) are closed as
        partial once none of their eval leases is still open or being verified (`in_flight`)."""
        rows = db.execute("SELECT version FROM eval_rounds WHERE status='open' AND version<?", (min_version,
            )).fetchall()
        closed = []
        for (version,) in rows:
            db.execute("DELETE FROM eval_queue WHERE version=?", (version,))
            if version not in in_flight:
                db.execute("UPDATE eval_rounds SET status='partial', finished_at=? WHERE version=?", (time.time(),
                    version))
                closed.append(int(version))
        return closed

    @staticmethod
    def _status(db: sqlite3.Connection, version: int) -> str | None:
        row = db.execute("SELECT status FROM eval_rounds WHERE version=?", (version,)).fetchone()
        return row[0] if row else None

    # ---------------------------------------------------------------------------------------------
    # results

    def result(self, version: int) -> EvalResult | None:
        rnd = self.db.one("SELECT * FROM eval_rounds WHERE version=?", (version,))
        if rnd is None:
            return None
        rows = self.db.all("SELECT rewards, tokens FROM eval_results WHERE version=?", (version,))
        return summarize(
            version, [(json.loads(r["rewards"]), json.loads(r["tokens"])) for r in rows], planned=rnd["planned"],
            k=rnd["k"], pass_ks=self.pass_ks, threshold=self.config.pass_threshold, complete=rnd["status"] == "done",
            finished_at=rnd["finished_at"],
        )

    def finished(self, after_version: int = -1) -> list[EvalResult]:
        """Closed rounds (done or partial) of versions above `after_version`, oldest first."""
        rows = self.db.all("SELECT version FROM eval_rounds WHERE status!='open' AND version>? ORDER BY version",
            (after_version,))
        return [r for (v,) in rows if (r := self.result(int(v))) is not None]

    def latest(self) -> EvalResult | None:
        row = self.db.one("SELECT MAX(version) FROM eval_rounds WHERE status!='open'")
        return self.result(int(row[0])) if row and row[0] is not None else None

    def open_rounds(self) -> int:
        return int(self.db.one("SELECT COUNT(*) FROM eval_rounds WHERE status='open'")[0])


def summarize(
    version: int, per_prompt: list[tuple[list[float], list[int]]], *, planned: int, k: int, pass_ks: list[int],
    threshold: float, complete: bool, finished_at: float | None = None,
) -> EvalResult:
    """avg@k (mean reward over all samples), pass@k per prompt averaged over prompts, mean completion length."""
    rewards = [r for rs, _ in per_prompt for r in rs]
    tokens = [t for _, ts in per_prompt for t in ts]
    pass_at: dict[str, float] = {}
    if per_prompt:
        for kk in pass_ks:
            scores = [pass_at_k(len(rs), sum(r >= threshold for r in rs), kk) for rs, _ in per_prompt if len(rs) >= kk]
            if scores:
                pass_at[str(kk)] = float(np.mean(scores))
    return EvalResult(
        policy_version=version, prompts=len(per_prompt), prompts_planned=planned, samples_per_prompt=k,
        avg_reward=float(np.mean(rewards)) if rewards else None, pass_at=pass_at,
        mean_completion_tokens=float(np.mean(tokens)) if tokens else None, complete=complete, finished_at=finished_at,
    )


def per_prompt_results(prompt_indices: list[int], completions: list[Any], rewards: list[float]) -> dict[int,
    tuple[list[float], list[int]]]:
    """Rewards and lengths of a submission's completions, by held-out prompt index (sample order)."""
    out: dict[int, tuple[list[float], list[int]]] = {i: ([], []) for i in prompt_indices}
    for c, r in sorted(zip(completions, rewards), key=lambda cr: (cr[0].prompt_index, cr[0].sample_index)):
        rs, ts = out[prompt_indices[c.prompt_index]]
        rs.append(float(r))
        ts.append(int(c.token_ids.size))
    return out


class RunEvaluation:
    """The orchestrator's side of evaluation. A run that evaluates (held-out prompts and an eval config)
    has an EvalBook, which the lease book leases from (`leases.evals`); every call is a no-op otherwise."""

    def __init__(self, db: Database, prompts: PromptSet, config: EvalConfig | None, orch: OrchestratorConfig, *,
                 leases: Any, versions: PolicyVersions, metrics: Any, finished: list[int]):
        self.db, self.leases, self.versions, self.metrics = db, leases, versions, metrics
        self.async_level = orch.async_level
        self.done = finished  # versions whose round a verdict finished or this closed, not yet logged
        self.book: EvalBook | None = None
        if (isinstance(prompts, HeldOutPrompts) or getattr(prompts, "held_out", None)) and config is not None:
            self.book = leases.evals = EvalBook(
                db, prompts, config, train_k=orch.samples_per_prompt, prompts_per_lease=orch.prompts_per_lease,
                seed_key=leases.seed_key,
            )

    def announced(self, old: int, new: int) -> None:
        """The current version moved from `old` to `new`: open the round of every newly announced version
        still generatable (several at once with mini_batches > 1; a version announced before a crash of this
        process again, idempotently)."""
        if self.book is None:
            return
        lo = max(staleness.min_policy_version(new, self.async_level), min(old + 1, new))
        with self.db.tx() as db:
            for v in range(lo, new + 1):
                if self.book.announce(db, v):
                    log.info("evaluation opened", extra={"policy_version": v,
                        "prompts": len(self.book.prompts.held_out)})
            self._close_left_behind(db)

    def housekeeping(self) -> None:
        if self.book is None:
            return
        with self.db.tx() as db:
            self._close_left_behind(db)
        self._log_finished()

    def _close_left_behind(self, db: sqlite3.Connection) -> None:
        assert self.book is not None
        min_version = staleness.min_policy_version(self.versions.current, self.async_level)
        for v in self.book.close_left_behind(db, min_version, eval_leases.versions_in_flight(db)):
            self.done.append(v)
            log.warning("evaluation closed partial: its version was left behind before every prompt was verified",
                extra={"policy_version": v})

    def _log_finished(self) -> None:
        """Evaluations finished since the last call: logged and exported to Prometheus."""
        book, done = self.book, self.done
        while book is not None and done:
            r = book.result(done.pop(0))
            if r is None:
                continue
            self.metrics.observe_eval(r)
            log.info("evaluation finished", extra={"policy_version": r.policy_version, "avg_reward": r.avg_reward,
                                                    "pass_at": r.pass_at,
                                                    "mean_completion_tokens": r.mean_completion_tokens,
                                                    "complete": r.complete})

    def finished(self, after_version: int = -1) -> list[EvalResult]:
        """Finished evaluations (held-out prompts, per policy version) of versions above `after_version`."""
        return self.book.finished(after_version) if self.book is not None else []

    def latest(self) -> EvalResult | None:
        return self.book.latest() if self.book is not None else None

    def open_rounds(self) -> int:
        return self.book.open_rounds() if self.book is not None else 0
