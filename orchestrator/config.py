"""The orchestrator's settings (`[orchestrator]` and `[data]` of a run config), and `StepShape`: what the
orchestrator must know of how the trainer consumes samples.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.models import SamplingParams


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field("toy", description="task in verifier's registry that scores completions")
    path: str = Field("", description="JSONL or datasets folder; empty: generate the task's synthetic prompts")
    num_prompts: int = Field(4096, ge=1, description="synthetic prompts to generate")
    pass_rate_column: str = "pass_rate"
    min_pass_rate: float | None = Field(None, ge=0, le=1, description="offline difficulty filter")
    max_pass_rate: float | None = Field(None, ge=0, le=1)
    task_params: dict[str, Any] = {}


class OrchestratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    async_level: int = Field(2, ge=0, description="generation for step N may use any version >= N - async_level")
    samples_per_prompt: int = Field(8, ge=1, description="GRPO group size")
    prompts_per_lease: int = Field(4, ge=1)
    sampling: SamplingParams = SamplingParams()
    lease_timeout_s: float = Field(60.0, gt=0)
    max_open_leases_per_worker: int = Field(2, ge=1)
    rate_limit_per_s: float = Field(50.0, gt=0, description="requests per second per worker")
    strikes_to_ban: int = Field(3, ge=1)
    heartbeat_interval_s: float = Field(5.0, gt=0)
    worker_dead_after_s: float = Field(30.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    join_tokens: list[str] = Field(default_factory=lambda: ["demo-join-token"])
    admin_token: str = "demo-admin-token"
    db_path: str = Field("", description="SQLite file; default <run dir>/orchestrator.sqlite")


class StepShape(BaseModel):
    """How the trainer consumes samples, as far as leases, the async bound and staleness need to know."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples_per_step: int = Field(ge=1)
    mini_batches: int = Field(1, ge=1, description="optimizer steps (published versions) per batch")
    max_staleness: int = Field(ge=0)
    advantage_std: bool = True
