"""reasoning-gym's procedural datasets as a swarmrl task: `data.task = "reasoning_gym"` (the optional extra
`pip install 'swarmrl[tasks]'`; docs/tasks.md).

    task_params = { dataset = "spell_backward", config = { min_word_len = 3, max_word_len = 3 } }
    task_params = { datasets = [{ name = "chain_sum", weight = 2 }, { name = "spell_backward", weight = 1 }] }

Prompts stream from the run's seed: item (seed, index, level) picks a dataset by weight (a seeded draw of its
own), then takes that dataset's entry `index % CHUNK` of an instance seeded by (seed, dataset, index // CHUNK):
fresh prompts without end, the same on every restart (some datasets index precomputed lists of `size` entries,
so an instance never holds more than CHUNK). The entry (question, answer, metadata) is the item's trusted
meta; a completion is scored by the dataset's own `score_answer` on the text inside its last
<answer>...</answer> (reasoning-gym's `extract_answer`; `answer_format = "tag"`) or on the stripped text
(`"strip"`). With `curriculum = true` the task has levels: level L sets every dataset's curriculum to its
global level L (capped at its last), the curriculum's attributes (e.g. min/max_word_len) over `config`.

reasoning-gym is imported when the task is made, once per process: in each reward process that happens when
it loads the task, outside any completion's time limit (~2 s and ~190 MB of address space, measured).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import threading
from collections import OrderedDict
from typing import Any, Literal

from environments.task_api import Task, TaskItem, stream_rng, stream_seed

CHUNK = 1000  # entries per dataset instance
KEPT_INSTANCES = 16  # dataset instances kept, at least (per dataset of a mix: 4; the stream moves forward)
RESERVED = ("seed", "size")  # config fields the stream sets


class ReasoningGymTask(Task):
    name = "reasoning_gym"
    stream = True

    def __init__(self, dataset: str = "", config: dict[str, Any] | None = None,
                 datasets: list[dict[str, Any]] | None = None, answer_format: Literal["tag", "strip"] = "tag",
                 system_prompt: str = "", curriculum: bool = False):
        try:
            from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum, get_score_answer_fn
            from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
        except ImportError as exc:
            raise ValueError(f"task 'reasoning_gym' needs the reasoning-gym package ({exc}): pip install "
                             "'swarmrl[tasks]' (or reasoning-gym==0.1.25)") from None
        self._registry, self._curricula, self._make_curriculum = DATASETS, CURRICULA, create_curriculum
        self._score_fn, self._extract = get_score_answer_fn, extract_answer
        if answer_format not in ("tag", "strip"):
            raise ValueError(f"reasoning_gym: answer_format must be 'tag' or 'strip', got {answer_format!r}")
        self.answer_format = answer_format
        self.system = SYSTEM_PROMPTS.get(system_prompt, system_prompt)  # a name of theirs, or the text itself
        if bool(dataset) == bool(datasets):
            raise ValueError("reasoning_gym: give either dataset (and config) or datasets (a weighted mix)")
        specs = [{"name": dataset, "weight": 1.0, "config": config or {}}] if dataset else list(datasets or [])
        self.sources = [self._source(s) for s in specs]
        self.curriculum = bool(curriculum)
        if self.curriculum:
            leveled = [len(a.levels) for s in self.sources if s[0] in CURRICULA
                       for a in create_curriculum(s[0]).attributes.values()]
            if not leveled:
                raise ValueError(f"reasoning_gym: none of {[s[0] for s in self.sources]} has a curriculum")
            self.levels = max(leveled)
        self._configs = {(s[0], lv): self._config(s[0], s[2], lv) for s in self.sources for lv in range(self.levels)}
        self._scorers = {s[0]: get_score_answer_fn(s[0]) for s in self.sources}  # built now: not in a reward call
        self._instances: OrderedDict[tuple, Any] = OrderedDict()
        self._kept = max(KEPT_INSTANCES, 4 * len(self.sources))
        self._lock = threading.Lock()

    def _source(self, spec: Any) -> tuple[str, float, dict[str, Any]]:
        if not isinstance(spec, dict) or "name" not in spec or set(spec) - {"name", "weight", "config"}:
            raise ValueError(f"reasoning_gym: a mix entry is {{name, weight?, config?}}, got {spec!r}")
        name, weight, config = spec["name"], float(spec.get("weight", 1.0)), dict(spec.get("config") or {})
        if name not in self._registry or name == "composite":
            near = difflib.get_close_matches(str(name), [n for n in self._registry if n != "composite"], n=3)
            raise ValueError(f"reasoning_gym: no dataset {name!r}" + (f" (did you mean {near}?)" if near else ""))
        if not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"reasoning_gym: dataset {name!r} needs a positive weight, got {weight}")
        if set(config) & set(RESERVED):
            raise ValueError(f"reasoning_gym: {name!r} config sets {sorted(set(config) & set(RESERVED))}: the "
                             "stream sets those (from the run's seed)")
        return name, weight, config

    def _config(self, name: str, config: dict[str, Any], level: int) -> Any:
        """The dataset's config dataclass at `level`, validated once here."""
        try:
            if self.curriculum and name in self._curricula:
                cur = self._make_curriculum(name)
                cur.set_global_level(level)  # capped at each attribute's last level
                cfg = cur.generate_configuration(defaults=config)
            else:
                cfg = self._registry[name][1](**config)
            if hasattr(cfg, "validate"):
                cfg.validate()
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"reasoning_gym: bad config for {name!r} {config}: {exc}") from None
        return cfg

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        if not 0 <= level < self.levels:
            raise ValueError(f"reasoning_gym: level {level} outside [0, {self.levels - 1}]")
        name = self.sources[0][0] if len(self.sources) == 1 else stream_rng("rg-mix", seed, index).choices(
            [s[0] for s in self.sources], weights=[s[1] for s in self.sources])[0]
        chunk, offset = divmod(index, CHUNK)
        entry = self._instance(name, level, seed, chunk)[offset]
        meta: dict[str, Any] = {"dataset": name, "entry": entry}
        if self.system:
            meta["system"] = self.system
        return TaskItem(f"{name}-{index}-l{level}", str(entry["question"]), str(entry["answer"]), meta)

    def _instance(self, name: str, level: int, seed: int, chunk: int) -> Any:
        key = (name, level, seed, chunk)
        with self._lock:
            ds = self._instances.get(key)
            if ds is None:
                cfg = dataclasses.replace(self._configs[(name, level)], seed=stream_seed("rg", seed, name, chunk),
                                          size=CHUNK)
                ds = self._instances[key] = self._registry[name][0](config=cfg)
                while len(self._instances) > self._kept:
                    self._instances.popitem(last=False)
            self._instances.move_to_end(key)
            return ds

    def from_record(self, record: dict) -> TaskItem:
        """A row exported from reasoning-gym ({question or prompt, answer, metadata}; map question with
        data.fields.prompt): its dataset from a "dataset" column, metadata.source_dataset, or the only one."""
        item = super().from_record(record)
        metadata = item.meta.get("metadata") or {}
        name = item.meta.get("dataset") or metadata.get("source_dataset") or (
            self.sources[0][0] if len(self.sources) == 1 else None)
        if name not in self._registry:
            raise ValueError(f"reasoning_gym record names no known dataset (got {name!r}): give a 'dataset' column")
        meta: dict[str, Any] = {"dataset": name, "entry": {"question": item.prompt, "answer": item.answer,
                                                           "metadata": metadata}}
        if self.system or "system" in item.meta:
            meta["system"] = item.meta.get("system", self.system)
        return TaskItem(item.prompt_id, item.prompt, item.answer, meta)

    def reward(self, item: TaskItem, completion_text: str) -> float:
        name = item.meta["dataset"]
        if name not in self._scorers:
            self._scorers[name] = self._score_fn(name)
        answer = self._extract(completion_text) if self.answer_format == "tag" else completion_text.strip()
        try:
            value = float(self._scorers[name](answer, item.meta["entry"]))
        except Exception:  # the dataset's scorer on a malformed answer: a wrong answer, not a broken reward
            return 0.0
        return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0
