"""Multi-turn samples: the trainer learns only from the model's tokens (environment tokens are context)."""

import numpy as np
import pytest
import torch

from protocol.arrays import le_bytes
from protocol.batches import GROUP_ARRAYS, SampleGroup
from trainer.config import LossConfig
from trainer.loss import ppo_loss, sequence_weights
from trainer.packing import make_micro_batches
from trainer.policy_model import forward_logprobs, load_model
from trainer.samples import TrainSample, samples_from_groups

torch.set_num_threads(1)

# prompt `ask:=`, then: model `?`, environment `291=`, model `29<eos>` (ids only matter as ids here)
PROMPT = [1, 46, 24, 34, 43, 42]
EPISODE = [48, 5, 12, 4, 42, 5, 12, 2]
ENV = np.array([0, 1, 1, 1, 1, 0, 0, 0], dtype=bool)


def episode_sample(advantage=1.0) -> TrainSample:
    return TrainSample(PROMPT, EPISODE, np.full(len(EPISODE), -1.0), advantage, 0.5, 0, "ep", loss_mask=~ENV)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, torch.device("cpu"))


def test_only_model_tokens_are_loss_positions_and_counted():
    s = episode_sample()
    assert s.num_completion_tokens == 4
    for mode in ("packed", "padded"):
        (mb,) = make_micro_batches([s], np.ones(1), 1000, mode)
        assert mb.targets.tolist() == [t for t, env in zip(EPISODE, ENV) if not env]
        assert mb.loss_positions.tolist() == [len(PROMPT) - 1 + i for i in np.flatnonzero(~ENV)]
    # Normalizers count the model's tokens only: 4 here, not 8.
    w = sequence_weights([s.num_completion_tokens], LossConfig(normalizer="sequence"))
    assert w.tolist() == [0.25]


def test_environment_positions_get_no_gradient(model):
    """The gradient of the loss with respect to each position's logits: zero where the target is an
    environment token, nonzero where the model sampled it."""
    s = episode_sample()
    (mb,) = make_micro_batches([s], np.ones(1), 1000, "padded")  # padded: logits for every position
    seen = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        seen["logits"] = output

    handle = model.lm_head.register_forward_hook(keep)
    try:
        model.zero_grad()
        lp, _ = forward_logprobs(model, mb, bf16=False)
        loss, _ = ppo_loss(lp, lp.detach() + 0.05, mb.behaviour_logprobs, mb.advantages, mb.weights, LossConfig())
        loss.backward()
    finally:
        handle.remove()
        model.zero_grad()
    grad = seen["logits"].grad[0].abs().sum(-1)  # [T] per input position
    # input position -> predicts an env token
    targets_of = {len(PROMPT) - 1 + i: bool(env) for i, env in enumerate(ENV)}
    for pos, env in targets_of.items():
        if env:
            assert grad[pos] == 0, pos
        else:
            assert grad[pos] > 0, pos
    assert grad[: len(PROMPT) - 1].sum() == 0  # nor the prompt


def test_env_masks_travel_through_sample_groups():
    """The orchestrator's group layout carries the masks; each member gets its own slice."""
    other = np.array([0, 0, 1, 0], dtype=np.uint8)
    g = SampleGroup("sub", 0, [0, 1], 0, le_bytes([1.0, -1.0], "float64"), le_bytes([1.0, 0.0], "float64"),
                    le_bytes([len(EPISODE), 4], "int32"), le_bytes(PROMPT, "int32"), le_bytes(EPISODE + [5, 6, 7, 8],
                    "int32"),
                    le_bytes(np.full(len(EPISODE) + 4, -1.0), "float32"),
                    le_bytes(np.concatenate([ENV.astype(np.uint8), other]), GROUP_ARRAYS["env_masks"]))
    a, b = samples_from_groups([g, g])[:2]
    assert a.loss_mask.tolist() == (~ENV).tolist() and b.loss_mask.tolist() == [True, True, False, True]
    assert a.num_completion_tokens == 4 and b.num_completion_tokens == 3


def test_a_mask_without_model_tokens_is_refused():
    with pytest.raises(ValueError, match="model token"):
        TrainSample(PROMPT, EPISODE, np.full(len(EPISODE), -1.0), 1.0, 0.5, 0, "bad", loss_mask=np.zeros(len(EPISODE),
            bool))
