"""Delta codec: bit-exact round trips and chains, and refusal of wrong bases, damage and hostile objects."""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard

from shardcast.delta import (
    CHOICE_SAMPLE_ELEMENTS,
    DeltaBaseMismatch,
    DeltaError,
    apply_delta,
    delta_stats,
    encode_delta,
    read_header,
)
from shardcast.delta_format import MAGIC
from shardcast.precision import cast_for_publishing
from shardcast.weights import model_hash

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int8, torch.uint8,
    torch.int32, torch.int64, torch.bool]


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert bits(a[k]) == bits(b[k]), k


def rand(dtype: torch.dtype, shape, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 0.5).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def perturb(t: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    """Flip some low bits of about `frac` of the elements (bits, so every dtype changes)."""
    out = t.clone()
    raw = out.view(-1).view(torch.uint8)
    width = t.element_size()
    mask = torch.rand(t.numel(), generator=g) < frac
    idx = mask.nonzero().view(-1) * width  # lowest byte of each chosen element
    raw[idx] ^= torch.randint(1, 4 if t.dtype != torch.bool else 2, (idx.numel(),), generator=g, dtype=torch.uint8)
    return out


def roundtrip(base: dict, new: dict) -> tuple[bytes, dict]:
    delta = encode_delta(base, new)
    out = apply_delta(base, delta, expected_hash=model_hash(new))
    assert_bit_equal(out, new)
    return delta, out


# --- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_sparse_dense_and_unchanged(dtype):
    g = torch.Generator().manual_seed(0)
    base = {"dense": rand(dtype, (64, 100), g), "sparse": rand(dtype, (300, 7), g), "same": rand(dtype, (50,), g),
        "empty": rand(dtype, (0, 3), g), "scalar": rand(dtype, (), g)}
    new = dict(base, dense=perturb(base["dense"], 0.9, g), sparse=perturb(base["sparse"], 0.01, g),
        scalar=perturb(base["scalar"], 1.0, g))
    delta, out = roundtrip(base, new)
    stats = delta_stats(delta)
    assert (stats["xor"], stats["sparse"], stats["same"]) == (2, 1, 2)  # a changed scalar is 100% dense
    assert out["same"] is base["same"]  # unchanged tensors are shared, not copied
    assert len(delta) < sum(t.numel() * t.element_size() for t in new.values())


def test_big_tensors_choose_their_encoding_on_a_sample():
    g = torch.Generator().manual_seed(5)
    n = 4 * CHOICE_SAMPLE_ELEMENTS
    base = {"dense": rand(torch.bfloat16, (n,), g), "sparse": rand(torch.bfloat16, (n,), g), "one": rand(torch.float16,
        (n,), g)}
    one = base["one"].clone()
    one.view(torch.int16)[20000] ^= 1  # between the first two sampled runs: the sample sees no change
    new = dict(base, dense=perturb(base["dense"], 0.95, g), sparse=perturb(base["sparse"], 0.02, g), one=one)
    delta, _ = roundtrip(base, new)
    stats = delta_stats(delta)
    assert (stats["xor"], stats["sparse"]) == (1, 2)
    assert len(delta) < 0.2 * sum(t.numel() * t.element_size() for t in new.values())


def test_workers_change_nothing_but_speed(pair):
    base, new, delta = pair
    assert encode_delta(base, new, workers=3, threads=2) == delta
    assert_bit_equal(apply_delta(base, delta, workers=3), new)
    h, s = split(delta)
    y, frame = entry(h, "y"), declaring(1 << 40)  # an error inside a worker still surfaces as DeltaError
    s = s[: y["offset"]] + frame + s[y["offset"] + y["length"] :]
    y["length"] = len(frame)
    with pytest.raises(DeltaError, match="frame declares"):
        apply_delta(base, forge(h, s), workers=3)


def test_no_change_is_a_tiny_delta():
    g = torch.Generator().manual_seed(1)
    base = {f"w{i}": rand(torch.float32, (256, 256), g) for i in range(4)}
    delta, _ = roundtrip(base, {k: v.clone() for k, v in base.items()})
    assert delta_stats(delta)["same"] == 4 and len(delta) < 1000


def from_bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    raw = np.array(values, {2: np.uint16, 4: np.uint32}[width]).view(np.uint8)
    return torch.from_numpy(raw.copy()).view(dtype)


def test_special_values_are_carried_bit_for_bit():
    # NaN payloads, -0.0 <-> +0.0, inf -> NaN, subnormals: changes that value comparisons miss or mangle.
    base = {
        "f32": from_bits([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000, 0x00000000, 0x7F800000,
        0x00000001], torch.float32),
        "bf16": from_bits([0x7FC0, 0x7FC1, 0x8000, 0x0000, 0x0001, 0xFF80], torch.bfloat16),
        "f16": from_bits([0x7E00, 0x8000, 0x0001], torch.float16),
    }
    new = {
        "f32": from_bits([0x7FC00002, 0x7FC00001, 0xFFC00001, 0x7F800002, 0x00000000, 0x80000000, 0x7FC00000,
        0x00000002], torch.float32),
        "bf16": from_bits([0x7FC1, 0x7FC0, 0x0000, 0x8000, 0x0002, 0xFFC0], torch.bfloat16),
        "f16": from_bits([0x7E01, 0x0000, 0x8001], torch.float16),
    }
    _, out = roundtrip(base, new)
    assert bits(out["f32"]) != bits(base["f32"])


def test_tied_aliases_stay_tied():
    g = torch.Generator().manual_seed(2)
    emb = rand(torch.bfloat16, (64, 32), g)
    base = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": rand(torch.bfloat16, (32,),
        g)}
    emb2 = perturb(emb, 0.05, g)
    new = {"model.embed_tokens.weight": emb2, "lm_head.weight": emb2,
        "model.norm.weight": base["model.norm.weight"].clone()}
    _, out = roundtrip(base, new)
    assert out["lm_head.weight"] is out["model.embed_tokens.weight"]
    assert model_hash(out) == model_hash(new)


