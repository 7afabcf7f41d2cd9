import numpy as np
import pytest

from trainer.advantages import group_advantages, has_signal


def test_group_normalized_by_hand():
    # mean 0.5, population std 0.5 -> (R - 0.5) / (0.5 + 1e-6)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(adv, np.array([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-6), rtol=1e-6)
    assert adv.dtype == np.float32


def test_uneven_group_by_hand():
    # rewards 0, 0, 0, 1: mean 0.25, std sqrt(0.1875) = 0.4330127
    adv = group_advantages([0.0, 0.0, 0.0, 1.0], eps=1e-6)
    std = np.sqrt(0.1875)
    np.testing.assert_allclose(adv, [-0.25 / (std + 1e-6)] * 3 + [0.75 / (std + 1e-6)], rtol=1e-6)
    assert adv.sum() == pytest.approx(0.0, abs=1e-6)


def test_dr_grpo_drops_the_std():
    np.testing.assert_allclose(group_advantages([0.0, 0.0, 0.0, 1.0], use_std=False), [-0.25, -0.25, -0.25, 0.75])


def test_equal_rewards_give_zero_signal():
    adv = group_advantages([0.7, 0.7, 0.7])
    assert np.all(adv == 0)
    assert not has_signal(adv)
    assert has_signal(group_advantages([0.0, 1.0]))


@pytest.mark.parametrize("bad", [[], [[[1.0, 2.0]]], [1.0, float("nan")], [float("inf"), 0.0], [[0.0, 1.0], [0.0,
    float("nan")]]])
def test_bad_rewards_are_rejected(bad):
    with pytest.raises(ValueError):
        group_advantages(bad)


@pytest.mark.parametrize("use_std", [True, False])
def test_several_groups_at_once_equal_each_group_alone_bit_for_bit(use_std):
    """The orchestrator computes all groups of a submission in one call; the result must be exactly
    what each group gets alone, ties and all-equal groups included."""
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 8, 16, 33):
        groups = np.concatenate([
            rng.random((5, k)),  # continuous
            rng.integers(0, 2, (5, k)).astype(float),  # 0/1 rewards: ties, sometimes all equal
            np.full((2, k), 0.7),  # all equal
            rng.choice([0.0, 0.25, 1.0], (5, k)),
        ])
        together = group_advantages(groups, use_std=use_std)
        alone = np.stack([group_advantages(g, use_std=use_std) for g in groups])
        assert together.dtype == np.float32 and together.shape == groups.shape
        assert np.array_equal(together, alone)
        assert has_signal(together).tolist() == [has_signal(a) for a in alone]
    assert not has_signal(group_advantages(np.full((1, 4), 1.0)))[0]


@pytest.mark.parametrize("use_std", [True, False])
def test_same_bits_as_numpy_mean_and_std(use_std):
    """group_advantages calls numpy's reductions directly; the result is bit for bit the textbook
    (R - mean) / (std + eps) of numpy's own mean and std."""
    rng = np.random.default_rng(1)
    for groups in (rng.random((50, 8)), rng.integers(0, 2, (50, 5)).astype(float), rng.normal(0, 1e6, (20, 33)),
        rng.random((1, 3))):
        want = groups - groups.mean(axis=-1, keepdims=True)
        if use_std:
            want = want / (groups.std(axis=-1, keepdims=True) + 1e-6)
        want[np.ptp(groups, axis=-1) == 0] = 0.0
        assert np.array_equal(group_advantages(groups, use_std=use_std), want.astype(np.float32))
