"""One run, one config: `RunConfig` composes every component's own config model (each default has one
owner: its package's model). Loaded by `swarmrl.loading` (TOML < environment < command line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inference_worker.config import WorkerConfig
from orchestrator.config import DataConfig, EvalConfig, OrchestratorConfig, StepShape
from shardcast.config import ShardcastConfig
from swarmrl.tracking import TrackingConfig
from trainer.config import TrainerConfig
from verifier.config import VerifierConfig


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field("", description="a transformers model folder; empty: make a tiny one in the run folder")
    init_size: Literal["tiny", "small"] = "tiny"
    init_arch: Literal["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"] | None = Field(
        None, description="make this real architecture (trainer/model_shapes.py, a BPE tokenizer trained here) "
        "instead of init_size's toy",
    )
    init_layers: int | None = Field(None, ge=1,
        description="with init_arch: fewer layers than the real model (a rehearsal at small size)")
    init_hidden: int | None = Field(None, ge=32,
        description="with init_arch: a narrower model, same architecture and vocabulary")
    init_seed: int = 0
    tie_embeddings: bool = True
    init_pretrain_steps: int = Field(
        0, ge=0, description="short base-model pretraining of the made model (trainer.tiny_model.pretrain_corpus); "
        "with init_pretrain_target, the minimum"
    )
    init_tool_format: bool = Field(
        False, description="the pretraining also teaches the lookup environment's tool format, with letters "
        "(multi-turn demo)"
    )
    init_pretrain_target: float | None = Field(
        None, gt=0, le=1,
        description="pretrain on until this echo accuracy (fresh echo lines, greedy, checked every 10 steps); None: "
        "exactly init_pretrain_steps",
    )
    init_pretrain_max_steps: int = Field(0, ge=0, description="cap on the pretraining steps with init_pretrain_target")

    @model_validator(mode="after")
    def _arch_or_size(self) -> "ModelConfig":
        if self.init_arch is None and (self.init_layers is not None or self.init_hidden is not None):
            raise ValueError("model.init_layers and model.init_hidden scale a real architecture: set model.init_arch")
        if self.init_arch is not None and (self.init_pretrain_target is not None or self.init_tool_format):
            raise ValueError("model.init_pretrain_target and init_tool_format are the toy model's (echo data); with "
                "init_arch use init_pretrain_steps")
        return self


class ResourcesConfig(BaseModel):
    """Ray resources of the trusted actors (GPUs on a cluster; 0 on a laptop)."""

    model_config = ConfigDict(extra="forbid")

    trainer_gpus: float = Field(0.0, ge=0, description="GPUs of each trainer rank (trainer.world_size ranks)")
    verifier_gpus: float = Field(0.0, ge=0, description="per verifier actor")
    verifier_cpus: float = Field(
        0.0, ge=0,
        description="per verifier actor: Ray places an actor only where these are free (on KubeRay, the autoscaler "
        "adds a node)"
    )
    trainer_resources: dict[str, float] = Field(default_factory=dict,
        description="custom Ray resources, e.g. {trainer = 1} to land on the trainer group")
    verifier_resources: dict[str, float] = Field(default_factory=dict)
    trainer_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy of the trainer ranks' group (trainer.world_size > 1): PACK fills "
        "a node first"
    )
    max_restarts: int = Field(
        5, ge=0, description="restarts of one component (an actor or a local process) within restart_window_s; one "
        "more stops the run"
    )
    restart_window_s: float = Field(600.0, gt=0)
    cpu_affinity: dict[Literal["workers", "trainer", "verifier", "orchestrator", "relays"], list[int]] = Field(
        default_factory=dict,
        description="pin local components to CPU cores, e.g. {workers = [0], trainer = [1]}: one machine standing in "
        "for several",
    )


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("demo", pattern=r"^[\w.-]+$")
    seed: int = 0
    output_dir: str = "runs"
    ray_address: str = Field("", description="empty: start a local Ray")
    num_workers: int = Field(1, ge=0, description="local inference workers started by `swarmrl run`")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    max_minutes: float = Field(0.0, ge=0, description="stop after this much wall time; 0: no limit")
    stop_reward: float | None = Field(
        None, description="stop once the mean reward of the accepted rollouts stays at or above this for 5 steps"
    )
    resources: ResourcesConfig = ResourcesConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    verifier: VerifierConfig = VerifierConfig()
    trainer: TrainerConfig = TrainerConfig()
    shardcast: ShardcastConfig = ShardcastConfig()
    worker: WorkerConfig = WorkerConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @model_validator(mode="after")
    def _whole_groups_per_step(self) -> "RunConfig":
        # The buffer hands out whole GRPO groups; a step of a fraction of a group would leave it short.
        if self.trainer.samples_per_step % self.orchestrator.samples_per_prompt:
            raise ValueError(
                f"trainer.samples_per_step ({self.trainer.samples_per_step}) must be a multiple of "
                f"orchestrator.samples_per_prompt, the group size ({self.orchestrator.samples_per_prompt})"
            )
        return self

    @model_validator(mode="after")
    def _trusted_behaviour_logprobs(self) -> "RunConfig":
        # A submission that is not spot-checked has no verifier logprobs: the worker's raw ones stand in
        # for mu, and they are the tempered ones only at temperature 1 (or greedy, trained at 1).
        temperature = self.orchestrator.sampling.temperature
        partial = {level: rate for level, rate in self.verifier.spot_check_rate.items() if rate < 1.0}
        if partial and temperature not in (0.0, 1.0):
            raise ValueError(
                f"verifier.spot_check_rate below 1 ({partial}) needs orchestrator.sampling.temperature 1 (or 0): "
                f"unchecked "
                f"submissions have only the worker's raw logprobs, which are not those of temperature {temperature}"
            )
        return self

    def step_shape(self) -> StepShape:
        """What the orchestrator needs to know of the trainer."""
        t = self.trainer
        return StepShape(samples_per_step=t.samples_per_step, mini_batches=t.mini_batches,
            max_staleness=t.max_staleness, advantage_std=t.loss.advantage_std)


def load_run_config(path: str | Path | None = None, overrides: dict[str, str] | list[str] | None = None,
    environ: dict[str, str] | None = None) -> RunConfig:
    """A RunConfig from TOML < SWARMRL_* environment < command-line overrides (see swarmrl.loading)."""
    from swarmrl.loading import load_config

    return load_config(path, overrides, environ, model=RunConfig)
