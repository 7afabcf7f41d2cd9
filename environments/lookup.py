""""lookup": the toy tool task. The prompt hides the digits; the model must call the tool to see them.

    prompt      ask:=
    model       ?              (a token holding "?" ends the turn as a tool call)
    environment 4821=          (the hidden digits, then "=")
    model       4821<eos>      (copy them: the toy task's reward on this last turn)

A model that answers without calling the tool can only guess. The base model learns the format from
letters (trainer.tiny_model's tool corpus, `ask:=?abc=abc`), never with digits, so RL has to carry it over.
"""

from __future__ import annotations

from typing import Any

from environments.base import Environment, EnvLimits
from environments.tasks import TaskItem, ToyCopyTask


class LookupEnv(Environment):
    name = "lookup"
    task = "lookup"  # the task that makes its prompts (environments.tasks)
    limits = EnvLimits(max_turns=2, max_turn_tokens=8, max_episode_tokens=24)
    tool_call = "?"

    @classmethod
    def run_tool(cls, item: TaskItem, call: str, seed: int) -> str:
        return f"{item.answer}="

    @classmethod
    def reward(cls, item: TaskItem, answer_text: str, state: dict[str, Any]) -> float:
        return ToyCopyTask(digits=max(1, len(item.answer))).reward(item, answer_text)
