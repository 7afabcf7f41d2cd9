"""The seeded-sampling PRF and draw shared by worker and verifier (protocol/prf.py, protocol/sampling.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from protocol import prf
from protocol import sampling as S
from protocol.models import SamplingParams

M32 = 0xFFFFFFFF


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 written byte-wise from the algorithm's description, any length: a third,
    independent implementation to hold the vectorized ones to."""
    h = seed
    nblocks = len(data) // 4

    def scramble(k: int) -> int:
        k = (k * 0xCC9E2D51) & M32
        k = ((k << 15) | (k >> 17)) & M32
        return (k * 0x1B873593) & M32

    for i in range(nblocks):
        h ^= scramble(struct.unpack_from("<I", data, 4 * i)[0])
        h = ((h << 13) | (h >> 19)) & M32
        h = (h * 5 + 0xE6546B64) & M32
    tail = data[4 * nblocks :]
    if tail:
        h ^= scramble(int.from_bytes(tail, "little"))
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_reference_murmur3_matches_published_vectors():
    # Test vectors published with MurmurHash3 (SMHasher; also listed on Wikipedia's MurmurHash page).
    vectors = [
        (b"", 0, 0x00000000),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\0\0\0\0", 0, 0x2362F9DE),
        (b"aaaa", 0x9747B28C, 0x5A97808A),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA),
        (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
    ]
    for data, seed, want in vectors:
        assert murmur3_32(data, seed) == want, data


EDGE_SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1]
EDGE_POSITIONS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 7, 100000, 3]
EDGE_TOKENS = [0, 1, 2, 63, 151935, 2**31 - 1, 2**31, 2**32 - 1]


def test_prf_is_murmur3_of_the_message_in_torch_and_numpy():
    want = np.array([[murmur3_32(struct.pack("<QII", s, p, t)) for t in EDGE_TOKENS] for s, p in zip(EDGE_SEEDS,
        EDGE_POSITIONS)], dtype=np.uint32)
    got_t = prf.prf_bits(torch.tensor(EDGE_SEEDS), torch.tensor(EDGE_POSITIONS), torch.tensor(EDGE_TOKENS))
    assert got_t.dtype == torch.int64 and int(got_t.min()) >= 0 and int(got_t.max()) <= M32
    np.testing.assert_array_equal(got_t.numpy().astype(np.uint32), want)
    np.testing.assert_array_equal(prf.prf_bits_np(EDGE_SEEDS, EDGE_POSITIONS, EDGE_TOKENS), want)


def _random_inputs(n: int, v: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**63, n, dtype=np.int64)
    positions = rng.integers(0, 2**32, n, dtype=np.int64)
    tokens = np.concatenate([np.arange(v - 3), [2**31 - 1, 2**31, 2**32 - 1]]).astype(np.int64)
    return seeds, positions, tokens


def test_numpy_and_torch_agree_bit_for_bit():
    seeds, positions, tokens = _random_inputs(300, 1000)
    bits_t = prf.prf_bits(torch.from_numpy(seeds), torch.from_numpy(positions), torch.from_numpy(tokens))
    bits_n = prf.prf_bits_np(seeds.astype(np.uint64), positions, tokens)
    np.testing.assert_array_equal(bits_t.numpy().astype(np.uint32), bits_n)
    # The row states alone (the worker computes them on the host with numpy).
    rows_t = prf.row_state(prf.seed_state(torch.from_numpy(seeds)), torch.from_numpy(positions))
    rows_n = prf.row_state_np(prf.seed_state_np(seeds.astype(np.uint64)), positions)
    assert rows_n.dtype == np.uint32
    np.testing.assert_array_equal(rows_t.numpy().astype(np.uint32), rows_n)
    u_t = prf.prf_uniform(torch.from_numpy(seeds), torch.from_numpy(positions), torch.from_numpy(tokens))
    u_n = prf.prf_uniform_np(seeds.astype(np.uint64), positions, tokens)
    assert u_t.dtype == torch.float32 and u_n.dtype == np.float32
    np.testing.assert_array_equal(u_t.numpy().view(np.int32), u_n.view(np.int32))


