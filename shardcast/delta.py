"""Delta objects: a policy version as a bit-exact patch against an earlier one.

Per tensor, x = new XOR base over the raw bits (unsigned-int views, so NaN payloads and -0.0 survive),
then the smaller of two zstd-compressed encodings:
  xor     the byte planes of x (byte 0 of every element, then byte 1, ...). Small updates leave the high
          bytes (sign, exponent) zero, and planes turn them into long zero runs for zstd.
  sparse  the positions where x != 0 (as gaps, uint32 byte planes) and x at those positions (byte planes).
          x rather than the new value: a one-ulp change has a tiny x, and on the `small` model's bf16
          updates this measured 35-40% fewer bytes than shipping the new values.
  same    no section: the tensor did not change.

Binary layout (all integers little-endian):
  0        8 bytes   MAGIC b"SWDELTA1"
  8        8 bytes   H, the header's length (uint64), at most MAX_HEADER_BYTES
  16       H bytes   the header, UTF-8 JSON (below)
  16+H     ...       the sections: one zstd frame per changed tensor, back to back in header order
  end-32   32 bytes  sha256 of every byte before it (a flipped or missing byte fails here)

Header: {"format": "swarmrl-delta", "version": 1, "base_hash": <model_hash of the base>,
  "result_hash": <model_hash of the result>, "tensors": [entry, ...]} with one entry per tensor of the
base (tied aliases excluded: they are the base's), sorted by name, each
  {"name", "dtype", "shape", "enc": "same"} or {..., "enc": "xor", "offset", "length"}
  or {..., "enc": "sparse", "count", "offset", "length"}; offsets are relative to the sections and must
  tile them exactly. A frame's decompressed size is implied (xor: nbytes; sparse: count * (4 + itemsize)),
  and the frame must declare exactly that size, so nothing is allocated beyond the base's own size.

A changed tensor set (names, shapes, dtypes, tying) is refused by encode_delta rather than shipped whole:
policy versions of one run never change it, so such a change is a bug, and a full version is the answer.
Apply checks the base's hash before any work and the result's hash after, so a delta yields the exact
signed weights or raises DeltaError. The sha256 trailer catches damage; it is no authentication (anyone can
recompute it): callers pass `expected_hash` from the signed manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import zstandard

if TYPE_CHECKING:
    import torch

MAGIC = b"SWDELTA1"
FORMAT = "swarmrl-delta"
FORMAT_VERSION = 1
TRAILER_BYTES = 32
MAX_HEADER_BYTES = 16 << 20  # ~100k tensors; also bounds the JSON parser's work
MAX_NAME_CHARS = 1024
MAX_NDIM = 16
# zstd level 1: on XOR planes (zero runs or near-random low bytes) levels 1 and 3 gave the same size within
# 1%, and level 1 encoded 1.2-3x faster (bench/results/delta_codec.md).
DEFAULT_LEVEL = 1
# Sparse is tried only up to this density: above it, dense XOR planes were never bigger in the bench.
SPARSE_MAX_DENSITY = 0.5
SPARSE_MAX_NUMEL = 1 << 32  # gaps are uint32, and their uint64 running sum cannot wrap
DTYPES = (
    "float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool",
)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class DeltaError(ValueError):
    """A delta that must not be applied: corrupt, truncated, hostile, or not for this base."""


class DeltaBaseMismatch(DeltaError):
    """The delta was made against another base: fetch the right base or a full version."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    enc: str  # "same" | "xor" | "sparse"
    count: int = 0  # sparse: positions that changed
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class DeltaHeader:
    base_hash: str
    result_hash: str
    tensors: list[TensorEntry]
    sections_start: int  # where the sections begin in the object


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
    """Element-order bytes -> byte planes (plane j = byte j of every element). One vectorized transpose."""
    return np.ascontiguousarray(a.reshape(-1, width).T).reshape(-1) if width > 1 else a


