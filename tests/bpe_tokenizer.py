"""A small byte-level BPE tokenizer for tests: tokens span several characters, as a real model's do.

Trained here (a fraction of a second) on task-like text: the built-in tasks' prompts and answers, calculator
episodes, words. Without the pre-tokenizer's regex split, merges cross digits, signs and newlines, so a
tool call's "?" arrives inside tokens such as "6?\\n" or ")*7?\\n", and prompts and answers read as a few
multi-character tokens. The special tokens are the char tokenizer's (trainer.tiny_model: pad, bos, eos at
0, 1, 2); `chatml=True` adds <|im_start|> and <|im_end|> and a ChatML chat template.
"""

from __future__ import annotations

import random

from trainer.tiny_model import SPECIAL_TOKENS

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = 400


def corpus(seed: int = 0) -> list[str]:
    from environments.tasks import get_task

    rng = random.Random(seed)
    texts = [it.prompt + it.answer for it in get_task("toy", digits=4).make_prompts(300, seed)]
    for it in get_task("countdown").make_prompts(300, seed + 1):
        texts += [it.prompt + it.answer, f"{it.prompt}{it.answer}?={it.meta['target']};{it.answer}"]
    texts += [f"{it.prompt} {it.answer}" for it in get_task("math").make_prompts(300, seed + 2)]
    texts += [f"{it.prompt}?{it.answer}={it.answer}" for it in get_task("lookup").make_prompts(100, seed + 3)]
    for _ in range(300):
        a, b, c = rng.randint(0, 99), rng.randint(0, 99), rng.randint(1, 9)
        texts.append(f"({a}+{b})*{c}?\n")
    texts += ["the system says copy the digits", "solve the problem step by step", "assistant user system"] * 20
    return texts


def make_bpe_tokenizer(chatml: bool = False, seed: int = 0):
    """A PreTrainedTokenizerFast: byte-level BPE with MERGES merges, EOS <|eos|> (or <|im_end|> with chatml)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(SPECIAL_TOKENS) + MERGES,
                                  special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer)
    if chatml:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_TOKENS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                  eos_token="<|im_end|>" if chatml else "<|eos|>", model_max_length=1024,
                                  clean_up_tokenization_spaces=False)
    if chatml:
        out.chat_template = CHATML_TEMPLATE
    return out


def pieces(tok, ids) -> list[str]:
    """Each token's own text."""
    return [tok.decode([int(i)]) for i in ids]


def multi_char(tok, ids) -> list[str]:
    """The tokens of `ids` that span more than one character."""
    return [p for p in pieces(tok, ids) if len(p) > 1]