@pytest.mark.parametrize("publish", [torch.bfloat16, torch.float32], ids=str)
def test_chain_of_ten_deltas_equals_the_full_version(publish):
    """An fp32 master under Adam-like steps, published per version; v0 + ten deltas == v10 bit for bit."""
    g = torch.Generator().manual_seed(3)
    master = {"a": torch.randn(128, 96, generator=g) * 0.02, "b": torch.randn(4096, generator=g), "n": torch.ones(96)}
    versions = [cast_for_publishing(master, publish)]
    for _ in range(10):
        for k in ("a", "b"):
            master[k] -= 1e-3 * torch.sign(torch.randn(master[k].shape, generator=g))
        versions.append(cast_for_publishing(master, publish))
    deltas = [encode_delta(versions[i], versions[i + 1]) for i in range(10)]
    state, h = versions[0], model_hash(versions[0])
    for i, d in enumerate(deltas):
        state = apply_delta(state, d, base_hash=h, expected_hash=model_hash(versions[i + 1]))
        h = read_header(d).result_hash
    assert_bit_equal(state, versions[10])
    with pytest.raises(DeltaBaseMismatch):  # out of order
        apply_delta(versions[0], deltas[1])


# --- refusals ---------------------------------------------------------------------------------------


@pytest.fixture
def pair():
    g = torch.Generator().manual_seed(4)
    base = {"x": rand(torch.bfloat16, (40, 30), g), "y": rand(torch.float32, (200,), g), "z": rand(torch.int32, (9,),
        g)}
    new = {"x": perturb(base["x"], 0.05, g), "y": perturb(base["y"], 0.9, g), "z": base["z"].clone()}
    return base, new, encode_delta(base, new)


def test_wrong_base_and_wrong_expectation_are_refused(pair):
    base, new, delta = pair
    other = dict(base, z=base["z"] + 1)
    with pytest.raises(DeltaBaseMismatch):
        apply_delta(other, delta)
    with pytest.raises(DeltaError, match="not .*"):  # a caller that vouches for a base it does not hold
        apply_delta(other, delta, base_hash=model_hash(base))
    with pytest.raises(DeltaError, match="manifest expects"):
        apply_delta(base, delta, expected_hash="00" * 32)


def test_changed_tensor_set_is_refused_at_encode(pair):
    base, new, _ = pair
    for bad in ({**new, "extra": torch.zeros(2)}, {k: v for k, v in new.items() if k != "z"}, dict(new,
        z=new["z"].to(torch.int64)), dict(new, y=new["y"].reshape(20, 10))):
        with pytest.raises(DeltaError, match="full version"):
            encode_delta(base, bad)
    tied = dict(base, w=base["x"])
    with pytest.raises(DeltaError, match="tying"):
        encode_delta(tied, dict(new, w=new["x"].clone()))


