"""Unit tests of the sampling-support, logprob and termination checks on constructed distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocol.models import FinishReason, SamplingParams
from verifier import checks

# Three positions over a vocabulary of 5 with known probabilities.
PROBS = torch.tensor([[0.5, 0.3, 0.1, 0.07, 0.03]] * 3)
LOGITS = PROBS.log()


def stats(tokens, sampling, slack=1e-4):
    return checks.token_stats(LOGITS, torch.tensor(tokens), sampling, slack)


def test_token_stats_raw_logprobs_ranks_and_mass():
    s = stats([0, 2, 4], SamplingParams(temperature=2.0))
    np.testing.assert_allclose(s.logprob, np.log([0.5, 0.1, 0.03]), rtol=1e-6)
    assert s.rank_above.tolist() == [0, 2, 4]
    tempered = (LOGITS[0] / 2).softmax(0)
    np.testing.assert_allclose(s.mass_above[1], float(tempered[:2].sum()), rtol=1e-5)
    np.testing.assert_allclose(s.tempered_logprob[2], math.log(float(tempered[4])), rtol=1e-5)


@pytest.mark.parametrize("sampling,tokens,outside", [
    (SamplingParams(top_k=2), [0, 1, 1], False),
    (SamplingParams(top_k=2), [0, 1, 2], True),
    (SamplingParams(top_p=0.75), [0, 1, 0], False),  # mass above token 1 is 0.5 < 0.75
    (SamplingParams(top_p=0.75), [2, 0, 0], True),  # mass above token 2 is 0.8
    (SamplingParams(top_p=0.85), [2, 0, 0], False),
    (SamplingParams(temperature=0.0), [0, 0, 0], False),
    (SamplingParams(temperature=0.0), [0, 1, 0], True),
    (SamplingParams(top_k=3, top_p=0.9), [2, 2, 2], False),  # top-3 renormalized: mass above 2 is 0.8/0.9
    (SamplingParams(top_k=3, top_p=0.85), [2, 2, 2], True),
])
def test_support(sampling, tokens, outside):
    found = checks.check_support(stats(tokens, sampling), sampling, min_token_logprob=-20)
    assert any(f.code == "token_outside_support" for f in found) == outside


def test_slack_accepts_near_ties_at_the_boundary():
    logits = torch.tensor([[2.0, 1.0, 1.0 - 1e-5, 0.0]])
    sampling = SamplingParams(top_k=2)
    tight = checks.token_stats(logits, torch.tensor([2]), sampling, 0.0)
    loose = checks.token_stats(logits, torch.tensor([2]), sampling, 1e-3)
    assert checks.check_support(tight, sampling, -20)
    assert not checks.check_support(loose, sampling, -20)


def test_implausible_token():
    logits = torch.tensor([[0.0, 0.0, -40.0]])
    s = checks.token_stats(logits, torch.tensor([2]), SamplingParams(), 1e-3)
    found = checks.check_support(s, SamplingParams(), min_token_logprob=-20)
    assert [f.code for f in found] == ["token_implausible"]


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
    assert checks.check_logprob_mean(sum(float(d.sum()) for d in drifted), sum(d.size for d in drifted), 2e-5) is not None


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
