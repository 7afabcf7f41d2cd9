"""A curriculum over a task's difficulty levels (Task.levels), moved by the online pass rate of verified rewards.

The run's prompt stream (orchestrator/prompt_stream.py) makes each new prompt at the current level and
reports the trusted rewards of every verified training completion with the level its prompt was made at.
Only completions of prompts at the current level count: samples generated before a move (asynchrony) do not
move the level again. Once `window` of them are in, the pass rate (the share with reward >= pass_threshold)
above `max_pass_rate` moves the level up, below `min_pass_rate` down, and the window starts over. The
defaults are INTELLECT-2's window of useful difficulty, 0.1 to 0.8 (its offline filter, applied online here).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CurriculumConfig(BaseModel):
    """`[data.curriculum]`: whether and how the run moves its task's difficulty level."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="move the level by the online pass rate; off: prompts stay at start_level")
    start_level: int = Field(0, ge=0, description="the level a run starts at (a restarted run resumes its own)")
    min_pass_rate: float = Field(0.1, ge=0, le=1, description="below this pass rate the level goes down one")
    max_pass_rate: float = Field(0.8, ge=0, le=1, description="above this pass rate the level goes up one")
    window: int = Field(256, ge=8, description="verified completions at the current level that a decision is made on")
    pass_threshold: float = Field(1.0, ge=0, le=1, description="a completion passes when its reward is at least this")

    @model_validator(mode="after")
    def _window_order(self) -> "CurriculumConfig":
        if self.min_pass_rate >= self.max_pass_rate:
            raise ValueError(f"curriculum: min_pass_rate ({self.min_pass_rate}) must be below max_pass_rate "
                             f"({self.max_pass_rate})")
        return self


class Curriculum:
    """The current level of a task with `levels` levels, and the rewards it is judged on. Thread-safe: the
    verification thread observes while request threads read the level."""

    def __init__(self, config: CurriculumConfig, levels: int):
        if config.start_level >= levels:
            raise ValueError(f"curriculum: start_level {config.start_level} but the task has {levels} level(s)")
        if config.enabled and levels < 2:
            raise ValueError("curriculum: enabled, but the task has one level only (for reasoning_gym: "
                             "task_params.curriculum = true)")
        self.config, self.levels = config, levels
        self.level = config.start_level
        self._passed: deque[bool] = deque(maxlen=config.window)
        self._lock = threading.Lock()

    def resume(self, level: int) -> None:
        """The level a restarted run had reached (clamped to this task's levels)."""
        with self._lock:
            self.level = min(max(0, int(level)), self.levels - 1)
            self._passed.clear()

    def observe(self, level: int, rewards: Iterable[float]) -> bool:
        """Rewards of verified completions whose prompts were made at `level`. True when the level moved."""
        if not self.config.enabled:
            return False
        with self._lock:
            if level != self.level:
                return False
            self._passed.extend(r >= self.config.pass_threshold for r in rewards)
            if len(self._passed) < self.config.window:
                return False
            rate = sum(self._passed) / len(self._passed)
            step = 1 if rate > self.config.max_pass_rate else -1 if rate < self.config.min_pass_rate else 0
            if step == 0 or not 0 <= self.level + step < self.levels:
                return False
            self.level += step
            self._passed.clear()
            return True

    def pass_rate(self) -> float | None:
        """The pass rate over the completions seen at the current level (None before any)."""
        with self._lock:
            return sum(self._passed) / len(self._passed) if self._passed else None
