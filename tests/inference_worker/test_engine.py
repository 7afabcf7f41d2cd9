"""The rollout engine on real vLLM (in-process) against HF transformers as the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from iw_helpers import make_lease

from protocol.models import FinishReason, RolloutSubmission

PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 21, 22, 23, 24, 25, 26]]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_forward(model, prompt: list[int], completion: list[int]):
    """Final-norm hidden states and raw log-softmax for every completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    p = len(prompt)
    hidden = out.hidden_states[-1][0, p - 1 : p - 1 + len(completion)]
    logp = torch.log_softmax(out.logits[0, p - 1 : p - 1 + len(completion)].float(), dim=-1)
    token_logp = logp.gather(1, torch.tensor(completion)[:, None])[:, 0]
    return hidden, token_logp


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_generate_matches_transformers(tied_engine, tiny_model_dir):
    from verifier.config import ProofThresholds
    from verifier.proofs import build_proofs, check_proofs

    lease = make_lease(PROMPTS, [[11, 12, 11], [5, 6, 7]], temperature=0.7, top_p=0.95, max_tokens=40)
    completions, hidden = tied_engine.generate_with_hidden(lease)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # Per-sample seeds: the same seed gives the same sample, different seeds different ones.
    assert completions[0].token_ids.tolist() == completions[2].token_ids.tolist()
    assert completions[0].token_ids.tolist() != completions[1].token_ids.tolist()

    model = hf_model(tiny_model_dir)
    for c, h in zip(completions, hidden):
        n = c.token_ids.size
        assert c.logprobs.shape == (n,) and h.shape == (n, tied_engine.hidden_size)
        assert len(c.proofs) == math.ceil(n / 32)
        assert c.proofs == build_proofs(h)  # chunks proven during generation == proofs of the whole [T, H]
        if c.finish_reason is FinishReason.length:
            assert n == 40
        ref_hidden, ref_logp = hf_forward(model, PROMPTS[c.prompt_index], c.token_ids.tolist())
        torch.testing.assert_close(h, ref_hidden, atol=1e-4, rtol=1e-4)
        # Raw logprobs (before temperature / top-p), which is what the verifier recomputes.
        np.testing.assert_allclose(c.logprobs, ref_logp.numpy(), atol=1e-4)
        checks = check_proofs(c.proofs, ref_hidden, ProofThresholds())
        assert all(ch.ok for ch in checks), [ch.stats for ch in checks]
    # The submission built from them passes the wire validation (a JSON round trip).
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash="0" * 64, completions=completions)
    again = RolloutSubmission.model_validate_json(sub.model_dump_json(), context={"vocab_size": 64})
    assert again.completions[3].proofs == completions[3].proofs


def test_proofs_detect_other_hidden_states(tied_engine, tiny_model_dir):
    from verifier.config import ProofThresholds
    from verifier.proofs import check_proofs

    lease = make_lease(PROMPTS[:1], [[3]], temperature=1.0, max_tokens=64)
    (c,), (h,) = tied_engine.generate_with_hidden(lease)
    shifted = torch.roll(h, 1, dims=0)  # hidden states of the wrong positions
    assert not all(ch.ok for ch in check_proofs(c.proofs, shifted, ProofThresholds()))


def test_finish_reason_stop_on_stop_token(tied_engine):
    greedy = make_lease(PROMPTS[:1], [[0]], temperature=0.0, max_tokens=30)
    (free,) = tied_engine.generate(greedy)
    assert free.finish_reason is FinishReason.length and free.token_ids.size == 30
    stop_at = int(free.token_ids[5])
    first = free.token_ids.tolist().index(stop_at)
    lease = make_lease(PROMPTS[:1], [[0]], temperature=0.0, max_tokens=30, stop_token_ids=[stop_at])
    (c,) = tied_engine.generate(lease)
    assert c.finish_reason is FinishReason.stop
    assert c.token_ids.tolist() == free.token_ids.tolist()[: first + 1]  # the stop token is the last token
    assert len(c.proofs) == math.ceil(c.token_ids.size / 32)


def test_lease_too_long_is_refused(tied_engine):
    from inference_worker.engine import LeaseNotGeneratable

    lease = make_lease([[1] * 200], [[0]], max_tokens=100)
    with pytest.raises(LeaseNotGeneratable, match="max_model_len"):
        tied_engine.generate(lease)
    # The engine is still usable afterwards.
    assert tied_engine.generate(make_lease(PROMPTS[:1], [[1]], max_tokens=4))[0].token_ids.size == 4
