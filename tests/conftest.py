"""Shared test set-up: environment for vLLM / Ray on CPU (vLLM in-process with a 1 GiB KV cache, its cache and socket
files in a temporary folder, no Ray auth token, no hub) and tiny models."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_TMP = Path(tempfile.mkdtemp(prefix="swarmrl-tests-"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(_TMP / "vllm-cache"))
os.environ.setdefault("VLLM_RPC_BASE_PATH", str(_TMP))  # vLLM's zmq socket files
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with tied embeddings (made locally, deterministic)."""
    from trainer.tiny_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-tied"), "tiny", seed=0, tie_embeddings=True)


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with a separate lm_head."""
    from trainer.tiny_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-untied"), "tiny", seed=1, tie_embeddings=False)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> Path:
    """A tiny model that knows the "lookup" environment's tool format a little (40 steps of the tool
    corpus, ~40 s here): it calls the tool after `ask:=` about a third of the time, so episodes have turns."""
    from trainer.tiny_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-tool"), "tiny", seed=0, tie_embeddings=True, pretrain_steps=40,
        tool_format=True)
