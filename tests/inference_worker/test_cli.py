"""`swarmrl worker` argument handling (no engine started: --dry-run and bad input)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from swarmrl.cli import app

runner = CliRunner()


def invoke(args):
    return runner.invoke(app, ["worker", *args])


def test_dry_run_resolves_overrides():
    res = invoke(["--orchestrator", "http://o:8000", "--join-token", "tok", "--name", "vol1", "--engine.dtype",
        "bfloat16", "--max_prompts_per_lease=3", "--dry-run"])
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.output)
    # the secret is never printed
    assert cfg["orchestrator_url"] == "http://o:8000" and cfg["join_token"] == "**********" and cfg["name"] == "vol1"
    assert cfg["engine"]["dtype"] == "bfloat16" and cfg["max_prompts_per_lease"] == 3


def test_bad_overrides_are_clear_errors():
    res = invoke(["--orchestrator", "http://o", "--join-token", "t", "--engine.dtype", "float64"])
    assert res.exit_code == 2 and "engine.dtype" in res.output
    res = invoke(["--orchestrator", "http://o", "--join-token", "t", "--no_such_field", "1"])
    assert res.exit_code == 2 and "no_such_field" in res.output
    res = invoke(["--join-token", "t"])
    assert res.exit_code == 2 and "--orchestrator" in res.output


def test_live_panel_renders_the_counters():
    from rich.console import Console

    from inference_worker.display import WorkerStats
    from protocol.models import WorkerState

    stats = WorkerStats(state=WorkerState.generating, worker_id="w7", loaded_version=3, orchestrator_version=4,
        tokens_per_s=1234.0, tasks_submitted=5, accepted=4, rejected=1)
    console = Console(record=True, width=100)
    console.print(stats.render())
    text = console.export_text()
    assert "generating" in text and "w7" in text and "3 loaded / 4 current" in text
    assert "1,234" in text and "4 / 1" in text


def test_a_work_dir_in_use_by_another_worker_process_is_refused(tmp_path):
    """Two workers on one work dir would write the same weight files (a new driver's worker beside the old
    one finishing its task after SIGTERM): the second waits `work_dir_wait_s`, then exits 2 naming the holder."""
    import os

    from shardcast.store import lock_folder

    held = lock_folder(tmp_path / "w", wait_s=0, what="worker")  # held by this process, as by a live worker
    try:
        res = invoke(["--orchestrator", "http://127.0.0.1:9", "--join-token", "t", "--work-dir", str(tmp_path / "w"),
            "--work_dir_wait_s", "0.3"])
    finally:
        os.close(held)
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())  # rich wraps long lines
    assert "in use by another worker" in said and f"pid {os.getpid()}" in said