def test_same_bits_with_one_and_two_threads():
    # Large enough that torch splits the elementwise kernels over threads (grain size 32768).
    seeds, positions, _ = _random_inputs(64, 0, seed=1)
    logits = torch.randn(64, 40000, generator=torch.Generator().manual_seed(0)) * 3
    params = S.DrawParams.build([0.8] * 64, [-1] * 64, [0.95] * 64, 40000)
    words = prf.token_words(torch.arange(40000))
    old = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            states = prf.row_state(prf.seed_state(torch.from_numpy(seeds)), torch.from_numpy(positions))
            results.append((prf.bits_from_states(states, words), S.log_exponentials(states, words), S.draw(logits,
                states, words, params)))
    finally:
        torch.set_num_threads(old)
    (b1, e1, w1), (b2, e2, w2) = results
    assert torch.equal(b1, b2)
    assert torch.equal(e1.view(torch.int32), e2.view(torch.int32))
    assert torch.equal(w1, w2)


def test_strided_and_other_dtype_inputs_give_the_same_bits():
    seeds, positions, tokens = _random_inputs(40, 300, seed=2)
    want = prf.prf_bits(torch.from_numpy(seeds), torch.from_numpy(positions), torch.from_numpy(tokens))
    # Every other element of a longer buffer, a column of a matrix.
    seed_buf = torch.zeros(80, dtype=torch.int64)
    seed_buf[::2] = torch.from_numpy(seeds)
    pos_mat = torch.zeros(40, 3, dtype=torch.int64)
    pos_mat[:, 1] = torch.from_numpy(positions)
    tok_strided = torch.from_numpy(np.repeat(tokens, 2))[::2]
    assert not seed_buf[::2].is_contiguous() and not pos_mat[:, 1].is_contiguous() and not tok_strided.is_contiguous()
    got = prf.prf_bits(seed_buf[::2], pos_mat[:, 1], tok_strided)
    assert torch.equal(got, want)
    # Tokens given per row ([N, V], broadcast or a strided expansion) and positions as int32.
    tok_rows = torch.from_numpy(tokens).expand(40, -1)
    assert torch.equal(prf.prf_bits(torch.from_numpy(seeds), torch.from_numpy(positions).int(), tok_rows), want)
    # A non-contiguous [N, V] slice of the result of a transpose.
    tok_t = torch.from_numpy(tokens).repeat(40, 1).t().contiguous().t()
    assert torch.equal(prf.prf_bits(torch.from_numpy(seeds), torch.from_numpy(positions), tok_t), want)


def test_rows_do_not_depend_on_the_batch():
    seeds, positions, tokens = _random_inputs(17, 200, seed=3)
    t = torch.from_numpy(tokens)
    batched = prf.prf_bits(torch.from_numpy(seeds), torch.from_numpy(positions), t)
    for i in range(17):
        alone = prf.prf_bits(torch.from_numpy(seeds[i : i + 1]), torch.from_numpy(positions[i : i + 1]), t)
        assert alone.shape == (1, 200)
        assert torch.equal(alone[0], batched[i])
    # A token's value does not depend on which other tokens are asked for.
    assert torch.equal(prf.prf_bits(torch.from_numpy(seeds), torch.from_numpy(positions), t[50:60]), batched[:, 50:60])


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2,
        dtype=torch.float64)))


