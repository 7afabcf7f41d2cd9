"""How much KV cache the CPU engine gets, derived from the model instead of a constant.

A fixed 256 MiB suited the toy model (4 KiB per token) and is about 1,170 tokens at Qwen3-0.6B in fp32
(224 KiB per token: 28 layers x 8 KV heads x 128 x K and V x 4 bytes): vLLM refuses to start when one
sequence of max_model_len does not fit. The default is now enough for `sequences` full-length sequences
(vLLM pages the cache, so shorter completions share it), capped by a share of the memory available, and
never below one full-length sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def bytes_per_token(config: Any, dtype: str) -> int:
    """K and V of every layer for one token: layers x KV heads x head_dim x 2 x dtype bytes."""
    if dtype == "auto":
        dtype = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
            or "float32").replace("torch.", "")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return int(config.num_hidden_layers) * int(kv_heads) * int(head_dim) * 2 * DTYPE_BYTES.get(dtype, 4)


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def derived_bytes(config: Any, dtype: str, max_model_len: int, sequences: int, max_fraction: float,
    available: int | None = None) -> int:
    per_sequence = bytes_per_token(config, dtype) * max_model_len
    want = per_sequence * sequences
    available = available_bytes() if available is None else available
    if available:
        want = min(want, int(available * max_fraction))
    return max(per_sequence, want, 1 << 20)
