"""What the reward pool (verifier.reward_pool) is asked and what it answers: a `RewardRequest` (a task,
its item and a completion's text, or a tool call's) and, for each, a `RewardResult` with its status."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Hashable, Literal, Mapping, Sequence

from environments.tasks import TaskItem


class RewardStatus(str, Enum):
    """How a request came out; the pool's docstring (verifier.reward_pool) says when each is given."""

    ok = "ok"
    error = "error"
    timed_out = "timed_out"
    crashed = "crashed"
    skipped = "skipped"


@dataclass(frozen=True)
class RewardRequest:
    task: str  # a built-in task name ("toy", "countdown", "math") or a plug-in "module:function"
    item: TaskItem
    text: str  # the decoded completion
    params: Mapping[str, Any] = field(default_factory=dict)  # the task's parameters (kwargs for a plug-in)
    group: Hashable | None = None  # e.g. the submission id: the failure budget is per group
    # "reward": the call returns a reward in [0, 1]. "text": it returns a string (an environment's tool
    # output, environments.registry.tool_output), which comes back in RewardResult.output.
    returns: Literal["reward", "text"] = "reward"
    # The completion's token ids (its final EOS included): what a TRL-form reward gets as completion_ids
    # (verifier/trl_rewards.py); None: not known to the caller, passed on as None.
    completion_ids: Sequence[int] | None = field(default=None, compare=False)  # an array neither hashes nor compares


@dataclass(frozen=True)
class RewardResult:
    reward: float
    status: RewardStatus
    message: str = ""
    seconds: float = 0.0
    output: str = ""  # a "text" call's string, when its status is ok
    kind: str = ""  # why it is not ok, finer than the status: "load", "wall", "none", an exception's name...


def req_kind(r: RewardRequest) -> str:
    return "tool" if r.returns == "text" else "reward"
