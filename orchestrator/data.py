"""Prompts for the run: loaded from a local dataset through a field map (orchestrator/data_files.py), or made by
the run's task (environments.tasks.get_task: a built-in, or a user's "package.module:TaskClass"); rendered
with the tokenizer's chat template and tokenized, dropping prompts over the length limit; and chosen for each
lease by the run's seed, so a worker cannot pick its prompts.

Two kinds: a `PromptSet`, finite (a dataset, or the task's `make_prompts(num_prompts, seed)`), leased in one
seeded permutation per epoch; and a `PromptStream` (`data.stream`), made on demand by the task's
`item(seed, index, level)` without end, a fresh prompt for every lease position, at the level of the run's
curriculum (environments/curriculum.py). docs/tasks.md describes both.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from environments.curriculum import Curriculum, CurriculumConfig
from environments.task_api import stream_seed
from orchestrator.config import DataConfig
from orchestrator.data_files import (  # noqa: F401 - re-exported: the orchestrator's data API
    DATA_SUFFIXES,
    DataError,
    filter_by_pass_rate,
    load_rows,
    read_records,
    to_record,
)
from orchestrator.db import Database
from protocol import limits
from protocol.operator_models import CurriculumStatus

log = logging.getLogger(__name__)

# A stream's prompt index: position * SLOTS + slot. Slot < SLOTS - 1 is the level the prompt was made at (so
# a restarted orchestrator remakes the same prompt for a leased index, whatever level the run is at now);
# slot SLOTS - 1 holds the held-out (evaluation) prompts, whose indices stay below 2**32 (eval seeds' key).
SLOTS = 64
HELD_OUT_SLOT = SLOTS - 1
# A stream prompt over the token limit or outside the vocabulary is replaced by the task's item at
# position + k * RETRY_STRIDE (k = 1 .. MAX_ATTEMPTS - 1): positions never reach the stride.
RETRY_STRIDE = 1 << 40
MAX_ATTEMPTS = 8
CACHED_PROMPTS = 8192  # a stream's recently made prompts, kept for verification (a miss remakes the prompt)
LEVEL_KEY = "curriculum_level"  # the meta counter a restarted run resumes its curriculum from


@dataclass
class Prompt:
    item: Any  # environments.tasks.TaskItem: prompt_id, prompt, answer, meta
    token_ids: np.ndarray  # int32

    @property
    def prompt_id(self) -> str:
        return self.item.prompt_id


def make_task(config: DataConfig) -> Any:
    """The run's task (environments.task_api.Task), made with data.task_params; DataError saying why not."""
    from environments.tasks import get_task

    try:
        return get_task(config.task, **config.task_params)
    except ValueError as exc:
        raise DataError(str(exc)) from None


def streams(config: DataConfig, task: Any) -> bool:
    """Whether the run's prompts are the task's stream (data.stream, or the task's default without data.path)."""
    if config.path:
        return False
    return bool(task.stream if config.stream is None else config.stream)


def items_from_rows(rows: list[dict[str, Any]], config: DataConfig) -> list[Any]:
    task = make_task(config)
    items = []
    for i, row in enumerate(rows):
        try:
            items.append(task.from_record(to_record(row, config)))
        except (KeyError, TypeError, ValueError) as exc:
            reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # KeyError's str() adds quotes
            raise DataError(f"{config.path}: row {i}: {reason}") from None
    return items


def load_items(config: DataConfig, seed: int, limit: int = 0) -> list[Any]:
    """TaskItems from the configured dataset, or made by the task: its finite set, or the first num_prompts
    items of its stream (at the curriculum's start level). `limit`: at most that many (0: all)."""
    if config.path:
        items = items_from_rows(load_rows(config), config)
        return items[:limit] if limit else items
    task = make_task(config)
    n = min(limit or config.num_prompts, config.num_prompts)
    try:
        if streams(config, task):
            items = [task.item(seed, i, config.curriculum.start_level) for i in range(n)]
        else:
            items = list(task.make_prompts(n, seed))
    except NotImplementedError as exc:
        raise DataError(str(exc)) from None
    if config.system_prompt:
        for item in items:
            item.meta["system"] = config.system_prompt
    return items


