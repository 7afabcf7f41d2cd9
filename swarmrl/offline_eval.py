"""`swarmrl eval`: the evaluation of the swarm (orchestrator/evaluation.py) on one machine, without a run:
the workers' vLLM engine (seeded sampler, so draws are reproducible) on a trainer checkpoint, a transformers
folder or a published version folder, the task's trusted reward in the verifier's sandboxed reward pool,
and the same avg@k / pass@k / completion length summary. By default the prompts are the run config's
held-out ones, so a checkpoint can be scored on exactly what the run evaluated during training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.data import Prompt, PromptSet, load_tokenizer
from orchestrator.evaluation import held_out_data, hold_out, summarize
from protocol import limits
from protocol.models import SamplingParams, TaskLease, TaskPrompt
from protocol.operator_models import EvalResult
from swarmrl.config import RunConfig

log = logging.getLogger(__name__)


def resolve_model(path: Path, base_model: Path | None = None) -> tuple[Path, Path | None, int | None]:
    """(folder the engine starts from, weights folder to load into it or None, policy version if known) for
    a trainer checkpoint, a run folder (its latest checkpoint), a transformers folder, or a published
    version folder of safetensors shards (which needs `base_model` for the config and tokenizer)."""
    from trainer.checkpoint import checkpoint_root, latest_checkpoint

    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        latest = latest_checkpoint(checkpoint_root(path)) if (path / "checkpoints").is_dir() else None
        path = latest or path
    if (path / "trainer_state.json").is_file():
        version = json.loads((path / "trainer_state.json").read_text()).get("published_version")
        return path / "model", None, None if version is None else int(version)
    if (path / "config.json").is_file():
        return path, None, None
    if any(path.glob("*.safetensors")):
        if base_model is None or not (Path(base_model) / "config.json").is_file():
            raise ValueError(f"{path} holds weights only (a published version): pass --base-model, a folder with its "
                f"config and tokenizer")
        manifest = path / "manifest.json"  # a shardcast version folder says which version it is
        version = json.loads(manifest.read_text()).get("version") if manifest.is_file() else None
        return Path(base_model), path, None if version is None else int(version)
    raise ValueError(f"{path} is neither a checkpoint, a run folder, a transformers folder nor a folder of "
        f"safetensors weights")


def eval_prompts(cfg: RunConfig, model_dir: Path, data: Path | None = None, limit: int = 0) -> list[Prompt]:
    """`data` if given, else the run's held-out prompts: eval.path / eval.split, or its seeded held-out slice
    (what training evaluates)."""
    source = cfg.data.model_copy(update={"path": str(data), "split": cfg.eval.split
        or cfg.data.split}) if data else held_out_data(cfg.data, cfg.eval)
    if source is not None:
        prompts = PromptSet.from_config(source, model_dir, cfg.seed).prompts
    else:
        held = hold_out(PromptSet.from_config(cfg.data, model_dir, cfg.seed), cfg.eval.num_prompts, cfg.seed)
        prompts = [held.prompts[i] for i in held.held_out]
    return prompts[:limit] if limit else prompts


def sample_seeds(seed: int, prompt_id: str, k: int) -> list[int]:
    """k seeds of a prompt, fixed by (seed, prompt id): the same command draws the same samples."""
    words = hashlib.shake_128(f"swarmrl-eval:{seed}:{prompt_id}".encode()).digest(8 * k)
    return (np.frombuffer(words, dtype="<u8") >> np.uint64(1)).tolist()


def evaluate(
    cfg: RunConfig, checkpoint: Path, *, samples: int, data: Path | None = None, base_model: Path | None = None,
    num_prompts: int = 0, seed: int = 0, engine: Any = None,
) -> tuple[EvalResult, dict[str, Any]]:
    """Generate `samples` completions per prompt with the checkpoint, score them with the trusted reward and
    summarize. Returns the result and what was evaluated (model, prompts, timings)."""
    from inference_worker.engine import RolloutEngine
    from verifier.reference import eos_token_ids
    from verifier.reward_pool import RewardPool
    from verifier.reward_requests import RewardRequest
    from verifier.service import decode_completion

    model_dir, weights_dir, version = resolve_model(checkpoint, base_model)
    prompts = eval_prompts(cfg, model_dir, data, num_prompts)
    sampling: SamplingParams = cfg.orchestrator.sampling
    if engine is None:  # proofs are for verifiers; nothing here is checked by anyone else
        engine = RolloutEngine(model_dir, cfg.worker.engine.model_copy(update={"proofs": False}))
    if weights_dir is not None:
        engine.reload(weights_dir, version or 0, "")
    started = time.perf_counter()
    per_lease = max(1, min(limits.MAX_PROMPTS_PER_TASK, limits.MAX_COMPLETIONS_PER_SUBMISSION // samples))
    completions: list[tuple[Prompt, list[Any]]] = []
    for start in range(0, len(prompts), per_lease):
        chunk = prompts[start : start + per_lease]
        lease = TaskLease(
            lease_id=f"eval-{start}", samples_per_prompt=samples, sampling=sampling, policy_version=version or 0,
            min_policy_version=0, deadline=time.time() + 86400.0,
            prompts=[TaskPrompt(prompt_id=p.prompt_id, token_ids=p.token_ids, seeds=sample_seeds(seed, p.prompt_id,
            samples)) for p in chunk],
        )
        out = engine.generate(lease)
        for j, p in enumerate(chunk):
            completions.append((p, sorted((c for c in out if c.prompt_index == j), key=lambda c: c.sample_index)))
    generated = time.perf_counter() - started
    tokenizer = load_tokenizer(model_dir)
    eos = set(eos_token_ids(model_dir)) | ({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None
        else set())
    data_cfg = cfg.data
    task, params = (data_cfg.reward, data_cfg.reward_params) if data_cfg.reward else (data_cfg.task,
        data_cfg.task_params)
    requests = [RewardRequest(task, p.item, decode_completion(tokenizer, eos, c.token_ids), params, p.prompt_id) for p,
        cs in completions for c in cs]
    with RewardPool(cfg.verifier.rewards) as pool:
        scored = pool.score_many(requests)
    rewards = iter(r.reward for r in scored)
    per_prompt = [([next(rewards) for _ in cs], [int(c.token_ids.size) for c in cs]) for _, cs in completions]
    pass_ks = sorted({k for k in [*cfg.eval.pass_at, samples] if 1 <= k <= samples})
    result = summarize(
        version or 0, per_prompt, planned=len(prompts), k=samples, pass_ks=pass_ks, threshold=cfg.eval.pass_threshold,
        complete=True, finished_at=time.time(),
    )
    info = {
        "model": str(model_dir), "weights": None if weights_dir is None else str(weights_dir), "data": str(data
        or cfg.eval.path or cfg.eval.split or "held-out slice"),
        "task": task, "seed": seed, "prompt_ids": [p.prompt_id for p in prompts], "generate_s": round(generated, 3),
        "reward_errors": sum(r.status.value != "ok" for r in scored),
    }
    return result, info
