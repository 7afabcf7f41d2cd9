"""Unit tests of the draw, logprob and termination checks on constructed distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.models import FinishReason, SamplingParams
from protocol.sampling import replay
from verifier import checks

# Three positions over a vocabulary of 5 with known probabilities.
PROBS = torch.tensor([[0.5, 0.3, 0.1, 0.07, 0.03]] * 3)
LOGITS = PROBS.log()


def stats(tokens, sampling):
    return checks.token_stats(LOGITS, torch.tensor(tokens), sampling)


def test_token_stats_raw_and_tempered_logprobs():
    s = stats([0, 2, 4], SamplingParams(temperature=2.0))
    np.testing.assert_allclose(s.logprob, np.log([0.5, 0.1, 0.03]), rtol=1e-6)
    tempered = (LOGITS[0] / 2).softmax(0)
    np.testing.assert_allclose(s.tempered_logprob, np.log(tempered[[0, 2, 4]].numpy()), rtol=1e-5)
    greedy = stats([0, 2, 4], SamplingParams(temperature=0.0))  # greedy is trained at temperature 1
    np.testing.assert_array_equal(greedy.tempered_logprob, greedy.logprob)


def draw_of(logits, seed, tokens, sampling, slack=(0.0, 0.0)):
    r = replay(logits, seed, torch.arange(len(tokens)), torch.tensor(tokens), sampling, *slack)
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    scale = torch.maximum(logits.gather(1, r.winner[:, None]).abs(), logits.gather(1, torch.tensor(tokens)[:,
        None]).abs())[:, 0]
    return checks.Draw(r.winner.numpy(), r.margin.double().numpy() * t, r.inside.numpy(), scale.double().numpy(),
        r.exact.numpy())


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(top_k=2), SamplingParams(temperature=0.0)])
def test_the_seeds_own_draws_pass_and_any_other_token_fails(sampling):
    logits = torch.randn(40, 50, generator=torch.Generator().manual_seed(1)) * 2
    winners = draw_of(logits, 12345, [0] * 40, sampling).winner
    ok = checks.check_draws(draw_of(logits, 12345, winners.tolist(), sampling), winners, 1e-3)
    assert ok.finding is None and ok.near_ties == 0 and ok.max_margin == 0.0
    # Another seed's draws (a sample generated under another sample's seed): caught, with the position.
    other = draw_of(logits, 999, [0] * 40, sampling).winner
    if sampling.temperature > 0:
        bad = checks.check_draws(draw_of(logits, 12345, other.tolist(), sampling), other, 1e-3)
        assert bad.finding is not None and bad.finding.code in ("not_seeded_draw", "token_outside_support")
        first = int(np.argmax(other != winners))
        assert bad.finding.stats["token_index"] <= first
    # One token changed to the runner-up: caught at that position.
    edited = winners.copy()
    edited[7] = int(torch.topk(logits[7],
        2).indices[1]) if winners[7] == int(logits[7].argmax()) else int(logits[7].argmax())
    bad = checks.check_draws(draw_of(logits, 12345, edited.tolist(), sampling), edited, 1e-3)
    assert bad.finding is not None and bad.finding.stats["token_index"] == 7


def test_a_near_tie_within_the_margin_passes_and_is_counted():
    """Worker and verifier logits differ by noise: a token that wins on the worker's logits may lose on ours
    by a hair. Within the margin it passes (counted as a near tie); beyond it, it is rejected."""
    logits = torch.zeros(1, 4)
    logits[0, 1] = 1.0
    seed = 7
    r = replay(logits, seed, torch.tensor([0]), torch.tensor([0]), SamplingParams())
    winner = int(r.winner)
    runner_up = next(t for t in range(4) if t != winner)
    # Move the runner-up's logit so that it loses to the winner by exactly 1e-4 in score.
    gap = float(replay(logits, seed, torch.tensor([0]), torch.tensor([runner_up]), SamplingParams()).margin)
    logits[0, runner_up] += gap - 1e-4
    d = draw_of(logits, seed, [runner_up], SamplingParams())
    assert d.winner[0] == winner and 0 < d.margin[0] < 2e-4
    near = checks.check_draws(d, np.array([runner_up]), 1e-3)
    assert near.finding is None and near.near_ties == 1 and 0 < near.max_margin < 2e-4
    far = checks.check_draws(d, np.array([runner_up]), 1e-5)
    assert far.finding is not None and far.finding.code == "not_seeded_draw" and far.finding.stats["margin"] > 1e-5
    assert f"the seed draws {winner}, not {runner_up}" in far.finding.message


def test_the_tolerance_grows_with_the_size_of_the_logits():
    """bf16 rounds a logit of 20 in steps of 0.06: the same small margin that fails at logits near 0 passes
    near 20, but a real difference (a token that lost by 1 logit) fails at any size."""
    small = checks.check_draws(checks.Draw(np.array([5]), np.array([0.05]), np.array([True]), np.array([0.5])),
        np.array([6]), 0.02, 2**-7)
    assert small.finding is not None and small.finding.code == "not_seeded_draw"
    large = checks.Draw(np.array([5]), np.array([0.05]), np.array([True]), np.array([20.0]))
    assert checks.check_draws(large, np.array([6]), 0.02, 2**-7).finding is None
    far = checks.Draw(np.array([5]), np.array([1.0]), np.array([True]), np.array([20.0]))
    assert checks.check_draws(far, np.array([6]), 0.02, 2**-7).finding is not None


def test_a_token_outside_the_support_is_named_as_such():
    sampling = SamplingParams(top_k=2)
    d = draw_of(LOGITS, 3, [4, 0, 0], sampling)
    found = checks.check_draws(d, np.array([4, 0, 0]), 1e9)  # even an infinite margin never admits it
    assert found.finding is not None and found.finding.code == "token_outside_support"
    assert found.finding.stats["token_index"] == 0


def test_slack_widens_the_support_for_tokens_at_its_boundary():
    logits = torch.tensor([[2.0, 1.0, 1.0 - 1e-5, 0.0]])
    sampling = SamplingParams(top_k=2)
    assert not draw_of(logits, 1, [2], sampling).inside[0]
    assert draw_of(logits, 1, [2], sampling, (0.0, 1e-3)).inside[0]


def test_logprob_check():
    s = stats([0, 1, 2], SamplingParams())
    honest = checks.logprob_diffs(s.logprob.astype(np.float32), s)
    assert checks.check_logprob_max(honest, 1e-3) is None
    assert checks.check_logprob_mean(float(honest.sum()), honest.size, 1e-4) is None
    forged = s.logprob.copy()
    forged[1] += 0.01
    f = checks.check_logprob_max(checks.logprob_diffs(forged, s), 1e-3)
    assert f and f.code == "logprob_mismatch" and f.stats["token_index"] == 1
    scaled = checks.logprob_diffs(s.logprob * 0.9999, s)  # every token a little off: the mean check
    assert checks.check_logprob_max(scaled, 1.0) is None
    assert checks.check_logprob_mean(float(scaled.sum()), scaled.size, 1e-5) is not None
    short = checks.logprob_diffs(s.logprob[:2], s)
    assert isinstance(short, checks.Finding) and short.code == "logprob_mismatch"


def test_one_noisy_token_in_a_short_completion_passes_the_submission_mean():
    """The false positive seen on an honest worker: 1.1e-4 on one token of a 5-token completion (mean 2.2e-5
    over the completion), in a submission of 64 such completions where the other tokens agree."""
    diffs = [np.zeros(5) for _ in range(64)]
    for d in diffs[:5]:
        d[1] = 1.08e-4
    assert all(checks.check_logprob_max(d, 1e-3) is None for d in diffs)
    assert checks.check_logprob_mean(sum(float(d.sum()) for d in diffs), sum(d.size for d in diffs), 2e-5) is None
    drifted = [d + 5e-5 for d in diffs]  # a systematic drift on every token is still caught
    assert checks.check_logprob_mean(sum(float(d.sum()) for d in drifted), sum(d.size for d in drifted),
        2e-5) is not None


EOS = {2}


@pytest.mark.parametrize("tokens,reason,max_tokens,stop_ids,ok", [
    ([5, 6, 2], "stop", 8, [], True),
    ([5, 6, 7], "stop", 8, [], False),  # stop without EOS
    ([5, 2, 7], "stop", 8, [], False),  # EOS then more
    ([5, 6, 9], "stop", 8, [9], True),  # stop token
    ([5, 9, 2], "stop", 8, [9], False),  # stop token then more
    ([5, 6, 7, 8], "length", 4, [], True),
    ([5, 6, 7, 2], "length", 4, [], False),  # EOS exactly at max_tokens: vLLM says stop
    ([5, 6, 7, 2], "stop", 4, [], True),
    ([5, 6, 7], "length", 4, [], False),  # truncated
    ([5, 2, 7, 8], "length", 4, [], False),
    ([5, 6, 7, 8, 2], "stop", 4, [], False),  # longer than max_tokens
    ([2], "stop", 1, [], True),
])
def test_termination(tokens, reason, max_tokens, stop_ids, ok):
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids)
    found = checks.check_termination(np.array(tokens), FinishReason(reason), sampling, EOS)
    assert (found is None) == ok
    if found:
        assert found.code == "bad_termination" and found.message


def test_a_short_submissions_mean_leaves_room_for_one_outlier():
    """bf16, batch 1: honest one-token submissions had |diff| 0.015 against a mean limit of 0.01; their mean
    is one token's noise. fp16 claimed as fp32 (mean >= 5e-5 per token) still fails from 7 tokens on."""
    assert checks.check_logprob_mean(0.015, 1, 0.01) is None
    assert checks.check_logprob_mean(3 * 0.0114, 3, 0.01) is None
    assert checks.check_logprob_mean(1.08e-4, 1, 2e-5) is None  # the fp32 outlier, alone in a submission
    assert checks.check_logprob_mean(0.12, 1, 0.01) is not None
    assert checks.check_logprob_mean(3 * 0.05, 3, 0.01) is not None  # three tokens far off: not one outlier
    assert checks.check_logprob_mean(7 * 5e-5, 7, 2e-5) is not None
    assert checks.check_logprob_mean(1000 * 0.015, 1000, 0.01) is not None  # a long drift is still a drift


