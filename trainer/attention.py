"""Variable-length ("varlen") causal attention for packed rows, as a transformers attention backend.

transformers already keeps packed sequences apart under plain sdpa: it turns position resets into a
dense block-diagonal [T, T] mask. That costs O(T^2) in the packed length T (all sequences of the
micro-batch), not O(sum of L_i^2), and sdpa with an explicit mask cannot use its fused causal kernels. On
GPUs, flash-attention's varlen kernels solve this; this backend does the same with one causal sdpa call
per sequence, which is what makes packing pay off on the CPU (bench/results/trainer_packing.md).

Segments come from `cu_seq_lens_q` (cumulative sequence starts, the flash-attention varlen convention,
which the trainer passes for packed micro-batches) or else from the position resets in `position_ids`.
Anything else (a padding mask, decoding with a cache, several rows) goes to transformers' own sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "swarmrl_varlen_sdpa"
_registered = False


def segment_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative starts [0, s1, ..., T] of the sequences in one packed row (position resets)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] - pos[:-1] != 1).reshape(-1) + 1
    zero = torch.zeros(1, dtype=torch.int64, device=pos.device)
    end = torch.tensor([pos.numel()], dtype=torch.int64, device=pos.device)
    return torch.cat([zero, starts.to(torch.int64), end])


def varlen_sdpa_attention(
    module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2] and query.shape[2] > 1
    if not packed:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, position_ids=position_ids,
            **kwargs
        )
    bounds = cu_seq_lens_q if cu_seq_lens_q is not None else segment_bounds(position_ids)
    bounds = bounds.tolist()
    gqa = query.shape[1] != key.shape[1]
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
            dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling, enable_gqa=gqa,
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, attention_mask=None, **kwargs):
    """No dense mask for packed rows (the attention above separates them); the usual sdpa mask otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make `attn_implementation=NAME` available to transformers models (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, varlen_sdpa_attention)
        AttentionMaskInterface.register(NAME, _mask)
        _registered = True
    return NAME