def test_every_flipped_byte_is_refused(pair):
    base, _, delta = pair
    h = model_hash(base)
    for i in range(len(delta)):
        bad = bytearray(delta)
        bad[i] ^= 0x10
        with pytest.raises(DeltaError):
            apply_delta(base, bytes(bad), base_hash=h)


def test_a_flipped_byte_with_a_recomputed_trailer_never_yields_wrong_weights(pair):
    """The trailer is no authentication: a relay can re-hash. Then every flip must still raise or be harmless."""
    base, new, delta = pair
    h, want = model_hash(base), model_hash(new)
    refused = 0
    for i in range(len(delta) - 32):
        bad = bytearray(delta[:-32])
        bad[i] ^= 0x10
        try:
            out = apply_delta(base, bytes(bad) + hashlib.sha256(bad).digest(), base_hash=h)
        except DeltaError:
            refused += 1
            continue
        assert model_hash(out) == want
    assert refused > 0.9 * (len(delta) - 32)


def test_every_truncation_is_refused(pair):
    base, _, delta = pair
    for n in [*range(0, 64), *range(64, len(delta), 7), len(delta) - 1]:
        with pytest.raises(DeltaError):
            apply_delta(base, delta[:n])


# --- hostile objects: well framed (valid trailer), lying inside ----------------------------------------


