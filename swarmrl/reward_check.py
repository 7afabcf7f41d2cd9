"""A run's start-up check of its task and reward, in the verifier actors' own reward pools: the driver calls
`check_rewards` once the verifier pool is live and before any worker can get a lease; a reward that does not
load, or whose first call runs past the limits, stops the run with an error naming the reward and the fix
(verifier/reward_preflight.py). Every reward process of every actor has then made its first call.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from environments.registry import REWARD_ENTRY, reward_text
from swarmrl.config import RunConfig
from swarmrl.processes import RunFailed
from verifier.reward_preflight import PreflightResult, first_error
from verifier.reward_requests import RewardRequest

log = logging.getLogger(__name__)

# An episode's final state as Environment.final_state makes it for one model turn without a tool call: the
# stand-in an environment's reward is checked on (a plug-in may want more; then only its loading is checked).
STAND_IN_STATE = {"turns": 1, "tool_calls": 0}


def preflight_request(cfg: RunConfig) -> tuple[RewardRequest, str, bool]:
    """(request, reward name, strict): the run's reward on its task's first item, that item's answer as the
    completion. An environment run's reward is the environment's, on a stand-in final state (not strict)."""
    from orchestrator.data import load_items  # through environments.tasks.get_task, as the orchestrator makes them

    data = cfg.data
    try:
        items = load_items(data, cfg.seed)
    except Exception as exc:  # a task (plug-in) that does not load or make its prompts: whatever it raised, say so
        raise RunFailed(f"task {data.task!r} could not make its prompts: {type(exc).__name__}: {exc}") from exc
    if not items:
        raise RunFailed(f"task {data.task!r} made no prompts")
    item = items[0]
    env = cfg.orchestrator.environment
    if env:
        text = reward_text(item.answer, STAND_IN_STATE)
        return RewardRequest(REWARD_ENTRY, item, text, {"environment": env}), f"environment:{env}", False
    task, params = (data.reward, data.reward_params) if data.reward else (data.task, data.task_params)
    return RewardRequest(task, item, item.answer, dict(params)), task, True


def check_rewards(verifiers: Sequence[Any], cfg: RunConfig, timeout_s: float | None = None) -> list[PreflightResult]:
    """Check the run's reward in every verifier actor's reward pool (Ray handles of VerifierActor). Raises
    RunFailed with the first error. `timeout_s`: default, a load and a first call per process, with room."""
    import ray

    request, name, strict = preflight_request(cfg)
    limits = cfg.verifier.rewards
    timeout = timeout_s if timeout_s is not None else 2 * (limits.start_timeout_s + limits.time_limit_s) + 30
    futures = [v.check_rewards.remote(request, name, strict) for v in verifiers]
    try:
        results = ray.get(futures, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        why = f"no answer from the verifier actors within {timeout:g} s"
        raise RunFailed(f"the start-up check of reward {name!r}: {why}") from None
    except ray.exceptions.RayError as exc:
        why = str(exc).splitlines()[0][:300]
        raise RunFailed(f"the start-up check of reward {name!r} failed in a verifier actor: {why}") from None
    error = first_error(results)
    if error:
        raise RunFailed(error)
    return results