def test_uniforms_are_uniform_and_bits_balanced():
    seeds = torch.arange(200, dtype=torch.int64) * 7919 + 5  # a fixed, structured set of seeds
    positions = torch.arange(200) % 64
    bits = prf.prf_bits(seeds, positions, torch.arange(8192))  # 1.6M values, neighbours in every input
    u = prf.uniform_from_bits(bits)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = np.bincount((u.numpy() * 256).astype(np.int64).ravel(), minlength=256)
    assert _chi2_pvalue(counts, np.full(256, u.numel() / 256)) > 1e-4
    n = bits.numel()
    for b in range(32):
        ones = int(((bits >> b) & 1).sum())
        assert abs(ones - n / 2) < 5 * (n / 4) ** 0.5, f"bit {b}: {ones} of {n}"
    # Neighbouring tokens, positions and seeds are uncorrelated.
    x = u.double() - 0.5
    for a, b in ((x[:, :-1], x[:, 1:]), (x[:-1], x[1:])):
        corr = float((a * b).mean() / (a.std() * b.std()))
        assert abs(corr) < 5 / a.numel() ** 0.5


def _tempered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution by the definition (float64): top-k with ties kept, then the tokens
    whose more probable tokens' mass is below top-p, renormalized."""
    z = logits / temperature
    keep = np.ones_like(z, dtype=bool)
    if 0 < top_k < len(z):
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        above = np.array([p[p > p[i]].sum() for i in range(len(p))])
        keep &= above < top_p
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.8),
    (0.9, 6, 0.9)])
def test_draw_frequencies_follow_the_tempered_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.6, 0.5, 0.2, 0.0, -0.3, -0.5, -0.8, -1.0])
    want = _tempered_probs(logits.double().numpy(), temperature, top_k, top_p)
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 + 17  # fixed seed set: the test is deterministic
    positions = torch.arange(n) % 97
    params = S.DrawParams.build([temperature] * n, [top_k] * n, [top_p] * n, 12)
    states = prf.row_state(prf.seed_state(seeds), positions)
    got = S.draw(logits.expand(n, -1), states, prf.token_words(torch.arange(12)), params)
    counts = np.bincount(got.numpy(), minlength=12)
    assert (counts[want == 0] == 0).all(), "a token outside the support was drawn"
    inside = want > 0
    assert _chi2_pvalue(counts[inside], n * want[inside]) > 1e-3, (counts, (n * want).round())


def test_support_matches_the_definition_with_ties():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(300, 40, generator=gen).double().round(decimals=1).float()  # many exact ties
    for temperature, top_k, top_p in [(1.0, 7, 1.0), (0.6, -1, 0.7), (1.2, 10, 0.5), (1.0, 1, 0.3)]:
        params = S.DrawParams.build([temperature] * 300, [top_k] * 300, [top_p] * 300, 40)
        z = S.tempered(logits, params)
        thr = S.support_threshold(z, params)
        got = (z >= thr).numpy()
        for row in range(300):
            want = _tempered_probs(logits[row].double().numpy(), temperature, top_k, top_p) > 0
            # float32 vs float64 can only differ where a prefix's mass sits right at top_p.
            if (got[row] != want).any():
                zr = np.sort(z[row].double().numpy())[::-1]
                p = np.exp(zr - zr.max())
                assert np.min(np.abs(np.cumsum(p / p.sum()) - top_p)) < 1e-5, row
        if top_k > 0:
            assert (got.sum(1) >= top_k).all() or top_p < 1


def test_greedy_rows_take_the_argmax_with_the_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    states = prf.row_state(prf.seed_state(torch.tensor([1, 2, 3])), torch.tensor([0, 0, 0]))
    words = prf.token_words(torch.arange(4))
    greedy = S.DrawParams.build([0.0] * 3, [-1] * 3, [1.0] * 3, 4)
    assert S.draw(logits, states, words, greedy).tolist() == [1, 0, 3]
    # Mixed with sampled rows: the greedy row ignores its noise, top-k / top-p do not change its argmax.
    mixed = S.DrawParams.build([0.0, 1.0, 0.0], [2, -1, 1], [0.5, 1.0, 0.9], 4)
    got = S.draw(logits, states, words, mixed)
    assert got[0] == 1 and got[2] == 3
    alone = S.draw(logits[1:2], states[1:2], words, S.DrawParams.build([1.0], [-1], [1.0], 4))
    assert got[1] == alone[0]


