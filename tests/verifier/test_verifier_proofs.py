"""Unit tests of the TOPLOC-style proofs: exact roundtrip, sizes, partial chunks, dtypes, tampering."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier import proofs
from verifier.config import CALIBRATED, ProofThresholds

TOPLOC = ProofThresholds(max_exponent_mismatches=38, max_mantissa_mean=10, max_mantissa_median=8)
EXACT = ProofThresholds(max_exponent_mismatches=0, max_mantissa_mean=0, max_mantissa_median=0)


@given(st.integers(1, 128), st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_interpolation_passes_through_every_point(k, seed):
    rng = np.random.default_rng(seed)
    x = np.stack([rng.choice(proofs.PRIME, k, replace=False) for _ in range(3)]).astype(np.int64)
    y = rng.integers(0, proofs.PRIME, (3, k)).astype(np.int64)
    coefs = proofs.interpolate(x, y)
    assert coefs.shape == (3, k) and coefs.min() >= 0 and coefs.max() < proofs.PRIME
    assert (proofs.evaluate(coefs, x) == y).all()


def test_interpolation_matches_a_known_polynomial():
    coefs = np.array([[5, 0, 3]], dtype=np.int64)  # 5 + 3 z^2
    x = np.array([[0, 1, 2]], dtype=np.int64)
    y = (5 + 3 * x * x) % proofs.PRIME
    assert (proofs.interpolate(x, y) == coefs).all()


def test_injective_moduli_are_the_largest_that_separate_the_indices():
    idx = np.array([[0, proofs.PRIME, 2 * proofs.PRIME + 1]], dtype=np.int64)  # collide mod p
    m = int(proofs.injective_moduli(idx)[0])
    assert m < proofs.PRIME
    assert len(set((idx[0] % m).tolist())) == 3
    for bigger in range(m + 1, proofs.PRIME + 1):
        assert len(set((idx[0] % bigger).tolist())) < 3
    assert proofs.injective_moduli(np.array([[3, 7, 100]]))[0] == proofs.PRIME


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(32, 64), (100, 64), (1, 64), (1, 256), (33, 96), (5, 20)])
def test_roundtrip_sizes_and_exact_check(dtype, tokens, hidden):
    hs = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens * hidden)).to(dtype)
    built = proofs.build_proofs(hs)
    sizes = proofs.chunk_sizes(tokens)
    assert len(built) == len(sizes) == -(-tokens // 32)
    for proof, n in zip(built, sizes):
        assert len(proof) == 2 + 2 * min(128, n * hidden) <= 258
    checks = proofs.check_proofs(built, hs, EXACT)
    assert [c.chunk_index for c in checks] == list(range(len(sizes)))
    assert all(c.ok and c.exponent_mismatches == 0 and c.mantissa_mean == 0 for c in checks)


def test_fp32_and_bf16_of_the_same_values_give_the_same_proof_when_values_are_bf16_exact():
    hs = torch.randn(40, 64).to(torch.bfloat16)
    assert proofs.build_proofs(hs) == proofs.build_proofs(hs.float())


def test_small_noise_passes_and_unrelated_activations_fail():
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(96, 512, generator=g)
    built = proofs.build_proofs(hs)
    noisy = hs * (1 + 1e-3 * torch.randn(hs.shape, generator=g))
    assert all(c.ok for c in proofs.check_proofs(built, noisy, TOPLOC))
    other = torch.randn(96, 512, generator=g)
    checks = proofs.check_proofs(built, other, TOPLOC)
    assert not any(c.ok for c in checks)
    assert min(c.exponent_mismatches for c in checks) >= 100
    assert "exponent mismatches" in checks[0].reason


def test_one_changed_row_fails_only_its_chunk():
    hs = torch.randn(96, 128)
    built = proofs.build_proofs(hs)
    changed = hs.clone()
    changed[40] = torch.randn(128) * 3  # a different hidden state for token 40 (chunk 1)
    ok = [c.ok for c in proofs.check_proofs(built, changed, CALIBRATED["float32"].proof)]
    assert ok == [True, False, True]


def test_malformed_missing_and_extra_proofs_are_reported_per_chunk():
    hs = torch.randn(70, 64)
    built = proofs.build_proofs(hs)
    assert len(built) == 3
    short = built[0][:-2]
    big_modulus = struct.pack("<H", proofs.PRIME + 1) + built[1][2:]
    bad_coef = built[2][:2] + struct.pack("<H", 65535) + built[2][4:]
    checks = proofs.check_proofs([short, big_modulus, bad_coef], hs, TOPLOC)
    assert [c.ok for c in checks] == [False, False, False]
    assert all(c.reason.startswith("malformed proof") for c in checks)
    missing = proofs.check_proofs(built[:2], hs, TOPLOC)
    assert [c.ok for c in missing] == [True, True, False] and missing[2].reason == "proof missing"
    extra = proofs.check_proofs(built + [built[0]], hs, TOPLOC)
    assert [c.ok for c in extra] == [True, True, True, False]


def test_build_many_equals_one_by_one():
    hs = [torch.randn(n, 64) for n in (1, 32, 70, 64, 5)]
    assert proofs.build_proofs_many(hs) == [proofs.build_proofs(h) for h in hs]
    many = [torch.randn(32 * 30 + 7, 8) for _ in range(3)]  # 90 full chunks: more than one batch
    assert proofs.build_proofs_many(many) == [proofs.build_proofs(h) for h in many]


@pytest.mark.parametrize("bad", [torch.zeros(0, 8), torch.zeros(8), torch.zeros(3, 4, dtype=torch.int64),
    torch.zeros(4, 0)])
def test_bad_hidden_states_raise(bad):
    with pytest.raises(ValueError):
        proofs.build_proofs(bad)


def test_chunk_stats_are_floats_for_rejections():
    hs = torch.randn(32, 64)
    c = proofs.check_proofs(proofs.build_proofs(hs), torch.randn(32, 64), TOPLOC)[0]
    stats = c.stats()
    assert set(stats) == {"num_values", "exponent_mismatches", "mantissa_mean", "mantissa_median"}
    assert all(isinstance(v, float) for v in stats.values())


def test_module_imports_no_cluster_or_hf_code():
    import subprocess
    import sys

    code = ("import sys, verifier.proofs; "
            "bad = [m for m in ('transformers', 'ray', 'fastapi', 'vllm') if m in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
