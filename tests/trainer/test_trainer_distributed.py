"""Two processes (gloo, CPU) with FSDP2 take the same step as one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_dist_worker import fixed_batch

from trainer.config import TrainerConfig
from trainer.train import Trainer

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_ranks_match_one_process(tiny_model_dir, tmp_path, strategy):
    out = tmp_path / "two_ranks.safetensors"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent)]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "trainer_dist_worker.py"), str(tiny_model_dir), str(tmp_path / "run2"),
            str(out), strategy],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)

    torch.set_num_threads(1)
    cfg = TrainerConfig(lr=1e-2, micro_batch_tokens=128, checkpoint_every=100)
    one = Trainer(cfg, tiny_model_dir, tmp_path / "run1")
    want = one.step(fixed_batch())
    two = json.loads(Path(str(out) + ".json").read_text())
    assert two["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    # FSDP2 really sharded: each rank holds half of the (padded) vocab rows of the embedding
    if strategy == "fsdp2":
        assert two["param_is_dtensor"] == 1.0 and two["local_param_rows"] == one.model_config.vocab_size / 2
    else:
        assert two["param_is_dtensor"] == 0.0
    assert two["tokens"] == want["tokens"] and two["completion_tokens"] == want["completion_tokens"]
    got = load_file(str(out))
    ref = one.state_dict_for_publish()
    assert set(got) == set(ref)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    for name in ref:
        # Adam's first step moves every weight by ~lr; tiny gradient differences from summation order stay small
        torch.testing.assert_close(got[name], ref[name], atol=1e-4, rtol=0, msg=name)
        assert not torch.equal(got[name], base[name]) or name.endswith("bias")

    # Second step with a single sample (one rank has nothing to train: placeholders keep it in step).
    nxt = fixed_batch(n=1, seed=1, version=1)
    want2 = one.step(nxt)
    two2 = json.loads(Path(str(out) + ".step2.json").read_text())
    assert two2["loss"] == pytest.approx(want2["loss"], rel=1e-3, abs=1e-5)
    assert two2["tokens"] == want2["tokens"] and two2["samples/trained"] == 1
    got2 = load_file(str(out) + ".step2")
    want2_params = one.state_dict_for_publish()
    for name in want2_params:
        torch.testing.assert_close(got2[name], want2_params[name], atol=3e-4, rtol=0, msg=name)

    # The 2-rank checkpoint after step 1 (gathered model + optimizer state) resumes in one process:
    # same weights, and the same next step.
    resumed = Trainer(cfg, tiny_model_dir, tmp_path / "run2")
    assert resumed.version == 1
    for name, t in resumed.state_dict_for_publish().items():
        assert torch.equal(t, got[name]), name
    m_resumed = resumed.step(nxt)
    assert m_resumed["loss"] == pytest.approx(two2["loss"], rel=1e-3, abs=1e-5)
    for name, t in resumed.state_dict_for_publish().items():
        torch.testing.assert_close(t, got2[name], atol=3e-4, rtol=0, msg=name)
