from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from protocol.limits import MAX_LEASE_WAIT_S


class EngineConfig(BaseModel):
    """vLLM engine settings. A GPU is a config, not a fork of the code."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16|auto)$")
    max_model_len: int = Field(512, ge=16)
    kv_cache_bytes: int | None = Field(
        None, ge=1 << 20,
        description="KV cache size (CPU). Unset: derived from the model, enough for kv_cache_sequences sequences "
        "of max_model_len tokens, at most kv_cache_max_fraction of the available memory, never less than one "
        "(kv_cache.py)",
    )
    kv_cache_sequences: int = Field(16, ge=1, description="full-length sequences the derived KV cache holds at once")
    kv_cache_max_fraction: float = Field(0.25, gt=0, le=1,
        description="the derived KV cache's cap, of the memory available")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    multiprocess: bool = Field(False, description="vLLM's multiprocess engine; in-process starts faster")
    enforce_eager: bool = True
    proofs: bool = Field(True, description="build TOPLOC-style proofs during generation")
    seeded_sampler: bool = Field(True,
        description="draw tokens with the seeded sampler; off (vLLM's own sampling) is for benchmarks only: verifiers "
        "reject it")
    max_lora_rank: int = Field(
        0, ge=0, le=512,
        description="0: full-weight versions only; >0: vLLM's LoRA on, for adapter versions up to this rank "
        "(the worker turns it on by itself when the run publishes adapters)",
    )


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    orchestrator_url: str = "http://127.0.0.1:8000"
    join_token: SecretStr = SecretStr("")  # shown as ********** by --dry-run; empty: open join (open_join.py)
    join_token_file: str = Field(
        "", description="with no join_token: where the token claimed by open join is kept (per orchestrator URL) and "
        "read back on every later start; empty: <work_dir>/open-join-token.json, or ~/.swarmrl/open-join-token.json",
    )
    name: str = "worker"
    model: str = Field(
        "",
        description="base model (local folder or hub id) with config and tokenizer; weights then come from "
        "shardcast. Empty: use the downloaded version folder, which must then hold config.json",
    )
    work_dir: str = Field("", description="weights download folder; a temporary one if empty")
    work_dir_wait_s: float = Field(
        120.0, ge=0,
        description="one worker process per work_dir: a new one waits this long for the previous one (finishing "
        "its task after SIGTERM) to exit, then gives up (two would write the same weight files)",
    )
    engine: EngineConfig = EngineConfig()
    max_prompts_per_lease: int = Field(8, ge=1)
    lease_wait_s: float = Field(
        2.0, ge=0, le=MAX_LEASE_WAIT_S,
        description="when the run's generation budget is full, the orchestrator holds a lease request "
        "this long for room (a long poll) instead of the worker sleeping a retry-after; 0: ask and sleep",
    )
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    retries: int = Field(5, ge=0, description="retries of one request on network errors / 5xx before backing off")
    display: bool = Field(True, description="rich live panel (only on a terminal)")
    num_threads: int = Field(0, ge=0, description="torch threads; 0 leaves torch's default")
