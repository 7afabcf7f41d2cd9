"""The attack matrix on real vLLM output (CPU, in-process) from locally made tiny models.

Honest rollouts (fp32 and bf16; batch 1 and 32; short and long; several sampling settings) must all
be accepted; every attack must be rejected in every trial. The stale-weights attack (the previous
policy version, one AdamW step earlier) and small logprob forgeries against a bf16 run are measured
and written out, not asserted: whether they are detectable depends on the learning rate and on the
bf16 noise floor (see bench/results/verifier_attacks_*.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.verifier_calibration import run_matrix, table_markdown, write_results

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
REPO = Path(__file__).resolve().parents[2]


def check(result, honest_min: int):
    print("\n" + table_markdown(result))
    honest = [r for r in result.rows if r["expect"] == "accept"]
    assert sum(r["trials"] for r in honest) >= honest_min
    for r in honest:
        assert r["rejected"] == 0, (r["scenario"], r["examples"])
    for r in result.rows:
        if r["expect"] == "reject":
            assert r["accepted"] == 0, (r["scenario"], r["accepted"], r["trials"])
    # The noise the thresholds were calibrated on must still hold.
    fp32 = result.honest_stats["float32"]
    assert fp32["logprob_max_abs_diff"] < 1e-4 and fp32["exponent_mismatches"] <= 1


def test_attack_matrix_ci(tmp_path, tiny_model_dir):
    """>= 200 honest completions across fp32 and bf16, 12 trials per attack (about a minute)."""
    counts = {"long_t1_b32": 32, "long_t0.7_p0.9_k20_b32": 32, "short_t1_b32": 32, "mixed_b1": 6, "greedy_b1": 2}
    result = run_matrix(tmp_path, tiny_model_dir, trials=12, honest_counts=counts, stale_lrs=(1e-4,))
    write_results(result, tmp_path, "ci", {"trials": 12})
    check(result, honest_min=200)


@pytest.mark.slow
def test_attack_matrix_full(tmp_path, tiny_model_dir):
    """Hundreds of trials per attack; writes bench/results/verifier_attacks_full.{md,json}."""
    counts = {"long_t1_b32": 96, "long_t0.7_p0.9_k20_b32": 64, "short_t1_b32": 64, "mixed_b1": 24, "greedy_b1": 8}
    result = run_matrix(tmp_path, tiny_model_dir, trials=200, honest_counts=counts, stale_lrs=(1e-5, 1e-4, 1e-3))
    write_results(result, REPO / "bench" / "results", "full", {"trials": 200, "size": "tiny", "honest": counts})
    check(result, honest_min=500)
