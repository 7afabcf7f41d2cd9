"""The PRF of the seeded draw (protocol.sampling): the uniform u(s, t, v) behind each token's noise.

u(s, t, v) for sample seed s (< 2**63), completion position t (< 2**32) and token id v (< 2**32)
is built from h = MurmurHash3_x86_32 (Austin Appleby's MurmurHash3.cpp, public domain, SMHasher) with
hash seed 0 over the 16-byte little-endian message

    s mod 2**32 | s div 2**32 | t | v          (four uint32 words)

and u = (2 * (h >> 9) + 1) / 2**24, an odd multiple of 2**-24 in (0, 1), exact in float32. It is
counter-based (no state, nothing to rewind after a discarded draw) and integer-only, so its bits do not
depend on the device, the thread count or the batch. In torch every uint32 value lives in an int64 and
every product stays below 2**63 (see `_mul32`), so signed overflow never happens. `prf_bits_np` is an
independent numpy (uint32) implementation; the two must agree bit for bit.

Only numpy is imported at module level (protocol's rule); torch inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF
# MurmurHash3_x86_32 constants (MurmurHash3.cpp, github.com/aappleby/smhasher).
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_ROUND_ADD = 0xE6546B64
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
_MESSAGE_BYTES = 16
_U_SCALE = 2.0**-24


# --------------------------------------------------------------------------------------------------
# PRF in torch: uint32 values held in int64


def _mul32(x: "torch.Tensor", c: int) -> "torch.Tensor":
    """x * c mod 2**32 for x in [0, 2**32). A constant c >= 2**31 is used as c - 2**32 (same residue
    mod 2**32, |c - 2**32| <= 2**31), so |x * c| < 2**63 either way: int64 never overflows, and & keeps
    the two's-complement residue."""
    return (x * (c - 2**32 if c >= 2**31 else c)) & MASK32


def _rotl32(x: "torch.Tensor", r: int) -> "torch.Tensor":
    return ((x << r) & MASK32) | (x >> (32 - r))


def _mix_word(k: "torch.Tensor") -> "torch.Tensor":
    """MurmurHash3's per-block scramble of one message word (k *= c1; k = rotl(k, 15); k *= c2)."""
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _absorb(h: "torch.Tensor", k_mixed: "torch.Tensor") -> "torch.Tensor":
    """h ^= k; h = rotl(h, 13); h = h * 5 + 0xe6546b64 (h * 5 < 2**35: no overflow)."""
    h = _rotl32(h ^ k_mixed, 13)
    return (h * 5 + _ROUND_ADD) & MASK32


def _fmix32_(h: "torch.Tensor") -> "torch.Tensor":
    """MurmurHash3's finalizer, in place on a fresh [N, V] buffer with one scratch buffer. At a large
    vocabulary the elementwise passes are what the draw costs, and fresh allocations dominated them:
    bits of 256 x 151,936 took 41 ms per row with a new tensor per op, 4 ms in place (2-core CPU)."""
    import torch

    tmp = torch.empty_like(h)
    for shift, c in ((16, _FMIX1), (13, _FMIX2)):  # both constants are >= 2**31: see _mul32
        h ^= torch.bitwise_right_shift(h, shift, out=tmp)
        h.mul_(c - 2**32).bitwise_and_(MASK32)
    h ^= torch.bitwise_right_shift(h, 16, out=tmp)
    return h


def seed_state(seeds: "torch.Tensor") -> "torch.Tensor":
    """The hash state after the two seed words, [N] int64 (cache it per request: it never changes)."""
    import torch

    s = seeds.to(torch.int64)
    h = _absorb(torch.zeros_like(s), _mix_word(s & MASK32))
    return _absorb(h, _mix_word(s >> 32))


def row_state(seed_states: "torch.Tensor", positions: "torch.Tensor") -> "torch.Tensor":
    """The hash state after the position word, [N] int64."""
    import torch

    return _absorb(seed_states, _mix_word(positions.to(device=seed_states.device, dtype=torch.int64) & MASK32))