def test_mixed_rows_equal_rows_drawn_alone():
    """Per-row settings in one batch (greedy, top-k of several sizes, top-p, neither) act row by row."""
    rng = np.random.default_rng(9)
    n, v = 120, 50
    logits = torch.from_numpy(rng.normal(0, 2, (n, v)).astype(np.float32))
    settings = [
        (float(rng.choice([0.0, 0.5, 1.0, 1.5])), int(rng.choice([-1, 1, 3, 8, 12, 49, 50])), float(rng.choice([1.0,
        0.3, 0.6, 0.9])))
        for _ in range(n)
    ]
    states = prf.row_state(prf.seed_state(torch.arange(n) * 31 + 1), torch.arange(n) + 5)
    words = prf.token_words(torch.arange(v))
    params = S.DrawParams.build(*zip(*settings), v)
    together = S.draw(logits, states, words, params)
    z = S.tempered(logits, params)
    thr = S.support_threshold(z, params)
    for i, (t, k, p) in enumerate(settings):
        one = S.DrawParams.build([t], [k], [p], v)
        alone = S.draw(logits[i : i + 1], states[i : i + 1], words, one)
        assert together[i] == alone[0], settings[i]
        thr_alone = S.support_threshold(S.tempered(logits[i : i + 1], one), one)
        want = torch.ones(v, dtype=torch.bool) if thr_alone is None else z[i] >= thr_alone[0]
        assert torch.equal(z[i] >= thr[i], want), settings[i]


def test_replay_winner_margin_and_support():
    gen = torch.Generator().manual_seed(11)
    t_len, v = 64, 80
    logits = torch.randn(t_len, v, generator=gen) * 2
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    seed = 2**62 + 99
    states = prf.row_state(prf.seed_state(torch.full((t_len,), seed)), torch.arange(t_len))
    params = S.DrawParams.build([0.8] * t_len, [20] * t_len, [0.9] * t_len, v)
    drawn = S.draw(logits, states, prf.token_words(torch.arange(v)), params)

    honest = S.replay(logits, seed, torch.arange(t_len), drawn, sampling)
    assert torch.equal(honest.winner, drawn)
    assert torch.equal(honest.margin, torch.zeros(t_len)) and bool(honest.inside.all())

    # Numerical noise on the replaying side: the winners mostly stay, and any change has a tiny margin.
    noisy = S.replay(logits + 1e-5 * torch.randn(t_len, v, generator=gen), seed, torch.arange(t_len), drawn, sampling)
    assert float(noisy.margin.abs().max()) < 1e-4

    # Another seed's tokens, or the top token each time (greedy under a sampling lease), are other draws.
    other = S.replay(logits, seed + 1, torch.arange(t_len), drawn, sampling)
    assert (other.winner != drawn).sum() > t_len // 4 and float(other.margin.max()) > 0.1
    greedy = S.replay(logits, seed, torch.arange(t_len), logits.argmax(-1), sampling)
    assert float(greedy.margin.max()) > 0.1
    # A token outside top-k is flagged; its margin is measured without the mask.
    worst = logits.argmin(-1)
    outside = S.replay(logits, seed, torch.arange(t_len), worst, sampling)
    assert not bool(outside.inside.any())
    # A slice of positions (the verifier works in slices of rows) replays the same.
    part = S.replay(logits[10:30], seed, torch.arange(10, 30), drawn[10:30], sampling)
    assert torch.equal(part.winner, drawn[10:30])


def test_replay_at_temperature_zero_is_argmax_in_logit_units():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, 0.0]])
    r = S.replay(logits, 5, torch.arange(2), torch.tensor([2, 1]), SamplingParams(temperature=0.0))
    assert r.winner.tolist() == [1, 0]
    assert r.margin.tolist() == [1.0, 0.0]  # a tie with a higher id: margin 0, the verifier's call


