"""A folder made by `init-model --arch` loads in transformers, the verifier's reference loader and the
workers' vLLM engine, and an honest rollout from the engine passes the real Verifier.

Each architecture at a tiny width (2 layers, hidden 64) with its real vocabulary: the config class, the
tokenizer, the chat template and the 151,936 / 128,256-row embedding are the real ones.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from inference_worker.kv_cache import derived_bytes
from trainer.model_shapes import PRESETS, init_model

MAX_MODEL_LEN = 128
CONCURRENT = 4  # sequences of one lease: 2 prompts x 2 samples
HASH = "a" * 64


def chat_prompts(tok, items) -> list[np.ndarray]:
    out = []
    for item in items:
        text = tok.apply_chat_template([{"role": "user", "content": item.prompt}], tokenize=False,
            add_generation_prompt=True)
        out.append(np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32))
    return out


@pytest.mark.parametrize("arch,untied", [("qwen2.5-0.5b", False), ("qwen3-0.6b", False), ("llama-3.2-1b", True)])
def test_made_model_loads_everywhere_and_honest_rollouts_verify(arch, untied, tmp_path, arch_tokenizers):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from environments.tasks import get_task
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine
    from protocol.models import RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
    from protocol.verdicts import VerdictStatus
    from verifier.config import VerifierConfig
    from verifier.reference import eos_token_ids, load_reference_model
    from verifier.service import Verifier, VerifyJob

    # A few steps of pretraining: peaked distributions, as a base model's, not a near-uniform draw over 150k ids.
    model_dir = init_model(tmp_path / arch, arch, seed=0, untied=untied, layers=2, hidden=64, pretrain_steps=3,
                           batch_size=2, seq_len=64, lr=1e-2, tokenizer=arch_tokenizers[arch])
    vocab = PRESETS[arch].vocab

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert hf.get_output_embeddings().weight.shape == (vocab, 64)
    ref = load_reference_model(model_dir, None)
    # the path a published version takes: config + safetensors
    ref_from_weights = load_reference_model(model_dir, model_dir)
    ids = torch.tensor([[5, 17, 300, 4000]])
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(ref(ids).logits, want)
        torch.testing.assert_close(ref_from_weights(ids).logits, want)

    tok = AutoTokenizer.from_pretrained(model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end and im_end in eos_token_ids(model_dir)
    items = get_task("toy").make_prompts(2, seed=1)
    sampling = SamplingParams(temperature=1.0, max_tokens=24)
    lease = TaskLease(lease_id="L", prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=p, seeds=[11 + 2 * i, 12 + 2 * i])
                                             for i, p in enumerate(chat_prompts(tok, items))],
                      samples_per_prompt=2, sampling=sampling, policy_version=0, min_policy_version=0,
                      deadline=time.time() + 600, generation_version=0)

    # The KV cache from the model's shape (the engine's default is a fixed 256 MiB, tools' 64 MiB).
    kv = derived_bytes(AutoConfig.from_pretrained(model_dir), "float32", MAX_MODEL_LEN, CONCURRENT, 0.25)
    engine = RolloutEngine(model_dir, EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_bytes=kv))
    try:
        assert engine.hidden_size == 64
        completions = engine.generate(lease)
    finally:
        engine.close()
    assert len(completions) == 4 and all(0 <= int(t) < vocab for c in completions for t in c.token_ids)
    assert len({tuple(c.token_ids.tolist()) for c in completions}) == 4  # four seeds, four different draws

    verifier = Verifier(VerifierConfig(keep_versions=1), lambda _: model_dir, model_dir)
    sub = RolloutSubmission(lease_id="L", policy_version=0, model_hash=HASH, completions=completions)
    verdict = verifier.verify(VerifyJob("s1", sub, lease, items, "toy", HASH))
    assert verdict.status == VerdictStatus.accepted and verdict.rejections == [], verdict.rejections
    assert verdict.verified_tokens == sum(c.token_ids.size for c in completions)
    for c, mu in zip(completions, verdict.behaviour_logprobs):  # at temperature 1 the worker's and ours agree
        np.testing.assert_allclose(mu, c.logprobs, atol=1e-4)
