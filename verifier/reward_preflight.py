"""The start-up check of a run's reward, in the reward pool that will score it.

A reward that cannot work used to show only as one log line while the run scored every completion 0 (a
plug-in whose folder was not on import_paths), or timed out on every completion (a reward that imported a
2 s library inside the function: each first call in a fresh process ran past the limit, the process was
killed, and its replacement started over). So before any worker gets a lease, `check` scores the task's
first item in every process of the pool (`RewardPool.warm`), each under the limits of a real completion.
Every process has then loaded the reward and made its first call; a result that is not a reward becomes an
error that names the reward, what happened and the fix. The driver stops the run with it
(swarmrl/reward_check.py runs this in each verifier actor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from verifier.reward_config import RewardPoolConfig
from verifier.reward_pool import RewardPool, RewardPoolError
from verifier.reward_requests import RewardRequest, RewardResult, RewardStatus

log = logging.getLogger(__name__)

VALUE_KINDS = frozenset({"not_a_number", "nan", "out_of_range", "not_a_list", "wrong_length"})


@dataclass(frozen=True)
class PreflightResult:
    """What one pool's check found: `error` is "" when every process scored the item."""

    error: str
    processes: int
    slowest_s: float  # the slowest first call, to compare with time_limit_s
    no_reward: int = 0  # processes where a TRL reward answered None (no reward for the item: allowed)


def check(pool: RewardPool, request: RewardRequest, reward_name: str, strict: bool = True) -> PreflightResult:
    """Score `request` once in every process of `pool` and judge the results. `strict` False: the request's
    text is made up (an environment's reward on a stand-in final state), so only a reward that does not load,
    runs past a limit or kills its process is an error; one that raises on it is logged."""
    try:
        results = pool.warm(request)
    except RewardPoolError as exc:  # a reward process that loads it cannot even start
        return PreflightResult(f"reward {reward_name!r} failed its start-up check: {exc}", pool.config.processes, 0.0)
    slowest = max((r.seconds for r in results), default=0.0)

    def excused(r: RewardResult) -> bool:
        return not strict and r.status is RewardStatus.error and r.kind not in ("load", "none")

    for r in filter(excused, results):
        log.warning("start-up check of %s on a stand-in episode: %s (not an error: its input was made up)",
                    reward_name, r.message)
    bad = [(i, r) for i, r in enumerate(results) if r.status is not RewardStatus.ok and r.kind != "none"]
    bad = [(i, r) for i, r in bad if not excused(r)]
    no_reward = sum(r.kind == "none" for r in results)
    if not bad:
        extra = {"reward": reward_name, "processes": len(results), "slowest_first_call_s": round(slowest, 4)}
        log.info("reward checked at start-up", extra={**extra, "no_reward": no_reward})
        return PreflightResult("", len(results), slowest, no_reward)
    i, r = bad[0]
    where = f"in reward process {i + 1} of {len(results)}" + (f" ({len(bad)} failed)" if len(bad) > 1 else "")
    error = f"reward {reward_name!r} failed its start-up check {where}: {r.message}. Fix: {fix_for(r, pool.config)}"
    return PreflightResult(error, len(results), slowest, no_reward)


def fix_for(r: RewardResult, config: RewardPoolConfig) -> str:
    """What an operator can do about a failed first call, by how it failed."""
    if r.status is RewardStatus.timed_out and r.kind == "load":
        return (f"its module took longer to import than verifier.rewards.start_timeout_s = {config.start_timeout_s:g} "
                "s; make the import faster or raise start_timeout_s")
    if r.status is RewardStatus.timed_out:
        cpu = r.kind == "cpu"
        limit = f"cpu_limit_s = {config.cpu_limit_s}" if cpu else f"time_limit_s = {config.time_limit_s:g} s"
        return (f"its first call in a fresh reward process ran past verifier.rewards.{limit}. Import slow libraries "
                "at the top of the plug-in's module, not inside the function: each process imports them once, when "
                "it loads the reward, outside a completion's limit. Or raise the limit")
    if r.status is RewardStatus.crashed:
        return (f"its process died ({r.kind}): over verifier.rewards.memory_limit_mb = {config.memory_limit_mb} "
                "(raise it), or a crash in native code the reward calls")
    if r.kind == "load" and ("ModuleNotFoundError" in r.message or "ImportError" in r.message):
        return (f"add the folder that holds its module to verifier.rewards.import_paths (now "
                f"{list(config.import_paths)}), or install its package where the verifier runs")
    if r.kind == "load":
        return "check data.reward (or data.task), its style (verifier.rewards.style) and its parameters"
    if r.kind in VALUE_KINDS:
        return ("a swarmrl-style reward returns a float in [0, 1]; a TRL-style one (verifier.rewards.style = "
                "\"trl\") a list with one finite float or None per completion")
    return "the reward raised on the task's first item, scored with the item's answer as the completion: fix the reward"


def first_error(results: Sequence[PreflightResult]) -> str:
    """The first pool's error of several (one per verifier actor), or ""."""
    return next((r.error for r in results if r.error), "")
