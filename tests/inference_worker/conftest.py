"""Fixtures for the inference worker tests: one in-process vLLM engine per tiny model, for the session.

Session scope on purpose: closing an in-process engine tears down vLLM's global distributed state, which
breaks every other in-process engine still alive in this process. So none is closed before the session ends."""

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


@pytest.fixture(scope="session")
def tool_engine(tool_model_dir):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    engine = RolloutEngine(tool_model_dir, EngineConfig(max_model_len=128, kv_cache_bytes=32 << 20))
    yield engine
    engine.close()
