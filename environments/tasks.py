"""The built-in tasks, and the registry that names them: prompts and trusted rewards, computed from the completion
text on the trusted side, on the plug-in API of environments.task_api (a user's own task is
`data.task = "package.module:TaskClass"`, loaded by environments.task_plugins; docs/tasks.md).

A worker's own reward claim is never used. Every task makes seeded synthetic prompts (a finite set,
`make_prompts`, or a stream, `item`) or loads dataset rows (`from_record`), and scores a decoded completion
with `reward` in [0, 1].

- "toy": copy the digits of the prompt (`copy:4821=` -> `4821`), with partial credit, so a random tiny
  model already gets a graded, nonzero reward and GRPO sees signal from the first step.
- "countdown": combine the given numbers with + - * / into an expression equal to the target.
- "math": free-form answers, checked with the `math-verify` library.
- "reasoning_gym": reasoning-gym's procedural datasets and their own scorers (environments/reasoning_gym_task.py).

Prompts of "toy" and "countdown" only use characters of `trainer.tiny_model.ALPHABET`, so the char
tokenizer encodes them one token per character.
"""

from __future__ import annotations

import ast
import operator
import random
import threading
from typing import Any, Callable

from environments.reasoning_gym_task import ReasoningGymTask
from environments.task_api import Task, TaskItem, stream_rng
from environments.task_api import prompt_id as _prompt_id
from environments.task_plugins import import_plugin, task_class

__all__ = ["TASKS", "Task", "TaskItem", "get_task", "import_plugin", "safe_arithmetic"]


