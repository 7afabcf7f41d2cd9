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
    origin = Origin(tmp_path / "origin", generate_signing_key(tmp_path / "key.pem"), run_id=RUN, keep_versions=2,
        shard_bytes=20_000)
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


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_a_delta_chain_reloads_from_memory_and_a_flipped_delta_never_reaches_vllm(which, request, tmp_path):
    """bfloat16 versions of a float32 master (trainer.publish_dtype), published as deltas; the worker's client
    pulls them (one relay flips a byte of every delta), applies them in memory and hot-reloads vLLM from
    the tensors it holds: vLLM then generates exactly what transformers generates on the published weights."""
    from shardcast.client import ShardcastClient
    from shardcast.keys import generate_signing_key
    from shardcast.origin import Origin
    from shardcast.precision import cast_for_publishing
    from shardcast.server import serve_origin
    from shardcast.weights import model_hash

    engine = request.getfixturevalue(f"{which}_engine")
    model_dir = request.getfixturevalue("tiny_model_dir" if which == "tied" else "tiny_untied_model_dir")
    master = perturbed(model_dir, seed=11)
    origin = Origin(tmp_path / "origin", generate_signing_key(tmp_path / "key.pem"), run_id=RUN, shard_bytes=20_000,
        anchor_every=100, max_chain_fraction=10)
    published = {0: cast_for_publishing(master.state_dict())}
    origin.publish(0, published[0])
    gen = torch.Generator().manual_seed(3)
    for v in (1, 2, 3):  # Adam-like steps on the float32 master, big enough to move greedy tokens
        with torch.no_grad():
            for p in master.parameters():
                p.add_(torch.sign(torch.randn(p.shape, generator=gen)) * 0.05 * (p.std() if p.numel() > 1 else 1.0))
        published[v] = cast_for_publishing(master.state_dict())
        assert origin.publish(v, published[v]).deltas  # a delta version
    before = vllm_greedy(engine)
    try:
        with serve_origin(origin) as server:
            import sys
            from pathlib import Path

            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shardcast"))
            from tools.hostile_relay import HostileRelay

            flipper = HostileRelay(server.url, "flip", flip_match="delta")
            try:
                client = ShardcastClient([flipper.url], engine_pub(origin), tmp_path / "worker", run_id=RUN,
                    fallback_urls=[server.url])
                first = client.pull(0)
                engine.reload(first.path, 0, first.manifest.model_hash, state=first.state)
                pulled = client.pull(3)
            finally:
                flipper.stop()
        assert pulled.steps == ["held 0", "delta 1", "delta 2", "delta 3"] and pulled.state is not None
        assert "signed blake3" in (client.stats[flipper.url].banned or "")  # the flipped delta was caught, not applied
        assert model_hash(pulled.state) == pulled.manifest.model_hash == model_hash(published[3])
        for f in list(pulled.path.glob("*.safetensors")):  # from memory: the folder is not read at all
            f.unlink()
        engine.reload(pulled.path, 3, pulled.manifest.model_hash, state=pulled.state)
        expected = hf_prompt_logprobs(hf_model(model_dir, published[3]))
        # the chain moved the policy
        assert expected != pytest.approx(hf_prompt_logprobs(hf_model(model_dir, published[0])), abs=1e-3)
        assert engine.policy_version == 3 and vllm_prompt_logprobs(engine) == pytest.approx(expected, abs=1e-4)
    finally:
        engine.reload(model_dir, 0, "0" * 64)
    assert vllm_greedy(engine) == before


PROMPT = [1, 10, 11, 12, 40, 13, 30, 31]


def vllm_prompt_logprobs(engine) -> list[float]:
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = engine.llm.generate([vllm.TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].prompt_logprobs
    return [out[i][tok].logprob for i, tok in enumerate(PROMPT) if i > 0]


def hf_prompt_logprobs(model) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], dim=-1)
    return [logp[i - 1, tok].item() for i, tok in enumerate(PROMPT) if i > 0]


def engine_pub(origin) -> str:
    return origin.public_key_b64


def hf_model(model_dir, state: dict):
    """transformers on exactly the published (bfloat16) weights, computing in float32 like the engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model
