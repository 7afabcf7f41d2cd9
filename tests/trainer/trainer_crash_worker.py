"""Crashes a trainer in the middle of writing its second checkpoint (started by test_trainer_checkpoint.py).

argv: model_dir run_dir. Step 1 writes checkpoint step_00000001; during step 2's checkpoint the process
dies (os._exit) right after the model weights were written and while train_state.pt is half written.
"""

import os
import sys
from pathlib import Path

import torch
from trainer_helpers import random_samples

from trainer.config import TrainerConfig
from trainer.train import Trainer


def main() -> None:
    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(lr=1e-2, checkpoint_every=1), Path(sys.argv[1]), Path(sys.argv[2]))
    trainer.step(random_samples(4, seed=1))

    def dying_save(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"\x80\x02partial")
            out.flush()
        os._exit(17)

    torch.save = dying_save
    trainer.step(random_samples(4, seed=2, version=1))
    raise SystemExit("unreachable: the checkpoint write should have crashed")


if __name__ == "__main__":
    main()