def test_replay_slack_tells_a_support_boundary_flip_from_another_draw():
    """A token whose more probable tokens hold top_p - 1e-5 of the mass on the drawing side and
    top_p + 1e-5 on the replaying side: strictly, the replay's winner differs by a wide margin; with a
    slack above the noise, the boundary token does not compete and the claimed token is accepted."""

    def logits_with(a: float) -> torch.Tensor:
        return torch.tensor([0.4, 0.3, 0.2 - a, 0.05, 0.03, 0.02 + a]).log()

    drawn_side, replay_side = logits_with(1e-5), logits_with(-1e-5)
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    params = S.DrawParams.build([1.0], [-1], [0.9], 6)
    words = prf.token_words(torch.arange(6))
    seed = next(s for s in range(1000) if int(S.draw(drawn_side[None], prf.row_state(prf.seed_state(torch.tensor([s])),
        torch.tensor([0])), words, params)[0]) == 3)
    claimed = torch.tensor([3])
    strict = S.replay(replay_side[None], seed, torch.tensor([0]), claimed, sampling)
    assert not bool(strict.inside[0]) and int(strict.winner[0]) != 3
    loose = S.replay(replay_side[None], seed, torch.tensor([0]), claimed, sampling, top_p_slack=1e-4)
    assert bool(loose.inside[0]) and float(loose.margin[0]) <= 0.0
    # A token clearly outside stays outside, and a wrong token clearly inside keeps a positive margin.
    assert not bool(S.replay(replay_side[None], seed, torch.tensor([0]), torch.tensor([5]), sampling,
        top_p_slack=1e-4).inside[0])
    other = next(t for t in range(3) if t != int(loose.winner[0]))
    assert float(S.replay(replay_side[None], seed, torch.tensor([0]), torch.tensor([other]), sampling,
        top_p_slack=1e-4).margin[0]) > 0


def test_replay_logit_slack_on_top_k():
    # Tokens 1 and 2 are 1e-6 apart at the top-k=2 boundary; noise can swap them.
    logits = torch.tensor([[2.0, 1.0, 1.0 - 1e-6, -1.0]])
    sampling = SamplingParams(temperature=1.0, top_k=2)
    for token in range(3):
        r = S.replay(logits, 1, torch.tensor([0]), torch.tensor([token]), sampling, logit_slack=1e-3)
        assert bool(r.inside[0])
        assert int(r.winner[0]) == 0  # only token 0 is inside for sure
        assert (float(r.margin[0]) == 0.0) == (token == 0)
    assert not bool(S.replay(logits, 1, torch.tensor([0]), torch.tensor([3]), sampling, logit_slack=1e-3).inside[0])
    # top_k=1 raised by the slack still lets the top token compete.
    r = S.replay(logits, 1, torch.tensor([0]), torch.tensor([0]), SamplingParams(temperature=1.0, top_k=1),
        logit_slack=1e-3)
    assert int(r.winner[0]) == 0 and float(r.margin[0]) == 0.0


def test_replay_logit_slack_covers_near_tied_tokens_swapping_at_the_top_p_boundary():
    # Tokens 2 and 3 are near-tied third place; only the third place fits in top_p = 0.85. Noise swaps
    # them, so each side keeps a different one although the masses barely move.
    def logits_with(a: float) -> torch.Tensor:
        return torch.tensor([0.5, 0.3, 0.1 + a, 0.1 - a]).log()

    drawn_side, replay_side = logits_with(1e-6), logits_with(-1e-6)
    sampling = SamplingParams(temperature=1.0, top_p=0.85)
    params = S.DrawParams.build([1.0], [-1], [0.85], 4)
    words = prf.token_words(torch.arange(4))

    def state(seed):
        return prf.row_state(prf.seed_state(torch.tensor([seed])), torch.tensor([0]))

    def score(seed, token):
        return float(S.log_exponentials(state(seed), words)[0, token].neg() + replay_side[token])

    # A seed whose draw is token 2 while token 3 would beat it on the replaying side.
    seed = next(s for s in range(5000) if int(S.draw(drawn_side[None], state(s), words, params)[0]) == 2 and score(s,
        3) > score(s, 2))
    claimed = torch.tensor([2])
    mass_only = S.replay(replay_side[None], seed, torch.tensor([0]), claimed, sampling, top_p_slack=0.01)
    assert int(mass_only.winner[0]) == 3 and float(mass_only.margin[0]) > 0
    both = S.replay(replay_side[None], seed, torch.tensor([0]), claimed, sampling, top_p_slack=0.01, logit_slack=1e-3)
    assert bool(both.inside[0]) and float(both.margin[0]) <= 0.0


