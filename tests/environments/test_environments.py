"""The environments on token ids: their replies, limits and rewards, and the episode checks of the
verifier (verifier/episodes.py) on hand-made episodes. No model: the char tokenizer of trainer.tiny_model."""

from __future__ import annotations

import numpy as np
import pytest

from environments.base import EnvLimits, model_turns
from environments.calculator import CalculatorEnv
from environments.lookup import LookupEnv
from environments.registry import (
    ENVIRONMENTS,
    episode_reward,
    get_environment,
    item_from_wire,
    item_to_wire,
    reward_text,
)
from environments.tasks import get_task
from protocol.models import Completion, SamplingParams
from trainer.tiny_model import EOS_ID, make_tokenizer
from verifier.episodes import check_episode, tool_calls
from verifier.reward_requests import RewardResult, RewardStatus

TOK = make_tokenizer()


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def env(name: str):
    return get_environment(name, enc, [EOS_ID])


def lookup_item():
    return get_task("lookup", digits=3).make_prompts(1, seed=5)[0]


def run(e, item, turns: list[list[int]], seed: int = 0):
    """Play model turns against the environment; returns (ids, mask) and whether it ended after the last."""
    ids: list[int] = []
    mask: list[int] = []
    for k, turn in enumerate(turns):
        ids += turn
        mask += [0] * len(turn)
        obs = e.reply(item, ids, mask, seed)
        if obs is None:
            return ids, mask, True
        if k < len(turns) - 1:
            ids += obs
            mask += [1] * len(obs)
    return ids, mask, False


def test_lookup_answers_a_tool_call_with_the_hidden_digits_then_ends():
    e, item = env("lookup"), lookup_item()
    assert item.prompt == "ask:=" and item.answer not in item.prompt
    assert e.stop_token_ids == enc("?")
    obs = e.reply(item, enc("?"), [0], seed=1)
    assert TOK.decode(obs) == f"{item.answer}="
    ids, mask, ended = run(e, item, [enc("?"), enc(item.answer) + [EOS_ID]])
    assert ended and TOK.decode(ids, skip_special_tokens=True) == f"?{item.answer}={item.answer}"
    assert model_turns(np.array(mask)) == [(0, 1), (5, 9)]


def test_an_answer_without_a_tool_call_ends_the_episode():
    e, item = env("lookup"), lookup_item()
    assert e.reply(item, enc("12") + [EOS_ID], [0, 0, 0], seed=0) is None
    assert e.reply(item, enc("12345678"), [0] * 8, seed=0) is None  # hit the turn cap
    # The last allowed turn ends the episode even on a tool call.
    ids, mask, ended = run(e, item, [enc("?"), enc("?")])
    assert ended and len(model_turns(np.array(mask))) == LookupEnv.limits.max_turns


def test_replies_are_deterministic_and_need_a_model_turn_last():
    e, item = env("calculator"), get_task("countdown").make_prompts(1, seed=2)[0]
    a = e.reply(item, enc("3*5?"), [0, 0, 0, 0], seed=9)
    b = env("calculator").reply(item, enc("3*5?"), [0, 0, 0, 0], seed=9)
    assert a == b and TOK.decode(a) == "=15;"
    with pytest.raises(ValueError):
        e.reply(item, enc("?=1;"), [0, 1, 1, 1], seed=0)


@pytest.mark.parametrize("call,shown", [("2+3*4", "=14;"), ("7/2", "=3.5;"), ("1/0", "=err;"), ("abc", "=err;"),
    ("(((", "=err;"), ("", "=err;")])
def test_calculator_evaluates_arithmetic_and_reports_errors(call, shown):
    e, item = env("calculator"), get_task("countdown").make_prompts(1, seed=2)[0]
    ids = enc(call + "?")
    assert TOK.decode(e.reply(item, ids, [0] * len(ids), seed=0)) == shown


def test_calculator_reward_is_countdowns_on_the_last_turn():
    item = get_task("countdown").make_prompts(1, seed=2)[0]
    assert CalculatorEnv.reward(item, item.answer, {}) == 1.0
    assert episode_reward(reward_text(item.answer, {"turns": 2}), item, "calculator") == 1.0
    assert episode_reward(reward_text("zz", {}), item, "calculator") == 0.0


def test_lookup_reward_and_items_round_trip():
    item = lookup_item()
    assert LookupEnv.reward(item, item.answer, {}) == 1.0
    assert LookupEnv.reward(item, "", {}) < 0.3
    back = item_from_wire(item.prompt_id, item_to_wire(item))
    assert (back.prompt, back.answer, back.meta) == (item.prompt, item.answer, item.meta)


def test_limits_are_declared_and_checked():
    for cls in ENVIRONMENTS.values():
        assert cls.limits.max_turns >= 2 and cls.limits.max_turn_tokens <= cls.limits.max_episode_tokens
    with pytest.raises(ValueError):
        EnvLimits(max_turns=0, max_turn_tokens=4, max_episode_tokens=8)
    e = env("lookup")
    assert e.turn_cap(0) == 8 and e.turn_cap(20) == 4 and e.turn_cap(24) == 0


