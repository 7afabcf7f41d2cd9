"""TOPLOC-style proofs of the final hidden states, built by workers and checked by the verifier.

The scheme follows TOPLOC (Ong et al., ICML 2025); this is our own vectorized implementation:

- split the generated tokens' final-norm hidden states [T, H] into chunks of 32 rows (the last one may
  be shorter), flatten each chunk, and keep the k = min(128, values in the chunk) values of largest |value|;
- pick the largest modulus m <= 65497 for which (flat index mod m) is injective on those k indices;
- interpolate the polynomial of degree k-1 over GF(65497) through (index mod m, bf16 bit pattern of the
  value) and store m and its k coefficients as little-endian uint16: 2 + 2k <= 258 bytes;
- to check, the verifier recomputes the hidden states, takes *its own* top-k indices per chunk,
  evaluates the polynomial there and compares the claimed bf16 bit patterns with its own: the number of
  sign/exponent mismatches, and the mean and median mantissa difference where sign and exponent agree.

All chunks are processed at once: interpolation is the Lagrange form, turned into monomial coefficients
with two exact matrix products (every product of two residues is < 2^32 and a sum of 128 of them
< 2^39, so float64 BLAS is exact before the final `mod p`).

Only torch and numpy are imported here: inference workers import this module.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

PRIME = 65497  # the largest prime below 2^16 - 38; bf16 patterns >= PRIME are NaNs, which never win top-k
CHUNK_TOKENS = 32
TOPK = 128
MAX_PROOF_BYTES = 2 + 2 * TOPK
_BATCH_CHUNKS = 64  # chunks interpolated together by build_proofs_many

_INV_TABLE: np.ndarray | None = None


def _inverse_table() -> np.ndarray:
    """Multiplicative inverses of 0..p-1 mod p (Fermat: a^(p-2)), computed once, 512 KiB."""
    global _INV_TABLE
    if _INV_TABLE is None:
        a = np.arange(PRIME, dtype=np.int64)
        result = np.ones_like(a)
        e = PRIME - 2
        while e:
            if e & 1:
                result = result * a % PRIME
            a = a * a % PRIME
            e >>= 1
        _INV_TABLE = result
    return _INV_TABLE


def _powers(x: np.ndarray, k: int) -> np.ndarray:
    """x^e mod p for e = 0..k-1: [..., n] -> [..., n, k], by doubling (log2(k) steps)."""
    out = np.ones(x.shape + (k,), dtype=np.int64)
    if k > 1:
        out[..., 1] = x
    filled, step = 2, x * x % PRIME  # step = x^filled
    while filled < k:
        n = min(filled, k - filled)
        out[..., filled : filled + n] = out[..., :n] * step[..., None] % PRIME
        filled += n
        step = step * step % PRIME
    return out


def _matvec_mod(mat: np.ndarray, vec: np.ndarray, subscripts: str) -> np.ndarray:
    """Exact (sum of products of residues) mod p via float64 einsum; valid while terms*p^2 < 2^53."""
    return np.rint(np.einsum(subscripts, mat.astype(np.float64), vec.astype(np.float64))).astype(np.int64) % PRIME


def _prod_mod(a: np.ndarray) -> np.ndarray:
    """Product over the last axis mod p, as a pairwise tree."""
    while a.shape[-1] > 1:
        if a.shape[-1] % 2:
            a = np.concatenate([a, np.ones(a.shape[:-1] + (1,), dtype=np.int64)], axis=-1)
        a = a[..., 0::2] * a[..., 1::2] % PRIME
    return a[..., 0]


def _master_poly(x: np.ndarray) -> np.ndarray:
    """Coefficients (low to high) of prod_i (z - x_i) for each row of x [C, k]: [C, k+1].

    A product tree: log2(k) levels, each multiplying pairs of polynomials as an outer product summed
    along its anti-diagonals (a pad-and-reshape "skew" view, so no BLAS and no Python loop over terms).
    """
    c, k = x.shape
    width = 1 << max(0, (k - 1).bit_length())
    polys = np.zeros((c, width, 2), dtype=np.int64)
    polys[:, :, 0] = 1  # padding factors are the constant 1
    polys[:, :k, 0] = (-x) % PRIME
    polys[:, :k, 1] = 1
    while polys.shape[1] > 1:
        n, d = polys.shape[1] // 2, polys.shape[2]
        outer = polys[:, 0::2, :, None] * polys[:, 1::2, None, :]  # [C, n, d, d], entries < 2^32
        # Row i of the outer product shifted right by i: padding each row to 2d and re-reading the
        # flat buffer with row length 2d-1 puts entry (i, j) in column i+j.
        padded = np.concatenate([outer, np.zeros_like(outer)], axis=-1).reshape(c, n, 2 * d * d)
        skew = padded[..., : d * (2 * d - 1)].reshape(c, n, d, 2 * d - 1)
        polys = skew.sum(axis=2) % PRIME  # sums of d terms < 2^32: no int64 overflow
    return polys[:, 0, : k + 1]


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Monomial coefficients (low to high) of the degree-(k-1) polynomials through (x, y) over GF(p).

    x, y: [C, k] int64, x distinct per row, values in [0, p). Returns [C, k] int64.
    """
    c, k = x.shape
    master = _master_poly(x)
    # Barycentric weights w_i = 1 / prod_{j != i} (x_i - x_j).
    diff = (x[:, :, None] - x[:, None, :]) % PRIME
    diff[:, np.arange(k), np.arange(k)] = 1
    weights = _inverse_table()[_prod_mod(diff)]
    cw = y % PRIME * weights % PRIME  # [C, k]
    # P(z) = sum_i cw_i M(z) / (z - x_i), and M(z)/(z - x_i) has coefficient j equal to
    # sum_e M_{j+1+e} x_i^e. So coef_j = sum_e u_e M_{j+1+e} with u_e = sum_i cw_i x_i^e.
    u = _matvec_mod(_powers(x, k), cw, "cie,ci->ce")
    idx = np.arange(k)[:, None] + np.arange(k)[None, :] + 1  # [j, e] -> j+1+e, in 1..2k-1
    padded = np.concatenate([master, np.zeros((c, k), dtype=np.int64)], axis=1)
    hankel = padded[:, idx]  # [C, k, k]
    return _matvec_mod(hankel, u, "cje,ce->cj")