def _unplanes(p: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        out = np.empty(p.size, np.uint8)
    out.reshape(-1, width)[...] = p.reshape(width, -1).T
    return out


# --- encode -----------------------------------------------------------------------------------------


def encode_delta(
    base: Mapping[str, "torch.Tensor"],
    new: Mapping[str, "torch.Tensor"],
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    base_hash: str | None = None,
    new_hash: str | None = None,
) -> bytes:
    """The delta that turns `base` into `new`, bit for bit. Pass the hashes if already known (saves a pass).

    threads: zstd worker threads per frame (0 = compress in this thread).
    """
    from shardcast.weights import model_hash

    _check_host()
    b_tensors, b_aliases = _canonical(base)
    n_tensors, n_aliases = _canonical(new)
    if list(b_tensors) != list(n_tensors) or b_aliases != n_aliases:
        raise DeltaError(f"tensor names or tying differ: {sorted(set(b_tensors) ^ set(n_tensors))[:5]}; publish a full version")
    for name, b in b_tensors.items():
        n = n_tensors[name]
        if b.dtype != n.dtype or tuple(b.shape) != tuple(n.shape):
            raise DeltaError(f"tensor {name!r} changed from {b.dtype} {tuple(b.shape)} to {n.dtype} {tuple(n.shape)}; publish a full version")
    cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True)
    entries, frames, offset = [], [], 0
    for name, b in b_tensors.items():
        entry = {"name": name, "dtype": _dtype_name(b), "shape": list(b.shape)}
        enc, count, frame = _encode_tensor(b, n_tensors[name], cctx)
        entry["enc"] = enc
        if enc == "sparse":
            entry["count"] = count
        if frame is not None:
            entry.update(offset=offset, length=len(frame))
            frames.append(frame)
            offset += len(frame)
        entries.append(entry)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "base_hash": base_hash or model_hash(base),
        "result_hash": new_hash or model_hash(new),
        "tensors": entries,
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise DeltaError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    h = hashlib.sha256()
    parts = [MAGIC, struct.pack("<Q", len(head)), head, *frames]
    for p in parts:
        h.update(p)
    parts.append(h.digest())
    return b"".join(parts)


def _encode_tensor(b: "torch.Tensor", n: "torch.Tensor", cctx) -> tuple[str, int, bytes | None]:
    width = b.element_size()
    uint = _UINT[width]
    x = np.bitwise_xor(_bytes(b).view(uint), _bytes(n).view(uint))
    changed = x != 0  # bool fast paths: count_nonzero / flatnonzero on a mask measured 2-5x faster than on x
    count = int(np.count_nonzero(changed))
    if count == 0:
        return "same", 0, None
    best = ("xor", 0, cctx.compress(_planes(x.view(np.uint8), width)))
    if count <= SPARSE_MAX_DENSITY * x.size and x.size <= SPARSE_MAX_NUMEL:
        pos = np.flatnonzero(changed)
        gaps = np.diff(pos, prepend=0).astype(np.uint32)  # first = position, then >= 1
        raw = np.concatenate([_planes(gaps.view(np.uint8), 4), _planes(x[pos].view(np.uint8), width)])
        frame = cctx.compress(raw)
        if len(frame) < len(best[2]):
            best = ("sparse", count, frame)
    return best


# --- parse (untrusted bytes) ------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise DeltaError("duplicate key in the delta header")
    return dict(pairs)


def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:  # type() is int: refuses bool and float
        raise DeltaError(f"bad {what}: {str(v)[:40]!r}")
    return v


