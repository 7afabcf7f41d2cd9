"""The built-in tasks' prompts and rewards, and the verifier's replay of calculator episodes, with a byte-level
BPE tokenizer whose tokens span several characters (tests/bpe_tokenizer.py). No model: the episodes are not
spot-checked, so the verifier runs what needs none (turn ends, the environment's replay with its tool in the
sandboxed pool, the reward on the decoded answer)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from environments.base import model_turns
from environments.registry import item_to_wire
from environments.tasks import get_task, safe_arithmetic
from protocol.models import Completion, RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from protocol.verdicts import VerdictStatus
from tests.bpe_tokenizer import make_bpe_tokenizer, multi_char, pieces
from trainer.tiny_model import EOS_ID, make_tokenizer
from verifier.config import VerifierConfig
from verifier.reward_config import RewardPoolConfig
from verifier.service import Verifier, VerifyJob, decode_completion

CHAR = make_tokenizer()
TASKS = {"toy": {"digits": 4}, "countdown": {}, "math": {}, "lookup": {"digits": 4}}
HASH0 = "a" * 64


@pytest.fixture(scope="module")
def bpe():
    tok = make_bpe_tokenizer()
    for name, params in TASKS.items():  # every task's prompts really are multi-character tokens
        for item in get_task(name, **params).make_prompts(8, seed=1):
            ids = tok.encode(item.prompt, add_special_tokens=False)
            assert multi_char(tok, ids) and len(ids) < len(item.prompt), (name, pieces(tok, ids))
    return tok


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def splits(tok, text: str) -> list[list[int]]:
    """Token ids that decode to `text`, split in different ways: the tokenizer's own encoding, one token per
    character, and two halves encoded apart at every cut (a model may sample any of them)."""
    out = [enc(tok, text), [t for ch in text for t in enc(tok, ch)]]
    out += [enc(tok, text[:k]) + enc(tok, text[k:]) for k in range(1, len(text))]
    unique = []
    for ids in out:
        if ids not in unique:
            unique.append(ids)
    return unique


def wrong_answer(name: str, item) -> str:
    if name == "countdown":
        return "-".join(map(str, item.meta["nums"]))  # well-formed over the numbers, another value
    if name == "math":
        return str(int(item.answer) + 1)
    return item.answer[:-1] + str((int(item.answer[-1]) + 1) % 10)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_prompts_round_trip_through_multi_character_tokens(bpe, name):
    for item in get_task(name, **TASKS[name]).make_prompts(20, seed=4):
        ids = enc(bpe, item.prompt)
        assert bpe.decode(ids) == item.prompt and len(ids) < len(item.prompt)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rewards_score_decoded_answers_however_they_are_split(bpe, name):
    task = get_task(name, **TASKS[name])
    eos = {bpe.eos_token_id}
    multi = 0
    for item in task.make_prompts(6, seed=4):
        wrong = wrong_answer(name, item)
        if name == "countdown" and task.reward(item, wrong) == 1.0:
            continue
        for text, want in ((item.answer, 1.0), (wrong, None)):
            ways = splits(bpe, text)
            multi += sum(bool(multi_char(bpe, ids)) for ids in ways)
            char_text = decode_completion(CHAR, {EOS_ID}, np.array(enc(CHAR, text) + [EOS_ID]))
            char_reward = task.reward(item, char_text)
            for ids in ways:
                for tail in ([bpe.eos_token_id], []):  # ended on EOS, or on the length cap
                    got = decode_completion(bpe, eos, np.array(ids + tail))
                    assert got == text, (pieces(bpe, ids), got)
                    reward = task.reward(item, got)
                    assert reward == char_reward, (name, text, pieces(bpe, ids))
                    assert reward == 1.0 if want == 1.0 else reward < 1.0
    assert multi >= 6, "answers should be split into multi-character tokens too"


# --------------------------------------------------------------------------------------------------
# The verifier's replay of calculator episodes on BPE tokens.


def completion(pi: int, ids, mask) -> Completion:
    n_model = mask.count(0)
    finishes = ["stop"] * len(model_turns(np.array(mask)))
    return Completion(prompt_index=pi, sample_index=0, token_ids=np.array(ids, np.int32), logprobs=np.full(n_model,
        -1.0, np.float32),
                      finish_reason="stop", proofs=[b"p"] * -(-n_model // 32), env_mask=np.array(mask, np.uint8),
                      turn_finish_reasons=finishes)


def episode(turns: list[list[int]], observations: list[list[int]]) -> tuple[list[int], list[int]]:
    """Model turns with the observations between them, as a worker submits them."""
    ids: list[int] = []
    mask: list[int] = []
    for k, turn in enumerate(turns):
        ids += turn
        mask += [0] * len(turn)
        if k < len(observations):
            ids += observations[k]
            mask += [1] * len(observations[k])
    return ids, mask


def test_the_verifier_replays_bpe_calculator_episodes_and_scores_them(bpe, tmp_path):
    """Honest episodes (a call closed inside the token ")*7?\n", one closed by "?" after multi-character
    tokens, one without a call) are accepted by a verifier that loads the tokenizer from the model folder,
    with the calculator's trusted tool runs and the countdown rewards of the decoded answers; a forged tool
    result is rejected."""
    bpe.save_pretrained(tmp_path)
    items = get_task("countdown").make_prompts(3, seed=8)
    # A token such as ")*7?\n": the call "(2+3)*7" closes inside it, with text after the "?".
    ender = next((t for t in range(len(bpe)) if re.fullmatch(r"\)\*\d\?.+", bpe.decode([t]), re.S)), None)
    assert ender is not None, "the tokenizer should have tokens such as ')*7?\\n'"
    value, _ = safe_arithmetic("(2+3" + bpe.decode([ender]).partition("?")[0])
    seeds = [11, 12, 13]
    wrong = wrong_answer("countdown", items[1])
    played = [
        # then right: 1.0
        episode([enc(bpe, "(2+3") + [ender], enc(bpe, items[0].answer) + [bpe.eos_token_id]], [enc(bpe,
        f"={int(value)};")]),
        episode([enc(bpe, "1+2?"), enc(bpe, wrong) + [bpe.eos_token_id]], [enc(bpe, "=3;")]),  # then a wrong answer
        episode([enc(bpe, items[2].answer) + [bpe.eos_token_id]], []),  # no tool call at all
    ]
    comps = [completion(pi, ids, mask) for pi, (ids, mask) in enumerate(played)]
    assert multi_char(bpe, comps[0].token_ids) and multi_char(bpe, comps[1].token_ids)
    prompts = [TaskPrompt(prompt_id=f"p{i}", token_ids=np.array(enc(bpe, it.prompt), np.int32), seeds=[s],
        env_item=item_to_wire(it))
               for i, (it, s) in enumerate(zip(items, seeds))]
    lease = TaskLease(lease_id="B1", prompts=prompts, samples_per_prompt=1, sampling=SamplingParams(temperature=1.0,
        max_tokens=96),
                      policy_version=0, min_policy_version=0, deadline=time.time() + 600, generation_version=0,
                      environment="calculator")

    def job(completions, sid):
        sub = RolloutSubmission(lease_id="B1", policy_version=0, model_hash=HASH0, completions=completions)
        return VerifyJob(submission_id=sid, submission=sub, lease=lease, items=items, task_name="countdown",
            expected_model_hash=HASH0)

    cfg = VerifierConfig(spot_check_rate={"new": 0.0}, rewards=RewardPoolConfig(processes=1))
    v = Verifier(cfg, lambda version: tmp_path, tmp_path)
    try:
        verdict = v.verify(job(comps, "honest"))
        assert verdict.status == VerdictStatus.accepted, verdict.rejections[:3]
        task = get_task("countdown")
        assert verdict.rewards == [1.0, task.reward(items[1], wrong), 1.0]
        assert verdict.rewards[1] < 1.0
        forged_ids = np.array(comps[0].token_ids)
        at = int(np.flatnonzero(np.asarray(comps[0].env_mask) == 1)[0]) + 1  # inside the tool's result
        forged_ids[at] = enc(bpe, "9")[0] if bpe.decode([int(forged_ids[at])]) != "9" else enc(bpe, "8")[0]
        forged = comps[0].model_copy(update={"token_ids": forged_ids.astype(np.int32)})
        verdict = v.verify(job([forged], "forged"))
        assert verdict.status == VerdictStatus.rejected and verdict.rejections[0].code == "env_mismatch"
    finally:
        v.close()
