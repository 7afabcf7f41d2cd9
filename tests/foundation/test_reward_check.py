"""The run's start-up check of its reward (swarmrl/reward_check.py): the request it makes from the run config.
The check in real reward pools: tests/verifier/test_reward_preflight.py; in a real verifier actor (Ray):
tests/orchestrator/test_ray.py."""

from __future__ import annotations

import pytest

from environments.registry import REWARD_ENTRY
from orchestrator.data import load_items
from swarmrl.config import RunConfig
from swarmrl.processes import RunFailed
from swarmrl.reward_check import preflight_request

MOD = "swarmrl_reward_check_plugin"


def config(**data) -> RunConfig:
    return RunConfig.model_validate({"data": data})


def test_the_request_is_the_runs_reward_on_its_tasks_first_item():
    cfg = config(task="countdown", task_params={"num_numbers": 3})
    request, name, strict = preflight_request(cfg)
    first = load_items(cfg.data, cfg.seed)[0]
    assert (request.task, dict(request.params), name, strict) == ("countdown", {"num_numbers": 3}, "countdown", True)
    assert request.item == first and request.text == first.answer

    cfg = config(task="toy", reward=f"{MOD}:exact", reward_params={"bonus": 1})
    request, name, _ = preflight_request(cfg)
    assert (request.task, dict(request.params), name) == (f"{MOD}:exact", {"bonus": 1}, f"{MOD}:exact")


def test_an_environment_run_checks_the_environments_reward_leniently():
    cfg = RunConfig.model_validate({"data": {"task": "lookup"}, "orchestrator": {"environment": "lookup"}})
    request, name, strict = preflight_request(cfg)
    assert request.task == REWARD_ENTRY and dict(request.params) == {"environment": "lookup"}
    assert name == "environment:lookup" and not strict


def test_a_task_that_cannot_make_its_prompts_stops_the_run():
    with pytest.raises(RunFailed, match="toy.*digits"):
        preflight_request(config(task="toy", task_params={"digits": 99}))


# The check in a real verifier actor (Ray): tests/orchestrator/test_ray.py, with that file's actor.
