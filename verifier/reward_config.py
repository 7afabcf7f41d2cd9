"""The reward pool's settings (verifier.reward_pool), each default with the reason for it.

Meant to sit in the verifier's config as `VerifierConfig.rewards`; its own module until then.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RewardPoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Honest rewards are cheap (toy/countdown: microseconds; math-verify: ~1 ms median, measured), so a few
    # processes keep up with the prefill; more than one so that a completion being timed out does not
    # stall every other one. Capped at the CPU count: a reward is CPU-bound.
    processes: int = Field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)), ge=1, le=256)
    # Honest math-verify calls measured ~1 ms median and 40 ms at worst on a loaded 2-core VM
    # (bench/results/reward_pool.md): 2 s is 50x the worst, and an attacker's completion costs at most
    # this much of one process.
    time_limit_s: float = Field(2.0, gt=0, le=600, description="wall-clock seconds per completion")
    # CPU seconds per completion (RLIMIT_CPU): matters only for rewards that burn several cores at once
    # (threads), since a single thread reaches the wall limit first; also holds if the parent stalls.
    cpu_limit_s: int | None = Field(4, ge=1, description="CPU seconds per completion; None: no CPU limit")
    # Address space a child may add to what it has mapped at start (RLIMIT_AS). A child with math-verify
    # loaded maps ~70 MB and stays there on honest inputs; 1 GiB per process is ample and bounds the host
    # to processes x 1 GiB.
    memory_limit_mb: int | None = Field(1024, ge=16, description="MiB per process on top of its start size")
    # Completions per IPC message at most. For toy rewards on one process, 32 per message cost half as
    # much per completion as 8, and larger chunks gained little; a chunk's results (<= 32 x ~400 B) fit in a socket
    # buffer, so a
    # child never blocks on sending them while the parent is busy.
    max_batch: int = Field(32, ge=1, le=256)
    # After this many timed-out or crashed completions in one group (submission), its completions not yet
    # started are skipped: a submission costs the pool at most about budget x time_limit_s. A skipped
    # completion's GRPO group is dropped like a timed-out one's (never trained with reward 0, no strike).
    group_failure_budget: int | None = Field(2, ge=1, description="None: score every completion")
    # forkserver: children fork from a clean, single-threaded server process with math-verify preloaded.
    # Plain fork is unsafe in the verifier (torch and its threads); spawn works, but a replacement after
    # a kill re-imports everything and was ready 2-4x later than with forkserver (bench).
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    import_paths: list[str] = Field(
        default_factory=list,
        description="prepended to sys.path in children, for plug-ins; a relative path is resolved against "
        "the folder the config is loaded in (the reward processes may run elsewhere)",
    )
    start_timeout_s: float = Field(
        60.0, gt=0, description="a child must be ready within this; also the limit for loading a task (importing "
        "its module) in a running child, which is not charged to a completion's time_limit_s",
    )
    # How the run's reward plug-in (data.reward) is called. A setting, not a guess from its signature: a
    # callable class, a functools.partial or a C function may show no usable signature, and the style decides
    # which values are valid (trl: unbounded), which an operator should choose rather than a heuristic.
    # Built-in tasks and environments' rewards are swarmrl code, always called in swarmrl's form.
    style: Literal["swarmrl", "trl"] = Field(
        "swarmrl", description="swarmrl: fn(text, item, **reward_params) -> float in [0, 1]; trl: TRL's "
        "fn(prompts, completions, completion_ids, **columns) -> list[float | None] (verifier/trl_rewards.py)",
    )

    @field_validator("import_paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        return [str(Path(p).resolve()) for p in paths]