class ToyCopyTask(Task):
    """`copy:<digits>=` -> the same digits, then EOS.

    reward = 0.6 * (per answer position: 1 if right, 0.5 * (1 - |digit error| / 9) if a wrong digit) / len(answer)
           + 0.2 * (fraction of the first len(answer) characters that are digits)
           + 0.2 * length score (1 at the right length, falling linearly to 0 at twice the error)
    The optimum (exact copy, then EOS) scores 1.0. Credit for a near digit makes the reward smooth in
    the sampled digit, so a group of samples ranks "closer" above "further" and GRPO gets a direction
    even before any sample copies a digit exactly. A random model scores a few percent, with variance
    across samples from the digit and length terms, which is what GRPO needs to start climbing.
    `digits` sets the difficulty; `digits=1` is the easiest.
    """

    name = "toy"

    def __init__(self, digits: int = 3, prefix: str = "copy:"):
        if not 1 <= int(digits) <= 32:
            raise ValueError(f"toy task: digits must be in [1, 32], got {digits}")
        self.digits = int(digits)
        self.prefix = prefix

    def make_prompts(self, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(seed)
        return [self._draw(rng) for _ in range(n)]

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        return self._draw(stream_rng(self.name, seed, index))

    def _draw(self, rng: random.Random) -> TaskItem:
        answer = "".join(rng.choice("0123456789") for _ in range(self.digits))
        prompt = f"{self.prefix}{answer}="
        return TaskItem(_prompt_id(self.name, prompt), prompt, answer, {})

    def reward(self, item: TaskItem, completion_text: str) -> float:
        a, c = item.answer, completion_text
        n = len(a)
        if n == 0:
            return float(c == "")
        matched = sum(_digit_credit(x, y) for x, y in zip(a, c)) / n
        head = c[:n]
        digits = sum(ch.isdigit() for ch in head) / n
        length = max(0.0, 1.0 - abs(len(c) - n) / n)
        return float(min(1.0, max(0.0, 0.6 * matched + 0.2 * digits + 0.2 * length)))


class LookupTask(ToyCopyTask):
    """The prompts of the "lookup" environment (environments/lookup.py): `ask:=` with the digits hidden in
    the item's answer. Every prompt reads the same; the prompt id tells them apart. Scored as text (a
    single-turn run of it) it is the toy task's reward: a model can only guess."""

    name = "lookup"

    def __init__(self, digits: int = 3, prefix: str = "ask:"):
        super().__init__(digits, prefix)

    def make_prompts(self, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(seed)
        return [self._hidden(self._draw(rng), f"{seed}:{i}") for i in range(n)]

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        return self._hidden(super().item(seed, index, level), f"stream:{seed}:{index}")

    def _hidden(self, item: TaskItem, key: str) -> TaskItem:
        prompt = f"{self.prefix}="
        return TaskItem(_prompt_id(self.name, f"{prompt}{item.answer}:{key}"), prompt, item.answer, {})


def _digit_credit(want: str, got: str) -> float:
    if want == got:
        return 1.0
    if want.isdigit() and got.isdigit():
        return 0.5 * (1.0 - abs(int(want) - int(got)) / 9.0)
    return 0.0


# --------------------------------------------------------------------------------------------------
# countdown

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def safe_arithmetic(expr: str) -> tuple[float, list[int]]:
    """Evaluate + - * / over integer literals (and parentheses). Returns (value, literals used).

    Raises ValueError on anything else: names, calls, powers, huge literals, division by zero.
    """
    if len(expr) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    used: list[int] = []

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 10**6:
            used.append(node.value)
            return node.value
        raise ValueError(f"not allowed in an expression: {type(node).__name__}")

    return float(ev(tree.body)), used


class CountdownTask(Task):
    """`nums:3,5,7 target:22=` -> an expression such as `3*5+7`, using each number at most once.

    reward: 1.0 for a correct expression; `format_reward` (0.1) for a well-formed expression over the
    given numbers with the wrong value; 0 otherwise.
    """

    name = "countdown"

    def __init__(self, num_numbers: int = 3, max_number: int = 20, format_reward: float = 0.1):
        if not 2 <= int(num_numbers) <= 6:
            raise ValueError(f"countdown: num_numbers must be in [2, 6], got {num_numbers}")
        if not 2 <= int(max_number) <= 1000:
            raise ValueError(f"countdown: max_number must be in [2, 1000], got {max_number}")
        self.num_numbers, self.max_number, self.format_reward = int(num_numbers), int(max_number), float(format_reward)

    def make_prompts(self, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(seed)
        return [self._draw(rng) for _ in range(n)]

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        return self._draw(stream_rng(self.name, seed, index))

    def _draw(self, rng: random.Random) -> TaskItem:
        while True:  # until the expression's value is a positive integer
            nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            expr = str(nums[0])
            for x in nums[1:]:
                lhs = expr if rng.random() < 0.5 or "*" in expr else f"({expr})"
                expr = f"{lhs}{rng.choice('+-*')}{x}"
            value, _ = safe_arithmetic(expr)
            if value > 0 and value == int(value):
                break
        shown = sorted(nums)
        prompt = f"nums:{','.join(map(str, shown))} target:{int(value)}="
        return TaskItem(_prompt_id(self.name, prompt), prompt, expr, {"nums": shown, "target": int(value)})

    def from_record(self, record: dict) -> TaskItem:
        item = super().from_record(record)
        for key in ("nums", "target"):
            if key not in item.meta:
                raise ValueError(f"countdown record lacks {key!r}")
        return item

    def reward(self, item: TaskItem, completion_text: str) -> float:
        text = completion_text.strip().split("=")[0].strip()
        try:
            value, used = safe_arithmetic(text)
        except (ValueError, ArithmeticError, RecursionError):
            return 0.0
        pool = list(item.meta["nums"])
        for x in used:
            if x not in pool:
                return 0.0
            pool.remove(x)
        return 1.0 if abs(value - float(item.meta["target"])) < 1e-9 else self.format_reward


# --------------------------------------------------------------------------------------------------
# math


class MathTask(Task):
    """Free-form math answers checked with `math-verify` (the answer may be LaTeX or a plain number).

    Synthetic prompts are small arithmetic questions; real data comes in through `from_record`.
    """

    name = "math"

    def __init__(self, max_operand: int = 50):
        self.max_operand = int(max_operand)

    def make_prompts(self, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(seed)
        return [self._draw(rng) for _ in range(n)]

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        return self._draw(stream_rng(self.name, seed, index))

    def _draw(self, rng: random.Random) -> TaskItem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice("+-*")
        prompt = f"what is {a}{op}{b}? answer:"
        answer = str(eval(f"{a}{op}{b}"))  # noqa: S307 -- our own two integers and one operator
        return TaskItem(_prompt_id(self.name, prompt), prompt, answer, {})

    def reward(self, item: TaskItem, completion_text: str) -> float:
        from math_verify import parse, verify

        # math-verify's timeouts use SIGALRM, which only works in the main thread.
        main = threading.current_thread() is threading.main_thread()
        timeout = 5 if main else None
        try:
            gold = parse(item.answer if "$" in item.answer or "\\" in item.answer else f"${item.answer}$",
                parsing_timeout=timeout)
            pred = parse(completion_text, parsing_timeout=timeout)
            return 1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0
        except Exception:  # a malformed completion is a wrong answer, never a crash of the verifier
            return 0.0


TASKS: dict[str, type[Task]] = {
    "toy": ToyCopyTask, "countdown": CountdownTask, "math": MathTask, "lookup": LookupTask,
    "reasoning_gym": ReasoningGymTask,
}


def get_task(name: str, **params: Any) -> Task:
    """A built-in task by name, or a user's task named "package.module:TaskClass" (environments.task_plugins),
    made with `params` (data.task_params). ValueError, saying what is missing or wrong, when it cannot be."""
    if name in TASKS:
        cls = TASKS[name]
    elif ":" in name:
        cls = task_class(name)
    else:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)} or name your own as "
                         "'package.module:TaskClass'")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"task {name!r}: bad parameters {params}: {exc}") from None
