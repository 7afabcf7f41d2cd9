"""A pulled version folder is what vLLM's `reload_weights(weights_path=...)` needs (HF names, tied head)."""

from __future__ import annotations

import pytest
import torch
from shardcast_helpers import RUN

from shardcast.client import ShardcastClient
from shardcast.origin import Origin
from shardcast.server import serve_origin


@pytest.mark.slow  # ~45 s on 2 busy cores (vLLM start-up); result recorded in bench/results/shardcast_notes.md
def test_vllm_reloads_a_pulled_version(tmp_path, key, pub, tiny_model_dir):
    vllm = pytest.importorskip("vllm")
    from transformers import AutoConfig, Qwen2ForCausalLM

    torch.manual_seed(7)
    trained = Qwen2ForCausalLM(AutoConfig.from_pretrained(tiny_model_dir)).float().eval()
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=64 << 10)
    origin.publish(1, trained.state_dict())
    with serve_origin(origin) as server:
        pulled = ShardcastClient([server.url], pub, tmp_path / "worker", run_id=RUN).pull()

    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    prompt = [1, 10, 11, 12, 40, 13]
    # The worker's own engine and reload path (which repacks a tied lm_head: inference_worker/capture.py).
    engine = RolloutEngine(tiny_model_dir, EngineConfig(max_model_len=256, kv_cache_bytes=64 << 20))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs() -> list[float]:
        out = engine.llm.generate([vllm.TokensPrompt(prompt_token_ids=prompt)], params)[0].prompt_logprobs
        return [out[i][tok].logprob for i, tok in enumerate(prompt) if i > 0]

    try:
        before = prompt_logprobs()
        engine.reload(pulled.path, 1, pulled.manifest.model_hash)
        after = prompt_logprobs()
    finally:
        engine.close()
    with torch.no_grad():
        logp = torch.log_softmax(trained(torch.tensor([prompt])).logits[0], dim=-1)
    expected = [logp[i - 1, tok].item() for i, tok in enumerate(prompt) if i > 0]
    assert after == pytest.approx(expected, abs=1e-4)
    assert before != pytest.approx(expected, abs=1e-4)  # the reload changed the policy
