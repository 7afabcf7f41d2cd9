"""Shared helpers for the trainer tests (not a test module)."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.samples import TrainSample


def random_samples(n: int, seed: int = 0, version: int = 0, max_prompt: int = 12,
    max_completion: int = 40) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c = int(rng.integers(1, max_completion))
        out.append(
            TrainSample(
                prompt_ids=rng.integers(3, 50, size=int(rng.integers(1, max_prompt))),
                completion_ids=rng.integers(3, 50, size=c),
                behaviour_logprobs=-rng.uniform(3.5, 4.5, size=c),
                advantage=float(rng.normal()),
                reward=float(rng.uniform()),
                behaviour_version=version,
                sample_id=f"s{seed}-{i}",
            )
        )
    return out


def with_behaviour(samples: list[TrainSample], logprobs: list[torch.Tensor]) -> list[TrainSample]:
    return [
        TrainSample(s.prompt_ids, s.completion_ids, lp.numpy(), s.advantage, s.reward, s.behaviour_version, s.sample_id)
        for s, lp in zip(samples, logprobs)
    ]


def plain_logprobs(model, sample: TrainSample, temperature: float = 1.0) -> torch.Tensor:
    """Completion logprobs of one sample (of logits / temperature), computed the obvious way: a batch of
    one, full logits."""
    tokens = torch.tensor(np.concatenate([sample.prompt_ids, sample.completion_ids]))[None]
    logits = model(input_ids=tokens, use_cache=False).logits[0].float()
    p = sample.prompt_ids.size
    logp = torch.log_softmax(logits[p - 1 : -1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]


class SafetensorsPublisher:
    """A real `publish` transport for tests: writes each version as <root>/v<N>/model.safetensors."""

    def __init__(self, root):
        self.root = root
        self.versions: list[int] = []

    def __call__(self, version, state_dict):
        d = self.root / f"v{version}"
        d.mkdir(parents=True, exist_ok=False)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(d / "model.safetensors"))
        self.versions.append(version)

    def load(self, version: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.root / f"v{version}" / "model.safetensors"))
