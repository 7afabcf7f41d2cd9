"""Delta objects: a policy version as a bit-exact patch against an earlier one (format: delta_format.py).

Per tensor, x = new XOR base over the raw bits (unsigned-int views, so NaN payloads and -0.0 survive),
then the smaller of two zstd-compressed encodings (judged on a sample of the tensor when it is big):
  xor     the byte planes of x (byte 0 of every element, then byte 1, ...). Small updates leave the high
          bytes (sign, exponent) zero, and planes turn them into long zero runs for zstd.
  sparse  the positions where x != 0 (as gaps, uint32 byte planes) and x at those positions (byte planes).
          x rather than the new value: a one-ulp change has a tiny x; on the `small` model's bf16 versions
          whole deltas came out 28-37% smaller than with new values (bench/results/delta_codec.md).
  same    no section: the tensor did not change.
A frame's decompressed size is implied by the base (xor: nbytes; sparse: count * (4 + itemsize), count <=
numel / 2), and the frame must declare exactly that size, so decoding a tensor allocates at most 2.5x its
size (int8 sparse; 1.5x for bf16) plus the result, whatever the delta claims.

A changed tensor set (names, shapes, dtypes, tying) is refused by encode_delta rather than shipped whole:
policy versions of one run never change it, so such a change is a bug, and a full version is the answer.
Apply checks the base's hash before any work and the result's hash after, so a delta yields the exact
signed weights or raises DeltaError; callers pass `expected_hash` from the signed manifest.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from shardcast.delta_format import (  # noqa: F401 - re-exported: the API is shardcast.delta
    DTYPES,
    SPARSE_MAX_DENSITY,
    SPARSE_MAX_NUMEL,
    DeltaBaseMismatch,
    DeltaError,
    DeltaHeader,
    TensorEntry,
    header_bytes_for,
    pack_delta,
    read_header,
    sections_of,
)

if TYPE_CHECKING:
    import torch

# zstd level 1 (bench/results/delta_codec.md): on XOR planes (zero runs, near-random low bytes) it gave the
# size of level 3 or smaller (8% smaller on bf16 sparse sections) for 1.0-1.7x less CPU; level 9 saved at
# most 1.2% for 3-5x the CPU.
DEFAULT_LEVEL = 1
# Bigger tensors choose their encoding by compressing both on a sample of this many elements: on the
# synthetic bench the same bytes as compressing both whole, for half the encode CPU in bf16.
CHOICE_SAMPLE_ELEMENTS = 1 << 18
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# --- raw byte views ---------------------------------------------------------------------------------


def _check_host() -> None:
    if sys.byteorder != "little":  # the format is the in-memory layout of a little-endian host, like safetensors
        raise RuntimeError("shardcast deltas need a little-endian host")


def _canonical(state: Mapping[str, "torch.Tensor"]) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
    from shardcast.weights import split_aliases

    tensors, aliases = split_aliases(state)
    for name, t in tensors.items():
        if _dtype_name(t) not in DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} is not supported by deltas")
    return dict(sorted(tensors.items())), aliases


def _dtype_name(t: "torch.Tensor") -> str:
    return str(t.dtype).removeprefix("torch.")


def _bytes(t: "torch.Tensor") -> np.ndarray:
    """The tensor's raw bytes as a flat uint8 array (a view when it is already a contiguous CPU tensor)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _planes(a: np.ndarray, width: int) -> np.ndarray:
    """Element-order bytes -> byte planes (plane j = byte j of every element)."""
    if width == 1:
        return a
    out = np.empty(a.size, np.uint8)
    src, dst = a.reshape(-1, width), out.reshape(width, -1)
    for j in range(width):  # one strided copy per plane: measured 1.2-5x faster than one transposing copy
        dst[j] = src[:, j]
    return out


def _unplanes(p: np.ndarray, width: int) -> np.ndarray:
    if width == 1:
        return p
    out = np.empty(p.size, np.uint8)
    src, dst = p.reshape(width, -1), out.reshape(-1, width)
    for j in range(width):
        dst[:, j] = src[j]
    return out


# --- encode -----------------------------------------------------------------------------------------


