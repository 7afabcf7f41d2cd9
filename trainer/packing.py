"""Micro-batches: pack variable-length sequences up to a token budget, or pad them (the baseline).

Packed: the sequences of a micro-batch are concatenated into one row of shape [1, T]; their
`position_ids` restart at 0 at every sequence start and `cu_seq_lens` holds the sequence starts
(flash-attention's varlen convention). Attention stays within each sequence: our varlen backend
(trainer/attention.py) and flash-attention use cu_seq_lens; under plain sdpa/eager, transformers turns
the position resets into a block-diagonal causal mask (masking_utils.find_packed_sequence_indices).
tests/trainer/test_trainer_packing.py checks that a sequence's logits packed with others equal its logits alone.

Padded: rows padded on the right to the longest sequence of the micro-batch, with a 2-D attention mask.

One optimizer step's plan (`plan_micro_batches`): each rank's share of the samples, weighted by the loss's
normalizer and packed (or padded), with placeholders so that every rank runs as many micro-batches.

A sequence of n tokens feeds its first n-1 tokens to the model; position p predicts token p+1. Loss
positions are those whose target is a completion token that the model sampled (a multi-turn episode's
environment tokens are context only: no loss, no entropy, not in any normalizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from trainer import distributed as dist_utils
from trainer.config import TrainerConfig
from trainer.loss import sequence_weights
from trainer.samples import TrainSample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor | None  # [B, T] for padded rows, None when packed
    loss_positions: torch.Tensor  # [N] flat indices into B*T whose logits predict a completion token
    targets: torch.Tensor  # [N] the completion tokens
    behaviour_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N] normalizer per token (see loss.sequence_weights)
    sample_index: torch.Tensor  # [N] index of each token's sample in the step's list
    num_tokens: int  # real tokens fed to the model
    num_sequences: int
    cu_seq_lens: torch.Tensor | None = None  # packed: int32 sequence starts [0, ..., T] (flash-attention varlen)
    max_length: int | None = None  # packed: longest sequence in the row

    @property
    def num_slots(self) -> int:
        """Tokens computed, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**moved)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Assign items to bins of capacity `budget` (longest first, into the first bin with room).

    An item longer than the budget gets a bin of its own rather than being dropped."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def pad_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Arrival-order groups whose padded size (rows x longest) stays within the budget."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def _rows(samples: Sequence[TrainSample], index: Sequence[int], seq_weights: np.ndarray):
    """Per sequence: model input, positions (local), loss positions (local), targets and per-token data."""
    for i in index:
        s = samples[i]
        tokens = np.concatenate([s.prompt_ids, s.completion_ids])
        n_in = tokens.size - 1
        p = s.prompt_ids.size
        learn = s.loss_indices
        c = learn.size
        yield dict(
            i=i,
            inputs=tokens[:-1],
            loss_pos=p - 1 + learn,
            targets=s.completion_ids[learn],
            behaviour=s.behaviour_logprobs[learn],
            advantages=np.full(c, s.advantage, dtype=np.float32),
            weights=np.full(c, seq_weights[i], dtype=np.float64),
            n_in=n_in,
        )


def _cat(parts: list[np.ndarray], dtype) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts).astype(dtype))


