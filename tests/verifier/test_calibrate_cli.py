"""`python -m tools.calibrate`: the developer entry point of the verifier calibration (tools/ is not
installed, so the `swarmrl` command has no calibrate subcommand)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]


def test_runs_as_a_module_from_the_checkout_with_every_part():
    out = subprocess.run([sys.executable, "-m", "tools.calibrate", "--help"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"})
    assert out.returncode == 0, out.stderr
    for option in ("--part", "--trials", "--honest-scale", "--completions", "--models", "--accumulate", "--batches",
        "--dtypes", "--burst"):
        assert option in out.stdout


def test_bad_options_are_refused_before_any_work():
    from tools.calibrate import app

    runner = CliRunner()
    res = runner.invoke(app, ["--part", "nope"], env={"COLUMNS": "250"})
    assert res.exit_code == 2 and "--part is attacks, episodes, draws, steering, weights or all" in res.output
    res = runner.invoke(app, ["--models", "tiny,huge"], env={"COLUMNS": "250"})
    assert res.exit_code == 2 and "unknown models ['huge']" in res.output


def test_swarmrl_verifier_keeps_check_only():
    from typer.main import get_command

    from swarmrl.cli import app

    assert set(get_command(app).commands["verifier"].commands) == {"check"}