def test_a_tool_call_that_is_not_one_token_is_refused():
    with pytest.raises(ValueError, match="one token"):
        get_environment("lookup", lambda text: [1, 2], [EOS_ID])


# --------------------------------------------------------------------------------------------------
# The verifier's episode checks (no model): honest episodes pass, each forgery names its reason.

SAMPLING = SamplingParams(max_tokens=24)


def completion(ids, mask, finishes) -> Completion:
    n_model = mask.count(0)
    return Completion(prompt_index=0, sample_index=0, token_ids=np.array(ids, np.int32), logprobs=np.full(n_model,
        -1.0, np.float32),
                      finish_reason=finishes[-1], proofs=[b"p"] * -(-n_model // 32), env_mask=np.array(mask, np.uint8),
                      turn_finish_reasons=finishes)


def check(e, item, seed, c, sampling=None):
    """check_episode with the tool calls run in this process (the verifier runs them in its pool)."""
    tools = {k: RewardResult(0.0, RewardStatus.ok, output=type(e).run_tool(item, call, seed)) for k,
        call in tool_calls(e, c)}
    return check_episode(e, item, seed, c, sampling or SAMPLING, {EOS_ID}, tools)


def honest_lookup():
    item = lookup_item()
    ids, mask, _ = run(env("lookup"), item, [enc("?"), enc(item.answer) + [EOS_ID]])
    return item, ids, mask


def test_honest_episode_passes_the_episode_checks():
    item, ids, mask = honest_lookup()
    assert check(env("lookup"), item, 0, completion(ids, mask, ["stop", "stop"])) is None


def test_forgeries_are_found_with_their_position():
    e, (item, ids, mask) = env("lookup"), honest_lookup()
    forged = list(ids)
    forged[2] = enc("9" if TOK.decode([ids[2]]) != "9" else "8")[0]  # a friendlier tool result
    f = check(e, item, 0, completion(forged, mask, ["stop", "stop"]))
    assert f.code == "env_mismatch" and f.stats["position"] == 2
    # Truncated after the tool call, claimed complete.
    f = check(e, item, 0, completion(ids[:1], mask[:1], ["stop"]))
    assert f.code == "episode_incomplete"
    # The observation shortened by one token (the turn boundary moved into it).
    f = check(e, item, 0, completion(ids[:4] + ids[5:], mask[:4] + mask[5:], ["stop", "stop"]))
    assert f.code == "env_mismatch"
    # Environment tokens claimed as the model's: the tool call then sits inside a model turn.
    f = check(e, item, 0, completion(ids, [0] * len(ids), ["stop"]))
    assert f.code == "bad_termination"
    # A wrong turn finish reason.
    f = check(e, item, 0, completion(ids, mask, ["length", "stop"]))
    assert f.code == "bad_termination"
    # A model turn over its cap.
    item2 = lookup_item()
    long_turn = enc("12345678") + enc("9")
    f = check(e, item2, 0, completion(long_turn, [0] * 9, ["length"]))
    assert f.code == "bad_termination"


def test_a_tool_run_that_failed_on_the_trusted_side_rejects_the_episode():
    e, (item, ids, mask) = env("lookup"), honest_lookup()
    c = completion(ids, mask, ["stop", "stop"])
    assert tool_calls(e, c) == [(0, "")]  # lookup's tool takes no input
    timed_out = {0: RewardResult(0.0, RewardStatus.timed_out, "tool ran past the 2 s limit", 2.1)}
    f = check_episode(e, item, 0, c, SAMPLING, {EOS_ID}, timed_out)
    assert f.code == "tool_failed" and f.stats["turn"] == 0 and "timed_out" in f.message
    assert check_episode(e, item, 0, c, SAMPLING, {EOS_ID}, {}).code == "tool_failed"  # never run is no pass either
    # An episode over its bounds asks for no tool run at all (it is rejected without one).
    assert tool_calls(e, completion(ids * 3, mask * 3, ["stop"] * len(model_turns(np.array(mask * 3))))) == []


def test_the_calculator_reads_its_call_through_its_own_token_table():
    e = env("calculator")
    item = get_task("countdown").make_prompts(1, seed=3)[0]
    ids = enc("3*5?")
    assert e.pending_call(ids, [0] * 4) == "3*5"
    assert CalculatorEnv.run_tool(item, "3*5", 0) == "=15;"
    assert CalculatorEnv.run_tool(item, "3*\x00", 0) == "=err;"  # a token outside the table
    assert e.pending_call(enc("3*5") + [EOS_ID], [0] * 4) is None  # EOS ends the episode: no tool


def test_plugin_environments_are_loaded_by_module_and_class_name():
    from environments.registry import environment_class

    assert environment_class("environments.lookup:LookupEnv") is LookupEnv
    with pytest.raises(ValueError, match="not a subclass"):
        environment_class("environments.calculator:format_value")
    with pytest.raises(ValueError, match="cannot load"):
        environment_class("no_such_module_here:Env")
    with pytest.raises(ValueError, match="unknown environment"):
        environment_class("nope")