def token_words(token_ids: "torch.Tensor") -> "torch.Tensor":
    """The token word scrambled and rotated by 13 (rotation distributes over XOR, so the last block's
    rotl(h ^ k, 13) is rotl(h, 13) ^ rotl(k, 13): the token side is rotated once per vocabulary).
    For a vocabulary, cache `token_words(arange(V))`."""
    import torch

    return _rotl32(_mix_word(token_ids.to(torch.int64) & MASK32), 13)


def bits_from_states(rows: "torch.Tensor", tokens: "torch.Tensor") -> "torch.Tensor":
    """h for row states [N] (`row_state`) and token words [V] or [N, V] (`token_words`): [N, V] int64
    holding uint32. The last block (h * 5 + 0xe6546b64), the length and the finalizer."""
    h = _rotl32(rows, 13).unsqueeze(-1) ^ tokens
    h.mul_(5).add_(_ROUND_ADD).bitwise_and_(MASK32).bitwise_xor_(_MESSAGE_BYTES)
    return _fmix32_(h)


def prf_bits(seeds: "torch.Tensor", positions: "torch.Tensor", token_ids: "torch.Tensor") -> "torch.Tensor":
    """MurmurHash3_x86_32 of (seed, position, token) for seeds [N], positions [N], token_ids [V] or
    [N, V]; [N, V] int64 holding uint32."""
    return bits_from_states(row_state(seed_state(seeds), positions), token_words(token_ids.to(seeds.device)))


def uniform_from_bits(h: "torch.Tensor") -> "torch.Tensor":
    """The top 23 bits k as (2k + 1) * 2**-24 = k * 2**-23 + 2**-24: float32 in (0, 1), exact."""
    import torch

    return (h >> 9).to(torch.float32).mul_(2.0**-23).add_(_U_SCALE)


def prf_uniform(seeds: "torch.Tensor", positions: "torch.Tensor", token_ids: "torch.Tensor") -> "torch.Tensor":
    return uniform_from_bits(prf_bits(seeds, positions, token_ids))


# --------------------------------------------------------------------------------------------------
# PRF in numpy (reference): uint32 arithmetic wraps modulo 2**32 by definition


def _absorb_np(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    """One MurmurHash3 block: scramble the word k, fold it into the state h."""
    k = k * np.uint32(_C1)
    k = (k << np.uint32(15)) | (k >> np.uint32(17))
    k = k * np.uint32(_C2)
    h = h ^ k
    h = (h << np.uint32(13)) | (h >> np.uint32(19))
    return h * np.uint32(5) + np.uint32(_ROUND_ADD)


def seed_state_np(seeds) -> np.ndarray:
    """`seed_state` in numpy: uint32 [N]."""
    seeds = np.atleast_1d(np.asarray(seeds, dtype=np.uint64))
    with np.errstate(over="ignore"):
        h = _absorb_np(np.zeros(seeds.shape, dtype=np.uint32), (seeds & np.uint64(MASK32)).astype(np.uint32))
        return _absorb_np(h, (seeds >> np.uint64(32)).astype(np.uint32))


def row_state_np(seed_states: np.ndarray, positions) -> np.ndarray:
    """`row_state` in numpy: uint32 [N]. The worker computes row states on the host, where the
    positions are, in a few microseconds (about 20 tiny torch ops otherwise, per step)."""
    with np.errstate(over="ignore"):
        return _absorb_np(seed_states, np.atleast_1d(np.asarray(positions, dtype=np.uint64)).astype(np.uint32))


def prf_bits_np(seeds, positions, token_ids) -> np.ndarray:
    """The numpy reference of `prf_bits`: uint32 [N, V]."""
    h = row_state_np(seed_state_np(seeds), positions)[:, None]
    with np.errstate(over="ignore"):
        h = _absorb_np(h, np.asarray(token_ids, dtype=np.uint64).astype(np.uint32))
        h = h ^ np.uint32(_MESSAGE_BYTES)
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(_FMIX1)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(_FMIX2)
        return h ^ (h >> np.uint32(16))


def prf_uniform_np(seeds, positions, token_ids) -> np.ndarray:
    h = prf_bits_np(seeds, positions, token_ids)
    return ((h >> np.uint32(9)).astype(np.float32) * np.float32(2) + np.float32(1)) * np.float32(_U_SCALE)
