"""The policy model: its fp32 master weights loaded from a transformers folder, and the logprobs (and
entropy) of a micro-batch's completion tokens under it, of the distribution the workers sampled from."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer import attention as attention_impl
from trainer.loss import entropy_from_logprobs
from trainer.packing import MicroBatch


def load_model(model_dir: Path, device: torch.device, attention: str = "varlen") -> nn.Module:
    """fp32 master weights. attention: "varlen" (ours, trainer/attention.py), or any transformers
    implementation ("sdpa", "flash_attention_2", ...)."""
    from transformers import AutoModelForCausalLM

    impl = attention_impl.register() if attention == "varlen" else attention
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl)
    return model.to(device)


def forward_logprobs(model: nn.Module, mb: MicroBatch, bf16: bool, temperature: float = 1.0) -> tuple[torch.Tensor,
    torch.Tensor]:
    """Logprobs of the completion tokens under logits / temperature, the distribution the workers sampled
    from, and its entropy at those positions (fp32, 1-D, one per token)."""
    device = mb.input_ids.device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
        if mb.attention_mask is None:
            # Packed row, no attention mask: the sequences are kept apart by cu_seq_lens (varlen / flash
            # attention) or, under plain sdpa, by the block-diagonal mask transformers derives from the
            # position resets. use_cache=False matters: with a cache that derivation is skipped.
            out = model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                use_cache=False,
                logits_to_keep=mb.loss_positions,
                cu_seq_lens_q=mb.cu_seq_lens,
                cu_seq_lens_k=mb.cu_seq_lens,
                max_length_q=mb.max_length,
                max_length_k=mb.max_length,
            )
            logits = out.logits[0]
        else:
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask,
                use_cache=False)
            logits = out.logits.flatten(0, 1)[mb.loss_positions]
    logits = logits.float()
    logp_all = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    logprobs = logp_all.gather(-1, mb.targets[:, None])[:, 0]
    entropy = entropy_from_logprobs(logp_all)
    return logprobs, entropy
