"""Fixtures for the inference worker tests: one in-process vLLM engine per tiny model, for the session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tied_engine(tiny_model_dir):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    engine = RolloutEngine(tiny_model_dir, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def untied_engine(tiny_untied_model_dir):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    engine = RolloutEngine(tiny_untied_model_dir, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))
    yield engine
    engine.close()
