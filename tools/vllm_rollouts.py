"""Honest rollouts for calibration, tests and benchmarks, from the product's own vLLM engine
(`inference_worker.engine.RolloutEngine`): what an honest worker generates, plus the final hidden states
that produced each token, so that a tool can build proofs itself (or tamper with them).

One completion per prompt, each with its own seed; `batch` prompts go to vLLM at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inference_worker.config import EngineConfig
from inference_worker.engine import RolloutEngine
from protocol.models import Completion, FinishReason, SamplingParams, TaskLease, TaskPrompt


@dataclass
class Rollout:
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason
    hidden: torch.Tensor  # [T, H]


def make_engine(model_dir: Path, dtype: str = "float32", max_model_len: int = 512,
    seeded_sampler: bool = True) -> RolloutEngine:
    """An in-process engine that returns hidden states (proofs are left to the caller). Without the
    seeded sampler it draws with vLLM's own sampling: what a worker that ignores the seeds sends."""
    return RolloutEngine(model_dir, EngineConfig(dtype=dtype, max_model_len=max_model_len, kv_cache_bytes=64 << 20,
                                                 proofs=False, seeded_sampler=seeded_sampler))


def batch_lease(prompts: list[np.ndarray], sampling: SamplingParams, seeds: list[int], lease_id: str = "tool",
    version: int = 0) -> TaskLease:
    """One lease of several prompts, one sample each (each sample its own seed)."""
    return TaskLease(
        lease_id=lease_id,
        prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=p, seeds=[s]) for i, (p, s) in enumerate(zip(prompts, seeds))],
        samples_per_prompt=1,
        sampling=sampling,
        policy_version=version,
        min_policy_version=0,
        deadline=time.time() + 3600,
    )


def generate(engine: RolloutEngine, prompts: list[np.ndarray], sampling: SamplingParams, seeds: list[int],
    batch: int = 32) -> list[Rollout]:
    out: list[Rollout] = []
    for start in range(0, len(prompts), batch):
        part, part_seeds = prompts[start : start + batch], seeds[start : start + batch]
        completions, hidden = engine.generate_with_hidden(batch_lease(part, sampling, part_seeds))
        for c, h in zip(completions, hidden):
            prompt = np.asarray(part[c.prompt_index], dtype=np.int32)
            out.append(Rollout(prompt, np.asarray(c.token_ids).copy(), np.asarray(c.logprobs).copy(), c.finish_reason,
                h))
    return out


def honest_completions(model_dir: Path, lease: TaskLease, dtype: str = "float32") -> list[Completion]:
    """Exactly what an unmodified worker submits for `lease`: a fresh in-process engine with proofs
    built during generation, closed afterwards (2-4 s to start on the tiny model)."""
    engine = RolloutEngine(model_dir, EngineConfig(dtype=dtype, max_model_len=512, kv_cache_bytes=64 << 20))
    try:
        return engine.generate(lease)
    finally:
        engine.close()
