"""Seeded sampling: the draw that makes a completion's tokens evidence (worker and verifier share it).

Every sampled token is the winner of an exponential race (Gumbel-max) whose noise is a function of
(sample seed, position, token id) only, so the verifier can replay each draw on its own logits.

PRF. u(s, t, v) for sample seed s, completion position t and token id v: an odd multiple of 2**-24 in
(0, 1), exact in float32, from a counter-based, integer-only hash, so its bits do not depend on the
device, the thread count or the batch (`protocol.prf`: its definition, in torch and a numpy reference).

Draw (vLLM's order of operations, see verifier/checks.py): z = logits / temperature in float32; the
support keeps the top-k values of z (ties at the k-th value kept), then the smallest set of most
probable tokens reaching top-p: sorted descending, token i stays iff the tempered, top-k-renormalized
probability mass before it (exp(z - logsumexp z), summed in sorted order) is below top-p (ties with
the last kept value stay). Then

    score_v = z_v - log E_v,  E_v = -log u_v  (E ~ Exp(1), so -log E is Gumbel(0, 1))
    winner  = argmax over the support of score_v  (lowest token id on an exact tie)

P(winner = v) is softmax(z) renormalized over the support. The log-normalizer is the same for every
token of a row, so z ranks exactly as the tempered logprob would, with one rounding fewer. Temperature
0 is plain argmax of the logits (no noise). A replay gives, per position, the seed's winner under the
replaying side's logits and the margin score_winner - score_claimed (score units, i.e. logits divided
by the temperature; logits at temperature 0), which is 0 when the claimed token wins and small when an
honest worker's logits differ from the verifier's only by numerical noise. (The PRF's bits are exact
everywhere; log E goes through the device's float32 log, which may differ by an ulp across devices:
about 1e-7 in score units, far below the logits' own noise.)

No torch at module level (protocol imports only pydantic and numpy there); torch inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from protocol.prf import bits_from_states, row_state, seed_state, token_words, uniform_from_bits

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------------------------------
# The draw


@dataclass(frozen=True)
class DrawParams:
    """Per-row sampling settings as device tensors [N, 1], with host-side flags that spare device syncs."""

    temperature: "torch.Tensor"  # float32; 1 on greedy rows (their logits are used as they are)
    greedy: "torch.Tensor | None"  # bool; None when no row is greedy
    all_greedy: bool
    unit_temperature: bool  # every row at temperature 1 or greedy: no division
    k_index: "torch.Tensor | None"  # int64 k - 1 into the top-k_max values; None when no row uses top-k
    k_off: "torch.Tensor | None"  # bool: rows without top-k (when others use it); None if none
    k_max: int
    top_p: "torch.Tensor | None"  # float32 (0 on rows without top-p: masked by p_off); None if unused
    p_off: "torch.Tensor | None"  # bool: rows without top-p (when others use it); None if none

    @staticmethod
    def build(temperatures: Sequence[float], top_ks: Sequence[int], top_ps: Sequence[float], vocab_size: int,
        device=None) -> "DrawParams":
        """From per-row (temperature, top_k, top_p) as on the wire: top_k <= 0 or >= V and top_p >= 1 are off."""
        import torch

        temps = [float(t) for t in temperatures]
        greedy = [t <= 0.0 for t in temps]
        ks = [int(k) if 0 < int(k) < vocab_size else 0 for k in top_ks]
        ps = [min(float(p), 1.0) for p in top_ps]

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype).view(-1, 1).to(device)

        k_max = max(ks)
        return DrawParams(
            temperature=col([1.0 if g else t for g, t in zip(greedy, temps)], torch.float32),
            greedy=col(greedy, torch.bool) if any(greedy) else None,
            all_greedy=all(greedy),
            unit_temperature=all(g or t == 1.0 for g, t in zip(greedy, temps)),
            k_index=col([(k or k_max) - 1 for k in ks], torch.int64) if k_max else None,
            k_off=col([k == 0 for k in ks], torch.bool) if k_max and not all(ks) else None,
            k_max=k_max,
            top_p=col([p if p < 1.0 else 0.0 for p in ps], torch.float32) if any(p < 1.0 for p in ps) else None,
            p_off=col([p >= 1.0 for p in ps], torch.bool) if any(p < 1.0 for p in ps) and any(p >= 1.0 for p in ps)
            else None,
        )


def tempered(logits: "torch.Tensor", params: DrawParams) -> "torch.Tensor":
    """z = logits / temperature in float32 (greedy rows: the logits)."""
    import torch

    z = logits.to(torch.float32)
    return z if params.unit_temperature else z / params.temperature


def support_threshold(z: "torch.Tensor", params: DrawParams, top_p_shift: float = 0.0, z_shift: float = 0.0,
                      z_shift_rel: float = 0.0) -> "torch.Tensor | None":
    """Per row, the smallest tempered logit inside the support ([N, 1]); None when every token is inside.

    The shifts move the boundary for a replay on logits that differ slightly from the drawing side's:
    top-p by `top_p_shift` of probability mass, and the support's edge by `z_shift` (tempered logit
    units), which covers near-tied tokens at the edge swapping places (and with them the mass that counts
    as "before" each). Lowered (z_shift < 0), tokens within |z_shift| below the last kept one join.
    Raised, a kept token stays only if it stands more than z_shift above the first token left out: it is
    that token a near tie could swap with. (Raising the threshold itself, the last kept token's own
    logit, left that token out always: every support of two or more tokens had a boundary band.) The edge
    moves by z_shift_rel * |threshold| more, the same way: a logit is rounded in steps that grow with it."""
    import torch

    thr = thr_k = None
    if params.k_index is not None:
        thr_k = torch.topk(z, params.k_max, dim=-1).values.gather(-1, params.k_index)
        if params.k_off is not None:
            thr_k = thr_k.masked_fill(params.k_off, float("-inf"))
        thr = thr_k
    if params.top_p is not None:
        thr_p = _top_p_threshold(z if thr_k is None else z.masked_fill(z < thr_k, float("-inf")),
            params.top_p + top_p_shift)
        if params.p_off is not None:
            thr_p = thr_p.masked_fill(params.p_off, float("-inf"))
        thr = thr_p if thr is None else torch.maximum(thr, thr_p)
    if thr is None or not z_shift:
        return thr
    shift = abs(z_shift) + z_shift_rel * thr.abs().nan_to_num(posinf=0.0, neginf=0.0)  # -inf: every token kept
    if z_shift > 0:
        left_out = z.masked_fill(z >= thr, float("-inf")).max(-1, keepdim=True).values
        thr = torch.maximum(thr, left_out + shift)
        return torch.minimum(thr, z.max(-1, keepdim=True).values)  # never empty: the top token stays
    return thr - shift


# Top-p looks at the most probable tokens first and sorts a whole row only when these hold less than
# top_p: at vocabulary 151,936 the full sort was most of a top-p replay (CPU, about 5x the LM head).
TOP_P_PREFIX = 1024


def _top_p_threshold(zk: "torch.Tensor", top_p: "torch.Tensor") -> "torch.Tensor":
    """The smallest kept value of the tempered (top-k masked) logits zk [N, V] under top-p [N, 1].

    Sorted descending, position i stays iff the mass before it (cum[i - 1]) is below top_p, so the kept
    tokens are a prefix; probabilities are exp(z - logsumexp(z)) of the whole row. When the first
    TOP_P_PREFIX sorted tokens already hold top_p, the rest is never kept and need not be sorted."""
    import torch

    n, vocab = zk.shape
    lse = torch.logsumexp(zk, dim=-1, keepdim=True)
    k = min(vocab, TOP_P_PREFIX)
    zs = torch.topk(zk, k, dim=-1).values  # sorted, descending
    cum = (zs - lse).exp_().cumsum(-1)
    thr = zs.gather(-1, (cum[:, :-1] < top_p).sum(-1, keepdim=True))  # index kept - 1
    if k < vocab:
        short = (cum[:, -1:] < top_p).view(-1).nonzero().view(-1)  # rows whose prefix holds too little
        if short.numel():
            zf = torch.sort(zk.index_select(0, short), dim=-1, descending=True).values
            cf = (zf - lse.index_select(0, short)).exp_().cumsum(-1)
            thr = thr.index_copy(0, short, zf.gather(-1, (cf[:, :-1] < top_p.index_select(0, short)).sum(-1,
                keepdim=True)))
    # The kept prefix can end in the -inf tail (rounding leaves the mass just below top_p): every
    # finite token is then kept, and a top-k threshold (the caller's maximum) still holds.
    return thr


def log_exponentials(states: "torch.Tensor", tokens: "torch.Tensor") -> "torch.Tensor":
    """log E = log(-log u) for row states [N] and token words [V]: float32 [N, V]."""
    return uniform_from_bits(bits_from_states(states, tokens)).log_().neg_().log_()


def winners(score: "torch.Tensor", z_threshold: "torch.Tensor | None", z: "torch.Tensor") -> "torch.Tensor":
    """argmax of the score over the support, [N] int64; torch.argmax returns the first (lowest id)
    maximum on ties."""
    if z_threshold is not None:
        score = score.masked_fill(z < z_threshold, float("-inf"))
    return score.argmax(-1)


def scores(logits: "torch.Tensor", states: "torch.Tensor", tokens: "torch.Tensor",
    params: DrawParams) -> tuple["torch.Tensor", "torch.Tensor | None", "torch.Tensor"]:
    """(z, support threshold, score = z - log E) for logits [N, V], row states [N] (`row_state`) and
    token words [V]; the score is not masked to the support."""
    z = tempered(logits, params)
    thr = support_threshold(z, params)
    if params.all_greedy:
        return z, thr, z
    log_e = log_exponentials(states, tokens)
    if params.greedy is not None:
        log_e.masked_fill_(params.greedy, 0.0)
    return z, thr, log_e.neg_().add_(z)  # z - log E, in the fresh buffer (same bits: a - b is a + (-b))


def draw(logits: "torch.Tensor", states: "torch.Tensor", tokens: "torch.Tensor", params: DrawParams) -> "torch.Tensor":
    """The seeded winner of each row, [N] int64."""
    z, thr, score = scores(logits, states, tokens, params)
    return winners(score, thr, z)


@dataclass
class Replay:
    """Per position of a replayed completion (all [T], on the logits' device)."""

    winner: "torch.Tensor"  # int64: the seed's winner under the replaying side's logits (tightened support)
    margin: "torch.Tensor"  # float32: score(winner) - score(claimed), 0 when the claimed token wins.
    # The claimed token's score is taken even outside the support: a claimed token whose score beats
    # every token of the tightened support has a negative margin.
    inside: "torch.Tensor"  # bool: the claimed token is inside the (widened) support under these logits
    exact: "torch.Tensor"  # int64: the seed's winner over this side's own support (no slack): the one
    # token an honest worker draws unless numerical noise moved a near tie or the support's boundary
    choice: "torch.Tensor | None" = None  # bool: more than one token would pass here (with a draw margin given)


def replay(logits: "torch.Tensor", seeds, positions, tokens: "torch.Tensor", sampling, top_p_slack: float = 0.0,
           logit_slack: float = 0.0, slack_rel: float = 0.0, draw_margin: float | None = None,
           draw_margin_rel: float = 0.0) -> Replay:
    """Replay the draws of claimed `tokens` [T] under `logits` [T, V] (row t produced token t).

    `seeds`: one int (a completion) or [T]; `positions`: [T] (usually arange(T), or an offset slice of
    it); `sampling`: anything with temperature, top_k, top_p (protocol.models.SamplingParams).

    The drawing side's logits differ from these by numerical noise, so a token near the support's
    boundary may be inside on one side and outside on the other. With slacks, only tokens inside even
    with top-p lowered by `top_p_slack` and the support's threshold raised by `logit_slack` (raw logit
    units, plus `slack_rel` of the edge's |logit|) compete for `winner`, and `inside` accepts the claimed
    token if it is inside with both moved the other way. With both 0 (the default) the support is this
    side's own. With `draw_margin` (logits, plus `draw_margin_rel` of the larger |logit| of the two
    compared), `choice` says where more than one token would pass: a token of the widened support within
    the margin of the winner, or beating it. Only there can noise, or a worker, send another token.
    """
    import torch

    n, vocab = logits.shape
    device = logits.device
    params = DrawParams.build([sampling.temperature] * n, [sampling.top_k] * n, [sampling.top_p] * n, vocab, device)
    seeds = torch.as_tensor(seeds, dtype=torch.int64, device=device).expand(n).contiguous()
    positions = torch.as_tensor(positions, dtype=torch.int64, device=device)
    tokens = torch.as_tensor(tokens, dtype=torch.int64, device=device).view(-1, 1)
    z = tempered(logits, params)
    z_slack = logit_slack / (sampling.temperature if sampling.temperature > 0 else 1.0)
    own = support_threshold(z, params)
    if top_p_slack or logit_slack:
        thr = support_threshold(z, params, -top_p_slack, z_slack, slack_rel)
        wide = support_threshold(z, params, top_p_slack, -z_slack, slack_rel)
    else:
        thr = wide = own
    score = z
    if not params.all_greedy:
        score = log_exponentials(row_state(seed_state(seeds), positions), token_words(torch.arange(vocab,
            device=device))).neg_().add_(z)
    win = winners(score, thr, z)
    exact = win if thr is own else winners(score, own, z)
    margin = score.gather(1, win.view(-1, 1)) - score.gather(1, tokens)
    inside = torch.ones(n, dtype=torch.bool, device=device) if wide is None else (z.gather(1, tokens) >= wide).view(-1)
    choice = None
    if draw_margin is not None:
        to_score = 1.0 / (sampling.temperature if sampling.temperature > 0 else 1.0)
        scale = torch.maximum(logits.float().gather(1, win.view(-1, 1)).abs(), logits.float().abs())
        passes = score >= score.gather(1, win.view(-1,
            1)) - scale.mul_(draw_margin_rel).add_(draw_margin).mul_(to_score)
        if wide is not None:
            passes &= z >= wide
        choice = passes.sum(-1) > 1
    return Replay(winner=win, margin=margin.view(-1), inside=inside, exact=exact, choice=choice)