def read_header(delta: bytes | memoryview) -> DeltaHeader:
    """Check the framing and trailer, then parse and validate the header (no base needed, bounded work)."""
    mv = memoryview(delta).cast("B")
    if len(mv) < len(MAGIC) + 8 + TRAILER_BYTES:
        raise DeltaError(f"delta of {len(mv)} bytes is truncated")
    if mv[: len(MAGIC)] != MAGIC:
        raise DeltaError("not a swarmrl delta (bad magic)")
    if hashlib.sha256(mv[:-TRAILER_BYTES]).digest() != mv[-TRAILER_BYTES:]:
        raise DeltaError("delta is corrupted or truncated (sha256 trailer mismatch)")
    (head_len,) = struct.unpack_from("<Q", mv, len(MAGIC))
    start = len(MAGIC) + 8
    end = len(mv) - TRAILER_BYTES
    if head_len > MAX_HEADER_BYTES or start + head_len > end:
        raise DeltaError(f"header length {head_len} is out of bounds")
    try:
        h = json.loads(bytes(mv[start : start + head_len]).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:  # DeltaError is a ValueError: keep its message
        raise DeltaError(f"malformed delta header: {str(e)[:200]}") from None
    if not isinstance(h, dict) or set(h) != {"format", "version", "base_hash", "result_hash", "tensors"}:
        raise DeltaError("delta header has the wrong fields")
    if h["format"] != FORMAT or h["version"] != FORMAT_VERSION:
        raise DeltaError(f"unsupported delta format {str(h['format'])[:40]!r} v{str(h['version'])[:10]}")
    for k in ("base_hash", "result_hash"):
        if not isinstance(h[k], str) or not _HEX64.match(h[k]):
            raise DeltaError(f"bad {k}")
    if not isinstance(h["tensors"], list):
        raise DeltaError("tensors is not a list")
    sections = end - start - head_len
    tensors: list[TensorEntry] = []
    offset = 0
    for e in h["tensors"]:
        t = _parse_entry(e, offset, sections)
        if tensors and t.name <= tensors[-1].name:
            raise DeltaError(f"tensor names are not sorted and unique at {t.name[:80]!r}")
        tensors.append(t)
        offset += t.length
    if offset != sections:
        raise DeltaError(f"sections hold {sections} bytes, the header accounts for {offset}")
    return DeltaHeader(h["base_hash"], h["result_hash"], tensors, start + head_len)


def _parse_entry(e, offset: int, sections: int) -> TensorEntry:
    if not isinstance(e, dict):
        raise DeltaError("a tensor entry is not an object")
    enc = e.get("enc")
    keys = {"same": set(), "xor": {"offset", "length"}, "sparse": {"count", "offset", "length"}}.get(enc) if isinstance(enc, str) else None
    if keys is None or set(e) != {"name", "dtype", "shape", "enc"} | keys:
        raise DeltaError(f"bad tensor entry fields: {sorted(map(str, e))[:8]}")
    name, dtype, shape = e["name"], e["dtype"], e["shape"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise DeltaError("bad tensor name")
    if dtype not in DTYPES:
        raise DeltaError(f"tensor {name[:80]!r}: unsupported dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise DeltaError(f"tensor {name[:80]!r}: bad shape")
    shape = tuple(_int(d, 0, 1 << 48, "dimension") for d in shape)
    if enc == "same":
        return TensorEntry(name, dtype, shape, enc)
    count = _int(e["count"], 1, SPARSE_MAX_NUMEL, "count") if enc == "sparse" else 0
    if _int(e["offset"], 0, sections, "offset") != offset:
        raise DeltaError(f"tensor {name[:80]!r}: section at {e['offset']}, expected {offset} (sections must tile)")
    length = _int(e["length"], 1, sections - offset, "length")
    return TensorEntry(name, dtype, shape, enc, count, offset, length)


# --- apply ------------------------------------------------------------------------------------------


def apply_delta(
    base: Mapping[str, "torch.Tensor"],
    delta: bytes | memoryview,
    *,
    base_hash: str | None = None,
    expected_hash: str | None = None,
) -> dict[str, "torch.Tensor"]:
    """`base` patched by `delta`: new CPU tensors for changed ones, the base's own tensors for unchanged ones.

    base_hash: the base's model_hash if the caller knows it (else computed). expected_hash: the result's
    hash from the signed manifest. Raises DeltaError (DeltaBaseMismatch for a wrong base); never returns
    weights whose hash is not the delta's (and the expected) result hash.
    """
    from shardcast.weights import model_hash

    _check_host()
    header = read_header(delta)
    if expected_hash is not None and header.result_hash != expected_hash:
        raise DeltaError(f"delta yields {header.result_hash[:12]}, the manifest expects {expected_hash[:12]}")
    tensors, aliases = _canonical(base)
    have = base_hash or model_hash(base)
    if header.base_hash != have:
        raise DeltaBaseMismatch(f"delta is for base {header.base_hash[:12]}, this base is {have[:12]}")
    if [t.name for t in header.tensors] != list(tensors):
        raise DeltaError("the delta's tensor names are not the base's")
    for t in header.tensors:  # every size below derives from the base, so check the claims against it first
        b = tensors[t.name]
        if t.dtype != _dtype_name(b) or t.shape != tuple(b.shape):
            raise DeltaError(f"tensor {t.name!r}: delta says {t.dtype} {t.shape}, base has {b.dtype} {tuple(b.shape)}")
        if t.enc == "sparse" and not (t.count <= b.numel() <= SPARSE_MAX_NUMEL):
            raise DeltaError(f"tensor {t.name!r}: sparse count {t.count} for {b.numel()} elements")
    mv = memoryview(delta).cast("B")
    sections = mv[header.sections_start : len(mv) - TRAILER_BYTES]
    dctx = zstandard.ZstdDecompressor()
    out = {t.name: _decode_tensor(tensors[t.name], t, sections[t.offset : t.offset + t.length], dctx) for t in header.tensors}
    result = {name: out[aliases.get(name, name)] for name in base}
    got = model_hash(result)
    if got != header.result_hash:
        raise DeltaError(f"applying the delta gave {got[:12]}, not {header.result_hash[:12]}")
    return result


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
        _unplanes(_decompress(dctx, frame, numel * width, t.name), width, out=o)
        np.bitwise_xor(o.view(uint), base.view(uint), out=o.view(uint))
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
