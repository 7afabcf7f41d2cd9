"""Tiny Qwen2-architecture models and a character-level tokenizer, made locally.

No model hub is reachable from our machines, so tests and the demo make their own base model. The
tokenizer has one token per character of a small alphabet (digits, lowercase letters, arithmetic
signs), which suits the toy and countdown tasks: every digit is its own token, and a random model
starts near-uniform over ~50 tokens, so GRPO sees signal from the first step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=()?:;,.<>"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

SIZES: dict[str, dict[str, int]] = {
    # ~0.1M params: fast enough for CI end-to-end runs.
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    # ~3M params: the demo's learner.
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}


def vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + list(ALPHABET)
    return {t: i for i, t in enumerate(tokens)}


def make_tokenizer():
    """A PreTrainedTokenizerFast with one token per character, EOS = <|eos|>."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocab(), merges=[], unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def padded_vocab_size() -> int:
    n = len(vocab())
    return (n + 63) // 64 * 64  # a multiple of 64 suits GEMM kernels


def make_config(size: Literal["tiny", "small"] = "tiny", tie_embeddings: bool = True):
    from transformers import Qwen2Config

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    return Qwen2Config(
        vocab_size=padded_vocab_size(),
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
        use_sliding_window=False,
        **SIZES[size],
    )


def init_model(out: str | Path, size: Literal["tiny", "small"] = "tiny", seed: int = 0, tie_embeddings: bool = True) -> Path:
    """Write a randomly initialised model and its tokenizer to `out`. Deterministic for a given seed."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(size, tie_embeddings)
    devnull_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    torch.random.set_rng_state(devnull_rng)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer().save_pretrained(out)
    (out / "swarmrl_model.json").write_text(json.dumps({"size": size, "seed": seed, "tie_embeddings": tie_embeddings}, indent=2))
    return out
