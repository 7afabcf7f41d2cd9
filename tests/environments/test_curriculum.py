"""The curriculum: the level moves by the online pass rate over a window of verified rewards at that level."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from environments.curriculum import Curriculum, CurriculumConfig


def curriculum(levels: int = 4, **cfg) -> Curriculum:
    return Curriculum(CurriculumConfig(enabled=True, window=8, **cfg), levels)


def test_up_when_the_pass_rate_is_over_the_window_and_down_when_under():
    c = curriculum()
    assert not c.observe(0, [1.0] * 7)  # the window is not full yet
    assert c.level == 0 and c.pass_rate() == 1.0
    assert c.observe(0, [1.0])  # 8 of 8 passed > 0.8
    assert c.level == 1 and c.pass_rate() is None  # the window starts over at the new level
    assert c.observe(1, [0.0] * 8)  # 0 of 8 < 0.1
    assert c.level == 0


def test_in_the_window_it_stays_and_rewards_below_the_threshold_do_not_pass():
    c = curriculum(pass_threshold=0.9)
    assert not c.observe(0, [1.0] * 4 + [0.0] * 4)  # 0.5: inside [0.1, 0.8]
    assert not c.observe(0, [0.89] * 8)  # under the threshold: a pass rate of 0, but at level 0 already
    assert c.level == 0


def test_only_rewards_of_the_current_level_count():
    c = curriculum()
    assert c.observe(0, [1.0] * 8) and c.level == 1
    # Samples generated before the move (async) come back with their old level: they do not count.
    assert not c.observe(0, [1.0] * 64)
    assert c.level == 1 and c.pass_rate() is None


def test_the_level_stays_within_the_tasks_levels():
    c = curriculum(levels=2)
    c.observe(0, [1.0] * 8)
    assert c.level == 1
    assert not c.observe(1, [1.0] * 8) and c.level == 1
    c.resume(7)
    assert c.level == 1
    c.resume(-3)
    assert c.level == 0


def test_disabled_it_never_moves():
    c = Curriculum(CurriculumConfig(enabled=False, start_level=2, window=8), 4)
    assert not c.observe(2, [1.0] * 100) and c.level == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValidationError, match="min_pass_rate"):
        CurriculumConfig(min_pass_rate=0.8, max_pass_rate=0.5)
    with pytest.raises(ValueError, match="start_level 3"):
        Curriculum(CurriculumConfig(start_level=3), 2)
    with pytest.raises(ValueError, match="one level only"):
        Curriculum(CurriculumConfig(enabled=True), 1)
