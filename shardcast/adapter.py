"""LoRA adapter versions: a published version that holds an adapter instead of the whole model.

An adapter version is an ordinary state dict, so shardcast shards, signs and hashes it like any other:
- the adapter's tensors under peft's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
  as in peft's `adapter_model.safetensors`, which vLLM and peft load);
- `swarmrl.lora.config`: the adapter config (peft's `adapter_config.json`) as UTF-8 JSON bytes (uint8);
- `swarmrl.lora.base_model_hash`: the model hash of the base it was trained on, as hex bytes (uint8).

`shardcast.weights.model_hash` of that dict therefore covers the base's hash, the config and the adapter's
bytes: the same adapter on another base, or with another scaling, is another model hash, and a worker
cannot pass off a version on a base that is not the run's.

The base hash is `base_model_hash(folder)`: the model hash of the base folder's safetensors weights in
float32 (the trainer's master precision), computed the same way by the trainer, the verifier and workers.
torch is imported inside the functions: the shardcast client never needs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CONFIG_KEY = "swarmrl.lora.config"
BASE_HASH_KEY = "swarmrl.lora.base_model_hash"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"


def _bytes_tensor(data: bytes) -> "torch.Tensor":
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _tensor_bytes(t: "torch.Tensor") -> bytes:
    return bytes(t.detach().to("cpu").contiguous().numpy().tobytes())


def pack_adapter(tensors: Mapping[str, "torch.Tensor"], config: Mapping[str, Any], base_hash: str) -> dict[str,
    "torch.Tensor"]:
    """The state dict to publish for an adapter (tensors by peft name, `config` as adapter_config.json)."""
    if not tensors:
        raise ValueError("an adapter version needs at least one tensor")
    clash = {CONFIG_KEY, BASE_HASH_KEY} & set(tensors)
    if clash:
        raise ValueError(f"adapter tensor names clash with the version's metadata keys: {sorted(clash)}")
    if len(base_hash) != 64 or any(c not in "0123456789abcdef" for c in base_hash):
        raise ValueError(f"base_hash must be a sha256 hex digest, got {base_hash!r}")
    state = dict(tensors)
    state[CONFIG_KEY] = _bytes_tensor(json.dumps(dict(config), sort_keys=True, separators=(",", ":")).encode())
    state[BASE_HASH_KEY] = _bytes_tensor(base_hash.encode())
    return state


def is_adapter(state_or_dir: Mapping[str, Any] | Path | str) -> bool:
    """Whether a state dict (or a version folder's safetensors) is an adapter version."""
    if isinstance(state_or_dir, Mapping):
        return CONFIG_KEY in state_or_dir
    from safetensors import safe_open

    for file in sorted(Path(state_or_dir).glob("*.safetensors")):
        if file.name == PEFT_WEIGHTS_FILE:
            continue
        with safe_open(str(file), framework="pt") as f:
            if CONFIG_KEY in f.keys():
                return True
    return False


def unpack_adapter(state: Mapping[str, "torch.Tensor"]) -> tuple[dict[str, "torch.Tensor"], dict[str, Any], str]:
    """(adapter tensors, adapter config, base model hash) of an adapter version's state dict."""
    if CONFIG_KEY not in state or BASE_HASH_KEY not in state:
        raise ValueError("not an adapter version: its metadata tensors are missing")
    config = json.loads(_tensor_bytes(state[CONFIG_KEY]).decode())
    base_hash = _tensor_bytes(state[BASE_HASH_KEY]).decode()
    tensors = {k: v for k, v in state.items() if k not in (CONFIG_KEY, BASE_HASH_KEY)}
    return tensors, config, base_hash


def load_version(path: Path | str) -> dict[str, "torch.Tensor"]:
    """A version folder's state dict (full or adapter)."""
    from shardcast.weights import load_version_dir

    return load_version_dir(Path(path))


def write_peft_dir(state: Mapping[str, "torch.Tensor"], out: Path) -> Path:
    """Write an adapter version as a peft folder (`adapter_model.safetensors` + `adapter_config.json`),
    the form vLLM's `LoRARequest` and peft's `PeftModel.from_pretrained` read. Returns `out`."""
    from safetensors.torch import save_file

    tensors, config, _ = unpack_adapter(state)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(out / PEFT_WEIGHTS_FILE),
        metadata={"format": "pt"})
    (out / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def base_model_hash(model_dir: Path | str) -> str:
    """The model hash of a base model folder's weights, every floating tensor in float32."""
    import torch

    from shardcast.weights import load_version_dir, model_hash

    state = load_version_dir(Path(model_dir))
    return model_hash({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})
