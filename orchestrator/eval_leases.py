"""Eval leases: the held-out prompts of one policy version's evaluation (orchestrator/evaluation.py), leased
to a worker that holds that version. They go before training prompts and outside the async bound (never
trained on, they take no room from training), pinned to the evaluated version, with the held-out prompts'
own seeds (evaluation.EvalBook.seeds). Otherwise built and stored like a training lease (leases.py): the
same id sequence, sampling and deadline rule (lease_deadlines.py), in the same `leases` table.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from typing import Any

from orchestrator.db import Database
from protocol import staleness
from protocol.models import TaskLease


def issue(
    book: Any, db: sqlite3.Connection, worker_id: str, max_prompts: int, current_version: int, version: int,
    now: float, request_id: str | None, token_id: str | None,
) -> TaskLease:
    """In the issuing transaction: an eval lease of the round of `version`. `book`: the leases.LeaseBook issuing
    it (not imported: leases.py imports this module)."""
    evals, config = book.evals, book.config
    assert evals is not None
    Database.add(db, "lease_seq", 1)
    seq = Database.read_int(db, "lease_seq")
    indices = evals.take(db, version, min(max_prompts, evals.prompts_per_lease))
    lease = TaskLease.model_construct(
        lease_id=f"L{seq:08d}-{secrets.token_hex(4)}",
        prompts=[book.task_prompt(i, evals.seeds(version, i)) for i in indices],
        samples_per_prompt=evals.k,
        sampling=config.sampling,
        policy_version=current_version,
        min_policy_version=min(version, staleness.min_policy_version(current_version, config.async_level)),
        deadline=book.deadlines.deadline(db, worker_id, len(indices), evals.k, now),
        generation_version=version,
        environment=config.environment,
    )
    db.execute(
        "INSERT INTO leases (lease_id, seq, worker_id, prompt_indices, body, issued_at, deadline, status, "
        "request_id, token_id, eval_version) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?, ?, ?)",
        (lease.lease_id, seq, worker_id, json.dumps(indices), lease.model_dump_json(), now, lease.deadline,
        request_id, token_id, version),
    )
    return lease


def versions_in_flight(db: sqlite3.Connection) -> set[int]:
    """Versions with eval leases open or submitted (not yet verified)."""
    return {int(r[0]) for r in db.execute(
        "SELECT DISTINCT eval_version FROM leases WHERE eval_version IS NOT NULL AND status IN ('open', 'submitted')")}
