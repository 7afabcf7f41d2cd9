"""The task plug-in API: what a task is to swarmrl. The built-in tasks (environments.tasks) and a user's own
(`data.task = "package.module:TaskClass"`, loaded by environments.task_plugins) are written on it.

A task lives on the trusted side only. It makes prompts, holds the trusted answer of each (in its TaskItem:
the answer and any metadata the reward needs; they never leave the trusted side), and scores a decoded
completion. Prompts come one of three ways, and a task writes the methods for the ways it supports:

- `item(seed, index, level)`: a procedural stream. The item must be a pure function of its arguments, so a
  restarted orchestrator makes the same prompt for the same index, and any number of leases get fresh prompts
  that nobody chose. `levels` > 1 declares difficulty levels that a curriculum moves between.
- `make_prompts(n, seed)`: a finite set (by default the stream's first n items at level 0).
- `from_record(record)`: rows of a dataset (`data.path`).

`reward(item, completion_text)` runs in the verifier's sandboxed reward pool, each process holding its own
instance made once with the same parameters (`data.task_params`): import slow libraries in `__init__` (or at
the top of the module), not in `reward`, whose time limit is per completion.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TaskItem:
    prompt_id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


def prompt_id(task: str, prompt: str) -> str:
    """A prompt's id from its text (the same prompt twice is one prompt in a finite set)."""
    return f"{task}-{hashlib.sha256(prompt.encode()).hexdigest()[:16]}"


def stream_rng(*key: Any) -> random.Random:
    """A Random seeded by a key such as (task name, seed, index): the same on every machine and every run of
    Python (a str seed is hashed with SHA-512, whatever PYTHONHASHSEED says)."""
    return random.Random(":".join(map(str, key)))


def stream_seed(*key: Any, bits: int = 32) -> int:
    """An integer seed derived from a key, for libraries that take one (reasoning-gym's datasets)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, key)).encode()).digest()[: bits // 8], "little")


class Task:
    """Subclass this; write `reward` and at least one way of making prompts (see the module's docstring)."""

    name = ""  # shown in logs and prompt ids; a plug-in without one is named by its class
    levels = 1  # difficulty levels 0 .. levels - 1 that `item` takes; a curriculum moves between them
    stream = False  # the default of data.stream: True makes prompts with `item` without end

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        """The stream's item at `index` (>= 0, unbounded) of the run's `seed`, at difficulty `level`."""
        raise NotImplementedError(f"task {self.name or type(self).__name__!r} has no item(seed, index, level): it "
                                  "cannot stream prompts")

    def make_prompts(self, n: int, seed: int) -> list[TaskItem]:
        """A finite set of n prompts; by default the stream's first n items at level 0."""
        if not writes(self, "item"):
            raise NotImplementedError(f"task {self.name or type(self).__name__!r} writes neither make_prompts(n, "
                                      "seed) nor item(seed, index, level): it makes no prompts (give data.path)")
        return [self.item(seed, i, 0) for i in range(n)]

    def reward(self, item: TaskItem, completion_text: str) -> float:
        """The trusted reward of one decoded completion, a float in [0, 1]."""
        raise NotImplementedError

    def from_record(self, record: dict) -> TaskItem:
        """A dataset row {"prompt": ..., "answer": ..., optional "prompt_id"/"id", anything else -> meta}."""
        if not isinstance(record, dict):
            raise ValueError(f"a task record must be an object, got {type(record).__name__}")
        missing = [k for k in ("prompt", "answer") if k not in record]
        if missing:
            raise ValueError(f"task record lacks {missing}: keys are {sorted(record)}")
        prompt, answer = record["prompt"], record["answer"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("task record 'prompt' must be a non-empty string")
        answer = str(answer)
        pid = str(record.get("prompt_id") or record.get("id") or prompt_id(self.name, prompt))
        meta = {k: v for k, v in record.items() if k not in ("prompt", "answer", "prompt_id", "id")}
        return TaskItem(pid, prompt, answer, meta)


def writes(task: Task | type[Task], method: str) -> bool:
    """Whether a task class writes `method` itself (or a base between it and Task does)."""
    cls = task if isinstance(task, type) else type(task)
    return getattr(cls, method, None) is not getattr(Task, method)
