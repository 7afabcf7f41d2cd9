"""The run folder `runs/<name>/`: resolved config, metrics.jsonl, checkpoints, reward.png and a summary.

Everything a person needs to understand a run after the fact lives here, in plain files. No entry is
named like a package we import (e.g. no `shardcast/`): `swarmrl run` may be started from inside its own
run folder, and Python puts the current folder first on the module path of `python -m` children, where
such a folder would shadow the installed package.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator


class RunDir:
    def __init__(self, root: str | Path, create: bool = True):
        self.root = Path(root)
        if create:  # owner only: it holds the signing key, the run's database and the resolved config
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    config_path = property(lambda self: self.root / "config.toml")
    metrics_path = property(lambda self: self.root / "metrics.jsonl")
    checkpoints = property(lambda self: self.root / "checkpoints")
    weights = property(lambda self: self.root / "weights")  # the shardcast origin's and relays' stores
    origin_dir = property(lambda self: self.root / "weights" / "origin")
    verifier_weights = property(lambda self: self.root / "verifier-weights")
    model_dir = property(lambda self: self.root / "base_model")
    plot_path = property(lambda self: self.root / "reward.png")
    summary_path = property(lambda self: self.root / "summary.md")
    db_path = property(lambda self: self.root / "orchestrator.sqlite")
    logs = property(lambda self: self.root / "logs")
    workers = property(lambda self: self.root / "workers")
    pids_path = property(lambda self: self.root / "pids.json")
    signing_key = property(lambda self: self.root / "signing_key.pem")
    ports_path = property(lambda self: self.root / "ports.json")  # chosen once, so a restart keeps its URL
    session_path = property(lambda self: self.root / "session.json")  # the driver's heartbeat

    def read_json(self, path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)

    # The driver's session: started, alive (a heartbeat every second), ended cleanly. A session that
    # never ended was a driver killed: the next one counts it as a restart of the driver.

    def open_session(self) -> dict[str, Any] | None:
        """Start a driver session; returns the previous one if it never ended (its driver died)."""
        old = self.read_json(self.session_path)
        now = time.time()
        self.write_json(self.session_path, {"pid": os.getpid(), "started_at": now, "heartbeat_at": now})
        return old if old and "ended_at" not in old else None

    def session_heartbeat(self) -> None:
        self.write_json(self.session_path, {**self.read_json(self.session_path), "heartbeat_at": time.time()})

    def close_session(self) -> None:
        self.write_json(self.session_path, {**self.read_json(self.session_path), "ended_at": time.time()})

    run_id_path = property(lambda self: self.root / "run_id")

    def run_id(self, name: str) -> str:
        """This run's id, `<name>-<12 hex>`: made once, then read back (a resumed run keeps it). Signed into
        every policy manifest, so a manifest of another run (even with the same key) is refused."""
        path = self.run_id_path
        if path.is_file():
            return path.read_text().strip()
        run_id = f"{name}-{uuid.uuid4().hex[:12]}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, path)
        return run_id

    def relay_dir(self, index: int) -> Path:
        return self.weights / f"relay-{index}"

    def write_config(self, toml_text: str) -> None:
        """The resolved config (secrets already shown as **********), readable by the owner only."""
        tmp = self.config_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(toml_text)
        os.replace(tmp, self.config_path)

    def append_metrics(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    eval_path = property(lambda self: self.root / "eval.jsonl")  # one record per evaluated policy version

    def append_eval(self, record: dict[str, Any]) -> None:
        with self.eval_path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def read_evals(self) -> Iterator[dict[str, Any]]:
        return self.read_metrics(self.eval_path)

    def read_metrics(self, path: Path | None = None) -> Iterator[dict[str, Any]]:
        path = path or self.metrics_path
        if not path.exists():
            return
        with path.open() as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by a crash mid-write

    def plot(self) -> Path | None:
        """reward.png: mean reward and throughput against wall time."""
        rows = [r for r in self.read_metrics() if "reward_mean" in r]
        if not rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0 = rows[0]["time"]
        minutes = [(r["time"] - t0) / 60 for r in rows]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
        ax1.plot(minutes, [r["reward_mean"] for r in rows], color="tab:blue")
        ax1.set_ylabel("mean reward")
        ax1.set_ylim(-0.02, 1.02)
        ax1.grid(alpha=0.3)
        ax1.set_title(f"{self.root.name}: reward and throughput")
        # Over the last few steps, from the step records themselves (the orchestrator's own rate is a
        # 60 s window, which lags a short run).
        window = 5
        rate = [
            sum(r.get("samples/trained", 0.0) for r in rows[max(1, i - window + 1) : i + 1]) / (r["time"] - rows[max(0,
            i - window)]["time"])
            if i and r["time"] > rows[max(0, i - window)]["time"] else float("nan")
            for i, r in enumerate(rows)
        ]
        ax2.plot(minutes, rate, color="tab:green", label=f"trained samples/s (last {window} steps)")
        ax2.set_ylabel("samples / s")
        ax2.set_xlabel("wall time (minutes)")
        ax2.grid(alpha=0.3)
        ax2.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=110)
        plt.close(fig)
        return self.plot_path

    def write_summary(self, lines: list[str]) -> None:
        self.summary_path.write_text("\n".join(lines) + "\n")
