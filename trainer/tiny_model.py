"""Tiny Qwen2-architecture models and a character-level tokenizer, made locally.

No model hub is reachable from our machines, so tests and the demo make their own base model. The
tokenizer has one token per character of a small alphabet (digits, lowercase letters, arithmetic
signs), which suits the toy and countdown tasks: every digit is its own token, and a random model
starts near-uniform over ~50 tokens, so GRPO sees signal from the first step.
"""

from __future__ import annotations

import json
import random
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


def pretrain_corpus(n: int, rng: random.Random, tool_format: bool = False) -> list[str]:
    """Base-model data: `copy:<letters>=<letters>` and `say:<digits>=<digits>`, short words echoed.

    It gives the random model what RL post-training builds on (attend to the prompt, write the answer
    after `=`, stop) but never the demo's task itself, `copy:<digits>=`: the base model has to combine
    two things it saw apart, does so only sometimes, and RL has to make it reliable.

    `tool_format` (the multi-turn demo's base model; off by default, which leaves the corpus unchanged)
    makes every third text the "lookup" environment's format with letters, `ask:=?<letters>=<letters>`:
    call the tool, then copy its answer. The environment hides digits, which the base model never saw there.
    """
    texts = []
    for i in range(n):
        if tool_format and i % 3 == 2:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 3)))
            texts.append(f"ask:=?{word}={word}")
            continue
        prefix, chars = ("copy:", "abcdefghijklmnopqrstuvwxyz") if i % 2 == 0 else ("say:", "0123456789")
        word = "".join(rng.choice(chars) for _ in range(rng.randint(1, 3)))
        texts.append(f"{prefix}{word}={word}")
    return texts


def pretrain(model, steps: int, seed: int, batch_size: int = 64, lr: float = 1e-3, tool_format: bool = False) -> None:
    """A short next-token pretraining of `model` on `pretrain_corpus` (loss on the answer and EOS; in a
    tool text on the tool call and the answer, never on the tool's observation)."""
    tok = make_tokenizer()
    equals = vocab()["="]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        texts = pretrain_corpus(batch_size, rng, tool_format)
        rows = [tok(t)["input_ids"] + [EOS_ID] for t in texts]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), PAD_ID)
        labels = torch.full((len(rows), width), -100)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            answer_start = row.index(equals) + 1
            if texts[i].startswith("ask:"):  # the tool call, then the answer after the observation
                labels[i, answer_start] = ids[i, answer_start]
                answer_start = row.index(equals, answer_start) + 1
            labels[i, answer_start : len(row)] = ids[i, answer_start : len(row)]
        loss = model(input_ids=ids, attention_mask=(ids != PAD_ID).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def init_model(
    out: str | Path,
    size: Literal["tiny", "small"] = "tiny",
    seed: int = 0,
    tie_embeddings: bool = True,
    pretrain_steps: int = 0,
    tool_format: bool = False,
) -> Path:
    """Write a randomly initialised model and its tokenizer to `out`. Deterministic for a given seed."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(size, tie_embeddings)
    devnull_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    if pretrain_steps:
        pretrain(model, pretrain_steps, seed, tool_format=tool_format)
    torch.random.set_rng_state(devnull_rng)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer().save_pretrained(out)
    (out / "swarmrl_model.json").write_text(json.dumps({"size": size, "seed": seed, "tie_embeddings": tie_embeddings, "pretrain_steps": pretrain_steps, **({"tool_format": True} if tool_format else {})}, indent=2))
    return out
