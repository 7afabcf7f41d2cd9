"""The environments on a byte-level BPE tokenizer whose tokens span several characters (tests/bpe_tokenizer.py):
a tool call's "?" inside a larger token ends the turn, the call is read from the turn's decoded text, and
the episode gives the same observation text, final state and reward as the same text under the char
tokenizer. The verifier's replay (verifier/episodes.py) reproduces it. No model."""

from __future__ import annotations

import re

import numpy as np
import pytest

from environments.base import model_turns
from environments.calculator import CALC_CHARS
from environments.registry import environment_for, get_environment
from environments.tasks import get_task, safe_arithmetic
from protocol.models import Completion, SamplingParams
from tests.bpe_tokenizer import make_bpe_tokenizer, multi_char, pieces
from trainer.tiny_model import EOS_ID, make_tokenizer
from verifier.episodes import check_episode, tool_calls
from verifier.reward_requests import RewardResult, RewardStatus

CHAR = make_tokenizer()
SAMPLING = SamplingParams(max_tokens=96)


@pytest.fixture(scope="module")
def bpe():
    tok = make_bpe_tokenizer()
    for task in ("countdown", "lookup"):  # the environments' prompts really are multi-character tokens
        for item in get_task(task).make_prompts(8, seed=1):
            ids = tok.encode(item.prompt, add_special_tokens=False)
            assert multi_char(tok, ids) and len(ids) < len(item.prompt) and tok.decode(ids) == item.prompt
    return tok


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def env_of(name: str, tok):
    return environment_for(name, tok, [tok.eos_token_id])


def countdown_item():
    return get_task("countdown").make_prompts(1, seed=2)[0]


def delimiter_calls(tok) -> list[tuple[str, int]]:
    """(text before it, token id) for tokens that hold "?" after calculator text and more text after it
    (")*7?\\n", "6?\\n"): the closing delimiter inside a larger token, with a prefix that makes the call a
    valid expression."""
    out = []
    for t in range(len(tok)):
        text = tok.decode([t])
        before, sep, after = text.partition("?")
        if not sep or not before or not after or not set(before) <= set(CALC_CHARS):
            continue
        for head in ("", "1", "(2+3", "(4*5"):
            try:
                safe_arithmetic(head + before)
            except ValueError:
                continue
            out.append((head + before, t))
            break
    return out


def play(env, item, turns: list[list[int]], seed: int = 0):
    """Model turns against the environment: (ids, mask, observations); asserts it ends after the last."""
    ids: list[int] = []
    mask: list[int] = []
    observations = []
    for k, turn in enumerate(turns):
        ids += turn
        mask += [0] * len(turn)
        obs = env.reply(item, ids, mask, seed)
        if k == len(turns) - 1:
            assert obs is None, "the episode should end after its last turn"
            break
        assert obs is not None, f"model turn {k} should be answered"
        observations.append(obs)
        ids += obs
        mask += [1] * len(obs)
    return ids, mask, observations


