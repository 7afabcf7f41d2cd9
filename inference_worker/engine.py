"""The rollout engine: vLLM generates a leased task; proofs come from hidden states captured on the way.

What a completion carries, and what the verifier checks it against:

- `token_ids`: the sampled tokens. With finish reason "stop" the last token is EOS or one of the lease's
  stop tokens (vLLM keeps it in `token_ids`); with "length" there are exactly `max_tokens` tokens.
- `logprobs`: for each sampled token, its log-probability under the policy **before** temperature,
  top-k and top-p are applied: vLLM's default `logprobs_mode="raw_logprobs"` (log-softmax of the raw
  logits). We ask for `logprobs=0`, which returns exactly the sampled token's logprob. The verifier
  recomputes the same quantity (log-softmax of its own logits) in one prefill and compares.
- `proofs`: TOPLOC-style proofs (`verifier.proofs.build_proofs`) over the final-norm hidden states
  [T, H], row t being the hidden state that produced token t. They are captured while vLLM generates
  (`inference_worker.capture`), inside vLLM's worker process; there is no second forward pass. Each
  full 32-token chunk is proven in a background thread while generation continues.

LoRA runs (trainer.lora): a version is an adapter (`shardcast.adapter`). The engine runs the base with
vLLM's LoRA support on, and `reload` of an adapter version only writes it as a peft folder and makes it the
`LoRARequest` of later generate calls (a new int id per version): the base's weights are never reloaded.
The captured hidden states are those of base + adapter, which is what the verifier recomputes.

Seeds: every sample is its own vLLM request (vLLM's `n>1` cannot carry per-sample seeds). Its tokens
are drawn by the seeded sampler (`inference_worker.seeded_sampler`, the draw of `protocol.sampling`):
the request reaches vLLM as greedy and carries the lease's seed, temperature, top-k and top-p in
`extra_args`; the sampler leaves only the seed's winner in each row, which the verifier can replay.

The engine runs vLLM in-process (`EngineConfig.multiprocess=False`, for tests and single-machine runs)
or in vLLM's multiprocess mode; `collective_rpc` calls reach the capture in either case, and only
bytes travel back.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from inference_worker.config import EngineConfig

# LeaseNotGeneratable is also imported from here (inference_worker.loop, tests)
from inference_worker.generation import GenerationStats, LeaseNotGeneratable
from inference_worker.generation import finish_reason as _finish_reason
from protocol import limits, memory
from protocol.models import Completion, TaskLease

log = logging.getLogger(__name__)

CAPTURE_EXTENSION = "inference_worker.capture.HiddenStateCapture"
# With proofs off (benchmarks only) every chunk gets this placeholder; a verifier rejects it.
NO_PROOF = b"\x00"
# The ranks vLLM's `max_lora_rank` accepts (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@contextmanager
def _vllm_process_mode(multiprocess: bool) -> Iterator[None]:
    """vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING when an engine is built (and caches env vars after
    the first engine in a process), so set it, uncached, just for the construction."""
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    # For the life of the process (vLLM reads it again after construction): the seeded sampler has
    # vLLM's V1 logits-processor interface, which Model Runner V2 (vLLM's default on CUDA with Triton;
    # the CPU build runs V1) refuses to load.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    os.environ[key] = "1" if multiprocess else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()


class RolloutEngine:
    """vLLM over one model folder; `generate` a lease, `reload` a new policy version in place."""

    def __init__(self, model_dir: Path | str, config: EngineConfig | None = None, *, policy_version: int | None = None,
        model_hash: str | None = None, seed: int = 0, dummy_weights: bool = False):
        from vllm import LLM
        from vllm.platforms import current_platform

        from inference_worker.seeded_sampler import SEEDED_SAMPLER

        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir) if os.path.exists(str(model_dir)) else model_dir
        self.policy_version = policy_version
        self.model_hash = model_hash
        self.last_stats = GenerationStats()
        self.environments: dict = {}  # made once per engine (episodes.py): each reads every token's text
        kwargs: dict = dict(
            model=str(model_dir),
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            enforce_eager=self.config.enforce_eager,
            distributed_executor_backend="uni",
            worker_extension_cls=CAPTURE_EXTENSION,
            logits_processors=[SEEDED_SAMPLER] if self.config.seeded_sampler else None,
            seed=seed,
            enable_prefix_caching=True,
        )
        if dummy_weights:  # a folder of config and tokenizer only: reload() brings every weight before use
            kwargs["load_format"] = "dummy"
        self.lora_request = None  # the adapter version in use (LoRA runs), else None
        self._adapters_dir: tempfile.TemporaryDirectory | None = None
        self._base_hash: str | None = None
        if self.config.max_lora_rank:
            # One adapter at a time: a worker generates with one policy version between two reloads.
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in VLLM_LORA_RANKS
                if r >= self.config.max_lora_rank))
            self._adapters_dir = tempfile.TemporaryDirectory(prefix="swarmrl-adapters-")
        if current_platform.is_cpu():
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes(model_dir)
        else:
            kwargs["gpu_memory_utilization"] = self.config.gpu_memory_utilization
        started = time.perf_counter()
        with _vllm_process_mode(self.config.multiprocess):
            self.llm = LLM(**kwargs)
        self.llm.collective_rpc("swarmrl_capture_install")
        self.hidden_size = int(self.llm.collective_rpc("swarmrl_hidden_size")[0])
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        log.info("vLLM engine up in %.1f s (multiprocess=%s)", time.perf_counter() - started, self.config.multiprocess)

    def kv_cache_bytes(self, model_dir) -> int:
        """The configured KV cache, or one derived from the model's shape (inference_worker/kv_cache.py)."""
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        from transformers import AutoConfig

        from inference_worker.kv_cache import derived_bytes

        cfg = self.config
        size = derived_bytes(AutoConfig.from_pretrained(model_dir), cfg.dtype, cfg.max_model_len,
            cfg.kv_cache_sequences, cfg.kv_cache_max_fraction)
        log.info("KV cache %.0f MiB, derived from the model (%d sequences of %d tokens at most)", size / 2**20,
            cfg.kv_cache_sequences, cfg.max_model_len)
        return size

    # ----------------------------------------------------------------------------------------------
    # Generation

    def _sampling_params(self, lease: TaskLease, seed: int):
        from vllm import SamplingParams

        from inference_worker.seeded_sampler import extra_args

        s = lease.sampling
        if self.config.seeded_sampler:
            # Greedy over the row the seeded sampler leaves: it alone applies temperature / top-k / top-p.
            how = dict(temperature=0.0, extra_args=extra_args(seed, s.temperature, s.top_k, s.top_p))
        else:  # vLLM's own sampling (benchmarks only)
            how = dict(temperature=s.temperature, top_p=s.top_p, top_k=0 if s.top_k == -1 else s.top_k, seed=int(seed))
        return SamplingParams(
            **how,
            max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids),
            logprobs=0,  # the sampled token's own logprob, raw (before temperature / top-k / top-p)
            detokenize=False,
        )

    def generate(self, lease: TaskLease) -> list[Completion]:
        """All samples of all prompts of `lease`, in (prompt_index, sample_index) order."""
        return self._generate(lease, return_hidden=False)[0]

    def generate_with_hidden(self, lease: TaskLease) -> tuple[list[Completion], list[torch.Tensor]]:
        """As `generate`, also returning each completion's captured hidden states [T, H] (float32)."""
        return self._generate(lease, return_hidden=True)

    def _generate(self, lease: TaskLease, return_hidden: bool) -> tuple[list[Completion], list[torch.Tensor]]:
        from vllm.inputs import TokensPrompt

        from inference_worker.capture import hidden_from_bytes

        if self.policy_version is not None and self.policy_version < lease.min_policy_version:
            raise LeaseNotGeneratable(f"loaded policy version {self.policy_version} is below the lease's minimum "
                f"{lease.min_policy_version}")
        if lease.environment is not None:  # multi-turn: the turn loop (hidden states returned by the capture)
            from inference_worker.episodes import generate_episodes

            return generate_episodes(self, lease, return_hidden)
        max_tokens = lease.sampling.max_tokens
        prompts, params, keys = [], [], []
        for pi, prompt in enumerate(lease.prompts):
            ids = [int(t) for t in prompt.token_ids]
            if len(ids) + max_tokens > self.max_model_len:
                raise LeaseNotGeneratable(f"prompt {prompt.prompt_id}: {len(ids)} prompt tokens + max_tokens "
                    f"{max_tokens} exceed max_model_len {self.max_model_len}")
            for si, seed in enumerate(prompt.seeds):
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(self._sampling_params(lease, seed))
                keys.append((pi, si, len(ids)))

        capture = self.config.proofs or return_hidden
        started = time.perf_counter()
        if capture:
            self.llm.collective_rpc("swarmrl_capture_start", args=(self.config.proofs,))
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        except BaseException:
            if capture:  # stop the capture so that rows never pile up
                self.llm.collective_rpc("swarmrl_capture_take", args=({}, False, False))
            raise
        captured: dict = {}
        capture_stats: dict = {}
        if capture:
            lengths = {o.request_id: [k[2], len(o.outputs[0].token_ids)] for o, k in zip(outputs, keys)}
            taken = self.llm.collective_rpc("swarmrl_capture_take", args=(lengths, self.config.proofs,
                return_hidden))[0]
            captured, capture_stats = taken["requests"], taken["stats"]

        completions: list[Completion] = []
        hidden: list[torch.Tensor] = []
        total_tokens = 0
        for out, (pi, si, _) in zip(outputs, keys):
            sample = out.outputs[0]
            token_ids = np.asarray(sample.token_ids, dtype=np.int32)
            if token_ids.size == 0:
                raise RuntimeError(f"vLLM returned an empty completion for prompt {pi} sample {si}")
            logprobs = np.array([entry[int(t)].logprob for t, entry in zip(sample.token_ids, sample.logprobs)],
                dtype=np.float32)
            # A logprob of exactly 0 can come out slightly positive in float32 (-0.0 vs +1e-8).
            np.minimum(logprobs, 0.0, out=logprobs)
            finish = _finish_reason(sample.finish_reason, token_ids.size, max_tokens)
            entry = captured[out.request_id] if capture else {}
            if self.config.proofs:
                proofs = entry["proofs"]
            else:
                proofs = [NO_PROOF] * math.ceil(token_ids.size / limits.PROOF_CHUNK_TOKENS)
            completions.append(Completion(prompt_index=pi, sample_index=si, token_ids=token_ids, logprobs=logprobs,
                finish_reason=finish, proofs=proofs))
            if return_hidden:
                hidden.append(hidden_from_bytes(entry))
            total_tokens += int(token_ids.size)
        self.last_stats = GenerationStats(
            len(completions), total_tokens, time.perf_counter() - started,
            capture_stats.get("record_s", 0.0), capture_stats.get("proof_thread_s", 0.0), capture_stats.get("take_s",
            0.0),
        )
        return completions, hidden

    # ----------------------------------------------------------------------------------------------
    # Weights

    def reload(self, weights_dir: Path | str, version: int, model_hash: str, state: dict[str,
        torch.Tensor] | None = None) -> float:
        """Load a new policy version in place; returns seconds taken.

        `state`: the version's verified tensors in memory (a shardcast pull that applied deltas has them):
        in-process, vLLM takes them directly and the disk is not read. Otherwise (or in multiprocess mode,
        where tensors cannot cross to the engine process) `weights_dir/*.safetensors` is read. Generation
        afterwards uses the new weights: the tied-embedding lm_head is repacked inside the worker
        (`HiddenStateCapture.swarmrl_reload`) and the prefix cache, which holds KV computed with the old
        weights, is cleared.
        """
        from shardcast.adapter import is_adapter

        weights_dir = Path(weights_dir)
        started = time.perf_counter()
        adapter = is_adapter(state if state is not None else weights_dir)
        if adapter:
            self._use_adapter(weights_dir, version, state)
        elif state is not None and not self.config.multiprocess:
            self.llm.collective_rpc("swarmrl_reload", kwargs={"weights": list(state.items())})
        elif not any(weights_dir.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors in {weights_dir}")
        else:
            self.llm.collective_rpc("swarmrl_reload", args=(str(weights_dir),))
        if not adapter:
            self._drop_adapter()  # a full version replaces base + adapter
        self.llm.reset_prefix_cache()
        memory.trim()  # the replaced weights
        self.policy_version = int(version)
        self.model_hash = model_hash
        took = time.perf_counter() - started
        log.info("reloaded policy version %d from %s in %.2f s", version, "memory" if state is not None
            and not self.config.multiprocess else weights_dir, took)
        return took

    def _use_adapter(self, weights_dir: Path, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Make an adapter version the one later generate calls use (vLLM loads it on first use)."""
        from vllm.lora.request import LoRARequest

        from shardcast.adapter import base_model_hash, load_version, unpack_adapter, write_peft_dir

        if self._adapters_dir is None:
            raise RuntimeError(f"version {version} is a LoRA adapter, but this engine runs without LoRA "
                f"(EngineConfig.max_lora_rank = 0)")
        state = state if state is not None else load_version(weights_dir)
        _, adapter_config, base_hash = unpack_adapter(state)
        if int(adapter_config["r"]) > self.config.max_lora_rank:
            raise RuntimeError(f"version {version}'s adapter has rank {adapter_config['r']} > max_lora_rank "
                f"{self.config.max_lora_rank}")
        if isinstance(self.model_dir, Path):  # a local base: refuse an adapter trained on another one
            self._base_hash = self._base_hash or base_model_hash(self.model_dir)
            if base_hash != self._base_hash:
                raise RuntimeError(f"version {version}'s adapter is for base {base_hash[:12]}..., this engine runs "
                    f"base {self._base_hash[:12]}...")
        path = write_peft_dir(state, Path(self._adapters_dir.name) / f"v{version}")
        self._drop_adapter()
        # vLLM caches adapters by int id (> 0): a new id per version, never reused.
        self.lora_request = LoRARequest(f"v{version}", int(version) + 1, str(path))

    def _drop_adapter(self) -> None:
        old, self.lora_request = self.lora_request, None
        if old is None:
            return
        try:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        except (AttributeError, KeyError, ValueError, RuntimeError):
            pass  # not loaded yet (never generated with); vLLM's LRU would evict it anyway
        import shutil

        shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut vLLM down (joins the engine core process in multiprocess mode)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if self._adapters_dir is not None:
            self._adapters_dir.cleanup()
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