def evaluate(coefs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Evaluate polynomials [C, k] at points [C, n] over GF(p)."""
    return _matvec_mod(_powers(x, coefs.shape[1]), coefs, "cnk,ck->cn")


def injective_moduli(indices: np.ndarray) -> np.ndarray:
    """Per row of distinct non-negative indices [C, k]: the largest m <= p with (indices mod m) distinct."""
    c, k = indices.shape
    result = np.zeros(c, dtype=np.int64)
    todo = np.arange(c)
    top = PRIME
    block = 16
    while todo.size:
        ms = top - np.arange(block, dtype=np.int64)
        ms = ms[ms >= k]
        if ms.size == 0:
            raise ValueError("no injective modulus exists")  # impossible for k <= 128 distinct indices
        r = np.sort(indices[todo][:, None, :] % ms[None, :, None], axis=-1)  # [n, B, k]
        ok = (np.diff(r, axis=-1) != 0).all(-1) if k > 1 else np.ones(r.shape[:2], dtype=bool)
        found = ok.any(-1)
        result[todo[found]] = ms[ok[found].argmax(-1)]
        todo = todo[~found]
        top -= block
    return result


def bf16_bits(values: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns (round to nearest even) as int64 in [0, 2^16)."""
    return values.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def chunk_sizes(num_tokens: int) -> list[int]:
    full, rest = divmod(num_tokens, CHUNK_TOKENS)
    return [CHUNK_TOKENS] * full + ([rest] if rest else [])


def num_values(chunk_tokens: int, hidden_size: int) -> int:
    """How many values a proof of a chunk with this many tokens carries."""
    return min(TOPK, chunk_tokens * hidden_size)


def _chunk_groups(hidden_states: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[T, H] -> groups of equally sized flattened chunks: [(first chunk index, [C, n*H])]."""
    if hidden_states.dim() != 2 or hidden_states.shape[0] == 0 or hidden_states.shape[1] == 0:
        raise ValueError(f"hidden states must be [T >= 1, H >= 1], got {tuple(hidden_states.shape)}")
    if not hidden_states.is_floating_point():
        raise ValueError(f"hidden states must be floating point, got {hidden_states.dtype}")
    t, h = hidden_states.shape
    hs = hidden_states.detach().to("cpu")
    full = t // CHUNK_TOKENS
    groups = []
    if full:
        groups.append((0, hs[: full * CHUNK_TOKENS].reshape(full, CHUNK_TOKENS * h)))
    if t % CHUNK_TOKENS:
        groups.append((full, hs[full * CHUNK_TOKENS :].reshape(1, -1)))
    return groups


def _float32_numpy(t: torch.Tensor) -> np.ndarray:
    """float32 numpy copy; bf16 is widened bit-exactly in numpy (single-threaded, no OpenMP)."""
    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return t.float().numpy() if t.dtype != torch.float32 else t.numpy()


def _top_values(flat: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row of [C, N]: (flat indices [C, k] of the k largest |values|, their bf16 bit patterns).

    numpy's single-threaded introselect: as fast as torch.topk on an idle machine, and unaffected by
    OpenMP thread contention when the worker's cores are busy with generation.
    """
    values = _float32_numpy(flat)
    k = min(TOPK, values.shape[1])
    idx = np.argpartition(np.abs(values), values.shape[1] - k, axis=1)[:, values.shape[1] - k :].astype(np.int64)
    return idx, bf16_bits(torch.from_numpy(np.take_along_axis(values, idx, axis=1)))


def build_proofs(hidden_states: torch.Tensor) -> list[bytes]:
    """One proof per 32 generated tokens for final hidden states [T, H] (row t produced token t)."""
    return build_proofs_many([hidden_states])[0]


def build_proofs_many(hidden_states: Sequence[torch.Tensor]) -> list[list[bytes]]:
    """`build_proofs` for several completions at once.

    Top-k runs per completion (all its full chunks together); the interpolations of every chunk with
    the same number of values (almost always 128), partial chunks included, share batched calls.
    """
    pending: dict[int, list[tuple[int, int, np.ndarray, np.ndarray]]] = {}  # k -> (owner, chunk, idx, bits)
    out: list[list[bytes]] = []
    for owner, hs in enumerate(hidden_states):
        groups = _chunk_groups(hs)
        out.append([b""] * sum(flat.shape[0] for _, flat in groups))
        for start, flat in groups:
            idx, bits = _top_values(flat)
            for j in range(flat.shape[0]):
                pending.setdefault(idx.shape[1], []).append((owner, start + j, idx[j], bits[j]))
    for entries in pending.values():
        for s in range(0, len(entries), _BATCH_CHUNKS):  # bounded memory: [B, k, k] int64 per call
            block = entries[s : s + _BATCH_CHUNKS]
            idx = np.stack([e[2] for e in block])
            moduli = injective_moduli(idx)
            coefs = interpolate(idx % moduli[:, None], np.stack([e[3] for e in block]) % PRIME)
            for (owner, chunk, _, _), m, row in zip(block, moduli, coefs):
                out[owner][chunk] = struct.pack("<H", int(m)) + row.astype("<u2").tobytes()
    return out


# --------------------------------------------------------------------------------------------------
# Checking


@dataclass(frozen=True)
class ChunkCheck:
    """The verdict on one proof chunk, with the statistics behind it."""

    chunk_index: int
    ok: bool
    num_values: int
    exponent_mismatches: int
    mantissa_mean: float
    mantissa_median: float
    reason: str = ""

    def stats(self) -> dict[str, float]:
        d = asdict(self)
        return {k: float(v) for k, v in d.items() if k not in ("ok", "reason", "chunk_index")}


def decode_proof(proof: bytes, k: int) -> tuple[int, np.ndarray]:
    """(modulus, coefficients) of a proof that must carry k values; raises ValueError when malformed."""
    if len(proof) != 2 + 2 * k:
        raise ValueError(f"proof has {len(proof)} bytes, expected {2 + 2 * k} for {k} values")
    m = struct.unpack_from("<H", proof)[0]
    if not k <= m <= PRIME:
        raise ValueError(f"modulus {m} outside [{k}, {PRIME}]")
    coefs = np.frombuffer(proof, dtype="<u2", offset=2).astype(np.int64)
    if int(coefs.max()) >= PRIME:
        raise ValueError(f"coefficient {int(coefs.max())} is not below {PRIME}")
    return m, coefs


def check_proofs(proofs: Sequence[bytes], hidden_states: torch.Tensor, thresholds) -> list[ChunkCheck]:
    """Check each proof against the verifier's own hidden states [T, H] of the same tokens.

    `thresholds` is a `verifier.config.ProofThresholds` (or anything with the same three attributes).
    A proof count that does not match the token count is reported on the missing / extra chunk.
    """
    groups = _chunk_groups(hidden_states)
    expected = sum(g[1].shape[0] for g in groups)
    results: list[ChunkCheck] = []
    for start, flat in groups:
        c, n = flat.shape
        k = min(TOPK, n)
        idx, own = _top_values(flat)
        decoded: list[tuple[int, int, np.ndarray] | None] = []
        for j in range(c):
            ci = start + j
            if ci >= len(proofs):
                results.append(ChunkCheck(ci, False, k, k, float("inf"), float("inf"), "proof missing"))
                decoded.append(None)
                continue
            try:
                m, coefs = decode_proof(proofs[ci], k)
            except ValueError as exc:
                results.append(ChunkCheck(ci, False, k, k, float("inf"), float("inf"), f"malformed proof: {exc}"))
                decoded.append(None)
                continue
            decoded.append((j, m, coefs))
        good = [d for d in decoded if d is not None]
        if not good:
            continue
        rows = np.array([d[0] for d in good])
        moduli = np.array([d[1] for d in good], dtype=np.int64)
        coefs = np.stack([d[2] for d in good])
        claimed = evaluate(coefs, idx[rows] % moduli[:, None])
        for r, (j, _, _) in enumerate(good):
            results.append(_compare(start + j, claimed[r], own[j], thresholds))
    results.sort(key=lambda r: r.chunk_index)
    for extra in range(expected, len(proofs)):
        results.append(ChunkCheck(extra, False, 0, 0, float("inf"), float("inf"),
            "proof for a chunk that does not exist"))
    return results


def _compare(chunk_index: int, claimed: np.ndarray, own: np.ndarray, thresholds) -> ChunkCheck:
    own = own % PRIME
    k = own.size
    exp_ok = (claimed >> 7) == (own >> 7)  # sign and exponent
    mismatches = int(k - exp_ok.sum())
    if exp_ok.any():
        mant = np.abs((claimed[exp_ok] & 0x7F) - (own[exp_ok] & 0x7F)).astype(np.float64)
        mean, median = float(mant.mean()), float(np.median(mant))
    else:
        mean = median = float("inf")
    reasons = []
    if mismatches > thresholds.max_exponent_mismatches:
        reasons.append(f"{mismatches}/{k} exponent mismatches > {thresholds.max_exponent_mismatches}")
    if mean > thresholds.max_mantissa_mean:
        reasons.append(f"mantissa mean error {mean:.3g} > {thresholds.max_mantissa_mean}")
    if median > thresholds.max_mantissa_median:
        reasons.append(f"mantissa median error {median:.3g} > {thresholds.max_mantissa_median}")
    return ChunkCheck(chunk_index, not reasons, k, mismatches, mean, median, "; ".join(reasons))
