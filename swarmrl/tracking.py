"""Experiment tracking: one `Tracker` interface, fanned out to the run folder's metrics.jsonl, TensorBoard and
Weights & Biases, chosen by `[tracking] backends`.

metrics.jsonl is always written (the run's own record: reward.png, the audit and a restarted driver read
it) and its format does not change. TensorBoard and W&B get the numeric scalars of each record; lists,
dicts and None are left out (they are in metrics.jsonl). A backend that fails is logged once and
switched off: tracking must never stop a run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger(__name__)

Backend = Literal["jsonl", "tensorboard", "wandb"]


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backends: list[Backend] = Field(default_factory=lambda: ["jsonl"], description="where each step's metrics go")
    tensorboard_dir: str = Field("", description="empty: <run folder>/tensorboard")
    wandb_project: str = "swarmrl"
    wandb_entity: str = ""
    wandb_mode: Literal["online", "offline"] = Field("offline",
        description="offline writes the run folder without network; `wandb sync` uploads it")
    wandb_dir: str = Field("", description="empty: the run folder (wandb writes ./wandb/ in it)")

    @field_validator("backends")
    @classmethod
    def _jsonl_always(cls, v: list[str]) -> list[str]:
        if "jsonl" not in v:
            raise ValueError("'jsonl' must be one of the backends: metrics.jsonl is the run's own record (reward.png, "
                "audit, resume)")
        return list(dict.fromkeys(v))


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The plain numbers of a record (bools count as 0 / 1; NaN stays: a NaN loss is worth seeing); everything
    else is left to metrics.jsonl."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


class JsonlTracker:
    """Appends each record to metrics.jsonl through the run folder (one JSON object per line, `time` first)."""

    def __init__(self, run_dir: Any):
        self.run_dir = run_dir  # swarmrl.run_dir.RunDir

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run_dir.append_metrics(metrics)

    def close(self) -> None:
        pass


class TensorBoardTracker:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # steps are seconds apart: a live TensorBoard sees each one

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, project: str, name: str, directory: str | Path, mode: str, entity: str = "", config: dict[str,
        Any] | None = None):
        import wandb  # optional (`swarmrl[tracking]`): imported only when chosen

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity or None, name=name, dir=str(directory), mode=mode,
            config=config or {}, reinit="create_new")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Fans each record out to every backend; a backend that raises is logged once and dropped."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for t in list(self.trackers):
            if isinstance(t, JsonlTracker):
                t.log(step, metrics)  # the run's own record: a failure here is a real error
                continue
            try:
                t.log(step, metrics)
            except Exception:
                log.exception("tracking backend %s failed; switched off for the rest of the run", type(t).__name__)
                self.trackers.remove(t)

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception:
                log.exception("tracking backend %s failed to close", type(t).__name__)
        self.trackers = []


def make_trackers(config: TrackingConfig, run_dir: Any, name: str, run_config: dict[str,
    Any] | None = None) -> Trackers:
    """The configured backends for the run folder `run_dir` (a RunDir)."""
    trackers: list[Tracker] = [JsonlTracker(run_dir)]
    if "tensorboard" in config.backends:
        trackers.append(TensorBoardTracker(config.tensorboard_dir or run_dir.root / "tensorboard"))
    if "wandb" in config.backends:
        trackers.append(WandbTracker(config.wandb_project, name, config.wandb_dir or run_dir.root, config.wandb_mode,
            config.wandb_entity, run_config))
    return Trackers(trackers)
