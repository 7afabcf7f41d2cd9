""""calculator": countdown with a calculator tool.

    prompt      nums:3,5,7 target:22=
    model       3*5?           (an expression, then "?", alone or inside a token such as "5?" or ")?\n")
    environment =15;           (its value, or "=err;" when it is not an expression of + - * / ( ) and integers)
    model       3*5+7<eos>     (the final answer: the countdown task's reward on this last turn)

The call is the turn's text before the "?" (environments.base: decoded from the ids by the tokenizer on
the worker and the verifier alike); a character outside CALC_CHARS in it makes the call "err".
"""

from __future__ import annotations

from typing import Any

from environments.base import Environment, EnvLimits
from environments.tasks import CountdownTask, TaskItem, safe_arithmetic

CALC_CHARS = "0123456789+-*/() "


def format_value(value: float) -> str:
    if value == int(value) and abs(value) < 10**9:
        return str(int(value))
    return f"{value:.4f}".rstrip("0")


class CalculatorEnv(Environment):
    name = "calculator"
    task = "countdown"
    limits = EnvLimits(max_turns=4, max_turn_tokens=16, max_episode_tokens=96)
    tool_call = "?"

    def call_input(self, text: str) -> str:
        return text

    @classmethod
    def run_tool(cls, item: TaskItem, call: str, seed: int) -> str:
        try:
            if not set(call) <= set(CALC_CHARS):  # also environments.base.OUTSIDE, an undecodable token
                raise ValueError("a character outside the calculator's")
            value, _ = safe_arithmetic(call)
            shown = format_value(value)
        except (ValueError, ArithmeticError, RecursionError, OverflowError):
            shown = "err"
        return f"={shown};"

    @classmethod
    def reward(cls, item: TaskItem, answer_text: str, state: dict[str, Any]) -> float:
        return CountdownTask(num_numbers=len(item.meta["nums"]), max_number=max(2,
            max(item.meta["nums"]))).reward(item, answer_text)