def completion(ids, mask) -> Completion:
    n_model = mask.count(0)
    finishes = ["stop"] * len(model_turns(np.array(mask)))
    return Completion(prompt_index=0, sample_index=0, token_ids=np.array(ids, np.int32), logprobs=np.full(n_model,
        -1.0, np.float32),
                      finish_reason="stop", proofs=[b"p"] * -(-n_model // 32), env_mask=np.array(mask, np.uint8),
                      turn_finish_reasons=finishes)


def replay(env, item, seed, c, eos: int):
    """The verifier's episode check, with the tool calls run here (the verifier runs them in its pool)."""
    tools = {k: RewardResult(0.0, RewardStatus.ok, output=type(env).run_tool(item, call, seed)) for k,
        call in tool_calls(env, c)}
    return check_episode(env, item, seed, c, SAMPLING, {eos}, tools)


# --------------------------------------------------------------------------------------------------


def test_every_token_that_holds_the_delimiter_stops_a_turn(bpe):
    env = env_of("calculator", bpe)
    holding = [t for t in range(len(bpe)) if "?" in bpe.decode([t])]
    assert env.stop_token_ids == holding and len(holding) > 5
    assert any(re.fullmatch(r".+\?.*", bpe.decode([t])) for t in holding)  # text before it: "6?\n", ")*7?\n"
    # The char tokenizer's are unchanged: "?" alone, through a bare encode or the tokenizer.
    assert env_of("calculator", CHAR).stop_token_ids == [CHAR.convert_tokens_to_ids("?")]
    assert get_environment("calculator", lambda s: enc(CHAR, s),
        [EOS_ID]).stop_token_ids == [CHAR.convert_tokens_to_ids("?")]


@pytest.mark.parametrize("split", ["canonical", "delimiter_inside", "one_token_per_char"])
def test_calculator_episode_matches_the_char_tokenizers(bpe, split):
    """A call, its observation, then the final answer: the same observation text, final state and reward
    as the same text under the char tokenizer, however the BPE turn splits the call."""
    item = countdown_item()
    if split == "delimiter_inside":
        call, ender = delimiter_calls(bpe)[0]
        head = call[: len(call) - len(bpe.decode([ender]).partition("?")[0])]
        turn = enc(bpe, head) + [ender]
        assert len(bpe.decode([ender])) > 1 and not bpe.decode([ender]).endswith("?")  # text after it, unread
    elif split == "canonical":
        call = "(2+3)*7"
        turn = enc(bpe, call + "?")
    else:
        call = "(2+3)*7"
        turn = [t for ch in call + "?" for t in enc(bpe, ch)]
    if split != "one_token_per_char":
        assert multi_char(bpe, turn), pieces(bpe, turn)
    answer = enc(bpe, item.answer) + [bpe.eos_token_id]
    env = env_of("calculator", bpe)
    ids, mask, obs = play(env, item, [turn, answer], seed=3)

    char_env = env_of("calculator", CHAR)
    char_ids, char_mask, char_obs = play(char_env, item, [enc(CHAR, call + "?"), enc(CHAR, item.answer) + [EOS_ID]],
        seed=3)
    value, _ = safe_arithmetic(call)
    assert bpe.decode(obs[0]) == CHAR.decode(char_obs[0]) == f"={int(value) if value == int(value) else value};"
    assert obs[0] == enc(bpe, bpe.decode(obs[0]))  # the environment's own encoding of its reply
    state = env.final_state(np.array(ids), np.array(mask))
    assert state == char_env.final_state(np.array(char_ids), np.array(char_mask)) == {"turns": 2, "tool_calls": 1}
    a, b = env.answer_span(np.array(mask))
    assert bpe.decode(ids[a:b], skip_special_tokens=True) == item.answer
    assert type(env).reward(item, bpe.decode(ids[a:b], skip_special_tokens=True), state) == 1.0

    # The verifier's replay: the same tool call, and the episode passes its checks.
    c = completion(ids, mask)
    assert tool_calls(env, c) == tool_calls(char_env, completion(char_ids, char_mask)) == [(0, call)]
    assert replay(env_of("calculator", make_bpe_tokenizer()), item, 3, c, bpe.eos_token_id) is None


def test_a_turn_that_goes_on_past_a_delimiter_token_is_refused(bpe):
    """vLLM stops on the first token that holds "?": a claimed turn that continues past one is forged."""
    item, env = countdown_item(), env_of("calculator", bpe)
    call, ender = delimiter_calls(bpe)[0]
    head = call[: len(call) - len(bpe.decode([ender]).partition("?")[0])]
    forged = enc(bpe, head) + [ender] + enc(bpe, item.answer) + [bpe.eos_token_id]
    f = replay(env, item, 0, completion(forged, [0] * len(forged)), bpe.eos_token_id)
    assert f is not None and f.code == "bad_termination"
    # A forged observation is found at its position.
    ids, mask, _ = play(env, item, [enc(bpe, head) + [ender], enc(bpe, item.answer) + [bpe.eos_token_id]])
    at = mask.index(1)
    forged_obs = list(ids)
    forged_obs[at] = enc(bpe, "=")[0] if bpe.decode([ids[at]]) != "=" else enc(bpe, ";")[0]
    f = replay(env, item, 0, completion(forged_obs, mask), bpe.eos_token_id)
    assert f is not None and f.code == "env_mismatch" and f.stats["position"] == at


def test_calculator_errors_on_text_outside_its_characters(bpe):
    item, env = countdown_item(), env_of("calculator", bpe)
    letters = enc(bpe, "what is 2+3?")  # letters: the call's text is "what is 2+3"
    ids = letters[: next(i for i, t in enumerate(letters) if "?" in bpe.decode([t])) + 1]
    assert bpe.decode(env.reply(item, ids, [0] * len(ids), seed=0)) == "=err;"
    past_vocab = enc(bpe, "2+3") + [len(bpe) + 5] + enc(bpe, "?")  # an id of the model's padded vocabulary
    assert bpe.decode(env.reply(item, past_vocab, [0] * len(past_vocab), seed=0)) == "=err;"
    ok = enc(bpe, "2+3?")
    assert bpe.decode(env.reply(item, ok, [0] * len(ok), seed=0)) == "=5;"


def test_lookup_episode_on_bpe_tokens(bpe):
    item, env = get_task("lookup", digits=4).make_prompts(1, seed=5)[0], env_of("lookup", bpe)
    enders = [t for t in env.stop_token_ids if len(bpe.decode([t])) > 1 and bpe.decode([t]).startswith("?")]
    assert enders, "the tokenizer should have tokens such as '?=' or '?\\n'"
    for call in ([enders[0]], enc(bpe, "?")):
        ids, mask, obs = play(env, item, [call, enc(bpe, item.answer) + [bpe.eos_token_id]], seed=1)
        assert bpe.decode(obs[0]) == f"{item.answer}=" and multi_char(bpe, obs[0])
        a, b = env.answer_span(np.array(mask))
        assert type(env).reward(item, bpe.decode(ids[a:b], skip_special_tokens=True), env.final_state(np.array(ids),
            np.array(mask))) == 1.0
        assert tool_calls(env, completion(ids, mask)) == [(0, "")]
        assert replay(env, item, 1, completion(ids, mask), bpe.eos_token_id) is None
