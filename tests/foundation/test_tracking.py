"""Experiment tracking: metrics.jsonl unchanged, TensorBoard event files that read back, W&B offline runs."""

from __future__ import annotations

import json
import time

import pytest

from swarmrl.config import RunConfig
from swarmrl.run_dir import RunDir
from swarmrl.tracking import Trackers, TrackingConfig, make_trackers

RECORDS = [
    {"step": s, "version": s, "reward_mean": 0.1 * s, "loss": 1.0 / s, "staleness": {"0": 16}, "acceptance_rate": None}
    for s in range(1, 4)
]


def test_jsonl_is_required_and_backends_come_from_the_config():
    with pytest.raises(ValueError, match="'jsonl' must be one of the backends"):
        TrackingConfig(backends=["tensorboard"])
    with pytest.raises(ValueError):
        TrackingConfig(backends=["jsonl", "mlflow"])
    cfg = RunConfig.model_validate({"tracking": {"backends": ["jsonl", "tensorboard"]}})
    assert cfg.tracking.backends == ["jsonl", "tensorboard"]
    assert RunConfig().tracking.backends == ["jsonl"]


def test_tensorboard_scalars_read_back_and_jsonl_is_unchanged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rd = RunDir(tmp_path / "run")
    tracker = make_trackers(TrackingConfig(backends=["jsonl", "tensorboard"]), rd, "t")
    for r in RECORDS:
        tracker.log(r["step"], r)
    tracker.close()

    # metrics.jsonl: the records as before, one JSON object per line with the time first.
    rows = [json.loads(line) for line in rd.metrics_path.read_text().splitlines()]
    assert [{k: v for k, v in row.items() if k != "time"} for row in rows] == RECORDS
    assert all(list(row)[0] == "time" for row in rows)

    events = list((rd.root / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(rd.root / "tensorboard"))
    acc.Reload()
    assert {"reward_mean", "loss", "step", "version"} <= set(acc.Tags()["scalars"])
    assert "staleness" not in acc.Tags()["scalars"] and "acceptance_rate" not in acc.Tags()["scalars"]
    got = [(e.step, e.value) for e in acc.Scalars("reward_mean")]
    assert [s for s, _ in got] == [1, 2, 3]
    assert [v for _, v in got] == pytest.approx([0.1, 0.2, 0.3])
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([1.0, 0.5, 1 / 3])


def test_a_failing_backend_is_dropped_not_fatal(tmp_path, caplog):
    rd = RunDir(tmp_path / "run")

    class Broken:
        def log(self, step, metrics):
            raise OSError("disk full")

        def close(self):
            pass

    tracker = make_trackers(TrackingConfig(), rd, "t")
    tracker = Trackers([*tracker.trackers, Broken()])
    for r in RECORDS:
        tracker.log(r["step"], r)
    assert len(rd.metrics_path.read_text().splitlines()) == 3
    assert sum("Broken failed" in rec.getMessage() for rec in caplog.records) == 1


def test_wandb_offline_writes_its_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    rd = RunDir(tmp_path / "run")
    tracker = make_trackers(TrackingConfig(backends=["jsonl", "wandb"]), rd, "offline-test", {"seed": 0})
    for r in RECORDS:
        tracker.log(r["step"], r)
    tracker.close()
    [run] = list((rd.root / "wandb").glob("offline-run-*"))
    [data] = list(run.glob("run-*.wandb"))
    # An offline run keeps its history in the .wandb record file (what `wandb sync` uploads).
    # wandb's service process may still be writing it when finish() returns.
    deadline = time.monotonic() + 60
    while b"reward_mean" not in (raw := data.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"reward_mean" in raw and b"loss" in raw and b"staleness" not in raw


def test_a_resumed_run_counts_its_steps_on_and_skips_what_it_recorded(tmp_path):
    """A second session on the same run folder (compose down/up, a crash): `step` goes on from the last record, so
    trackers get a step that only grows, and a version reported again by a restarted trainer is not recorded twice."""
    from swarmrl.run_record import RunRecord

    rd = RunDir(tmp_path / "run")
    first = RunRecord(RunConfig(), rd)
    for v in (1, 2, 3):
        first.step({"version": v, "loss": 1.0}, {0: 4})
    resumed = RunRecord(RunConfig(), RunDir(tmp_path / "run"))
    resumed.resume()
    for v in (3, 4, 5):  # version 3 is reported again (its step was trained before the stop)
        resumed.step({"version": v, "loss": 0.5}, {0: 4})
    rows = list(rd.read_metrics())
    assert [(r["step"], r["version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    assert resumed.progress.step - resumed.progress.session_first_step == 2
