"""Task registry: prompts, rewards, records."""

from __future__ import annotations

import random

import pytest

from environments.tasks import TaskItem, get_task, safe_arithmetic
from trainer.tiny_model import ALPHABET


def test_toy_prompts_are_char_tokenizer_friendly_and_seeded():
    task = get_task("toy", digits=4)
    items = task.make_prompts(50, seed=3)
    assert items == task.make_prompts(50, seed=3)
    assert items != task.make_prompts(50, seed=4)
    for it in items:
        assert set(it.prompt) <= set(ALPHABET) and set(it.answer) <= set(ALPHABET)
        assert it.prompt == f"copy:{it.answer}=" and len(it.answer) == 4


def test_toy_reward_optimum_partial_credit_and_random_baseline():
    task = get_task("toy", digits=4)
    item = TaskItem("x", "copy:4821=", "4821")
    assert task.reward(item, "4821") == 1.0
    assert task.reward(item, "") == 0.0
    partial = [task.reward(item, c) for c in ("4820", "48", "4821999", "1111")]
    assert all(0 < r < 1 for r in partial)
    assert task.reward(item, "4820") > task.reward(item, "1111") > task.reward(item, "abcd")
    # A random model (uniform characters, EOS with prob 1/50) gets a small but nonzero, graded reward.
    rng = random.Random(0)
    rewards = []
    for _ in range(500):
        text = ""
        while len(text) < 16 and rng.random() > 1 / 50:
            text += rng.choice(ALPHABET)
        rewards.append(task.reward(item, text))
    mean = sum(rewards) / len(rewards)
    assert 0.01 < mean < 0.3
    assert len(set(round(r, 6) for r in rewards)) > 3


def test_countdown():
    task = get_task("countdown", num_numbers=3, max_number=10)
    items = task.make_prompts(30, seed=0)
    for it in items:
        assert set(it.prompt) <= set(ALPHABET)
        assert task.reward(it, it.answer) == 1.0  # the construction's own expression solves it
    it = TaskItem("c", "nums:2,3,4 target:14=", "2+3*4", {"nums": [2, 3, 4], "target": 14})
    assert task.reward(it, "3*4+2") == 1.0
    assert task.reward(it, "2+3+4") == pytest.approx(0.1)  # well-formed, wrong value
    assert task.reward(it, "4*4-2") == 0.0  # 4 used twice
    assert task.reward(it, "__import__('os')") == 0.0
    assert task.reward(it, "2**30") == 0.0
    assert task.reward(it, "1/0") == 0.0
    with pytest.raises(ValueError):
        safe_arithmetic("a+1")


def test_math_uses_math_verify():
    task = get_task("math")
    it = task.make_prompts(1, seed=0)[0]
    assert task.reward(it, f"the answer is {it.answer}") == 1.0
    assert task.reward(it, "the answer is \\boxed{" + it.answer + "}") == 1.0
    assert task.reward(it, f"{int(it.answer) + 1}") == 0.0
    frac = TaskItem("m", "half?", "\\frac{1}{2}")
    assert task.reward(frac, "$0.5$") == 1.0
    assert task.reward(frac, "garbage }}{{") == 0.0


def test_records_and_errors():
    task = get_task("toy")
    item = task.from_record({"prompt": "copy:12=", "answer": 12, "id": "a1", "level": 3})
    assert item.prompt_id == "a1" and item.answer == "12" and item.meta == {"level": 3}
    assert task.from_record({"prompt": "copy:12=", "answer": "12"}).prompt_id.startswith("toy-")
    with pytest.raises(ValueError, match="lacks"):
        task.from_record({"prompt": "x"})
    with pytest.raises(ValueError, match="lacks"):
        get_task("countdown").from_record({"prompt": "x", "answer": "1"})
    with pytest.raises(ValueError, match="unknown task"):
        get_task("nope")
    with pytest.raises(ValueError, match="bad parameters"):
        get_task("toy", colour="red")
    with pytest.raises(ValueError):
        get_task("toy", digits=0)
