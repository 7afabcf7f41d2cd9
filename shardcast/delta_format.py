"""The delta object's binary format: framing, integrity trailer, and the validation of untrusted headers.

Layout (all integers little-endian):
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
  tile them exactly (no gap, overlap or trailing byte). JSON keys are unique, integers are JSON integers.

Nothing here allocates more than the object and its header's parse; the sizes a header claims are checked
against the base by the codec (delta.py) before anything is decompressed. The trailer is no
authentication (anyone can recompute it): that is the signed manifest's sha256 of the file.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass

MAGIC = b"SWDELTA1"
FORMAT = "swarmrl-delta"
FORMAT_VERSION = 1
TRAILER_BYTES = 32
# ~300k tensors (MoE checkpoints with unfused experts reach ~100k); callers also cap it by the base
MAX_HEADER_BYTES = 64 << 20
MAX_NAME_CHARS = 1024
MAX_NDIM = 16
SPARSE_MAX_NUMEL = 1 << 32  # gaps are uint32, and their uint64 running sum cannot wrap
# Sparse sections are at most this dense: the encoder tries sparse only up to it, and a decoder refuses
# more, which bounds what it allocates. Above it sparse saved under 1% (small model, tensors >90% changed).
SPARSE_MAX_DENSITY = 0.5
DTYPES = (
    "float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool",
)
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


def pack_delta(base_hash: str, result_hash: str, entries: list[dict], frames: list[bytes]) -> bytes:
    """Frame a header and its sections, sha256 trailer last."""
    header = {"format": FORMAT, "version": FORMAT_VERSION, "base_hash": base_hash, "result_hash": result_hash,
        "tensors": entries}
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise DeltaError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    parts = [MAGIC, struct.pack("<Q", len(head)), head, *frames]
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    parts.append(h.digest())
    return b"".join(parts)


def sections_of(delta: bytes | memoryview, header: DeltaHeader) -> memoryview:
    mv = memoryview(delta).cast("B")
    return mv[header.sections_start : len(mv) - TRAILER_BYTES]


def _no_duplicate_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise DeltaError("duplicate key in the delta header")
    return dict(pairs)


def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:  # type() is int: refuses bool and float
        raise DeltaError(f"bad {what}: {str(v)[:40]!r}")
    return v


def read_header(delta: bytes | memoryview, max_header_bytes: int = MAX_HEADER_BYTES) -> DeltaHeader:
    """Check the framing and trailer, then parse and validate the header (no base needed, bounded work).

    max_header_bytes: JSON parsing allocates ~10x its input in Python objects, so callers that know the
    base pass what its tensor list can need (header_bytes_for) and a padded header is refused unparsed.
    """
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
    if head_len > min(max_header_bytes, MAX_HEADER_BYTES) or start + head_len > end:
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


def header_bytes_for(names: list[str]) -> int:
    """An upper bound on the header of a delta over tensors with these names (an entry is < 600 bytes + name)."""
    return 512 + sum(len(json.dumps(n)) + 600 for n in names)


def _parse_entry(e, offset: int, sections: int) -> TensorEntry:
    if not isinstance(e, dict):
        raise DeltaError("a tensor entry is not an object")
    enc = e.get("enc")
    keys = {"same": set(), "xor": {"offset", "length"}, "sparse": {"count", "offset",
        "length"}}.get(enc) if isinstance(enc, str) else None
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
