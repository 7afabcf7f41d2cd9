""""calculator": countdown with a calculator tool.

    prompt      nums:3,5,7 target:22=
    model       3*5?           (an expression, then the tool-call token)
    environment =15;           (its value, or "=err;" when it is not an expression of + - * / ( ) and integers)
    model       3*5+7<eos>     (the final answer: the countdown task's reward on this last turn)

The environment reads the call through a table of single-token characters built with `encode`, never by
decoding model text: a token outside the table makes the call "err" on the worker and the verifier alike.
"""

from __future__ import annotations

from typing import Any

from environments.base import EnvLimits, Environment, Encode
from verifier.tasks import CountdownTask, TaskItem, safe_arithmetic

CALC_CHARS = "0123456789+-*/() "
OUTSIDE = "\x00"  # stands for a call token outside CALC_CHARS: the call is "err"


def format_value(value: float) -> str:
    if value == int(value) and abs(value) < 10**9:
        return str(int(value))
    return f"{value:.4f}".rstrip("0")


class CalculatorEnv(Environment):
    name = "calculator"
    task = "countdown"
    limits = EnvLimits(max_turns=4, max_turn_tokens=16, max_episode_tokens=96)
    tool_call = "?"

    def __init__(self, encode: Encode, eos_ids):
        super().__init__(encode, eos_ids)
        self.chars: dict[int, str] = {}
        for ch in CALC_CHARS:
            ids = encode(ch)
            if len(ids) == 1:
                self.chars[int(ids[0])] = ch

    def call_text(self, call: list[int]) -> str:
        return "".join(self.chars.get(t, OUTSIDE) for t in call)

    @classmethod
    def run_tool(cls, item: TaskItem, call: str, seed: int) -> str:
        try:
            if OUTSIDE in call:
                raise ValueError("token outside the calculator's characters")
            value, _ = safe_arithmetic(call)
            shown = format_value(value)
        except (ValueError, ArithmeticError, RecursionError, OverflowError):
            shown = "err"
        return f"={shown};"

    @classmethod
    def reward(cls, item: TaskItem, answer_text: str, state: dict[str, Any]) -> float:
        return CountdownTask(num_numbers=len(item.meta["nums"]), max_number=max(2, max(item.meta["nums"]))).reward(item, answer_text)