def first_item(config: DataConfig, seed: int) -> Any:
    """The run's first prompt's TaskItem, made as the run makes it: what a start-up check scores."""
    items = load_items(config, seed, limit=1)
    if not items:
        raise DataError(f"task {config.task!r} made no prompts")
    return items[0]


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def use_chat_template(config: DataConfig, tokenizer) -> bool:
    """Whether prompts go through the chat template (installing config.chat_template_jinja on the tokenizer)."""
    if config.chat_template_jinja:
        tokenizer.chat_template = config.chat_template_jinja
    has = bool(getattr(tokenizer, "chat_template", None))
    if config.chat_template == "on" and not has:
        raise DataError("data.chat_template is 'on' but the tokenizer has no chat template (give one in "
            "data.chat_template_jinja)")
    return has if config.chat_template == "auto" else config.chat_template == "on"


def encode_prompt(item: Any, tokenizer, chat: bool) -> np.ndarray:
    """The prompt's token ids: the chat template's rendering of [system?, user] with the generation prompt,
    or the plain text (a system prompt, if any, on the line before)."""
    system = item.meta.get("system", "")
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
            "content": item.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own special tokens
    else:
        ids = tokenizer(f"{system}\n{item.prompt}" if system else item.prompt)["input_ids"]
    return np.asarray(ids, dtype=np.int32)


def vocab_size(model_dir: str | Path, tokenizer=None) -> int:
    """The model's vocabulary (config.json), which may be padded beyond the tokenizer's."""
    cfg = Path(model_dir) / "config.json"
    if cfg.exists():
        v = json.loads(cfg.read_text()).get("vocab_size")
        if v:
            return int(v)
    return len(tokenizer) if tokenizer is not None else limits.MAX_VOCAB_SIZE


def unusable(ids: np.ndarray, limit: int, vocab: int) -> str | None:
    """Why a tokenized prompt cannot be leased ("too_long", "empty_or_bad_tokens"), or None."""
    if ids.size > limit:
        return "too_long"
    if ids.size == 0 or int(ids.max()) >= vocab:
        return "empty_or_bad_tokens"
    return None


def token_limit(max_tokens: int) -> int:
    return min(max_tokens or limits.MAX_PROMPT_TOKENS, limits.MAX_PROMPT_TOKENS)


