"""The published precision: what the origin ships is a cast of the trainer's fp32 master, made per version.

The master must stay fp32. At RL learning rates (1e-6 to 1e-5) one AdamW step moves most weights by
less than half a bf16 ulp, so a bf16 master would round every such step away and never learn; an fp32
master accumulates them until a bf16 value flips, and only those flips reach the wire as a delta.

The trainer calls this in its publish step (it owns the master and the `publish_dtype` setting); the
origin publishes, and keeps for the next delta, exactly the returned dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cast_for_publishing(master: Mapping[str, "torch.Tensor"], dtype: "torch.dtype | None" = None) -> dict[str,
    "torch.Tensor"]:
    """Floating-point tensors cast to `dtype` (default bf16, round to nearest even), others copied as they are.

    Every returned tensor is a fresh copy (the optimizer keeps mutating the master in place), and tied
    aliases stay tied (one tensor under both names), so `model_hash` and the shards see one tensor.
    """
    import torch

    from shardcast.weights import split_aliases

    dtype = torch.bfloat16 if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"publishing dtype must be floating point, got {dtype}")
    tensors, aliases = split_aliases(master)
    out = {
        name: t.detach().to(dtype, copy=True) if t.is_floating_point() else t.detach().clone()
        for name, t in tensors.items()
    }
    return {name: out[aliases.get(name, name)] for name in master}
