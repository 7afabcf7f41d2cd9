from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ProofThresholds(BaseModel):
    """Acceptance thresholds for one proof chunk. Defaults are calibrated in bench/results/."""

    model_config = ConfigDict(extra="forbid")

    max_exponent_mismatches: int = Field(38, ge=0, le=128, description="of the top-128 values (TOPLOC: >=90 must match)")
    max_mantissa_mean: float = Field(10.0, ge=0)
    max_mantissa_median: float = Field(8.0, ge=0)


class VerifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_actors: int = Field(1, ge=1)
    keep_versions: int = Field(3, ge=1, description="policy versions kept loaded per actor (LRU)")
    max_batch_tokens: int = Field(16384, ge=1, description="tokens per batched prefill")
    thresholds: ProofThresholds = ProofThresholds()
    logprob_max_abs_diff: float = Field(0.5, gt=0, description="per token, reported vs recomputed")
    logprob_max_mean_diff: float = Field(0.05, gt=0, description="mean over a completion")
    min_token_logprob: float = Field(-20.0, lt=0, description="below this a sampled token is implausible")
    spot_check_rate: dict[str, float] = Field(
        default_factory=lambda: {"new": 1.0, "trusted": 1.0},
        description="fraction of submissions verified, per worker trust level; default verifies everything",
    )
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
