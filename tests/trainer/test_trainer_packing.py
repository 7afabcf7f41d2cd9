"""Packing: budgets, layout, and no attention across packed sequences."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_helpers import random_samples

from trainer.config import LossConfig
from trainer.loss import ppo_loss, sequence_weights
from trainer.packing import first_fit_decreasing, make_micro_batches, pad_groups
from trainer.policy_model import forward_logprobs, load_model
from trainer.samples import TrainSample

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, torch.device("cpu"))


@pytest.fixture(scope="module", params=["varlen", "sdpa", "eager"])
def any_attention_model(tiny_model_dir, request):
    return load_model(tiny_model_dir, torch.device("cpu"), attention=request.param)


def test_first_fit_decreasing_by_hand():
    # longest first: 5 -> bin0 (3 left), 4 -> bin1 (4 left), 3 -> bin0 (0 left), 3 -> bin1 (1 left), 2 -> bin2
    assert first_fit_decreasing([5, 4, 3, 3, 2], 8) == [[0, 2], [1, 3], [4]]
    assert first_fit_decreasing([10, 1], 4) == [[0], [1]]  # too long: a bin of its own, never dropped


def test_pad_groups_by_hand():
    # rows x longest <= 8: [3,2] -> 2x3=6; adding 4 -> 3x4=12 > 8; [4,1] -> 8; [2]
    assert pad_groups([3, 2, 4, 1, 2], 8) == [[0, 1], [2, 3], [4]]


def test_layout_positions_and_targets():
    s = [TrainSample([5, 6, 7], [8, 9], [-1.0, -2.0], 1.0, 0.0, 0), TrainSample([10], [11, 12, 13], [-1, -1, -1], -1.0,
        0.0, 0)]
    (mb,) = make_micro_batches(s, np.array([0.5, 0.25]), 64)
    # longest first: sample 0 (5 tokens -> 4 inputs), then sample 1 (4 tokens -> 3 inputs)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 10, 11, 12]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.loss_positions.tolist() == [2, 3, 4, 5, 6]
    assert mb.targets.tolist() == [8, 9, 11, 12, 13]
    assert mb.advantages.tolist() == [1, 1, -1, -1, -1]
    assert mb.weights.tolist() == [0.5, 0.5, 0.25, 0.25, 0.25]
    assert mb.sample_index.tolist() == [0, 0, 1, 1, 1]
    assert mb.attention_mask is None and mb.num_tokens == 7
    assert mb.cu_seq_lens.tolist() == [0, 4, 7] and mb.max_length == 4

    (pb,) = make_micro_batches(s, np.array([0.5, 0.25]), 64, mode="padded")
    assert pb.input_ids.tolist() == [[5, 6, 7, 8], [10, 11, 12, 0]]
    assert pb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert pb.loss_positions.tolist() == [2, 3, 4, 5, 6]
    assert pb.targets.tolist() == [8, 9, 11, 12, 13]


def test_budget_is_respected_and_every_token_appears_once():
    samples = random_samples(40, seed=3)
    w = np.ones(len(samples))
    for mode in ("packed", "padded"):
        mbs = make_micro_batches(samples, w, 96, mode)
        assert all(mb.num_slots <= 96 for mb in mbs)
        seen = np.concatenate([mb.sample_index.numpy() for mb in mbs])
        assert np.bincount(seen).tolist() == [s.num_completion_tokens for s in samples]
    packed, padded = make_micro_batches(samples, w, 96), make_micro_batches(samples, w, 96, "padded")
    assert sum(mb.num_slots for mb in packed) < sum(mb.num_slots for mb in padded)


def test_no_attention_leaks_across_packed_sequences(any_attention_model):
    model = any_attention_model
    samples = random_samples(6, seed=1)
    w = np.ones(len(samples))
    (packed,) = make_micro_batches(samples, w, 10_000)
    with torch.no_grad():
        together, _ = forward_logprobs(model, packed, bf16=False)
        for i, s in enumerate(samples):
            (alone,) = make_micro_batches([s], w[:1], 10_000)
            lp_alone, _ = forward_logprobs(model, alone, bf16=False)
            torch.testing.assert_close(together[packed.sample_index == i], lp_alone, atol=1e-5, rtol=1e-5)

        # The varlen backend finds the sequences from the position resets alone, too.
        cu = packed.cu_seq_lens
        packed.cu_seq_lens = None
        torch.testing.assert_close(forward_logprobs(model, packed, bf16=False)[0], together, atol=1e-5, rtol=1e-5)

        # Control: the same row with positions that do not restart lets later sequences see earlier ones.
        packed.position_ids = torch.arange(packed.input_ids.shape[1])[None]
        leaky, _ = forward_logprobs(model, packed, bf16=False)
        assert (leaky - together).abs().max() > 1e-3
        packed.cu_seq_lens = cu


def test_segment_bounds():
    from trainer.attention import segment_bounds

    assert segment_bounds(torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])).tolist() == [0, 3, 4, 6, 10]
    assert segment_bounds(torch.tensor([[0, 1, 2]])).tolist() == [0, 3]


def test_full_logits_match_unpacked_model_call(model):
    """Packed logprobs equal a plain per-sample forward (full logits, no packing code at all)."""
    from trainer_helpers import plain_logprobs

    samples = random_samples(4, seed=2)
    (packed,) = make_micro_batches(samples, np.ones(4), 10_000)
    with torch.no_grad():
        together, _ = forward_logprobs(model, packed, bf16=False)
        for i, s in enumerate(samples):
            torch.testing.assert_close(together[packed.sample_index == i], plain_logprobs(model, s), atol=1e-5,
                rtol=1e-5)


@pytest.mark.parametrize("normalizer", ["tokens", "sequence", "constant"])
def test_padding_and_micro_batching_do_not_change_loss_or_gradient(model, normalizer):
    cfg = LossConfig(normalizer=normalizer, constant_normalizer=100.0)
    samples = random_samples(10, seed=4)
    weights = sequence_weights([s.num_completion_tokens for s in samples], cfg)

    def loss_and_grad(mode, budget):
        model.zero_grad()
        total = 0.0
        for mb in make_micro_batches(samples, weights, budget, mode):
            lp, _ = forward_logprobs(model, mb, bf16=False)
            loss, _ = ppo_loss(lp, lp.detach() + 0.05, mb.behaviour_logprobs, mb.advantages, mb.weights, cfg)
            loss.backward()
            total += loss.item()
        return total, torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_loss, ref_grad = loss_and_grad("packed", 10_000)  # one micro-batch
    assert ref_grad.abs().max() > 0
    for mode, budget in [("packed", 64), ("padded", 10_000), ("padded", 64)]:
        loss, grad = loss_and_grad(mode, budget)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-4)
    model.zero_grad()


@given(
    shapes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=25),
    budget=st.integers(8, 120),
    mode=st.sampled_from(["packed", "padded"]),
)
@settings(max_examples=60, deadline=None)
def test_layout_property(shapes, budget, mode):
    samples = [
        TrainSample(np.arange(p) % 40 + 3, (np.arange(c) * 7 + i) % 40 + 3, -np.ones(c), 0.5, 0.0, 0, f"s{i}")
        for i, (p, c) in enumerate(shapes)
    ]
    mbs = make_micro_batches(samples, np.arange(1, len(samples) + 1, dtype=float), budget, mode)
    seen = set()
    for mb in mbs:
        assert mb.num_slots <= budget or mb.num_sequences == 1
        flat = mb.input_ids.reshape(-1)
        for i in mb.sample_index.unique().tolist():
            sel = mb.sample_index == i
            s = samples[i]
            assert mb.targets[sel].tolist() == s.completion_ids.tolist()
            assert torch.all(mb.weights[sel] == i + 1)
            pos = mb.loss_positions[sel]
            # the logit at a loss position is fed the token just before its target
            before = np.concatenate([s.prompt_ids, s.completion_ids])[s.prompt_ids.size - 1 : -1]
            assert flat[pos].tolist() == before.tolist()
            seen.add(i)
    assert seen == set(range(len(samples)))
