"""The environment interface: a pure, deterministic function from an episode so far to its next reply.

An episode is the token ids after the prompt: model turns and environment observations interleaved, with
an env mask (1 = written by the environment, 0 = sampled by the model). After every model turn the
environment either appends an observation (token ids) or ends the episode. Its reply depends only on
(task item, episode token ids, env mask, the sample's seed) and the run's tokenizer: the worker runs it
between turns, the verifier replays it on the trusted side, and the two get the same token ids byte for
byte. A tokenizer is reached only through the functions given at construction: `encode` (text -> token
ids, no special tokens) for the environment's own strings and observations, and `decode` (token ids ->
text, the tokenizer's own decode of a whole span) for the text of a tool call; both sides load the same
tokenizer, so both read the same call from the same ids. (Without `decode`, as with a bare `encode`, token
texts come from encoding single characters: right for a char-level tokenizer only.)

How a tool call is delimited: by the text `tool_call` ("?" for the built-in ones), a token of its own that
may also arrive inside a longer token of a multi-character tokenizer ("5?", ")*7?\n"). Every token whose
text holds it is a stop token, so the turn ends on the first one; the call's text is the turn's decoded text
before the delimiter (what follows it in that token stays in the episode, unread).

The rules every environment shares live here (`reply` = `pending_call`, `run_tool`, `observation`); a
subclass writes `call_input` (the tool's input, from the call's text) and `run_tool` (the tool):
- a model turn that ends on EOS, or on no stop token at all (it hit its token cap), ends the episode;
- so does reaching `max_turns` model turns, or an observation that would leave no room in
  `max_episode_tokens` for another model token;
- otherwise the turn ended on a token that holds the tool-call text, and the tool's output text, encoded,
  is the observation.
The tool is the one part that runs on text from an untrusted worker, so it is a classmethod of plain
values: the verifier runs it in its sandboxed reward pool (verifier/reward_pool.py) with a time limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from environments.tasks import TaskItem
from protocol import limits

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]
OUTSIDE = "\x00"  # the text of a token the tokenizer cannot decode (an id past its vocabulary): no tool accepts it
# What a bare `encode` is asked for, one character at a time, to build its token texts.
_TABLE_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"


@dataclass(frozen=True)
class EnvLimits:
    max_turns: int  # model turns per episode
    max_turn_tokens: int  # tokens one model turn may sample
    max_episode_tokens: int  # all tokens after the prompt, model and environment

    def __post_init__(self) -> None:
        if not (1 <= self.max_turns
            and 1 <= self.max_turn_tokens <= self.max_episode_tokens <= limits.MAX_COMPLETION_TOKENS):
            raise ValueError(f"bad environment limits {self}")


def model_turns(env_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of model positions (mask 0), in order."""
    mask = np.asarray(env_mask, dtype=np.int8)
    if mask.size == 0:
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[1], mask, [1]])))  # where the mask changes
    starts, ends = edges[0::2], edges[1::2]
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


