"""Calibration and test helper: real vLLM generation (in-process, CPU) with capture of the final hidden states.

This is what an honest inference worker does: generate with vLLM, record tokens, raw logprobs and the
finish reason, and capture the final-norm hidden state that produced each token by wrapping
`model.compute_logits` (shared/notes/vllm-cpu.md). Self-contained so the verifier's tests do not depend
on the worker package. vLLM is imported lazily: only calibration, tests and benchmarks use this.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from protocol.models import FinishReason, SamplingParams


@dataclass
class Rollout:
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason
    hidden: torch.Tensor  # [T, H]


class CapturingLLM:
    def __init__(self, model_dir: Path, dtype: str = "float32", max_model_len: int = 512, seed: int = 0):
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            enforce_eager=True,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=64 << 20,
            max_model_len=max_model_len,
            seed=seed,
        )
        self.runner = self.llm.collective_rpc(_model_runner)[0]
        self.model = self.runner.model
        self.rows: dict[str, list[torch.Tensor]] = {}
        original = self.model.compute_logits

        def compute_logits(hidden_states, *args, **kwargs):
            req_ids = list(self.runner.input_batch.req_ids)
            if hidden_states.shape[0] != len(req_ids):
                raise RuntimeError(f"{hidden_states.shape[0]} rows for {len(req_ids)} requests")
            for rid, row in zip(req_ids, hidden_states.detach()):
                self.rows.setdefault(rid, []).append(row.clone())
            return original(hidden_states, *args, **kwargs)

        self.model.compute_logits = compute_logits

    def generate(self, prompts: list[np.ndarray], sampling: SamplingParams, seeds: list[int]) -> list[Rollout]:
        from vllm import SamplingParams as VSP

        self.rows.clear()
        params = [
            VSP(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                max_tokens=sampling.max_tokens,
                stop_token_ids=list(sampling.stop_token_ids),
                seed=seed,
                logprobs=0,
            )
            for seed in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params, use_tqdm=False)
        by_prefix: dict[str, list[torch.Tensor]] = {}
        for rid, rows in self.rows.items():
            by_prefix[rid.split("-")[0]] = rows
        result = []
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            tokens = np.asarray(c.token_ids, dtype=np.int32)
            lps = np.asarray([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], dtype=np.float32)
            rows = by_prefix[out.request_id.split("-")[0]]
            hidden = torch.stack(rows[-len(tokens):])
            result.append(Rollout(np.asarray(prompt, dtype=np.int32), tokens, lps, FinishReason(c.finish_reason), hidden))
        return result

    def reload(self, state: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hot-swap weights (the tied-embedding lm_head repack bug is worked around, see the notes)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state)})
        self.llm.collective_rpc(_repack_lm_head)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.model, self.runner
        del self.llm
        gc.collect()


def _model_runner(worker):
    return worker.model_runner


def _repack_lm_head(worker):
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.model
    with set_current_vllm_config(worker.vllm_config):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
