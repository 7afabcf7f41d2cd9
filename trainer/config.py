from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossConfig(BaseModel):
    """The staleness-aware clipped objective (docs/architecture.md, "The objective"; trainer/loss.py)."""

    model_config = ConfigDict(extra="forbid")

    epsilon_low: float = Field(0.2, ge=0, le=1)
    epsilon_high: float = Field(0.2, ge=0, description="DAPO clip-higher uses 0.28")
    ratio_cap: float = Field(4.0, gt=1, description="delta: cap on u for negative advantages (INTELLECT-2)")
    importance_cap: float = Field(2.0, gt=0, description="c: truncation of pi_prox / mu")
    normalizer: Literal["tokens", "sequence", "constant"] = "tokens"
    constant_normalizer: float = Field(1024.0, gt=0)
    advantage_std: bool = Field(True, description="divide by the group std (False: Dr. GRPO)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the frozen reference model")
    entropy_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _cap_above_clip(self) -> "LossConfig":
        # For A < 0 our dual clip floors the surrogate at delta * A. With delta < 1 + eps_high that floor
        # would bite inside the clip range, where INTELLECT-2's ratio cap (clip u at delta) and ours
        # give different gradients: refuse the setting instead of silently picking one.
        if self.ratio_cap < 1 + self.epsilon_high:
            raise ValueError(
                f"ratio_cap (delta = {self.ratio_cap}) must be >= 1 + epsilon_high ({1 + self.epsilon_high}): below "
                f"that the "
                "negative-advantage cap acts inside the clip range"
            )
        return self


class LoraConfig(BaseModel):
    """LoRA (via peft): train low-rank adapters on a frozen base; each version publishes the adapter only."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="off: full fine-tuning (every version publishes the whole model)")
    rank: int = Field(8, ge=1, le=512, description="r; vLLM serves ranks up to its max_lora_rank (the worker picks it)")
    alpha: float = Field(16.0, gt=0, description="the adapter's update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1,
        description="on the adapter input while training (0 keeps proximal logprobs exact)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="linear layers (by module name) that get an adapter",
    )


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loss: LossConfig = LossConfig()
    lora: LoraConfig = LoraConfig()
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    max_steps: int = Field(100, ge=1)
    samples_per_step: int = Field(64, ge=1, description="verified samples per optimizer step")
    micro_batch_tokens: int = Field(4096, ge=16, description="token budget of one packed micro-batch")
    grad_clip: float = Field(1.0, gt=0)
    bf16: bool = Field(False, description="bf16 autocast (CPU and GPU)")
    publish_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="precision of the published weights (the master stays float32; bfloat16 deltas are ~10x smaller)"
    )
    max_staleness: int = Field(2, ge=0, description="samples older than this many versions are dropped")
    checkpoint_every: int = Field(10, ge=1)
    background_checkpoints: bool = Field(
        True, description="write each step's checkpoint (and publish its versions) while the next step trains; false: "
        "in the step"
    )
    keep_checkpoints: int = Field(2, ge=1)
    num_threads: int = Field(0, ge=0, description="torch threads; 0 leaves torch's default")
    seed: int = 0
    device: str = Field("auto", description="auto: cuda if available, else cpu")
    attention: str = Field(
        "varlen",
        description='varlen: per-sequence causal sdpa for packed rows (CPU); or a transformers attn_implementation, '
        'e.g. "flash_attention_2" on GPU'
    )
    batching: Literal["packed", "padded"] = Field("packed", description="padded is the baseline the bench compares")
    mini_batches: int = Field(
        1, ge=1, description="optimizer steps per batch of samples; each publishes a version (INTELLECT-2 uses 8)"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine schedule floor, as a fraction of lr")
    distributed: Literal["fsdp2", "ddp"] = Field("fsdp2", description="multi-process strategy when WORLD_SIZE > 1")
    world_size: int = Field(
        1, ge=1, description="trainer ranks that `swarmrl run` places in one Ray placement group (data parallel, "
        "FSDP2); 1: one process"
    )
