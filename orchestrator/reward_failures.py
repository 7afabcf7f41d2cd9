"""Rewards the trusted side could not compute: a completion whose reward raised or gave no usable number
(error: a TRL reward's None, "no reward for this completion", is one), timed out, crashed its process or was
skipped (its submission had spent the pool's failure budget), `protocol.verdicts.UNSCORED_REWARD_STATUS`.

A verified completion's text is the policy's draw, not the worker's choice, so such a failure never charges
the worker (no strike, full credit); its GRPO group is dropped (orchestrator.buffer.build_groups) rather
than trained with a made-up reward of 0. What is counted here, per reward and kind, in the `meta` counters
(durable: /v1/status reads them, and /metrics starts from them after a restart), tells the operator which
reward code is failing on the policy's text.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from typing import Any

from orchestrator.db import Database
from protocol.models import TaskLease
from protocol.verdicts import UNSCORED_REWARD_STATUS, Verdict

PREFIX = "reward_failures:"  # meta key: reward_failures:<kind>:<reward> (a plug-in's name has a colon)
GROUPS_DROPPED = "groups_dropped_unscored"  # counted by the buffer, with the groups it keeps


def reward_name(task_name: str, lease: TaskLease) -> str:
    """What scored a lease's completions: the run's task or reward plug-in, or an environment's reward."""
    return f"environment:{lease.environment}" if lease.environment else task_name


def unscored(v: Verdict) -> list[bool] | None:
    """Per completion: whether its reward could not be computed; None when every reward was."""
    if v.reward_status is None:
        return None
    return [s in UNSCORED_REWARD_STATUS for s in v.reward_status]


def kinds(v: Verdict) -> dict[str, int]:
    """Unscored completions of a verdict, per kind."""
    return dict(Counter(s.value for s in v.reward_status or () if s in UNSCORED_REWARD_STATUS))


def record(db: sqlite3.Connection, reward: str, per_kind: dict[str, int]) -> None:
    """In the verdict's transaction, so a verdict applied twice cannot count twice."""
    for kind, n in per_kind.items():
        Database.add(db, f"{PREFIX}{kind}:{reward}", n)


def from_counters(counters: dict[str, float]) -> dict[str, dict[str, int]]:
    """reward -> kind -> completions, from the `meta` counters (Database.counters())."""
    out: dict[str, dict[str, int]] = {}
    for key, n in counters.items():
        if key.startswith(PREFIX):
            kind, _, reward = key[len(PREFIX):].partition(":")
            out.setdefault(reward, {})[kind] = int(n)
    return out


def observe(metrics: Any, reward: str, per_kind: dict[str, int], groups_dropped: int) -> None:
    """/metrics, after the verdict's commit."""
    for kind, n in per_kind.items():
        metrics.reward_failures.labels(reward, kind).inc(n)
    metrics.groups_dropped_unscored.inc(groups_dropped)


def seed_metrics(metrics: Any, counters: dict[str, float]) -> None:
    """At start: the Prometheus counters begin from the durable counts, so a restart does not hide them."""
    for reward, per_kind in from_counters(counters).items():
        observe(metrics, reward, per_kind, 0)
    metrics.groups_dropped_unscored.inc(int(counters.get(GROUPS_DROPPED, 0)))
