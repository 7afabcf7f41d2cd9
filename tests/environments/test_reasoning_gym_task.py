"""reasoning-gym as a built-in task, for real at a tiny size: its prompts streamed through the task API and the
orchestrator's data path, scored by its own scorers in the sandboxed reward pool. Skipped without the extra."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'swarmrl[tasks]')")

from environments.reasoning_gym_task import CHUNK  # noqa: E402
from environments.tasks import TaskItem, get_task  # noqa: E402
from orchestrator.data import PromptSet, first_item  # noqa: E402
from swarmrl.config import RunConfig  # noqa: E402
from swarmrl.loading import load_config  # noqa: E402
from trainer.tiny_model import ALPHABET  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "reasoning-gym-cpu.toml"
SPELL3 = {"dataset": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 3}}


def test_the_stream_is_a_pure_function_of_seed_index_and_level():
    task = get_task("reasoning_gym", **SPELL3)
    assert task.stream and task.levels == 1
    items = [task.item(0, i) for i in (0, 1, CHUNK - 1, CHUNK, 10**9)]  # across instances, far out
    assert items == [task.item(0, i) for i in (0, 1, CHUNK - 1, CHUNK, 10**9)]
    assert [it.prompt for it in items] != [task.item(1, i).prompt for i in (0, 1, CHUNK - 1, CHUNK, 10**9)]
    for it in items:
        word = it.meta["entry"]["metadata"]["word"]
        assert it.prompt.endswith(f": {word}") and it.answer == word[::-1] and len(word) == 3
        assert it.meta["dataset"] == "spell_backward"


def test_scored_by_the_datasets_own_scorer_after_the_answer_tag_or_a_strip():
    tagged, stripped = get_task("reasoning_gym", **SPELL3), get_task("reasoning_gym", **SPELL3, answer_format="strip")
    item = tagged.item(0, 3)
    assert tagged.reward(item, f"let me think <answer>{item.answer}</answer>") == 1.0
    assert tagged.reward(item, item.answer) == 0.0  # no tag: no answer
    assert stripped.reward(item, f" {item.answer}\n") == 1.0
    assert stripped.reward(item, item.answer[:2] + "#") == pytest.approx(2 / 3)  # spell_backward: per letter
    broken = TaskItem("x", "q", "a", {"dataset": "spell_backward", "entry": {}})  # the scorer raises: 0, not an error
    assert stripped.reward(broken, "abc") == 0.0


def test_a_weighted_mix_and_a_curriculum():
    mix = get_task("reasoning_gym", datasets=[{"name": "chain_sum", "weight": 3}, {"name": "spell_backward"}])
    counts = Counter(mix.item(0, i).meta["dataset"] for i in range(800))
    assert set(counts) == {"chain_sum", "spell_backward"} and 2.2 < counts["chain_sum"] / counts["spell_backward"] < 4
    leveled = get_task("reasoning_gym", dataset="spell_backward", curriculum=True)
    assert leveled.levels == 5  # reasoning-gym's word_len levels 3, 5, 7, 9, 11
    lengths = {lv: {len(leveled.item(0, i, lv).answer) for i in range(200)} for lv in (0, 2)}
    assert lengths[0] == {3} and max(lengths[2]) == 7 and min(lengths[2]) == 3
    with pytest.raises(ValueError, match="level 5"):
        leveled.item(0, 0, 5)


def test_bad_parameters_name_the_problem():
    with pytest.raises(ValueError, match="did you mean"):
        get_task("reasoning_gym", dataset="spell_backwards")
    with pytest.raises(ValueError, match="sets \\['seed'\\]"):
        get_task("reasoning_gym", dataset="chain_sum", config={"seed": 3})
    with pytest.raises(ValueError, match="has no curriculum|none of"):
        get_task("reasoning_gym", dataset="acre", curriculum=True)


def test_the_cpu_config_runs_the_plug_in_path_for_real(tiny_model_dir):
    """configs/reasoning-gym-cpu.toml's data section: real prompts streamed and tokenized for the demo's
    character model, and scored in the verifier's sandboxed reward pool by the dataset's scorer."""
    from verifier.reward_config import RewardPoolConfig
    from verifier.reward_pool import RewardPool
    from verifier.reward_requests import RewardRequest, RewardStatus

    cfg = load_config(CONFIG, environ={}, model=RunConfig)
    stream = PromptSet.from_config(cfg.data, tiny_model_dir, cfg.seed)
    assert stream.streamed
    prompts = [stream.prompts[stream.order(p)] for p in range(16)]
    assert first_item(cfg.data, cfg.seed).prompt == prompts[0].item.prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for p in prompts:
        # The question reaches the character model with its spaces and quotes, less any capital: it has no token
        # for one ("How many" arrives as "ow many").
        text, meta = tok.decode(p.token_ids.tolist()), p.item.meta["entry"]["metadata"]
        (word,) = meta["span"]
        assert text.startswith("ow many times does the letter ") and f'"{meta["target_letter"]}"' in text
        assert text.endswith('"' + "".join(ch for ch in word if ch in ALPHABET) + '"?'), text
        assert not any(ch.isupper() for ch in text)
    items = [p.item for p in prompts]
    task, params = cfg.data.task, cfg.data.task_params
    requests = [RewardRequest(task, it, it.answer, params) for it in items]
    requests += [RewardRequest(task, it, it.answer[0] + "##", params) for it in items]
    # reasoning-gym's import (~2 s) is over this limit: it must happen when the process loads the task, not in a call.
    with RewardPool(RewardPoolConfig(processes=1, time_limit_s=0.5)) as pool:
        results = pool.score_many(requests)
    assert all(r.status is RewardStatus.ok for r in results), [r.message for r in results]
    assert [r.reward for r in results[:16]] == [1.0] * 16
    assert all(r.reward == pytest.approx(1 / 3) for r in results[16:])