def test_top_p_prefix_equals_the_full_sort(monkeypatch):
    """Top-p sorts only the first TOP_P_PREFIX tokens unless they hold less than top_p; both paths give
    the same threshold, row by row (peaked rows stay in the prefix, flat ones need the full sort)."""
    gen = torch.Generator().manual_seed(3)
    v = 5000
    logits = torch.randn(60, v, generator=gen) * torch.tensor([6.0, 0.1, 2.0]).repeat(20)[:, None]
    settings = [(float(t), int(k), float(p)) for t, k, p in zip([1.0, 0.7, 1.3] * 20, [-1] * 50 + [2000] * 10, [0.5,
        0.9, 0.99, 1.0] * 15)]
    params = S.DrawParams.build(*zip(*settings), v)
    z = S.tempered(logits, params)
    fast = S.support_threshold(z, params)
    zk = z.masked_fill(z < torch.topk(z, 2000, dim=-1).values[:, -1:], float("-inf"))
    short = S.TOP_P_PREFIX < v and bool((torch.softmax(zk, -1).topk(S.TOP_P_PREFIX).values.sum(-1) < 0.9).any())
    assert short, "the test needs rows that go past the prefix"
    monkeypatch.setattr(S, "TOP_P_PREFIX", v)
    assert torch.equal(S.support_threshold(z, params), fast)


def test_a_support_edge_clear_of_the_first_token_left_out_has_no_boundary_band():
    """The tightened support keeps the last token of the support when it stands clear (by more than the
    slack) of the first token left out: nothing there can swap places, so no position offers a second
    token. Raising the threshold itself made the last kept token a band token in every row."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    params = S.DrawParams.build([1.0], [2], [1.0], 5)
    z = S.tempered(logits, params)
    own = S.support_threshold(z, params)
    assert torch.equal(S.support_threshold(z, params, 0.0, 0.05), own)  # tokens 0 and 1, surely inside
    # Near-tied with the first token left out: the last kept token is in the band.
    tied = torch.tensor([[3.0, 1.0, 1.0 - 0.01, 0.0, -1.0]])
    zt = S.tempered(tied, params)
    assert float(S.support_threshold(zt, params, 0.0, 0.05)) > float(S.support_threshold(zt, params))
    # With top-p the same: token 1 is kept (mass before it 0.67 < 0.9) and far from token 2.
    p_params = S.DrawParams.build([1.0], [-1], [0.9], 5)
    zp = S.tempered(logits, p_params)
    assert torch.equal(S.support_threshold(zp, p_params, -1e-3, 0.05), S.support_threshold(zp, p_params))


def test_replay_reports_the_exact_winner_beside_the_tightened_one():
    """`exact` is the winner over the replaying side's own support: a band token that wins there is the
    exact winner, while `winner` (tightened support) is another token."""
    logits = torch.tensor([[2.0, 1.0, 1.0 - 1e-6, -1.0]])
    sampling = SamplingParams(temperature=1.0, top_k=2)
    for seed in range(200):
        r = S.replay(logits, seed, torch.tensor([0]), torch.tensor([0]), sampling, logit_slack=1e-3)
        plain = S.replay(logits, seed, torch.tensor([0]), torch.tensor([0]), sampling)
        assert int(r.exact[0]) == int(plain.winner[0])
        if int(r.exact[0]) == 1:
            assert int(r.winner[0]) == 0  # token 1 is in the band: the tightened winner is token 0
            return
    raise AssertionError("no seed drew the band token")
