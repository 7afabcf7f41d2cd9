"""The trusted prefill: row alignment, batching with padding, per-sequence sampling settings."""

from __future__ import annotations

import numpy as np
import torch

from protocol.models import SamplingParams
from verifier.reference import eos_token_ids, load_reference_model, prefill


def test_prefill_rows_batching_and_weights_dir(tiny_untied_model_dir):
    model = load_reference_model(tiny_untied_model_dir, None, "float32")
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(3, 54, n).astype(np.int32), rng.integers(3, 54, t).astype(np.int32)) for n, t in ((5, 1), (9,
        40), (3, 17))]
    samplings = [SamplingParams(), SamplingParams(temperature=0.5, top_k=5), SamplingParams(top_p=0.5)]
    seeds = [11, 22, 33]
    batched = prefill(model, seqs, samplings, seeds=seeds)
    for (p, c), s, seed, got in zip(seqs, samplings, seeds, batched):
        alone = prefill(model, [(p, c)], [s], seeds=[seed])[0]
        full = torch.tensor(np.concatenate([p, c])[None].astype(np.int64))
        with torch.no_grad():
            out = model(full, output_hidden_states=True)
        want_h = out.hidden_states[-1][0, len(p) - 1 : len(p) - 1 + len(c)]
        want_lp = torch.log_softmax(out.logits[0, len(p) - 1 : len(p) - 1 + len(c)], -1).gather(1, torch.tensor(c[:,
            None].astype(np.int64)))[:, 0]
        assert got.hidden.shape == (len(c), model.config.hidden_size)
        torch.testing.assert_close(got.hidden, want_h, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got.stats.logprob, want_lp.numpy(), atol=1e-5)
        np.testing.assert_allclose(got.stats.tempered_logprob, alone.stats.tempered_logprob, atol=1e-6)
        # The replay sees each sequence's own seed and positions however the batch is laid out.
        np.testing.assert_array_equal(got.draw.winner, alone.draw.winner)
        np.testing.assert_allclose(got.draw.margin, alone.draw.margin, atol=1e-5)
    # Loading from a weights folder (a shardcast version: safetensors only) gives the same model.
    same = load_reference_model(tiny_untied_model_dir, tiny_untied_model_dir, "float32")
    again = prefill(same, seqs[:1], samplings[:1])[0]
    torch.testing.assert_close(again.hidden, batched[0].hidden)
    assert eos_token_ids(tiny_untied_model_dir) == {2}


def test_bf16_reference_and_bad_weights(tiny_model_dir, tmp_path):
    import pytest

    model = load_reference_model(tiny_model_dir, tiny_model_dir, "bfloat16")
    out = prefill(model, [(np.array([1, 5, 6], dtype=np.int32), np.array([7, 8], dtype=np.int32))],
        [SamplingParams()])[0]
    assert out.hidden.dtype == torch.bfloat16 and out.stats.logprob.dtype == np.float64
    with pytest.raises(FileNotFoundError):
        load_reference_model(tiny_model_dir, tmp_path, "float32")
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="do not fit"):
        load_reference_model(tiny_model_dir, tmp_path, "float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_reference_model(tiny_model_dir, None, "int8")


def test_device_option_cpu_behaves_as_before(tiny_model_dir):
    """VerifierConfig.device (default cpu) places the reference model; on the CPU nothing changes: the same
    prefill, replay and statistics."""
    import pytest
    from pydantic import ValidationError

    from verifier.config import VerifierConfig

    assert VerifierConfig().device == "cpu" and VerifierConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError):
        VerifierConfig(device="tpu")
    model = load_reference_model(tiny_model_dir, tiny_model_dir, "float32", device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    default = load_reference_model(tiny_model_dir, tiny_model_dir, "float32")
    rng = np.random.default_rng(3)
    seqs = [(rng.integers(3, 54, 6).astype(np.int32), rng.integers(3, 54, 30).astype(np.int32)) for _ in range(3)]
    samplings = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.5, top_k=5)]
    kwargs = dict(seeds=[1, 2, 3], draw_slack=(1e-3, 1e-3, 0.0), draw_margin=(1e-3, 0.0))
    for a, b in zip(prefill(model, seqs, samplings, **kwargs), prefill(default, seqs, samplings, **kwargs)):
        torch.testing.assert_close(a.hidden, b.hidden, rtol=0, atol=0)
        np.testing.assert_array_equal(a.stats.logprob, b.stats.logprob)
        np.testing.assert_array_equal(a.stats.tempered_logprob, b.stats.tempered_logprob)
        for f in ("winner", "margin", "inside", "exact", "choice"):
            np.testing.assert_array_equal(getattr(a.draw, f), getattr(b.draw, f))