class PromptSet:
    """The run's prompts, tokenized, and the seeded order in which leases get them."""

    streamed = False  # a PromptStream makes its prompts on demand, without end

    def __init__(self, prompts: list[Prompt], seed: int, vocab_size: int):
        if not prompts:
            raise DataError("no prompts (after filtering)")
        unique: dict[str, Prompt] = {}
        for p in prompts:  # the same prompt twice is one prompt (its groups would be indistinguishable)
            unique.setdefault(p.prompt_id, p)
        if len(unique) < len(prompts):
            log.info("dropped duplicate prompts", extra={"duplicates": len(prompts) - len(unique),
                                                         "kept": len(unique)})
        self.prompts = list(unique.values())
        self.seed = seed
        self.vocab_size = vocab_size
        self._epoch_orders: dict[int, np.ndarray] = {}
        self.dropped: dict[str, int] = {}  # prompts dropped by from_items, per reason

    @classmethod
    def from_items(cls, items: list[Any], tokenizer, seed: int, vocab_size: int, *, chat: bool = False,
                   max_tokens: int = 0) -> "PromptSet":
        limit = token_limit(max_tokens)
        prompts = []
        dropped = {"too_long": 0, "empty_or_bad_tokens": 0}
        for item in items:
            ids = encode_prompt(item, tokenizer, chat)
            why = unusable(ids, limit, vocab_size)
            if why:
                dropped[why] += 1
            else:
                prompts.append(Prompt(item, ids))
        if dropped["too_long"]:
            log.warning("dropped prompts longer than the token limit", extra={"dropped": dropped["too_long"],
                "limit": limit, "kept": len(prompts)})
        if dropped["empty_or_bad_tokens"]:
            log.warning("dropped prompts that are empty or outside the vocabulary",
                extra={"dropped": dropped["empty_or_bad_tokens"], "kept": len(prompts)})
        ps = cls(prompts, seed, vocab_size)
        ps.dropped = dropped
        return ps

    @classmethod
    def from_config(cls, config: DataConfig, model_dir: str | Path, seed: int) -> "PromptSet":
        """The run's prompts: a PromptStream when the task streams them (data.stream), else a PromptSet."""
        tok = load_tokenizer(model_dir)
        chat = use_chat_template(config, tok)
        vocab = vocab_size(model_dir, tok)
        task = make_task(config)
        if streams(config, task):
            stream = PromptStream(task, lambda item: encode_prompt(item, tok, chat), seed, vocab,
                                  max_tokens=config.max_prompt_tokens, system_prompt=config.system_prompt,
                                  curriculum=config.curriculum)
            log.info("prompts streamed", extra={"task": config.task, "levels": task.levels, "chat_template": chat,
                                                "level": stream.curriculum.level})
            return stream
        ps = cls.from_items(load_items(config, seed), tok, seed, vocab, chat=chat, max_tokens=config.max_prompt_tokens)
        log.info("prompts loaded", extra={"prompts": len(ps), "chat_template": chat, "dropped": ps.dropped})
        return ps

    def __len__(self) -> int:
        return len(self.prompts)

    def order(self, position: int) -> int:
        """Prompt index at `position` of the run's prompt stream: one seeded permutation per epoch."""
        epoch, i = divmod(position, len(self.prompts))
        perm = self._epoch_orders.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
            self._epoch_orders = {epoch: perm}  # positions only move forward: keep one epoch
        return int(perm[i])

    # A curriculum's hooks (PromptStream); a finite set has no levels.
    def attach(self, db: Database) -> None:
        """The run's database: where a curriculum keeps its level across restarts."""

    def observe(self, indices: Sequence[int], rewards: Sequence[float]) -> None:
        """The trusted rewards of verified training completions, with their prompts' indices."""

    def curriculum_state(self) -> CurriculumStatus | None:
        return None


class _ByIndex:
    """`stream.prompts[index]`: what a PromptSet's list gives, made on demand."""

    def __init__(self, get: Callable[[int], Prompt]):
        self._get = get

    def __getitem__(self, index: int) -> Prompt:
        return self._get(index)


