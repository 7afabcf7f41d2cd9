"""Offline difficulty filtering (INTELLECT-2): sample each prompt k times with the current model, score the
samples with the task's trusted reward, and keep the prompts whose pass rate lies in a window.

Too easy (always solved) and too hard (never solved) prompts give GRPO groups with no signal, which the
orchestrator drops online anyway, after paying for their generation and verification. Filtering once,
offline, spends that compute once. The output is a `datasets.save_to_disk` folder with the input's rows
(columns unchanged, so the same field map reads it) plus a pass-rate column; `[data] path` reads it.

Generation uses the workers' engine (`inference_worker.engine.RolloutEngine`, vLLM, seeded sampling with
the run's sampling parameters), and scoring the verifier's sandboxed reward pool, as in a run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.data import DataError, encode_prompt, items_from_rows, load_tokenizer, read_records, use_chat_template
from protocol import limits
from swarmrl.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class FilterResult:
    rows: list[dict[str, Any]]  # the kept rows, each with its pass rate
    rates: list[float | None]  # per input row; None: not scored (too long for the limit or the engine)
    kept: int
    too_long: int


def pass_rates(cfg: RunConfig, model_dir: str | Path, samples: int, pass_threshold: float = 1.0,
    prompts_per_batch: int = 32) -> tuple[list[dict[str, Any]], list[float | None], int]:
    """(rows, pass rate per row or None if the prompt is too long, rows too long) for cfg.data's dataset."""
    from inference_worker.engine import RolloutEngine
    from protocol.models import TaskLease, TaskPrompt
    from verifier.reward_pool import RewardPool
    from verifier.reward_requests import RewardRequest

    data = cfg.data
    if not data.path:
        raise DataError("data filter needs a dataset: set data.path")
    rows = read_records(data.path, data.split)
    items = items_from_rows(rows, data)
    tok = load_tokenizer(model_dir)
    chat = use_chat_template(data, tok)
    max_tokens = cfg.orchestrator.sampling.max_tokens
    limit = min(data.max_prompt_tokens or limits.MAX_PROMPT_TOKENS, limits.MAX_PROMPT_TOKENS,
        cfg.worker.engine.max_model_len - max_tokens)
    encoded = [encode_prompt(item, tok, chat) for item in items]
    todo = [i for i, ids in enumerate(encoded) if 0 < ids.size <= limit]
    too_long = len(rows) - len(todo)
    if too_long:
        log.warning("prompts too long to sample, left out", extra={"dropped": too_long, "limit": limit})

    rng = np.random.default_rng(cfg.seed)
    task = data.reward or data.task
    params = data.reward_params if data.reward else data.task_params
    rates: list[float | None] = [None] * len(rows)
    vocab = len(tok)
    engine = RolloutEngine(model_dir, cfg.worker.engine, seed=cfg.seed)
    pool = RewardPool(cfg.verifier.rewards, warmup=[(task, params)])
    try:
        step = min(prompts_per_batch, limits.MAX_PROMPTS_PER_TASK)
        for start in range(0, len(todo), step):
            batch = todo[start:start + step]
            prompts = [TaskPrompt(prompt_id=f"row-{i}", token_ids=encoded[i], seeds=[int(s) for s in rng.integers(0,
                2**63, samples)]) for i in batch]
            lease = TaskLease(
                lease_id=f"filter-{start}", prompts=prompts, samples_per_prompt=samples,
                sampling=cfg.orchestrator.sampling, policy_version=0, min_policy_version=0,
                deadline=time.time() + 86400,
            )
            completions = engine.generate(lease)
            # Decoded as the verifier decodes (ids past the tokenizer's vocabulary are padding: nothing).
            texts = [tok.decode([t for t in c.token_ids.tolist() if t < vocab], skip_special_tokens=True)
                for c in completions]
            results = pool.score_many([RewardRequest(task, items[batch[c.prompt_index]], text, params) for c,
                text in zip(completions, texts)])
            passed = np.zeros(len(batch))
            for c, r in zip(completions, results):
                passed[c.prompt_index] += r.reward >= pass_threshold
            for j, i in enumerate(batch):
                rates[i] = float(passed[j] / samples)
            log.info("data filter progress", extra={"scored": min(start + step, len(todo)), "of": len(todo)})
    finally:
        pool.close()
        engine.close()
    return rows, rates, too_long


def filter_dataset(cfg: RunConfig, model_dir: str | Path, out: str | Path, samples: int, min_pass: float,
    max_pass: float, pass_threshold: float = 1.0) -> FilterResult:
    """Score, keep rows with min_pass <= pass rate <= max_pass, and write them (plus the rate) to `out`."""
    import datasets

    if not 0 <= min_pass <= max_pass <= 1:
        raise ValueError(f"need 0 <= min_pass <= max_pass <= 1, got {min_pass}, {max_pass}")
    rows, rates, too_long = pass_rates(cfg, model_dir, samples, pass_threshold)
    column = cfg.data.pass_rate_column
    kept = [{**row, column: rate} for row, rate in zip(rows, rates) if rate is not None
        and min_pass <= rate <= max_pass]
    if not kept:
        raise DataError(
            f"no prompt's pass rate lies in [{min_pass}, {max_pass}] "
            f"(rates: {sorted(r for r in rates if r is not None)})")
    datasets.Dataset.from_list(kept).save_to_disk(str(out))
    log.info("data filter done", extra={"rows": len(rows), "kept": len(kept), "too_long": too_long, "out": str(out)})
    return FilterResult(kept, rates, len(kept), too_long)
