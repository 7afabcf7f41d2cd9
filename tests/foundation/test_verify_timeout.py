"""The Ray verifier pool's call timeout follows the call's tokens and the measured verify rate, never below
its floor (swarmrl/verify_timeout.py)."""

from __future__ import annotations

from swarmrl.verify_timeout import VerifyTimeout


def test_a_small_call_gets_the_floor_and_a_big_one_time_for_its_tokens():
    t = VerifyTimeout(floor_s=120.0, slack=3.0, initial_tokens_per_s=20.0)
    assert t.for_call(100) == 120.0
    # 16 submissions of 2 x 4 x 512 tokens at the 0.6B verifier's pace: no fixed 120 s cut
    assert abs(t.for_call(16 * 4096) - 3.0 * 16 * 4096 / 20.0) < 1e-6


def test_the_rate_is_measured_and_leans_slow():
    t = VerifyTimeout(floor_s=1.0, slack=3.0, initial_tokens_per_s=20.0)
    for _ in range(30):
        t.observe(7700, 100.0)  # 77 tokens/s, as measured at 0.6B
    assert abs(t.for_call(7700) - 300.0) < 5.0
    before = t.for_call(7700)
    t.observe(7700, 200.0)  # one call at half the pace
    slower = t.for_call(7700) - before
    t.observe(7700, 100.0)
    t.observe(7700, 50.0)  # one at twice the pace
    assert slower > 0 and before - t.for_call(7700) < slower  # a slow call moves it more than a fast one
    t.observe(0, 5.0)  # nothing verified: nothing learnt
    t.observe(100, 0.0)
    assert t.for_call(7700) > 1.0
