"""Checkpoints: model, optimizer, scheduler, step, RNG state and data cursor, written atomically.

Layout of `<run_dir>/checkpoints/step_00000010/`:
    model/             a plain transformers folder (config.json, model.safetensors, tokenizer files)
    train_state.pt     optimizer (one process), scheduler, RNG states
    optimizer/         a group of ranks: each rank's shard of the optimizer state (torch.distributed.checkpoint)
    trainer_state.json step, published version, data cursor, base model folder (human-readable)

A checkpoint is written into a hidden temporary folder next to it, every file fsynced, and then renamed
into place; a crash mid-write leaves only a temporary folder (ignored and cleaned up), so the previous
checkpoint stays the latest usable one. Only folders named step_* are ever read.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MODEL_FILE = "model.safetensors"
OPTIMIZER_DIR = "optimizer"
SHARDS_PREFIX = ".shards-step_"  # the ranks' optimizer shards, before the checkpoint that takes them in
# Files we copy from the base model folder into every checkpoint's model/ (tokenizer, generation config).
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def publishable_state(state: Mapping[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Drop the tied lm_head (it aliases the embedding), as transformers' save_pretrained does."""
    out = dict(state)
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return {k: v.contiguous() for k, v in out.items()}


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain Python values only, so `torch.load(weights_only=True)` reads
    it back (numpy's key array travels as a list)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def detached_copy(obj: Any) -> Any:
    """A copy of a (nested) state dict whose tensors share nothing with the live ones, on the CPU: what a
    background writer may read while the next step changes the weights and the optimizer state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: detached_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(detached_copy(v) for v in obj)
    return obj


def snapshot_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """What a checkpoint's copy holds: the float32 weights and, with AdamW, two moments of each trained one."""
    weights = sum(p.numel() * 4 for p in model.parameters())
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    return weights + (2 * trained if optimizer is not None else 0)


def snapshot_fits(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, share: float = 0.5) -> bool:
    """Whether a background checkpoint's copy fits in `share` of the memory available now (Linux; elsewhere
    assumed to fit). The trainer's own weights, gradients and moments are already resident."""
    import psutil

    return snapshot_bytes(model, optimizer) <= share * psutil.virtual_memory().available


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        _fsync(p)
    _fsync(path)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model_state: Mapping[str, torch.Tensor],
    model_config,
    base_model_dir: Path,
    train_state: Mapping[str, Any],
    trainer_state: Mapping[str, Any],
    keep: int,
    optimizer_shards: Path | None = None,
) -> Path:
    """Write a complete checkpoint for `step` atomically; keep the newest `keep`. Returns its folder.
    `optimizer_shards`: the folder the ranks wrote their optimizer shards to; it moves into the checkpoint."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        model_dir = tmp / "model"
        model_dir.mkdir()
        model_config.save_pretrained(model_dir)
        state = publishable_state(model_state, getattr(model_config, "tie_word_embeddings", False))
        save_file(state, str(model_dir / MODEL_FILE), metadata={"format": "pt"})
        for name in _SIDE_FILES:
            if (Path(base_model_dir) / name).is_file():
                shutil.copy2(Path(base_model_dir) / name, model_dir / name)
        torch.save(dict(train_state), tmp / "train_state.pt")
        if optimizer_shards is not None:
            os.rename(optimizer_shards, tmp / OPTIMIZER_DIR)  # the same file system: both are under root
        (tmp / "trainer_state.json").write_text(json.dumps(dict(trainer_state), indent=2, default=str))
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step after a resume: swap the old one out
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint written", extra={"step": step, "path": str(final)})
    return final


def remove_partial(root: Path) -> None:
    """Delete temporary folders left by a crash mid-write."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-", SHARDS_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model state, train state, trainer state) of a checkpoint folder."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a swarmrl checkpoint (no trainer_state.json)")
    model_state = load_file(str(path / "model" / MODEL_FILE))
    try:  # weights_only: a checkpoint is data; unpickling arbitrary objects from it could run code
        train_state = torch.load(path / "train_state.pt", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: train_state.pt holds more than tensors and plain values (an older swarmrl, or not "
            f"ours): {exc}") from None
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    return model_state, train_state, trainer_state


def export_checkpoint(path: Path, out_dir: Path) -> Path:
    """Copy a checkpoint's model into a plain transformers folder (AutoModelForCausalLM.from_pretrained loads it)."""
    path, out_dir = Path(path), Path(out_dir)
    src = path / "model"
    if not (src / "config.json").is_file() or not (src / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{path} holds no exported model (expected model/config.json and model/{MODEL_FILE})")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(src, tmp)
    lora = json.loads((path / "trainer_state.json").read_text()).get("lora")
    if lora:  # a LoRA run's checkpoint holds base + adapter: export them merged
        from trainer.lora import merged_state

        save_file(merged_state(load_file(str(src / MODEL_FILE)), lora["rank"], lora["alpha"]), str(tmp / MODEL_FILE),
            metadata={"format": "pt"})
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir
