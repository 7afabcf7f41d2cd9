"""Shared by the real-architecture tests: the BPE tokenizer, trained once per session into a session cache."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bpe_cache(tmp_path_factory):
    """A tokenizer cache folder of this session: the first build trains (~3-5 s), every later one reads it."""
    return tmp_path_factory.mktemp("bpe-cache")


@pytest.fixture(scope="session")
def qwen_tokenizer(bpe_cache):
    from trainer.bpe_tokenizer import build_tokenizer

    return build_tokenizer(151936, cache_dir=bpe_cache)


@pytest.fixture(scope="session")
def llama_tokenizer(bpe_cache, qwen_tokenizer):
    from trainer.bpe_tokenizer import build_tokenizer

    return build_tokenizer(128256, cache_dir=bpe_cache)  # the same trained BPE, padded to Llama's vocabulary


@pytest.fixture(scope="session")
def arch_tokenizers(qwen_tokenizer, llama_tokenizer):
    return {"qwen2.5-0.5b": qwen_tokenizer, "qwen3-0.6b": qwen_tokenizer, "llama-3.2-1b": llama_tokenizer}
