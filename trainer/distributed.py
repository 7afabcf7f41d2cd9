"""The multi-process path: torch.distributed process group, FSDP2 (`fully_shard`) or DDP, full model state
dicts (what publishing needs), the optimizer state in per-rank shards (torch.distributed.checkpoint).

Every rank receives the same list of samples and trains on its share (balanced by tokens); the loss is
normalized by step-wide totals, so the gradients are *summed* across ranks. FSDP2 and DDP average
gradients over ranks, so each rank scales its loss by the world size.

With one process, everything here is a no-op and the model stays a plain nn.Module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_from_env(device: torch.device) -> DistEnv:
    """Join the process group described by torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT), if any.
    The Ray launcher (swarmrl/trainer_actor.py) sets the same variables in each rank's actor."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # One timeout for both backends (NCCL's default is 10 min): ranks > 0 of a Ray group wait in a
        # collective for rank 0's next call while it waits for batches or for the orchestrator to answer.
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size())


def broadcast_object(obj: object, env: DistEnv) -> object:
    """Rank 0's `obj` on every rank (pickled; the others pass anything)."""
    if not env.enabled:
        return obj
    box = [obj if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def local_device(kind: str) -> torch.device:
    """The device this process trains on: cuda:LOCAL_RANK under a multi-GPU launch, else `kind`."""
    if kind == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(kind)


def wrap_model(model: nn.Module, env: DistEnv, strategy: Literal["fsdp2", "ddp"], device: torch.device) -> nn.Module:
    if not env.enabled:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (env.world_size,))
    # One FSDP unit per decoder layer, then the root (embeddings, final norm, lm_head; tied weights stay together).
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model,
        nn.parallel.DistributedDataParallel) else model


def split_for_rank(lengths: Sequence[int], env: DistEnv) -> list[int]:
    """Indices this rank trains on: longest first, each to the rank with the fewest tokens so far."""
    if not env.enabled:
        return list(range(len(lengths)))
    load = [0] * env.world_size
    mine: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(env.world_size), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        if r == env.rank:
            mine.append(i)
    return sorted(mine)


def all_reduce(values: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
    if env.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return values


def full_model_state(model: nn.Module, env: DistEnv, copy: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers on the CPU (every rank takes part; meaningful on rank 0).
    `copy=False`: one process on the CPU returns the live tensors (read before the next step changes them)."""
    if env.enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() if copy or v.device.type != "cpu" else v.detach() for k,
        v in unwrap(model).state_dict().items()}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: Mapping,
    optim_state: dict | None, env: DistEnv) -> None:
    """Load full (unsharded) states: a model state from `full_model_state`, an optimizer state from a
    one-process checkpoint (a group's optimizer state comes in shards: `load_optimizer_shards`)."""
    if env.enabled:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, dict(model_state), options=opts)
        if optimizer is not None and optim_state is not None:
            set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
        return
    missing, unexpected = unwrap(model).load_state_dict(dict(model_state), strict=False)
    tied = {"lm_head.weight"} if getattr(unwrap(model).config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    if optimizer is not None and optim_state is not None:
        optimizer.load_state_dict(optim_state)


def save_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank writes its own shard of the optimizer state into the folder `path` (shared by the ranks),
    rank 0 the index of them: torch.distributed.checkpoint, fsynced. A collective call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path.mkdir(parents=True, exist_ok=True)
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def load_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read `save_optimizer_shards`' folder: each rank reads its own shard (in one process, the whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # A fresh optimizer has no state to load into: get_optimizer_state_dict makes it (a step at lr 0).
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)
