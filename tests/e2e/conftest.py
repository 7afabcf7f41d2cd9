"""Whole-system runs that several tests only observe are made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import start_run, stop_run


@pytest.fixture(scope="session")
def short_run(tmp_path_factory) -> tuple[Path, int, str]:
    """6 steps, one worker, async level 1, max staleness 1, evaluation every 2 steps on 4 held-out prompts:
    (run folder, exit code, driver log). Observed by test_run.py and test_eval_run.py."""
    out = tmp_path_factory.mktemp("short-run")
    proc = start_run(out, "--name", "ci", "--trainer.max_steps", "6", "--num_workers", "1",
                     "--orchestrator.async_level", "1", "--trainer.max_staleness", "1",
                     "--eval.every_steps", "2", "--eval.num_prompts", "4")
    try:
        code = proc.wait(timeout=420)
    finally:
        stop_run(proc)
    return out / "ci", code, (out / "driver.log").read_text()
