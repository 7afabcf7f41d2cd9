"""The engine in vLLM's multiprocess mode: capture and reload run in the engine core process and only
bytes come back. Compared with the in-process engine on the same lease."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from iw_helpers import make_lease


@pytest.fixture(scope="module")
def mp_engine(tiny_model_dir, tmp_path_factory):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    # vLLM's zmq socket files go to VLLM_RPC_BASE_PATH (default /tmp); keep ours in a folder we delete.
    sockets = tmp_path_factory.mktemp("vllm-ipc")
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(sockets)
    try:
        engine = RolloutEngine(tiny_model_dir, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20,
            multiprocess=True))
    finally:
        if old is None:
            os.environ.pop("VLLM_RPC_BASE_PATH")
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = old
    yield engine
    engine.close()
    shutil.rmtree(sockets, ignore_errors=True)


def test_multiprocess_matches_in_process(mp_engine, tied_engine, tiny_model_dir, tmp_path):
    from test_engine import hf_greedy
    from test_reload import PROMPTS, N, perturbed, vllm_greedy

    assert mp_engine.llm.llm_engine.engine_core.__class__.__name__ != "InprocClient"
    tied_engine.reload(tiny_model_dir, 0, "0" * 64)
    lease = make_lease([[1, 10, 11, 12]], [[4, 5]], temperature=1.0, max_tokens=40)
    mp_out, mp_hidden = mp_engine.generate_with_hidden(lease)
    ip_out, ip_hidden = tied_engine.generate_with_hidden(lease)
    for a, b, ha, hb in zip(mp_out, ip_out, mp_hidden, ip_hidden):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.proofs == b.proofs
        torch.testing.assert_close(ha, hb)

    # Hot reload through a file path (tensors cannot cross the process boundary), tied embeddings.
    from safetensors.torch import save_file

    new = perturbed(tiny_model_dir, seed=3)
    sd = {k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"}
    (tmp_path / "v1").mkdir()
    save_file(sd, tmp_path / "v1" / "model.safetensors")
    mp_engine.reload(tmp_path / "v1", 1, "1" * 64)
    assert vllm_greedy(mp_engine) == [hf_greedy(new, p, N) for p in PROMPTS]