def encode_delta(
    base: Mapping[str, "torch.Tensor"],
    new: Mapping[str, "torch.Tensor"],
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    workers: int = 1,
    base_hash: str | None = None,
    new_hash: str | None = None,
) -> bytes:
    """The delta that turns `base` into `new`, bit for bit. Pass the hashes if already known (saves a pass).

    threads: zstd worker threads per frame (0 = compress in this thread). workers: tensors encoded at
    once (numpy and zstd release the GIL). Neither changes the bytes produced.
    """
    from shardcast.weights import model_hash

    _check_host()
    b_tensors, b_aliases = _canonical(base)
    n_tensors, n_aliases = _canonical(new)
    if list(b_tensors) != list(n_tensors) or b_aliases != n_aliases:
        raise DeltaError(f"tensor names or tying differ: {sorted(set(b_tensors) ^ set(n_tensors))[:5]}; publish a "
            f"full version")
    for name, b in b_tensors.items():
        n = n_tensors[name]
        if b.dtype != n.dtype or tuple(b.shape) != tuple(n.shape):
            raise DeltaError(f"tensor {name!r} changed from {b.dtype} {tuple(b.shape)} to {n.dtype} {tuple(n.shape)}; "
                f"publish a full version")

    def one(name: str) -> tuple[str, int, bytes | None]:
        # A compressor per tensor: they are not thread-safe, and making one costs ~20 us.
        cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True)
        return _encode_tensor(b_tensors[name], n_tensors[name], cctx)

    entries, frames, offset = [], [], 0
    for (name, b), (enc, count, frame) in zip(b_tensors.items(), _map(one, list(b_tensors), workers)):
        entry = {"name": name, "dtype": _dtype_name(b), "shape": list(b.shape)}
        entry["enc"] = enc
        if enc == "sparse":
            entry["count"] = count
        if frame is not None:
            entry.update(offset=offset, length=len(frame))
            frames.append(frame)
            offset += len(frame)
        entries.append(entry)
    return pack_delta(base_hash or model_hash(base), new_hash or model_hash(new), entries, frames)


def _encode_tensor(b: "torch.Tensor", n: "torch.Tensor", cctx) -> tuple[str, int, bytes | None]:
    width = b.element_size()
    uint = _UINT[width]
    x = np.bitwise_xor(_bytes(b).view(uint), _bytes(n).view(uint))
    count = int(np.count_nonzero(x))
    if count == 0:
        return "same", 0, None
    if count > SPARSE_MAX_DENSITY * x.size or x.size > SPARSE_MAX_NUMEL:
        return "xor", 0, cctx.compress(_dense_raw(x, width))
    if x.size > CHOICE_SAMPLE_ELEMENTS:
        # Compressing both encodings of the whole tensor doubled the encode time; a sample picks the
        # same encoding (ties and change-free samples go to sparse, the cheaper one to decode).
        sample = _sample(x)
        if len(cctx.compress(_sparse_raw(sample, width))) <= len(cctx.compress(_dense_raw(sample, width))):
            return "sparse", count, cctx.compress(_sparse_raw(x, width))
        return "xor", 0, cctx.compress(_dense_raw(x, width))
    sparse, dense = cctx.compress(_sparse_raw(x, width)), cctx.compress(_dense_raw(x, width))
    return ("sparse", count, sparse) if len(sparse) <= len(dense) else ("xor", 0, dense)


def _dense_raw(x: np.ndarray, width: int) -> np.ndarray:
    return _planes(x.view(np.uint8), width)


def _sparse_raw(x: np.ndarray, width: int) -> np.ndarray:
    pos = np.flatnonzero(x != 0)  # on a bool mask: measured 2-5x faster than on x itself
    gaps = np.diff(pos, prepend=0).astype(np.uint32)  # the first is the position itself, then >= 1
    return np.concatenate([_planes(gaps.view(np.uint8), 4), _planes(x[pos].view(np.uint8), width)])


def _sample(x: np.ndarray, chunks: int = 16) -> np.ndarray:
    """CHOICE_SAMPLE_ELEMENTS elements of x in `chunks` contiguous runs spread over the tensor."""
    run = CHOICE_SAMPLE_ELEMENTS // chunks
    starts = np.linspace(0, x.size - run, chunks).astype(np.int64)
    return np.concatenate([x[s : s + run] for s in starts])


# --- apply ------------------------------------------------------------------------------------------


