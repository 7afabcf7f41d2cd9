"""Draw calibrations made in several sittings (different seeds) add up to one table."""

from __future__ import annotations

import pytest

from tools.draw_calibration import merge_rows


def row(**over):
    base = {"model": "tiny", "dtype": "float32", "batch": 1, "sampling": "T=1", "max_tokens": 24, "completions": 400,
            "tokens": 9000, "false_rejections": 0, "rejection_codes": {}, "rejection_examples": [],
            "near_tie_tokens": 2, "max_margin_accepted": 1e-4, "strict_not_winner": 2, "strict_outside": 0,
            "strict_max_margin": 1e-4, "slack_outside": 0, "free_positions": 3, "band_positions": 1, "deviations": 2,
            "outside_logit_gap": 0.0, "outside_mass_gap": 0.0, "max_abs_logit": 4.0, "max_margin_over_tolerance": 0.1,
            "draw_margin": 1e-3, "draw_margin_rel": 2.0**-20, "draw_logit_slack": 1e-3, "draw_top_p_slack": 1e-3,
            "seconds": 10.0, "near_tie_share": 2 / 9000, "free_share": 3 / 9000}
    return base | over


def test_counts_add_up_and_maxima_are_the_largest():
    a = [row(), row(dtype="bfloat16")]
    b = [row(near_tie_tokens=5, max_margin_accepted=3e-4, false_rejections=1, rejection_codes={"not_seeded_draw": 1}),
        row(sampling="T=1,top_k=20")]
    merged = {(r["dtype"], r["sampling"]): r for r in merge_rows(a, b)}
    assert set(merged) == {("float32", "T=1"), ("bfloat16", "T=1"), ("float32", "T=1,top_k=20")}
    m = merged[("float32", "T=1")]
    assert m["completions"] == 800 and m["tokens"] == 18000 and m["near_tie_tokens"] == 7 and m["false_rejections"] == 1
    assert m["max_margin_accepted"] == 3e-4 and m["rejection_codes"] == {"not_seeded_draw": 1}
    assert m["near_tie_share"] == pytest.approx(7 / 18000)
    assert merged[("bfloat16", "T=1")]["completions"] == 400  # only in the first run
    assert a[0]["completions"] == 400  # the inputs are not changed


def test_runs_with_other_tolerances_are_refused():
    with pytest.raises(ValueError, match="different tolerances"):
        merge_rows([row()], [row(draw_margin=2e-3)])