def make_micro_batch(samples: Sequence[TrainSample], index: Sequence[int], seq_weights: np.ndarray,
    padded: bool) -> MicroBatch:
    rows = list(_rows(samples, index, seq_weights))
    if padded:
        width = max(r["n_in"] for r in rows)
        input_ids = np.zeros((len(rows), width), dtype=np.int64)
        attention = np.zeros((len(rows), width), dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64)
        loss_pos = []
        for b, r in enumerate(rows):
            input_ids[b, : r["n_in"]] = r["inputs"]
            attention[b, : r["n_in"]] = 1
            positions[b, : r["n_in"]] = np.arange(r["n_in"])
            loss_pos.append(b * width + r["loss_pos"])
        attention_mask = torch.from_numpy(attention)
        cu_seq_lens, max_length = None, None
    else:
        input_ids = np.concatenate([r["inputs"] for r in rows])[None]
        positions = np.concatenate([np.arange(r["n_in"]) for r in rows])[None]
        starts = np.cumsum([0] + [r["n_in"] for r in rows[:-1]])
        loss_pos = [start + r["loss_pos"] for start, r in zip(starts, rows)]
        attention_mask = None
        cu_seq_lens = torch.tensor(np.append(starts, input_ids.shape[1]), dtype=torch.int32)
        max_length = max(r["n_in"] for r in rows)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(positions),
        attention_mask=attention_mask,
        loss_positions=_cat(loss_pos, np.int64),
        targets=_cat([r["targets"] for r in rows], np.int64),
        behaviour_logprobs=_cat([r["behaviour"] for r in rows], np.float32),
        advantages=_cat([r["advantages"] for r in rows], np.float32),
        weights=_cat([r["weights"] for r in rows], np.float32),
        sample_index=torch.tensor(np.concatenate([np.full(len(r["targets"]), r["i"]) for r in rows]),
        dtype=torch.int64),
        num_tokens=int(sum(r["n_in"] for r in rows)),
        num_sequences=len(rows),
        cu_seq_lens=cu_seq_lens,
        max_length=max_length,
    )


def make_micro_batches(
    samples: Sequence[TrainSample],
    seq_weights: np.ndarray,
    token_budget: int,
    mode: Literal["packed", "padded"] = "packed",
) -> list[MicroBatch]:
    """Split samples into micro-batches of at most `token_budget` model-input tokens (padding included)."""
    if len(samples) != len(seq_weights):
        raise ValueError("one weight per sample")
    if not samples:
        return []
    lengths = [s.num_tokens - 1 for s in samples]
    if mode == "packed":
        groups = first_fit_decreasing(lengths, token_budget)
    elif mode == "padded":
        groups = pad_groups(lengths, token_budget)
    else:
        raise ValueError(f"unknown batching mode {mode!r}")
    return [make_micro_batch(samples, g, seq_weights, padded=(mode == "padded")) for g in groups]


def placeholder_micro_batch(mode: str) -> MicroBatch:
    """One pad token, no loss positions: keeps a rank in step with the others (it runs the
    forward/backward collectives) and contributes nothing."""
    z = torch.zeros(0)
    return MicroBatch(
        input_ids=torch.tensor([[0]]),
        position_ids=torch.tensor([[0]]),
        attention_mask=torch.ones(1, 1, dtype=torch.int64) if mode == "padded" else None,
        loss_positions=torch.zeros(0, dtype=torch.int64),
        targets=torch.zeros(0, dtype=torch.int64),
        behaviour_logprobs=z,
        advantages=z,
        weights=z,
        sample_index=torch.zeros(0, dtype=torch.int64),
        num_tokens=0,
        num_sequences=0,
        cu_seq_lens=None if mode == "padded" else torch.tensor([0, 1], dtype=torch.int32),
        max_length=None if mode == "padded" else 1,
    )


def plan_micro_batches(samples: list[TrainSample], config: TrainerConfig, env: dist_utils.DistEnv,
    device: torch.device) -> list[MicroBatch]:
    """This rank's micro-batches for one optimizer step; every rank gets the same number."""
    weights = sequence_weights([s.num_completion_tokens for s in samples], config.loss)
    mine = dist_utils.split_for_rank([s.num_tokens for s in samples], env)
    plan = make_micro_batches([samples[i] for i in mine], weights[mine], config.micro_batch_tokens, config.batching)
    if env.enabled:
        # FSDP/DDP collectives run per forward/backward, so ranks must run equally many micro-batches.
        n = dist_utils.all_reduce(torch.tensor([len(plan)]), env, op="max").item()
        while len(plan) < n:
            plan.append(placeholder_micro_batch(config.batching))
    return [mb.to(device) for mb in plan]