class Environment:
    name = ""
    # What a subclass sets (fixed per environment name, so that a lease needs to carry only the name).
    limits = EnvLimits(max_turns=1, max_turn_tokens=1, max_episode_tokens=1)
    tool_call = ""  # the text that ends a model turn as a tool call, alone or inside a longer token

    def __init__(self, encode: Encode, eos_ids: Sequence[int], decode: Decode | None = None, vocab_size: int = 0):
        """`decode` and `vocab_size` (the tokenizer's length): see the module's docstring."""
        self.encode = encode
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        ids = encode(self.tool_call)
        if len(ids) != 1:  # a token of its own, so that a call can end after any text
            raise ValueError(f"environment {self.name!r}: its tool-call text {self.tool_call!r} must be one token, "
                f"got {ids}")
        self.tool_call_id = int(ids[0])
        if decode is None:
            table = {}
            for ch in _TABLE_CHARS:
                one = encode(ch)
                if len(one) == 1:
                    table.setdefault(int(one[0]), ch)
            table[self.tool_call_id] = self.tool_call
            self._decode: Decode = lambda t: "".join(table.get(int(i), OUTSIDE) for i in t)
            self.vocab_size, candidates = max(table, default=-1) + 1, sorted(table)
        else:
            self._decode, self.vocab_size, candidates = decode, int(vocab_size), range(int(vocab_size))
        # Every token whose own text holds the delimiter ends a call (byte-level BPE never splits an ASCII
        # character across tokens, so no other token can bring it).
        self.call_enders = frozenset(t for t in candidates if self.tool_call in self._decode([t])) | {self.tool_call_id}

    # ----------------------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a model turn besides EOS (vLLM's `stop_token_ids` for each turn): every token
        that holds the tool-call text."""
        return sorted(self.call_enders)

    def text(self, ids: Sequence[int]) -> str:
        """The tokenizer's text of a span of token ids, decoded as a whole (an id past the vocabulary reads
        as OUTSIDE, never as nothing)."""
        out, run = [], []
        for t in (int(i) for i in ids):
            if 0 <= t < self.vocab_size:
                run.append(t)
                continue
            out += [self._decode(run) if run else "", OUTSIDE]
            run = []
        return "".join(out) + (self._decode(run) if run else "")

    def turn_cap(self, episode_len: int) -> int:
        """Most tokens the next model turn may sample, given the episode's length so far."""
        return max(0, min(self.limits.max_turn_tokens, self.limits.max_episode_tokens - episode_len))

    def reply(self, item: TaskItem, episode: Sequence[int], env_mask: Sequence[int], seed: int) -> list[int] | None:
        """The observation after the last model turn of `episode`, or None: the episode is over.
        (The worker calls this between turns; the verifier runs the same three steps, with `run_tool` in
        its sandboxed pool.)"""
        call = self.pending_call(episode, env_mask)
        if call is None:
            return None
        return self.observation(len(episode), self.run_tool(item, call, seed))

    def pending_call(self, episode: Sequence[int], env_mask: Sequence[int]) -> str | None:
        """The tool input that the last model turn of `episode` asks for, or None: the episode is over."""
        ids = np.asarray(episode, dtype=np.int64)
        turns = model_turns(np.asarray(env_mask))
        if not turns or turns[-1][1] != ids.size:
            raise ValueError("reply is asked after a model turn only")
        start, end = turns[-1]
        if int(ids[end - 1]) not in self.call_enders or len(turns) >= self.limits.max_turns:
            return None  # EOS, another stop token, the turn's cap, or the last allowed turn
        # The delimiter is in the last token (an earlier one would have ended the turn there).
        return self.call_input(self.text(ids[start:end]).partition(self.tool_call)[0])

    def observation(self, episode_len: int, tool_output: str) -> list[int] | None:
        """The tool's output as the observation's token ids, or None when it would leave no room for
        another model token (the episode ends there)."""
        obs = [int(t) for t in self.encode(tool_output)]
        if self.turn_cap(episode_len + len(obs)) < 1:
            return None
        return obs

    def call_input(self, text: str) -> str:
        """The tool's input from the call's text (the model turn's decoded text before the delimiter: the
        same string on the worker and the verifier, decoded by the same tokenizer from the same ids).
        Default: the tool takes no input."""
        return ""

    @classmethod
    def run_tool(cls, item: TaskItem, call: str, seed: int) -> str:
        """The tool: its output text for one call. A pure function of its arguments that needs no
        tokenizer, since on the trusted side it runs in the verifier's sandboxed pool with a time limit
        (the call text comes from an untrusted worker)."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------------
    # The reward: computed by the verifier's sandboxed reward pool from `reward_input`.

    def answer_span(self, env_mask: np.ndarray) -> tuple[int, int]:
        """Where the episode's answer is: the last model turn, without its final EOS (the verifier decodes it)."""
        return model_turns(env_mask)[-1]

    def reward(self, item: TaskItem, answer_text: str, state: dict[str, Any]) -> float:
        raise NotImplementedError

    def final_state(self, episode: np.ndarray, env_mask: np.ndarray) -> dict[str, Any]:
        """What the reward may use besides the answer text (plain values: it crosses to the reward pool)."""
        ids = np.asarray(episode)
        turns = model_turns(env_mask)
        calls = sum(1 for a, b in turns if int(ids[b - 1]) in self.call_enders)
        return {"turns": len(turns), "tool_calls": calls}
