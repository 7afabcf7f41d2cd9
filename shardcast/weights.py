"""Policy weights <-> safetensors shards, and the whole-model hash.

Tensor names are the HF/transformers names (`model.layers.0.self_attn.q_proj.weight`), which both
`Qwen2ForCausalLM.load_state_dict` and vLLM's `reload_weights(weights_path=...)` accept.

Tied weights: a tied model's `state_dict()` yields `lm_head.weight` as an alias of
`model.embed_tokens.weight` (same storage). safetensors cannot hold two views of one storage, and vLLM
skips `lm_head.*` for tied models, so an alias is written once, under its canonical name, and recorded
in the shard's safetensors metadata; `load_version_dir` re-creates it, so the dict it returns has the
same keys as the trainer's `state_dict()` and the same `model_hash`.

torch is imported inside the functions: the shardcast client (volunteers) never needs it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIASES_METADATA_KEY = "swarmrl.aliases"  # {alias name: canonical name}, in the shard holding the canonical tensor
_HASH_DOMAIN = b"swarmrl-model-hash-v1\0"


def split_aliases(state_dict: Mapping[str, "torch.Tensor"]) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
    """Separate tensors that are views of the same memory (tied weights) into canonical tensors + aliases.

    Of each group of aliases, the canonical name is the one transformers saves: not `lm_head.*`, else the
    first by name.
    """
    import torch

    groups: dict[tuple, list[str]] = {}
    for name, t in state_dict.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"state dict entry {name!r}: expected a dense torch.Tensor, got {type(t).__name__}")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        # Empty tensors share a null pointer without being tied.
        if t.numel() == 0:
            key = (name,)
        groups.setdefault(key, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for names in groups.values():
        names.sort(key=lambda n: (n.startswith("lm_head."), n))
        tensors[names[0]] = state_dict[names[0]]
        for alias in names[1:]:
            aliases[alias] = names[0]
    return tensors, aliases


def _raw_bytes(t: "torch.Tensor") -> memoryview:
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def model_hash(state_dict: Mapping[str, "torch.Tensor"]) -> str:
    """sha256 over the name-sorted (name, dtype, shape, raw bytes) of every tensor, then the aliases.

    Independent of sharding and of whether a tied alias is present as a view or only recorded.
    """
    tensors, aliases = split_aliases(state_dict)
    h = hashlib.sha256(_HASH_DOMAIN)
    for name in sorted(tensors):
        t = tensors[name]
        data = _raw_bytes(t)
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)], separators=(",", ":")).encode()
        h.update(struct.pack("<Q", len(header)) + header + struct.pack("<Q", data.nbytes))
        h.update(data)
    for alias in sorted(aliases):
        h.update(json.dumps(["alias", alias, aliases[alias]], separators=(",", ":")).encode())
    return h.hexdigest()


def plan_shards(tensors: Mapping[str, "torch.Tensor"], shard_bytes: int) -> list[list[str]]:
    """Pack name-sorted tensors greedily into shards of at most `shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def serialize_shard(tensors: Mapping[str, "torch.Tensor"], aliases: Mapping[str, str]) -> bytes:
    """One safetensors file; the aliases of its tensors go into its metadata."""
    from safetensors.torch import save

    mine = {a: c for a, c in aliases.items() if c in tensors}
    metadata = {"format": "pt"}
    if mine:
        metadata[ALIASES_METADATA_KEY] = json.dumps(mine, sort_keys=True)
    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=metadata)


def load_version_dir(path: Path) -> dict[str, "torch.Tensor"]:
    """All tensors of a version folder by HF name, tied aliases re-created as the same tensor."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            if ALIASES_METADATA_KEY in meta:
                aliases.update(json.loads(meta[ALIASES_METADATA_KEY]))
            for name in f.keys():
                if name in out:
                    raise ValueError(f"tensor {name!r} appears in two shards of {path}")
                out[name] = f.get_tensor(name)
    for alias, canonical in aliases.items():
        if canonical not in out:
            raise ValueError(f"alias {alias!r} points at missing tensor {canonical!r} in {path}")
        out[alias] = out[canonical]
    return out