def apply_delta(
    base: Mapping[str, "torch.Tensor"],
    delta: bytes | memoryview,
    *,
    base_hash: str | None = None,
    expected_hash: str | None = None,
    workers: int = 1,
) -> dict[str, "torch.Tensor"]:
    """`base` patched by `delta`: new CPU tensors for changed ones, the base's own tensors for unchanged ones.

    base_hash: the base's model_hash if the caller knows it (else computed). expected_hash: the result's
    hash from the signed manifest. Raises DeltaError (DeltaBaseMismatch for a wrong base); never returns
    weights whose hash is not the delta's (and the expected) result hash. workers: tensors decoded at once.
    """
    from shardcast.weights import model_hash

    _check_host()
    tensors, aliases = _canonical(base)
    header = read_header(delta, header_bytes_for(list(tensors)))
    if expected_hash is not None and header.result_hash != expected_hash:
        raise DeltaError(f"delta yields {header.result_hash[:12]}, the manifest expects {expected_hash[:12]}")
    have = base_hash or model_hash(base)
    if header.base_hash != have:
        raise DeltaBaseMismatch(f"delta is for base {header.base_hash[:12]}, this base is {have[:12]}")
    if [t.name for t in header.tensors] != list(tensors):
        raise DeltaError("the delta's tensor names are not the base's")
    for t in header.tensors:  # every size below derives from the base, so check the claims against it first
        b = tensors[t.name]
        if t.dtype != _dtype_name(b) or t.shape != tuple(b.shape):
            raise DeltaError(f"tensor {t.name!r}: delta says {t.dtype} {t.shape}, base has {b.dtype} {tuple(b.shape)}")
        if t.enc == "sparse" and not (t.count <= SPARSE_MAX_DENSITY * b.numel() and b.numel() <= SPARSE_MAX_NUMEL):
            raise DeltaError(f"tensor {t.name!r}: sparse count {t.count} for {b.numel()} elements")
    sections = sections_of(delta, header)

    def one(t: TensorEntry) -> "torch.Tensor":
        return _decode_tensor(tensors[t.name], t, sections[t.offset : t.offset + t.length],
            zstandard.ZstdDecompressor())

    out = dict(zip(tensors, _map(one, header.tensors, workers)))
    result = {name: out[aliases.get(name, name)] for name in base}
    got = model_hash(result)
    if got != header.result_hash:
        raise DeltaError(f"applying the delta gave {got[:12]}, not {header.result_hash[:12]}")
    return result


def _map(fn, items: list, workers: int) -> list:
    if workers <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def _decompress(dctx, frame: memoryview, size: int, name: str) -> np.ndarray:
    """Exactly one zstd frame declaring exactly `size` bytes: the declared size is checked before allocating."""
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
        if declared != size:
            raise DeltaError(f"tensor {name!r}: frame declares {declared} bytes, expected {size}")
        raw = dctx.decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise DeltaError(f"tensor {name!r}: bad zstd frame: {e}") from None
    if len(raw) != size:
        raise DeltaError(f"tensor {name!r}: frame gave {len(raw)} bytes, expected {size}")
    return np.frombuffer(raw, np.uint8)


def _decode_tensor(b: "torch.Tensor", t: TensorEntry, frame: memoryview, dctx) -> "torch.Tensor":
    import torch

    if t.enc == "same":
        return b
    width, numel = b.element_size(), b.numel()
    uint = _UINT[width]
    base = _bytes(b)
    out = torch.empty(tuple(b.shape), dtype=b.dtype)
    o = out.view(-1).view(torch.uint8).numpy()
    if t.enc == "xor":
        planes = _decompress(dctx, frame, numel * width, t.name).reshape(width, numel)
        dst, src = o.reshape(numel, width), base.reshape(numel, width)
        for j in range(width):  # un-plane and XOR in one pass per plane: measured 2-3x faster than two passes
            np.bitwise_xor(src[:, j], planes[j], out=dst[:, j])
        return out
    raw = _decompress(dctx, frame, t.count * (4 + width), t.name)
    gaps = _unplanes(raw[: 4 * t.count], 4).view(np.uint32)
    x = _unplanes(raw[4 * t.count :], width).view(uint)
    if not gaps[1:].all():
        raise DeltaError(f"tensor {t.name!r}: sparse positions are not strictly increasing")
    pos = np.cumsum(gaps, dtype=np.uint64)  # < 2**64: count <= 2**32 gaps, each < 2**32
    if pos[-1] >= numel or not x.all():
        raise DeltaError(f"tensor {t.name!r}: sparse position out of range or a zero change")
    o[:] = base
    ov = o.view(uint)
    ov[pos] ^= x
    return out


def delta_stats(delta: bytes | memoryview) -> dict[str, int]:
    """Tensors per encoding and the object's size: for logs and benchmarks."""
    header = read_header(delta)
    stats = {"bytes": len(delta), "same": 0, "xor": 0, "sparse": 0, "sparse_positions": 0}
    for t in header.tensors:
        stats[t.enc] += 1
        stats["sparse_positions"] += t.count
    return stats
