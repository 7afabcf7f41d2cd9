"""Reward functions written for TRL's GRPOTrainer run unchanged as swarmrl rewards (`style = "trl"`), in the real
reward pool: dataset columns as keyword arguments, unbounded values, None as "no reward", non-finite values
refused; and GRPO's group advantage needs no [0, 1] range."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from environments.registry import REWARD_ENTRY, reward_text
from environments.tasks import TaskItem, get_task
from trainer.advantages import group_advantages
from verifier.reward_pool import RewardPool, RewardPoolConfig
from verifier.reward_preflight import check
from verifier.reward_requests import RewardRequest, RewardStatus
from verifier.trl_rewards import MAX_ABS_REWARD

MOD = "swarmrl_trl_user_rewards"
# As a TRL user writes them: batched, columns by name, **kwargs for the rest, unbounded.
USER_REWARDS = '''
import re

def format_reward(completions, **kwargs):
    return [1.0 if re.fullmatch(r"<answer>.*</answer>", c, re.S) else 0.0 for c in completions]

def accuracy_reward(completions, solution, **kwargs):
    rewards = []
    for completion, sol in zip(completions, solution):
        m = re.search(r"<answer>(.*)</answer>", completion)
        rewards.append(-1.0 if m is None else (2.0 if m.group(1).strip() == sol else -0.5))
    return rewards

def length_penalty(prompts, completions, completion_ids, **kwargs):
    return [-0.01 * len(ids) + 0.001 * len(p) for p, ids in zip(prompts, completion_ids)]

def math_only(completions, task_type, **kwargs):
    return [float(len(c)) if t == "math" else None for c, t in zip(completions, task_type)]

def answer_echo(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]

def nan_reward(completions, **kwargs):
    return [float("nan") for _ in completions]

def inf_reward(completions, **kwargs):
    return [float("-inf") for _ in completions]

def huge(completions, **kwargs):
    return [1e200 for _ in completions]

def two_values(completions, **kwargs):
    return [1.0, 2.0]

def scalar(completions, **kwargs):
    return 1.0

def text_value(completions, **kwargs):
    return ["1.0" for _ in completions]

reward_funcs = [format_reward, accuracy_reward]
'''
TEXTS = ["<answer>42</answer>", "<answer>41</answer>", "42", "<answer> 42 </answer>", ""]
MATH = TaskItem("q1", "What is 6*7?", "42", {"solution": "42", "task_type": "math"})
CODE = TaskItem("q2", "Print 42.", "print(42)", {"solution": "print(42)", "task_type": "code"})


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("trl-plugins")
    (d / f"{MOD}.py").write_text(USER_REWARDS)
    return d


@pytest.fixture(scope="module")
def user_module(plugin_dir):
    """The user's module in this process, called the way TRL calls it: for the expected values."""
    spec = importlib.util.spec_from_file_location(MOD, plugin_dir / f"{MOD}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pool(plugin_dir):
    with RewardPool(RewardPoolConfig(processes=2, style="trl", import_paths=[str(plugin_dir)])) as p:
        yield p


def trl_batch(fn, items, texts, ids):
    """What TRL's GRPOTrainer does: one call over the batch, every other column a list keyword argument."""
    columns = {k: [it.meta[k] for it in items] for k in items[0].meta} | {"answer": [it.answer for it in items]}
    return fn(prompts=[it.prompt for it in items], completions=texts, completion_ids=ids, **columns)


def requests(name, items, texts, ids=None, params=None):
    return [RewardRequest(f"{MOD}:{name}", it, t, params or {}, completion_ids=None if ids is None else i)
            for it, t, i in zip(items, texts, ids or [None] * len(texts))]


@pytest.mark.parametrize("name", ["format_reward", "accuracy_reward", "length_penalty", "answer_echo"])
def test_a_trl_reward_gives_what_trl_would_give_it_per_completion(pool, user_module, name):
    items = [MATH] * len(TEXTS)
    ids = [np.arange(3 + n, dtype=np.int32) for n in range(len(TEXTS))]  # as the verifier holds them, lengths differ
    results = pool.score_many(requests(name, items, TEXTS, ids))
    assert [r.status for r in results] == [RewardStatus.ok] * len(TEXTS), [r.message for r in results]
    assert [r.reward for r in results] == trl_batch(getattr(user_module, name), items, TEXTS, [a.tolist() for a in ids])


def test_a_list_of_reward_functions_is_summed_with_trl_weights(pool, user_module):
    items = [MATH] * len(TEXTS)
    fmt = trl_batch(user_module.format_reward, items, TEXTS, None)
    acc = trl_batch(user_module.accuracy_reward, items, TEXTS, None)
    plain = pool.score_many(requests("reward_funcs", items, TEXTS))
    weighted = pool.score_many(requests("reward_funcs", items, TEXTS, params={"reward_weights": [0.5, 3.0]}))
    assert [r.reward for r in plain] == [f + a for f, a in zip(fmt, acc)]
    assert [r.reward for r in weighted] == [0.5 * f + 3.0 * a for f, a in zip(fmt, acc)]
    assert min(r.reward for r in weighted) < 0 < 1 < max(r.reward for r in weighted)  # unbounded, and ok
    assert all(r.status is RewardStatus.ok for r in plain + weighted)


def test_none_is_no_reward_for_that_completion(pool):
    math, code = pool.score_many(requests("math_only", [MATH, CODE], ["abc", "abc"]))
    assert math.status is RewardStatus.ok and math.reward == 3.0
    assert code.status is RewardStatus.error and code.kind == "none" and code.reward == 0.0 and "None" in code.message


@pytest.mark.parametrize("name, kind", [
    ("nan_reward", "nan"), ("inf_reward", "out_of_range"), ("huge", "out_of_range"), ("two_values", "wrong_length"),
    ("scalar", "not_a_list"), ("text_value", "not_a_number"),
])
def test_values_that_are_not_rewards_are_refused(pool, name, kind):
    r = pool.score(requests(name, [MATH], ["<answer>42</answer>"])[0])
    assert r.status is RewardStatus.error and r.kind == kind and r.reward == 0.0 and name in r.message


@pytest.mark.parametrize("params, words", [({"scale": 2}, "reward_weights"),
                                           ({"reward_weights": [1.0]}, "2 finite numbers")])
def test_parameters_other_than_trl_weights_are_a_load_error(pool, params, words):
    r = pool.score(requests("reward_funcs", [MATH], ["x"], params=params)[0])
    assert r.status is RewardStatus.error and r.kind == "load" and words in r.message


def test_builtin_tasks_and_environment_rewards_keep_their_own_form(pool):
    toy = get_task("toy", digits=3).make_prompts(1, seed=0)[0]
    r = pool.score(RewardRequest("toy", toy, toy.answer, {"digits": 3}))
    assert r.status is RewardStatus.ok and r.reward == 1.0
    item = TaskItem("l", "ask:=", "123")
    episode = reward_text("123", {"turns": 2, "tool_calls": 1})
    r = pool.score(RewardRequest(REWARD_ENTRY, item, episode, {"environment": "lookup"}))
    assert r.status is RewardStatus.ok and r.reward == 1.0


def test_the_start_up_check_accepts_a_trl_reward_that_has_no_reward_for_the_first_item(pool):
    result = check(pool, requests("math_only", [CODE], [CODE.answer])[0], f"{MOD}:math_only")
    assert result.error == "" and result.no_reward == result.processes == 2
    result = check(pool, requests("nan_reward", [MATH], [MATH.answer])[0], f"{MOD}:nan_reward")
    assert "nan_reward" in result.error and "TRL-style" in result.error


def test_grpo_advantages_need_no_unit_interval():
    """The group advantage is the same for r and a*r + b (a > 0), with or without the std, up to the shift:
    a [0, 1] range buys nothing; and it stays finite for a group of 64 at opposite ends of the allowed range."""
    rng = np.random.default_rng(0)
    r = rng.random((8, 16))
    for a, b in [(7.5, -3.0), (0.5, 0.25), (1e6, 1e6)]:  # std >> eps (1e-6), which is all scaling moves
        np.testing.assert_allclose(group_advantages(a * r + b), group_advantages(r), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(group_advantages(a * r + b, use_std=False), a * group_advantages(r, use_std=False),
                                   rtol=1e-4, atol=1e-4 * a)
    extreme = np.array([MAX_ABS_REWARD, -MAX_ABS_REWARD] * 32)
    for use_std in (True, False):
        assert np.isfinite(group_advantages(extreme, use_std=use_std)).all()
