"""LoRA training (peft): adapters on a frozen base, and the adapter version that the trainer publishes.

`attach` injects peft's LoRA layers into the transformers model in place; the trainer keeps training that
same module (its forward signature is unchanged, so packed varlen batches work as before) and the
optimizer sees only the adapter's parameters (the base's have requires_grad=False). A published version
is `shardcast.adapter.pack_adapter` of the adapter's tensors, its config and the base's model hash: a few
megabytes, where a full version is the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config import LoraConfig


def attach(model: nn.Module, config: LoraConfig):
    """Inject LoRA layers into `model` (in place; B = 0, so the model is unchanged until trained) and
    freeze the base. Returns the peft wrapper, which knows how to extract the adapter's state."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=list(config.target_modules),
        bias="none", task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, peft_config)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"trainer.lora.target_modules {config.target_modules} match no module of the model")
    return peft_model


def adapter_config(peft_model) -> dict[str, Any]:
    """peft's adapter_config.json contents, JSON-safe and free of local paths (they would enter the model hash)."""
    cfg = peft_model.peft_config["default"].to_dict()
    cfg.update(base_model_name_or_path=None, inference_mode=True)
    return json.loads(json.dumps(cfg, default=sorted))  # sets (target_modules) -> sorted lists; enums -> str


def adapter_state(peft_model, base_hash: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The version to publish: the adapter's tensors (fresh CPU copies at `dtype`), config and base hash."""
    from peft import get_peft_model_state_dict

    from shardcast.adapter import pack_adapter

    tensors = {k: v.detach().to("cpu", dtype=dtype, copy=True) for k,
        v in get_peft_model_state_dict(peft_model).items()}
    return pack_adapter(tensors, adapter_config(peft_model), base_hash)


def merged_state(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's weights (peft-injected names) as plain transformers weights, the adapter merged:
    W' = W + (alpha / r) * B A (Hu et al. 2021, "LoRA", eq. 3 with peft's alpha / r scaling)."""
    scale = alpha / rank
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." in name:
            prefix, suffix = name.split(".base_layer.", 1)
            if suffix == "weight":
                a, b = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
                t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
            name = f"{prefix}.{suffix}"
        out[name] = t
    return out


def base_hash(model_dir: Path) -> str:
    from shardcast.adapter import base_model_hash

    return base_model_hash(model_dir)