def split(delta: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", delta, 8)
    return json.loads(delta[16 : 16 + n]), delta[16 + n : -32]


def forge(header: dict | bytes, sections: bytes, head_len: int | None = None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = MAGIC + struct.pack("<Q", len(head) if head_len is None else head_len) + head + sections
    return body + hashlib.sha256(body).digest()


def refused_in_small_memory(base: dict, delta: bytes, limit: int = 4 << 20) -> str:
    tracemalloc.start()
    try:
        with pytest.raises(DeltaError) as e:
            apply_delta(base, delta)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{peak} bytes allocated while refusing: {e.value}"
    return str(e.value)


def entry(h: dict, name: str) -> dict:
    return next(t for t in h["tensors"] if t["name"] == name)


HOSTILE = {
    "huge shape": lambda h, s: (entry(h, "y").update(shape=[1 << 40]), s),
    "huge sparse count": lambda h, s: (entry(h, "x").update(count=1 << 32), s),
    "sparse denser than the format allows": lambda h, s: (entry(h, "x").update(count=601), s),
    "negative offset": lambda h, s: (entry(h, "x").update(offset=-5), s),
    "overlapping sections": lambda h, s: (entry(h, "y").update(offset=0), s),
    "length past the end": lambda h, s: (entry(h, "y").update(length=entry(h, "y")["length"] + 10**12), s),
    "gap between sections": lambda h, s: (entry(h, "y").update(offset=entry(h, "y")["offset"] + 1), s + b"\0"),
    "duplicate names": lambda h, s: (h["tensors"].insert(1, dict(h["tensors"][0])), s),
    "unsorted names": lambda h, s: (h["tensors"].reverse(), s),
    "duplicate name, no section": lambda h, s: (h["tensors"].append(dict(entry(h, "z"))), s),
    "unsorted, sections still tiling": lambda h, s: (h["tensors"].insert(0, h["tensors"].pop()), s),
    "missing tensor": lambda h, s: (h.update(tensors=[t for t in h["tensors"] if t["name"] != "z"]), s),
    "bool as count": lambda h, s: (entry(h, "x").update(count=True), s),
    "float as offset": lambda h, s: (entry(h, "x").update(offset=0.0), s),
    "unknown encoding": lambda h, s: (entry(h, "z").update(enc="whole"), s),
    "extra field": lambda h, s: (entry(h, "z").update(data="x"), s),
    "dtype lie": lambda h, s: (entry(h, "z").update(dtype="int64"), s),
    "unknown dtype": lambda h, s: (entry(h, "z").update(dtype="object"), s),
    "bad base hash": lambda h, s: (h.update(base_hash="XYZ"), s),
    "future version": lambda h, s: (h.update(version=2), s),
    "extra bytes after sections": lambda h, s: (None, s + b"junk"),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_headers_are_refused_before_allocating(pair, attack):
    base, _, delta = pair
    h, s = split(delta)
    _, s = HOSTILE[attack](h, s)
    refused_in_small_memory(base, forge(h, s))


def test_hostile_framing_is_refused(pair):
    base, _, delta = pair
    h, s = split(delta)
    head = json.dumps(h).encode()
    for bad in (
        forge(head, s, head_len=1 << 62),  # absurd header length
        forge(head, s, head_len=len(head) + len(s) + 1),  # header past the end
        forge(b'{"format": "swarmrl-delta", "format": "x"}', b""),  # duplicate JSON key
        forge(b"[" * 100_000 + b"]" * 100_000, b""),  # deep nesting
        forge(b"\xff\xfe", b""),  # not UTF-8
        forge(json.dumps({**h, "pad": ["xy"] * 200_000}).encode(), s),  # far more header than 3 tensors need
        b"NOTDELTA" + delta[8:],
    ):
        refused_in_small_memory(base, bad)


def test_frames_that_lie_are_refused(pair):
    """Sections swapped for frames that decompress fine but claim other sizes or hold bad sparse data."""
    base, _, delta = pair
    h, s = split(delta)
    x, y = entry(h, "x"), entry(h, "y")
    assert x["enc"] == "sparse" and y["enc"] == "xor"
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    count = x["count"]

    def with_x_frame(frame: bytes) -> bytes:
        h2 = json.loads(json.dumps(h))
        old = s[x["offset"] : x["offset"] + x["length"]]
        e = entry(h2, "x")
        e["length"] = len(frame)
        entry(h2, "y")["offset"] = y["offset"] - len(old) + len(frame) if y["offset"] > x["offset"] else y["offset"]
        new_s = s.replace(old, frame, 1)
        return forge(h2, new_s)

    def sparse_frame(gaps, x_vals) -> bytes:
        g = np.asarray(gaps, np.uint32).view(np.uint8).reshape(-1, 4).T.reshape(-1)
        v = np.asarray(x_vals, np.uint16).view(np.uint8).reshape(-1, 2).T.reshape(-1)
        return cctx.compress(np.concatenate([g, v]).tobytes())

    ones = [1] * count
    for frame in (
        declaring(1 << 40),  # a zstd bomb's header: refused on the declared size, nothing allocated
        zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * count * 6),  # no declared size
        cctx.compress(b"\0" * (count * 6 + 1)),  # one byte too many
        sparse_frame([0] + [0] * (count - 1), ones),  # positions not increasing
        sparse_frame([1195] + [1] * (count - 1), ones),  # past the end (40*30 elements)
        sparse_frame(list(range(count)), [0] + ones[1:]),  # a "change" of zero
        sparse_frame([1] * count, ones),  # well formed, but not the signed result
    ):
        refused_in_small_memory(base, with_x_frame(frame))


def declaring(size: int) -> bytes:
    """A valid frame of 1000 zeros whose header declares `size` bytes (frame header rebuilt with an 8-byte size)."""
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * 1000)
    blocks = frame[zstandard.frame_header_size(frame) :]
    lied = frame[:4] + bytes([0b1110_0000]) + struct.pack("<Q", size) + blocks  # FCS 8 bytes, single segment
    assert zstandard.get_frame_parameters(lied).content_size == size
    return lied


# --- published precision --------------------------------------------------------------------------


def test_cast_for_publishing_keeps_ties_copies_and_needs_an_fp32_master():
    w = torch.ones(8)
    master = {"emb": w, "head": w, "steps": torch.tensor([3])}
    pub = cast_for_publishing(master)
    assert pub["emb"].dtype == torch.bfloat16 and pub["head"] is pub["emb"] and pub["steps"].dtype == torch.int64
    master["steps"] += 1
    assert pub["steps"].item() == 3  # a copy: the trainer mutates the master in place
    # 1e-3 steps are below half a bf16 ulp at 1.0 (2**-8): a bf16 master never moves, an fp32 one flips
    # its published value once the steps add up.
    bf16_master = torch.ones(8, dtype=torch.bfloat16)
    published = []
    for _ in range(6):
        w += 1e-3
        bf16_master += 1e-3
        published.append(cast_for_publishing({"w": w})["w"][0].item())
    assert torch.all(bf16_master == 1.0)
    assert published[0] == 1.0 and published[-1] > 1.0
    with pytest.raises(ValueError):
        cast_for_publishing(master, torch.int8)
