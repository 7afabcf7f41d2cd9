"""Tiny Qwen2-architecture models and a character-level tokenizer, made locally.

No model hub is reachable from our machines, so tests and the demo make their own base model. The
tokenizer has one token per character of a small alphabet (digits, lowercase letters, space, arithmetic
signs, and then newline and `"'![]_`, which reasoning-gym's prompts use), which suits the toy and countdown
tasks: every digit is its own token, and a random model starts near-uniform over ~60 tokens, so GRPO sees
signal from the first step. There is no token for a capital letter (26 would not fit under the 64 ids of the
model's vocabulary) nor for any other character: such characters are dropped when encoding.

The tokenizer is byte-level, as Qwen2's: its vocabulary holds each character's GPT-2 byte-level string (a
space is `Ġ`, a newline `Ċ`, every other character is itself), and it encodes and decodes through the same
normalizer, pre-tokenizer and decoder as `transformers.Qwen2Tokenizer`. A model folder's config.json says
`qwen2`, so `AutoTokenizer.from_pretrained(folder)` (the inference worker, vLLM, the verifier) loads
`Qwen2Tokenizer`, which rebuilds that pipeline from the vocabulary whatever tokenizer.json holds: both give
the same ids and the same text (tests/foundation/test_tiny_model.py). With a character vocabulary and the
Fuse decoder of before, the reloaded tokenizer dropped every space.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

import torch

# The characters with a token, in id order after the special tokens. Only ever append: a character's id is its
# place here, and models already made rely on it. The first line is the original alphabet; the second was
# added for reasoning-gym's text. 64 - 3 special tokens - 61 characters leaves 3 free ids.
ALPHABET = ("0123456789abcdefghijklmnopqrstuvwxyz +-*/=()?:;,.<>"
            "\n\"'![]_")
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

SIZES: dict[str, dict[str, int]] = {
    # ~0.1M params: fast enough for CI end-to-end runs.
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1),
    # ~3M params: the demo's learner.
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2),
}


def byte_level(text: str) -> str:
    """`text`'s UTF-8 bytes in GPT-2's byte-level alphabet (bytes_to_unicode): printable bytes other than the
    space are themselves, the others are shifted past 255 (space `Ġ`, newline `Ċ`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return "".join(table[b] for b in text.encode())


def vocab() -> dict[str, int]:
    """Token string -> id: the special tokens, then each character of ALPHABET in byte-level form (`byte_level`)."""
    tokens = SPECIAL_TOKENS + [byte_level(ch) for ch in ALPHABET]
    return {t: i for i, t in enumerate(tokens)}


def make_tokenizer():
    """A PreTrainedTokenizerFast with one token per character, EOS = <|eos|>, no BOS added. Its pipeline is
    Qwen2Tokenizer's (see the module docstring), so a model folder reloads to the same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocab(), merges=[], unk_token=None, fuse_unk=False))
    # Qwen2Tokenizer's normalizer and decoder, and its pre-tokenizer's byte-level step (no prefix space, no regex
    # of its own). Its regex split before that step is left out: without merges, every byte is its own token
    # wherever the text is split. NFC matters: "e" and a combining accent compose to "é", dropped whole.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        unk_token=None,  # saved as null: Qwen2Tokenizer would otherwise add its default <|endoftext|> as id 61
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


def _echo_batch(texts: list[str], tok) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels of `texts` + EOS; labels only on the answer (after `=`) and EOS, and in a
    tool text on the tool call and the answer, never on the tool's observation."""
    equals = vocab()["="]
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
    return ids, labels


@torch.no_grad()
def echo_accuracy(model, texts: list[str]) -> float:
    """Fraction of `texts` (`pretrain_corpus` lines) whose whole answer and EOS the model gets right greedily.

    Teacher-forced: every answer position's argmax is the right token exactly when greedy decoding writes
    the answer and stops, so one forward pass replaces a decode loop. No randomness is drawn.
    """
    ids, labels = _echo_batch(texts, make_tokenizer())
    logits = model(input_ids=ids, attention_mask=(ids != PAD_ID).long()).logits
    guess = logits[:, :-1].argmax(-1)  # position t predicts token t + 1
    want = labels[:, 1:]
    right = (guess == want) | (want == -100)
    return right.all(-1).float().mean().item()


def pretrain(
    model,
    steps: int,
    seed: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    target_accuracy: float | None = None,
    max_steps: int = 0,
    check_every: int = 10,
    tool_format: bool = False,
) -> dict:
    """Next-token pretraining of `model` on `pretrain_corpus` (loss on the answer and EOS; with `tool_format`
    the corpus also holds tool texts, see `pretrain_corpus`).

    With `target_accuracy`, `steps` is a minimum: from there, every `check_every` steps, the echo accuracy on
    fresh echo lines is measured and training stops once it reaches the target, or at `max_steps`. Copying
    from the prompt appears suddenly and at a step that depends on the seed (an induction-head-like phase
    change); a fixed step count stopped some seeds before it, and RL could not start from those models.
    Returns the steps taken and the last measured accuracy. Deterministic for a seed: the checks draw no
    randomness and their lines come from their own generator.
    """
    tok = make_tokenizer()
    rng = random.Random(seed)
    held_out = pretrain_corpus(256, random.Random(f"echo-check-{seed}"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    cap = max(steps, max_steps) if target_accuracy is not None else steps
    accuracy, step = None, 0
    while step < cap:
        model.train()
        ids, labels = _echo_batch(pretrain_corpus(batch_size, rng, tool_format), tok)
        loss = model(input_ids=ids, attention_mask=(ids != PAD_ID).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if target_accuracy is not None and step >= steps and (step - steps) % check_every == 0:
            model.eval()
            accuracy = echo_accuracy(model, held_out)
            if accuracy >= target_accuracy:
                break
    model.eval()
    if accuracy is None:
        accuracy = echo_accuracy(model, held_out)
    return {"steps": step, "echo_accuracy": round(accuracy, 4)}


def init_model(
    out: str | Path,
    size: Literal["tiny", "small"] = "tiny",
    seed: int = 0,
    tie_embeddings: bool = True,
    pretrain_steps: int = 0,
    pretrain_target: float | None = None,
    pretrain_max_steps: int = 0,
    tool_format: bool = False,
) -> Path:
    """Write a randomly initialised model and its tokenizer to `out`. Deterministic for a given seed, so it
    is made once per machine (trainer/model_cache.py).

    `pretrain_steps` of echo pretraining (`pretrain`); with `pretrain_target`, at least that many and then
    until the echo accuracy reaches the target, at most `pretrain_max_steps`."""
    from trainer.model_cache import cache_key, cached_model

    args = dict(size=size, seed=seed, tie_embeddings=tie_embeddings, pretrain_steps=pretrain_steps,
                pretrain_target=pretrain_target, pretrain_max_steps=pretrain_max_steps, tool_format=tool_format)
    key = cache_key("tiny", args, [Path(__file__)])
    return cached_model(Path(out), key, lambda out: _make_model(out, **args))


def _make_model(out: Path, size: Literal["tiny", "small"], seed: int, tie_embeddings: bool, pretrain_steps: int,
                pretrain_target: float | None, pretrain_max_steps: int, tool_format: bool) -> Path:
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = make_config(size, tie_embeddings)
    devnull_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    info = {"size": size, "seed": seed, "tie_embeddings": tie_embeddings, "pretrain_steps": 0, **({"tool_format": True}
        if tool_format else {})}
    if pretrain_steps or pretrain_target is not None:
        # One thread: where other jobs hold the cores, torch's threads spin waiting on each other. Side by side at
        # load 10 on 2 cores, 20 steps of the small model took 91 s with 2 threads and 9-11 s with 1, and a demo
        # spent 11-14 minutes making its base model (bench/results/demo_seed_sweep.md). Same bits either way
        # (checked: tiny and small). A quiet machine was not measured.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            done = pretrain(model, pretrain_steps, seed, target_accuracy=pretrain_target, max_steps=pretrain_max_steps,
                tool_format=tool_format)
        finally:
            torch.set_num_threads(threads)
        info.update(pretrain_steps=done["steps"], pretrain_echo_accuracy=done["echo_accuracy"])
        if pretrain_target is not None:
            info.update(pretrain_min_steps=pretrain_steps, pretrain_target=pretrain_target,
                pretrain_max_steps=pretrain_max_steps)
    torch.random.set_rng_state(devnull_rng)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer().save_pretrained(out)
    (out / "swarmrl_model.json").write_text(json.dumps(info, indent=2))
    return out