class PromptStream(PromptSet):
    """The task's prompts, made on demand: lease position p gets index p * SLOTS + level (the curriculum's level
    when p was first leased), and that index's prompt is the task's item(seed, p, level), whose id is
    "p<p>-l<level>". A pure function of the index: a restarted orchestrator remakes the prompts of leases in
    flight, and a reissued lease gets its prompt again. Held-out prompts (held_out) sit in slot HELD_OUT_SLOT."""

    streamed = True

    def __init__(self, task: Any, encode: Callable[[Any], np.ndarray], seed: int, vocab_size: int, *,
                 max_tokens: int = 0, system_prompt: str = "", curriculum: CurriculumConfig | None = None):
        if task.levels >= SLOTS:
            raise DataError(f"task {task.name!r} has {task.levels} levels; a stream holds at most {SLOTS - 1}")
        try:
            self.curriculum = Curriculum(curriculum or CurriculumConfig(), task.levels)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        self.task, self.encode, self.seed, self.vocab_size = task, encode, seed, vocab_size
        self.limit, self.system_prompt = token_limit(max_tokens), system_prompt
        self.prompts = _ByIndex(self._prompt)  # type: ignore[assignment]
        self.held_out: list[int] = []  # indices of held-out prompts (evaluation), when the run evaluates
        self._held: list[Prompt] = []
        self.dropped = {"too_long": 0, "empty_or_bad_tokens": 0}
        self._cache: OrderedDict[int, Prompt] = OrderedDict()
        self._lock = threading.RLock()  # request threads lease, the verification thread reads items
        self._db: Database | None = None
        for position in range(4):  # a task that cannot stream, or makes no usable prompt, fails at start
            self._make(position, self.curriculum.level, seed, f"p{position}")

    def __len__(self) -> int:
        raise TypeError("a prompt stream has no length")

    def __bool__(self) -> bool:
        return True

    def order(self, position: int) -> int:
        return position * SLOTS + self.curriculum.level

    def _prompt(self, index: int) -> Prompt:
        position, slot = divmod(int(index), SLOTS)
        if index < 0 or (slot == HELD_OUT_SLOT and position >= len(self._held)) or (
                slot != HELD_OUT_SLOT and slot >= self.task.levels):
            raise IndexError(f"no prompt {index} in the stream")
        if slot == HELD_OUT_SLOT:
            return self._held[position]
        with self._lock:
            p = self._cache.get(index)
            if p is None:
                p = self._cache[index] = self._make(position, slot, self.seed, f"p{position}-l{slot}")
                if len(self._cache) > CACHED_PROMPTS:
                    self._cache.popitem(last=False)
            return p

    def _make(self, position: int, level: int, seed: int, prompt_id: str) -> Prompt:
        why = ""
        with self._lock:  # the tokenizer is shared between threads
            for attempt in range(MAX_ATTEMPTS):
                try:
                    item = self.task.item(seed, position + attempt * RETRY_STRIDE, level)
                except NotImplementedError as exc:
                    raise DataError(str(exc)) from None
                if self.system_prompt:
                    item.meta["system"] = self.system_prompt
                ids = self.encode(item)
                why = unusable(ids, self.limit, self.vocab_size) or ""
                if not why:
                    item.prompt_id = prompt_id
                    return Prompt(item, ids)
                self.dropped[why] += 1
        raise DataError(f"task {self.task.name!r}: {MAX_ATTEMPTS} prompts in a row at position {position}, level "
                        f"{level} cannot be leased ({why}; token limit {self.limit}, vocabulary {self.vocab_size})")

    def holding_out(self, source: int | list[Prompt]) -> "PromptStream":
        """With held-out prompts for evaluation: `source` of them made from a seed of their own at the start
        level ("heldout-<i>"), or the given ones (eval.path). They are never in the training order."""
        if isinstance(source, int):
            seed = stream_seed("held-out", self.seed)
            held = [self._make(i, self.curriculum.config.start_level, seed, f"heldout-{i}") for i in range(source)]
        else:
            held = list(source)
        self._held, self.held_out = held, [i * SLOTS + HELD_OUT_SLOT for i in range(len(held))]
        return self

    def attach(self, db: Database) -> None:
        self._db = db
        row = db.one("SELECT value FROM meta WHERE key=?", (LEVEL_KEY,))
        if row is not None and self.curriculum.config.enabled:
            self.curriculum.resume(int(float(row["value"])))
            log.info("curriculum resumed", extra={"level": self.curriculum.level, "levels": self.task.levels})

    def observe(self, indices: Sequence[int], rewards: Sequence[float]) -> None:
        by_level: dict[int, list[float]] = {}
        for index, reward in zip(indices, rewards):
            slot = int(index) % SLOTS
            if slot != HELD_OUT_SLOT:
                by_level.setdefault(slot, []).append(float(reward))
        for level, rs in by_level.items():
            if self.curriculum.observe(level, rs):
                new = self.curriculum.level
                log.info("curriculum moved", extra={"from_level": level, "level": new, "levels": self.task.levels})
                if self._db is not None:
                    with self._db.tx() as conn:
                        Database.set(conn, LEVEL_KEY, new)

    def curriculum_state(self) -> CurriculumStatus | None:
        c = self.curriculum
        if self.task.levels < 2 and not c.config.enabled:
            return None
        return CurriculumStatus(level=c.level, levels=self.task.levels, pass_rate=c.pass_rate(),
                                moving=c.config.enabled)
