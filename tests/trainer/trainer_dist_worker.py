"""One rank of the 2-process trainer test (tests/trainer/test_trainer_distributed.py starts it; not a test itself).

argv: model_dir run_dir out_file strategy. Trains one step on a fixed batch, saves a checkpoint
into run_dir, and on rank 0 writes the metrics and the full parameters to out_file (safetensors).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from trainer.config import TrainerConfig
from trainer.samples import TrainSample
from trainer.train import Trainer


def fixed_batch(n: int = 12, seed: int = 0, version: int = 0) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c = int(rng.integers(1, 40))
        out.append(
            TrainSample(
                prompt_ids=rng.integers(3, 50, size=int(rng.integers(2, 12))),
                completion_ids=rng.integers(3, 50, size=c),
                behaviour_logprobs=-rng.uniform(3.5, 4.5, size=c),
                advantage=float(rng.normal()),
                reward=0.0,
                behaviour_version=version,
                sample_id=f"s{i}",
            )
        )
    return out


def main() -> None:
    model_dir, run_dir, out_file, strategy = sys.argv[1:5]
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-2, micro_batch_tokens=128, distributed=strategy, checkpoint_every=100)
    trainer = Trainer(config, Path(model_dir), Path(run_dir))
    metrics = trainer.step(fixed_batch())
    state = trainer.state_dict_for_publish()
    trainer.save_checkpoint()  # full (gathered) model and optimizer state, written by rank 0
    # Evidence of the strategy in use: FSDP2 turns parameters into DTensor shards, DDP keeps full tensors.
    first = next(trainer.model.parameters())
    metrics["param_is_dtensor"] = float(type(first).__name__ == "DTensor")
    metrics["local_param_rows"] = float(first.to_local().shape[0] if hasattr(first, "to_local") else first.shape[0])
    if trainer.env.is_main:
        save_file(state, out_file)
        Path(out_file + ".json").write_text(json.dumps(metrics))
    # A step with fewer samples than ranks: rank 1 runs only placeholder micro-batches.
    metrics = trainer.step(fixed_batch(n=1, seed=1, version=1))
    state = trainer.state_dict_for_publish()
    if trainer.env.is_main:
        save_file(state, out_file + ".step2")
        Path(out_file + ".step2.json").write_text(json.dumps(metrics))
    if trainer.env.enabled:
        torch.distributed.destroy_process_group()
    # The work is done and written. Skip the interpreter's teardown: under load a C++ thread of the
    # process group is sometimes destroyed while joinable there ("terminate called without an active
    # exception", exit -6), which says nothing about the step this test compares.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
