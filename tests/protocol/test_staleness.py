"""The one staleness rule of a step: which samples it trains and drops, and its tally by version gap."""

from __future__ import annotations

from protocol import staleness


def test_a_step_trains_samples_at_most_max_staleness_behind_and_drops_the_rest():
    t = staleness.tally(5, 2, [(5, 1), (4, 2), (3, 4), (2, 8), (0, 16)])
    assert t.trained == {0: 1, 1: 2, 2: 4} and t.dropped == {3: 8, 5: 16}
    assert (t.num_trained, t.num_dropped) == (7, 24)
    assert [v for v in range(7) if t.trains(v)] == [3, 4, 5, 6]
    assert t.received() == {0: 1, 1: 2, 2: 4, 3: 8, 5: 16}


def test_pairs_of_one_version_add_up_and_no_bound_drops_nothing():
    t = staleness.tally(3, 0, [(3, 2), (2, 1), (3, 2), (2, 1)])
    assert t.trained == {0: 4} and t.dropped == {1: 2}
    unbounded = staleness.tally(9, None, [(0, 3), (9, 1)])
    assert unbounded.trained == {9: 3, 0: 1} and unbounded.dropped == {}


def test_a_behaviour_version_ahead_of_the_step_counts_as_gap_0():
    t = staleness.tally(2, 1, [(3, 5), (2, 1)])
    assert t.trained == {0: 6} and t.dropped == {}
