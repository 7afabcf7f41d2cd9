"""The architectures people post-train, at their real shapes, made locally (random init, no hub).

Each preset is transformers' own config class with the published model's shape: Qwen2.5-0.5B, Qwen3-0.6B,
Llama-3.2-1B. The weights are random (optionally a short pretraining on the tokenizer's corpus, so the
next-token distributions are peaked, not uniform); the tokenizer is `trainer.bpe_tokenizer`'s, padded to
the preset's vocabulary, so the embedding and the LM head have their real size.

`layers` / `hidden` / `intermediate` scale a preset down for tests while keeping its config class (and so
its code path in transformers and vLLM: q/k-norm, biases, GQA, rope scaling) and its real vocabulary.

`trainer.tiny_model` stays the toy (a character tokenizer, echo pretraining) that the demo runs on.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.bpe_tokenizer import ENDOFTEXT, IM_END, PAD, BuiltTokenizer, build_tokenizer, read_corpus


@dataclass(frozen=True)
class Preset:
    config_class: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position: int
    rope: dict
    rms_norm_eps: float
    extra: dict = field(default_factory=dict)


# max_position_embeddings stays the real one: transformers computes rope angles per forward, and vLLM's
# cos/sin cache (max_position x head_dim floats, one per rope kind) is 8-32 MB at these values.
PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": Preset("Qwen2Config", 24, 896, 4864, 14, 2, 64, 151936, 32768, {"rope_type": "default",
    "rope_theta": 1e6}, 1e-6,
                           {"use_sliding_window": False, "max_window_layers": 24}),
    "qwen3-0.6b": Preset("Qwen3Config", 28, 1024, 3072, 16, 8, 128, 151936, 40960, {"rope_type": "default",
    "rope_theta": 1e6}, 1e-6,
                         {"use_sliding_window": False, "max_window_layers": 28, "attention_bias": False}),
    "llama-3.2-1b": Preset("LlamaConfig", 16, 2048, 8192, 32, 8, 64, 128256, 131072,
                           {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 1e-5,
                            {"attention_bias": False, "mlp_bias": False}),
}
# The CLI's default with --arch. One step of 8 x 128 tokens at the real qwen3-0.6b shape took 98 s on 2 cores
# at load average ~4 (peak RSS 13.8 GB: weights, gradients, AdamW states, logits): a small default keeps it minutes.
DEFAULT_PRETRAIN_STEPS = 2
MIN_HEAD_DIM = 32  # scaled-down heads: vLLM's CPU attention supports 32 and up


def shapes(arch: str, layers: int | None = None, hidden: int | None = None, intermediate: int | None = None) -> dict:
    """The preset's shape, or a scaled-down one: with another `hidden`, heads of max(32, hidden / real heads)
    (at most the real head_dim), the real ratio of query to KV heads where it divides, and the intermediate
    size scaled with the width (to a multiple of 32)."""
    if arch not in PRESETS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[arch]
    s = dict(layers=layers or p.layers, hidden=p.hidden, heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim,
        intermediate=p.intermediate)
    if s["layers"] < 1:
        raise ValueError("layers must be at least 1")
    if hidden is not None and hidden != p.hidden:
        head_dim = min(p.head_dim, max(MIN_HEAD_DIM, hidden // p.heads))
        if hidden < MIN_HEAD_DIM or hidden % head_dim:
            raise ValueError(f"hidden {hidden} must be a multiple of {head_dim} (the scaled head size), at least "
                f"{MIN_HEAD_DIM}")
        heads = hidden // head_dim
        kv = max(1, heads * p.kv_heads // p.heads)
        while heads % kv:
            kv -= 1
        s.update(hidden=hidden, heads=heads, kv_heads=kv, head_dim=head_dim,
            intermediate=-(-p.intermediate * hidden // p.hidden // 32) * 32)
    if intermediate is not None:
        s["intermediate"] = intermediate
    return s


def make_config(arch: str, untied: bool = False, layers: int | None = None, hidden: int | None = None,
                intermediate: int | None = None, token_ids: dict[str, int] | None = None):
    """transformers' config of `arch` (scaled by the overrides). `token_ids`: the tokenizer's special ids."""
    import transformers

    s = shapes(arch, layers, hidden, intermediate)
    p = PRESETS[arch]
    ids = token_ids or {}
    kwargs = dict(
        vocab_size=p.vocab, hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=p.max_position,
        rope_parameters=dict(p.rope), rms_norm_eps=p.rms_norm_eps, tie_word_embeddings=not untied, hidden_act="silu",
        initializer_range=0.02, bos_token_id=ids.get(ENDOFTEXT), eos_token_id=ids.get(IM_END),
        pad_token_id=ids.get(PAD), dtype="float32", **p.extra,
    )
    if p.config_class != "Qwen2Config":  # Qwen2 derives head_dim from hidden / heads
        kwargs["head_dim"] = s["head_dim"]
    config = getattr(transformers, p.config_class)(**kwargs)
    if (getattr(config, "head_dim", None) or s["hidden"] // s["heads"]) != s["head_dim"]:
        raise AssertionError(f"{arch}: the config's head size is not {s['head_dim']}")
    return config


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def corpus_windows(text: str, tok, n: int, seq_len: int, rng: random.Random) -> torch.Tensor:
    """`n` rows of `seq_len` tokens, each from a random line start of the corpus text."""
    span = seq_len * 8  # characters; tokens here average 3-4 characters, so one span always fills a row
    rows = []
    while len(rows) < n:
        start = rng.randrange(0, max(1, len(text) - span))
        start = text.find("\n", start) + 1  # from a line start (0 when there is none after: the text's start)
        ids = tok(text[start : start + span], add_special_tokens=False)["input_ids"][:seq_len]
        if len(ids) == seq_len:
            rows.append(ids)
    return torch.tensor(rows, dtype=torch.long)


def pretrain(model, tok, text: str, steps: int, seed: int, batch_size: int = 8, seq_len: int = 128, lr: float = 1e-3,
             max_seconds: float | None = None) -> dict:
    """Next-token pretraining on corpus windows: AdamW, bf16 autocast on the model's device, losses of every
    step. `max_seconds`: no step starts after this much time (and at most `steps` steps either way)."""
    rng = random.Random(f"pretrain-{seed}")
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, times = [], []
    model.train()
    begun = time.perf_counter()
    for _ in range(steps):
        if max_seconds is not None and time.perf_counter() - begun >= max_seconds:
            break
        started = time.perf_counter()
        ids = corpus_windows(text, tok, batch_size, seq_len, rng).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
        times.append(round(time.perf_counter() - started, 2))
    model.eval()
    del opt
    return {"losses": losses, "step_s": times}


@torch.no_grad()
def mean_loss(model, tok, text: str, seed: int, batch_size: int = 4, seq_len: int = 128) -> float:
    """Next-token loss (float32) on corpus windows of their own generator (the same corpus, so not held out):
    ln(vocab) ~ 11.9 for a uniform model."""
    ids = corpus_windows(text, tok, batch_size, seq_len,
        random.Random(f"eval-{seed}")).to(next(model.parameters()).device)
    return float(model(input_ids=ids, labels=ids).loss)


def init_model(out: str | Path, arch: str, seed: int = 0, untied: bool = False, layers: int | None = None,
               hidden: int | None = None, intermediate: int | None = None, pretrain_steps: int = 0,
               cache_dir: Path | None = None, batch_size: int = 8, seq_len: int = 128, lr: float = 1e-3,
               tokenizer: BuiltTokenizer | None = None) -> Path:
    """Write a randomly initialised `arch` model (float32 safetensors) and its tokenizer to `out`, with
    `swarmrl_model.json` saying what was made. Deterministic for a seed (the same tokenizer bytes and weights).
    `tokenizer`: one built before (`build_tokenizer(PRESETS[arch].vocab)`), else built from the cache."""
    import transformers
    from transformers import GenerationConfig

    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = PRESETS.get(arch)
    if p is None:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(PRESETS)}")
    shapes(arch, layers, hidden, intermediate)  # a shape the architecture cannot take fails before any work
    built = tokenizer or build_tokenizer(p.vocab, cache_dir=cache_dir)
    tok = built.tokenizer
    tok.model_max_length = p.max_position
    if len(tok) != p.vocab:
        raise ValueError(f"the tokenizer has {len(tok)} ids; {arch} has a vocabulary of {p.vocab}")
    ids = built.info["special_tokens"]
    config = make_config(arch, untied, layers, hidden, intermediate, ids)
    model_class = getattr(transformers, p.config_class.replace("Config", "ForCausalLM"))
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class(config).float()
        info: dict = {"arch": arch, "config_class": p.config_class, "seed": seed, "tie_embeddings": not untied,
                      "shapes": {**shapes(arch, layers, hidden, intermediate), "vocab": p.vocab,
                      "max_position": p.max_position},
                      "real_shape": layers is None and hidden is None and intermediate is None,
                      "parameters": count_parameters(model), "pretrain_steps": 0}
        if pretrain_steps:
            text = "\n".join(read_corpus(Path(built.info["corpus"]["root"]), built.info["corpus"]["budget"]).texts)
            done = pretrain(model, tok, text, pretrain_steps, seed, batch_size, seq_len, lr)
            info.update(pretrain_steps=pretrain_steps, pretrain_batch=[batch_size, seq_len], pretrain_lr=lr,
                        pretrain_losses=done["losses"], pretrain_final_loss=done["losses"][-1],
                        pretrain_step_s=done["step_s"],
                        # after the last update; uniform: ln(vocab)
                        pretrain_eval_loss=round(mean_loss(model, tok, text, seed), 4))
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config = GenerationConfig(bos_token_id=ids[ENDOFTEXT], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[PAD])
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    tokenizer_info = {k: v for k, v in built.info.items() if k != "cache_hit"}
    tokenizer_info["tokenizer_json_sha256"] = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    info.update(tokenizer=tokenizer_info, make_s=round(time.perf_counter() - started, 1))
    (out / "swarmrl_model.json").write_text(json.dumps(info, indent=2))
    return out
