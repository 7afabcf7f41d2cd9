"""The verifier pool's sizing decision (swarmrl/verifier_scaling.py), on its own: queue, arrivals,
drain rate and actors in; the number of actors out."""

from __future__ import annotations

import pytest

from swarmrl.verifier_scaling import PoolLoad, VerifierAutoscaler


def scaler(lo: int = 1, hi: int = 4, **kw) -> VerifierAutoscaler:
    return VerifierAutoscaler(lo, hi, **{"up_cooldown_s": 30.0, "down_idle_s": 120.0, "target_drain_s": 30.0, **kw})


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        VerifierAutoscaler(3, 2)
    with pytest.raises(ValueError):
        VerifierAutoscaler(0, 2)


def test_grows_while_the_queue_grows_faster_than_it_drains():
    s = scaler()
    # One actor verifies 2 submissions/s; 5/s arrive; 100 wait. Needed: (5 + 100/30) / 2 = 4.2 -> but at
    # most doubling per decision: 2.
    assert s.desired(PoolLoad(queue=100, arrivals_per_s=5.0, drained_per_s=2.0, live=1), now=0.0) == 2
    # Within the cool-down nothing changes, even though the queue still grows.
    assert s.desired(PoolLoad(queue=150, arrivals_per_s=5.0, drained_per_s=4.0, live=2), now=10.0) == 2
    # After it: sized by the per-actor rate (2/s): (5 + 200/30) / 2 = 5.8 -> capped at max_actors 4.
    assert s.desired(PoolLoad(queue=200, arrivals_per_s=5.0, drained_per_s=4.0, live=2), now=40.0) == 4
    assert s.desired(PoolLoad(queue=300, arrivals_per_s=9.0, drained_per_s=8.0, live=4), now=100.0) == 4  # max


def test_holds_while_actors_are_pending():
    """Actors requested but not placed yet (KubeRay adding a node) are capacity already asked for."""
    s = scaler()
    assert s.desired(PoolLoad(queue=100, arrivals_per_s=5.0, drained_per_s=2.0, live=1, pending=1), now=0.0) == 2


def test_holds_a_queue_that_drains_in_time_or_is_only_a_batch_being_gathered():
    s = scaler()
    # Arrivals below the drain rate and 20 s of work: no growth.
    assert s.desired(PoolLoad(queue=40, arrivals_per_s=1.0, drained_per_s=2.0, live=1), now=0.0) == 1
    # A few submissions queued while the thread gathers its batch: not a backlog.
    assert s.desired(PoolLoad(queue=3, arrivals_per_s=5.0, drained_per_s=2.0, live=1), now=100.0) == 1
    # A queue with no verdict at all yet (actors loading weights): one more at a time, not max at once.
    assert s.desired(PoolLoad(queue=50, arrivals_per_s=3.0, drained_per_s=0.0, live=1), now=200.0) == 2


def test_shrinks_only_after_staying_idle_and_one_actor_at_a_time():
    s = scaler(lo=1, hi=4)
    s.desired(PoolLoad(queue=100, arrivals_per_s=8.0, drained_per_s=8.0, live=4), now=0.0)  # measures 2/s per actor
    idle = PoolLoad(queue=0, arrivals_per_s=0.5, drained_per_s=0.5, live=4)
    assert s.desired(idle, now=200.0) == 4  # the idle clock starts
    assert s.desired(idle, now=300.0) == 4  # 100 s < down_idle_s
    assert s.desired(idle, now=321.0) == 3  # 121 s idle: one goes
    idle3 = PoolLoad(queue=0, arrivals_per_s=0.5, drained_per_s=0.5, live=3)
    assert s.desired(idle3, now=330.0) == 3  # and the next only after another down_idle_s
    assert s.desired(idle3, now=400.0) == 3
    assert s.desired(idle3, now=452.0) == 2
    # A queue in between (a batch being gathered) resets the idle clock.
    assert s.desired(PoolLoad(queue=5, arrivals_per_s=1.0, drained_per_s=1.0, live=2), now=460.0) == 2
    idle2 = PoolLoad(queue=0, arrivals_per_s=0.5, drained_per_s=0.5, live=2)
    assert s.desired(idle2, now=470.0) == 2
    assert s.desired(idle2, now=580.0) == 2
    assert s.desired(idle2, now=591.0) == 1
    # never below min
    assert s.desired(PoolLoad(queue=0, arrivals_per_s=0.0, drained_per_s=0.0, live=1), now=5000.0) == 1


def test_does_not_shrink_when_the_arrivals_need_the_actors():
    """Hysteresis: an empty queue because the pool keeps up is not idleness."""
    s = scaler(lo=1, hi=4)
    s.desired(PoolLoad(queue=100, arrivals_per_s=8.0, drained_per_s=8.0, live=4), now=0.0)  # 2/s per actor
    busy = PoolLoad(queue=0, arrivals_per_s=5.0, drained_per_s=5.0, live=4)  # 3 actors at half rate give 3/s < 5/s
    for t in range(100, 2000, 50):
        assert s.desired(busy, now=float(t)) == 4


def test_pending_actors_go_first_when_idle():
    s = scaler(lo=1, hi=4, down_idle_s=10.0)
    idle = PoolLoad(queue=0, arrivals_per_s=0.0, drained_per_s=0.0, live=1, pending=2)
    assert s.desired(idle, now=100.0) == 3
    assert s.desired(idle, now=111.0) == 2  # the pool drops a pending one (VerifierPool.shrink)


def test_fixed_pool_when_min_equals_max():
    s = scaler(lo=2, hi=2)
    assert s.desired(PoolLoad(queue=4000, arrivals_per_s=100.0, drained_per_s=1.0, live=2), now=0.0) == 2
    for t in range(0, 1000, 100):
        assert s.desired(PoolLoad(queue=0, arrivals_per_s=0.0, drained_per_s=0.0, live=2), now=float(t)) == 2


def test_replaces_lost_actors_up_to_min():
    s = scaler(lo=2, hi=4)
    assert s.desired(PoolLoad(queue=0, arrivals_per_s=0.0, drained_per_s=0.0, live=1), now=0.0) == 2
    assert s.desired(PoolLoad(queue=0, arrivals_per_s=0.0, drained_per_s=0.0, live=0), now=1.0) == 2


def test_verifier_config_bounds():
    from verifier.config import VerifierConfig

    assert VerifierConfig(num_actors=3).actor_bounds() == (3, 3)  # the fixed pool of before
    assert VerifierConfig(min_actors=1, max_actors=4).actor_bounds() == (1, 4)
    assert VerifierConfig(min_actors=2).actor_bounds() == (2, 2)
    with pytest.raises(ValueError, match="min_actors"):
        VerifierConfig(min_actors=4, max_actors=2)
