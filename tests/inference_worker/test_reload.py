"""Hot weight reload into the running vLLM engine, checked against transformers on the new weights."""

from __future__ import annotations

import pytest
import torch

from iw_helpers import make_lease
from test_engine import hf_greedy

RUN = "test-run"  # the run id signed into the test origin's manifests

PROMPTS = [[1, 10, 11, 12, 13], [1, 30, 31, 5]]
N = 24


def vllm_greedy(engine) -> list[list[int]]:
    lease = make_lease(PROMPTS, [[0], [0]], temperature=0.0, max_tokens=N)
    return [c.token_ids.tolist() for c in engine.generate(lease)]


def perturbed(model_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied weights are one parameter, perturbed once
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * (p.std() if p.numel() > 1 else 1.0))
    return model


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_reload_matches_transformers(which, request, tmp_path):
    from shardcast.keys import generate_signing_key
    from shardcast.origin import Origin

    engine = request.getfixturevalue(f"{which}_engine")
    model_dir = request.getfixturevalue("tiny_model_dir" if which == "tied" else "tiny_untied_model_dir")
    assert engine.llm.llm_engine.model_config.hf_config.tie_word_embeddings == (which == "tied")

    new = perturbed(model_dir, seed=7)
    origin = Origin(tmp_path / "origin", generate_signing_key(tmp_path / "key.pem"), run_id=RUN, keep_versions=2, shard_bytes=20_000)
    manifest = origin.publish(1, new.state_dict())
    assert len(manifest.shards) > 1  # several shards, as a real download would be

    before = vllm_greedy(engine)
    expected = [hf_greedy(new, p, N) for p in PROMPTS]
    assert expected != before  # the test could fail: new weights give other tokens
    try:
        engine.reload(origin.version_dir(1), 1, manifest.model_hash)
        assert engine.policy_version == 1 and engine.model_hash == manifest.model_hash
        assert vllm_greedy(engine) == expected
    finally:
        # Back to the base weights (a plain transformers folder) for the other tests of the session.
        engine.reload(model_dir, 0, "0" * 64)
    assert vllm_greedy(engine) == before


def test_reload_refuses_folder_without_weights(tied_engine, tmp_path):
    with pytest.raises(FileNotFoundError):
        tied_engine.reload(tmp_path, 3, "0" * 64)
    assert tied_engine.policy_version != 3
