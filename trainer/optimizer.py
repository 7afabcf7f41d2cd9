"""The optimizer: AdamW over the parameters that train, and its learning-rate schedule (a linear warmup,
then constant or a cosine down to `min_lr_ratio` of the rate at `max_steps`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from trainer.config import TrainerConfig


def lr_lambda(config: TrainerConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.schedule == "constant":
            return 1.0
        span = max(1, config.max_steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        floor = config.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: nn.Module, config: TrainerConfig) -> tuple[torch.optim.AdamW,
    torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters (all of them, or a LoRA's adapters), and its LR schedule."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