def test_a_boundary_pick_that_beats_the_tightened_winner_is_counted():
    """A token of the boundary band (inside the widened support only) that outscores the tightened winner
    passes with margin <= 0, and so does the tightened winner where our exact winner is a band token: both
    are places where a worker could have sent either token, so both count (before, neither did)."""
    band_pick = checks.Draw(np.array([5]), np.array([-0.3]), np.array([True]), np.array([1.0]), np.array([9]))
    assert checks.check_draws(band_pick, np.array([9 + 1]), 1e-3).near_ties == 1
    assert checks.check_draws(band_pick, np.array([9]), 1e-3).near_ties == 0  # the exact draw itself
    tight_winner = checks.Draw(np.array([5]), np.array([0.0]), np.array([True]), np.array([1.0]), np.array([9]))
    assert checks.check_draws(tight_winner, np.array([5]), 1e-3).near_ties == 1
    # On real logits: top-k=2 with tokens 1 and 2 near-tied at the edge (our support keeps 1). A seed under which
    # token 2 outscores token 0: a worker whose noise swapped 1 and 2 sends 2, our exact draw is 1 (or 0).
    logits = torch.tensor([[2.0, 1.0, 1.0 - 1e-6, -1.0]])
    sampling = SamplingParams(temperature=1.0, top_k=2)
    seed = next(s for s in range(500) if float(replay(logits, s, torch.tensor([0]), torch.tensor([2]), sampling, 0.0,
        1e-3).margin[0]) <= 0)
    d = draw_of(logits, seed, [2], sampling, (0.0, 1e-3))
    assert d.exact[0] != 2
    report = checks.check_draws(d, np.array([2]), 1e-4)
    assert report.finding is None and report.near_ties == 1
