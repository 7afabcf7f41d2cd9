"""Environments by name (like tasks; a plug-in is "module:Class"), and the two entry points that the
verifier's sandboxed pool calls: the tool (`tool_output`) and the reward (`episode_reward`)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from environments.base import Decode, Encode, Environment
from environments.calculator import CalculatorEnv
from environments.lookup import LookupEnv
from environments.tasks import TaskItem, import_plugin

ENVIRONMENTS: dict[str, type[Environment]] = {"lookup": LookupEnv, "calculator": CalculatorEnv}
# The reward pool runs these as plug-ins (`module:function`, called as fn(text, item, **params)).
REWARD_ENTRY = "environments.registry:episode_reward"
TOOL_ENTRY = "environments.registry:tool_output"


def environment_class(name: str) -> type[Environment]:
    """A built-in environment, or a plug-in named "module:Class" (an Environment subclass)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        raise ValueError(f"unknown environment {name!r}; choose one of {sorted(ENVIRONMENTS)} or name a plug-in as "
            f"'module:Class'")
    cls = import_plugin(name, "environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name!r} is not a subclass of environments.base.Environment")
    return cls


def get_environment(name: str, encode: Encode, eos_ids: Sequence[int], decode: Decode | None = None,
    vocab_size: int = 0) -> Environment:
    return environment_class(name)(encode, eos_ids, decode=decode, vocab_size=vocab_size)


def environment_for(name: str, tokenizer: Any, eos_ids: Sequence[int]) -> Environment:
    """The environment on a transformers-style tokenizer, wired the same way on the worker (vLLM's copy of
    the tokenizer) and the verifier: encode without special tokens, decode a whole span keeping them (a
    special token in a call is text that no tool accepts)."""
    return get_environment(name, lambda text: tokenizer.encode(text, add_special_tokens=False), eos_ids,
                           lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False), len(tokenizer))


def item_to_wire(item: TaskItem) -> str:
    """What a lease's prompt carries for the worker's copy of the environment (TaskPrompt.env_item): the
    item's answer and meta. A worker that reads a hidden answer gains nothing: the model's tokens must
    still be the seed's draws, and the reward is computed on the trusted side from the trusted item."""
    return json.dumps({"prompt": item.prompt, "answer": item.answer, "meta": item.meta}, separators=(",", ":"),
        sort_keys=True)


def item_from_wire(prompt_id: str, text: str) -> TaskItem:
    data = json.loads(text)
    return TaskItem(prompt_id, str(data["prompt"]), str(data["answer"]), dict(data.get("meta") or {}))


def reward_text(answer_text: str, state: dict) -> str:
    """What the verifier sends to the reward pool for an episode (the pool's requests carry text)."""
    return json.dumps({"answer": answer_text, "state": state})


def tool_text(call: str, seed: int) -> str:
    """What the verifier sends to the pool for one tool call."""
    return json.dumps({"call": call, "seed": int(seed)})


def tool_output(text: str, item: TaskItem, environment: str) -> str:
    data = json.loads(text)
    return environment_class(environment).run_tool(item, str(data["call"]), int(data["seed"]))


def episode_reward(text: str, item: TaskItem, environment: str) -> float:
    data = json.loads(text)
    return environment_class(environment).reward(item, data["answer"], data["state"])
