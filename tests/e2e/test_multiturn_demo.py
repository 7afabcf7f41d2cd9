"""The multi-turn demo learns: workers run episodes of the "lookup" tool environment, the verifier replays
the environment, the trainer learns from the model's tokens only, and the mean reward rises above the base
model's. Slow (a whole run, up to 10 minutes): its latest numbers are in bench/results/multiturn_demo.md.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from e2e_helpers import REPO, metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_multiturn_demo_reward_rises_above_the_base_models(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "multiturn-demo.toml"),
         "--output_dir", str(tmp_path), "--orchestrator.port", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=15 * 60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path / "multiturn-demo")
    assert len(rows) >= 10, f"only {len(rows)} steps"
    base = rows[0]["reward_mean"]  # step 1 trains on version-0 rollouts: the base model's level
    assert rows[0]["staleness"] == {"0": rows[0]["samples/trained"]}
    last = [r["reward_mean"] for r in rows[-5:]]
    assert min(last) > base + 0.1, ([round(r["reward_mean"], 3) for r in rows[::5]], base)
