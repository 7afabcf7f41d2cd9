"""The CPU engine's KV cache is derived from the model's shape: a constant sized for the toy model is
below one sequence of a real model (vLLM then refuses to start)."""

from __future__ import annotations

from inference_worker.config import EngineConfig
from inference_worker.kv_cache import bytes_per_token, derived_bytes
from trainer.model_shapes import make_config

GIB = 1 << 30


def test_bytes_per_token_follow_the_real_shapes():
    qwen3 = make_config("qwen3-0.6b")  # 28 layers x 8 KV heads x head_dim 128
    assert bytes_per_token(qwen3, "float32") == 28 * 8 * 128 * 2 * 4 == 229_376
    assert bytes_per_token(qwen3, "bfloat16") == 229_376 // 2
    assert bytes_per_token(make_config("qwen2.5-0.5b"), "float32") == 24 * 2 * 64 * 2 * 4
    assert bytes_per_token(make_config("llama-3.2-1b"), "float32") == 16 * 8 * 64 * 2 * 4


def test_the_derived_cache_holds_full_sequences_within_a_share_of_memory():
    qwen3 = make_config("qwen3-0.6b")
    one = 229_376 * 512
    # The old constant (256 MiB) held ~1,170 tokens of this model: two sequences of 512; 16 need 1.75 GiB.
    assert (256 << 20) // 229_376 == 1170
    assert derived_bytes(qwen3, "float32", 512, 16, 0.25, available=24 * GIB) == 16 * one
    assert derived_bytes(qwen3, "float32", 512, 16, 0.25, available=4 * GIB) == GIB  # capped at a quarter
    assert derived_bytes(qwen3, "float32", 512, 16, 0.25, available=GIB // 4) == one  # never below one sequence
    assert EngineConfig().kv_cache_bytes is None  # derived unless set
