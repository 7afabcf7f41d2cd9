"""`swarmrl run`: the whole decentralized loop from one command.

    Ray ─┬─ TrainerActor      (Trainer + shardcast Origin: the origin lives on trainer rank 0)
         ├─ VerifierActor × N (verifier.service.Verifier; weights pulled from the origin, signature checked)
         └─ OrchestratorActor (SQLite state + the public HTTP API)
    relay processes           (`swarmrl shardcast relay`, mirroring the origin)
    worker processes          (`swarmrl worker`: join over HTTP with a join token, exactly like volunteers)

The driver starts, watches and stops; no sample passes through it. Each `train_step` of the trainer
actor takes a verified batch from the orchestrator, trains, publishes version N+1 through shardcast and
commits the batch, all on the trusted side; the driver gets metrics back, logs them and decides when to
stop. Every component is watched; if one dies for good the run stops with a clear error instead of hanging.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.config import RunConfig
from swarmrl.loading import dump_toml
from swarmrl.processes import Proc, RunFailed, free_port, start_relay, start_worker
from swarmrl.run_dir import RunDir

log = logging.getLogger(__name__)


@dataclass
class Progress:
    step: int = 0
    version: int = 0
    reward: float | None = None
    rewards: deque = field(default_factory=lambda: deque(maxlen=5))
    reward_totals: tuple[float, int] = (0.0, 0)
    status: Any = None
    last_metrics: dict[str, Any] = field(default_factory=dict)
    wait_for_trainer_total: float = 0.0
    started: float = field(default_factory=time.time)
    events: list[str] = field(default_factory=list)


def ensure_model(cfg: RunConfig, rd: RunDir) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path)
    if not (rd.model_dir / "config.json").exists():
        from trainer.tiny_model import init_model

        log.info("making the base model", extra={"size": cfg.model.init_size, "pretrain_steps": cfg.model.init_pretrain_steps})
        init_model(rd.model_dir, cfg.model.init_size, cfg.model.init_seed, cfg.model.tie_embeddings, cfg.model.init_pretrain_steps)
    return rd.model_dir


class Run:
    """All components of one run, started in dependency order and stopped in reverse."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rd = RunDir(cfg.run_dir)
        self.progress = Progress()
        self.relays: list[Proc] = []
        self.workers: list[Proc] = []
        self.trainer: Any = None
        self.orch: Any = None
        self.pool: Any = None
        self.url = ""
        self._stop = threading.Event()
        self._started_ray = False
        self._trainer_pid = 0

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        import ray

        from swarmrl.actors import RayVerifierPool, ShardcastWeights, init_ray, start_orchestrator_actor
        from swarmrl.trainer_actor import TrainerActor

        cfg, rd = self.cfg, self.rd
        rd.write_config(dump_toml(cfg))
        if not cfg.shardcast.run_id:  # made once per run folder; every component checks manifests against it
            cfg = self.cfg = cfg.model_copy(update={"shardcast": cfg.shardcast.model_copy(update={"run_id": rd.run_id(cfg.name)})})
        model_dir = ensure_model(cfg, rd)
        key_path = Path(cfg.shardcast.signing_key_path or rd.signing_key)
        self._started_ray = not ray.is_initialized() and not cfg.ray_address
        init_ray(cfg.ray_address, num_cpus=None if cfg.ray_address else max(2, os.cpu_count() or 2))

        if cfg.shardcast.origin_port == 0:
            # Pick the origin's port once: a restarted trainer must serve at the same URL, which the
            # relays and the verifiers already use.
            port = free_port(cfg.shardcast.host)
            cfg = self.cfg = cfg.model_copy(update={"shardcast": cfg.shardcast.model_copy(update={"origin_port": port})})
        log.info("starting trainer and shardcast origin")
        actor = ray.remote(
            num_cpus=0,
            num_gpus=cfg.resources.trainer_gpus,
            resources=cfg.resources.trainer_resources or None,
            max_restarts=cfg.resources.max_restarts,
            max_task_retries=0,
        )
        self.trainer = actor(TrainerActor).remote(cfg, str(model_dir), str(rd.root), str(key_path))
        info = ray.get(self.trainer.info.remote())
        info["origin_url"] = cfg.shardcast.advertise_origin_url or info["origin_url"]
        self.progress.version = info["version"]

        for i in range(cfg.shardcast.num_relays):
            self.relays.append(start_relay(info["origin_url"], info["public_key"], rd, i, cfg))
        relay_urls = list(cfg.shardcast.advertise_relay_urls) + [r.url for r in self.relays]
        relay_urls = relay_urls or [info["origin_url"]]

        log.info("starting verifier pool", extra={"actors": cfg.verifier.num_actors})
        weights = ShardcastWeights([info["origin_url"]], info["public_key"], str(rd.verifier_weights), cfg.shardcast.run_id)
        self.pool = RayVerifierPool.start(
            cfg.verifier, weights, str(model_dir), num_cpus=0, num_gpus=cfg.resources.verifier_gpus,
            resources=cfg.resources.verifier_resources, max_restarts=cfg.resources.max_restarts,
            cpus=cfg.resources.cpu_affinity.get("verifier"),
        )

        log.info("starting orchestrator")
        self.orch = start_orchestrator_actor(cfg, self.pool.actors, relay_urls=relay_urls, manifest_public_key=info["public_key"], origin_url=cfg.shardcast.public_origin_url or info["origin_url"])
        self.url = ray.get(self.orch.url.remote())
        ray.get(self.orch.publish_version.remote(info["version"], info["model_hash"]))
        self.progress.reward_totals = ray.get(self.orch.reward_totals.remote())  # a resumed run starts from here

        for i in range(cfg.num_workers):
            self.workers.append(start_worker(self.url, model_dir, rd, i, cfg))
        self._write_pids(info["pid"])
        log.info("run started", extra={"url": self.url, "run_dir": str(rd.root), "workers": cfg.num_workers})

    def _write_pids(self, trainer_pid: int) -> None:
        self._trainer_pid = trainer_pid
        pids = {"driver": os.getpid(), "trainer": trainer_pid, "relays": [r.popen.pid for r in self.relays], "workers": [w.popen.pid for w in self.workers], "url": self.url}
        self.rd.pids_path.write_text(json.dumps(pids, indent=2))

    # ---------------------------------------------------------------- watching the loop

    def train(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        cfg, p = self.cfg, self.progress
        deadline = time.time() + cfg.max_minutes * 60 if cfg.max_minutes else None
        while p.version < cfg.trainer.max_steps and not self._stop.is_set():
            if deadline and time.time() > deadline:
                p.events.append("time limit reached")
                break
            self._check_components()
            try:
                out = ray.get(self.trainer.train_step.remote())
            except RayActorError as exc:
                self._wait_for_trainer(exc)
                continue
            if out is None:
                # No whole batch yet. A converged policy yields only zero-signal groups, so no batch at
                # all: judge it by its accepted rollouts.
                self._update_reward(min_completions=cfg.trainer.samples_per_step)
                if self._reward_reached():
                    break
                continue
            if out["pid"] != self._trainer_pid:  # Ray restarted the trainer between two steps
                self._write_pids(out["pid"])
            self._record(out["metrics"], out["staleness"])
            if self._reward_reached():
                break
        ray.get(self.trainer.checkpoint.remote())

    def _update_reward(self, min_completions: int) -> None:
        """The mean reward of every rollout accepted since the last update, zero-signal groups included
        (the trained samples alone leave out the groups that are all wrong or all right)."""
        import ray

        p = self.progress
        reward_sum, completions = ray.get(self.orch.reward_totals.remote())
        if completions - p.reward_totals[1] >= min_completions:
            p.reward = (reward_sum - p.reward_totals[0]) / (completions - p.reward_totals[1])
            p.rewards.append(p.reward)
            p.reward_totals = (reward_sum, completions)

    def _reward_reached(self) -> bool:
        cfg, p = self.cfg, self.progress
        if cfg.stop_reward is not None and len(p.rewards) == p.rewards.maxlen and min(p.rewards) >= cfg.stop_reward:
            p.events.append(f"reward >= {cfg.stop_reward} for {p.rewards.maxlen} steps")
            return True
        return False

    def _record(self, metrics: dict[str, Any], gaps: dict[int, int]) -> None:
        import ray

        p = self.progress
        p.step += 1
        p.version = int(metrics["version"])
        self._update_reward(min_completions=1)
        try:
            p.status = ray.get(self.orch.status.remote(), timeout=10)
        except Exception:  # status is for display only
            pass
        st = p.status
        record = {
            "step": p.step,
            "version": p.version,
            "reward_mean": p.reward,
            "time/train": metrics.get("time/compute", 0.0),
            "staleness": {str(k): v for k, v in gaps.items()},
            **{k: v for k, v in metrics.items() if k != "version" and isinstance(v, (int, float))},
        }
        if st is not None:
            record["time/wait_for_trainer"] = st.wait_for_trainer_s - p.wait_for_trainer_total
            p.wait_for_trainer_total = st.wait_for_trainer_s
            record.update(
                rollout_tokens_per_s=st.rollout_tokens_per_s,
                trained_samples_per_s=st.trained_samples_per_s,
                acceptance_rate=st.acceptance_rate,
                workers_online=st.workers_online,
                buffer_depth=st.buffer_depth,
                groups_dropped_zero_signal=st.groups_dropped_zero_signal,
            )
        p.last_metrics = record
        self.rd.append_metrics(record)
        log.info("step", extra={"step": p.step, "version": p.version, "reward": None if p.reward is None else round(p.reward, 3)})

    def _wait_for_trainer(self, exc: Exception) -> None:
        """The trainer process died mid-step. Ray restarts it from its last checkpoint, and its first
        step reconciles with the orchestrator (the batch in flight is committed if that checkpoint holds
        it, given back if not): wait until it answers again."""
        import ray

        self.progress.events.append(f"trainer died ({type(exc).__name__}); resuming from its checkpoint")
        log.warning("trainer died; waiting for it to resume from its last checkpoint")
        deadline = time.time() + 300
        while True:
            try:
                info = ray.get(self.trainer.info.remote(), timeout=60)
                break
            except Exception as e:  # still restarting
                if time.time() > deadline:
                    raise RunFailed(f"the trainer did not come back after a crash: {e}") from e
                time.sleep(1.0)
        self.progress.version = info["version"]
        self._write_pids(info["pid"])

    def _check_components(self) -> None:
        for r in self.relays:
            if not r.alive():
                raise RunFailed(f"{r.name} exited with code {r.popen.returncode}; see {r.log_path}")
        if self.workers and not any(w.alive() for w in self.workers):
            w = self.workers[0]
            raise RunFailed(f"every local worker exited (e.g. {w.name}: code {w.popen.returncode}; see {w.log_path})")

    # ---------------------------------------------------------------- stop

    def request_stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            w.stop()
        for r in self.relays:
            r.stop()
        if self.orch is not None:
            try:
                ray.get(self.orch.stop.remote(), timeout=20)
            except Exception:
                pass
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    def finish(self) -> None:
        p = self.progress
        self.rd.plot()
        minutes = (time.time() - p.started) / 60
        rows = [r for r in self.rd.read_metrics() if r.get("reward_mean") is not None]
        first = rows[0]["reward_mean"] if rows else None
        st = p.status
        self.rd.write_summary(
            [
                f"# Run `{self.cfg.name}`",
                "",
                f"- optimizer steps this session: {p.step}; policy version: {p.version}",
                f"- wall time: {minutes:.1f} min",
                f"- mean reward: first step {first if first is None else round(first, 3)}, last {None if p.reward is None else round(p.reward, 3)}",
                f"- acceptance rate: {st.acceptance_rate:.3f}" if st else "- acceptance rate: n/a",
                f"- submissions accepted / rejected: {st.submissions_accepted} / {st.submissions_rejected}" if st else "",
                f"- groups dropped for zero signal: {st.groups_dropped_zero_signal}" if st else "",
                f"- staleness histogram (version gap: samples): {st.staleness_histogram}" if st else "",
                f"- async_level: {self.cfg.orchestrator.async_level}, workers: {self.cfg.num_workers}",
                *(f"- event: {e}" for e in p.events),
                "",
                "Files: config.toml, metrics.jsonl, reward.png, checkpoints/, logs/.",
            ]
        )


def run(cfg: RunConfig, display: bool | None = None) -> int:
    """Run to completion. Returns a process exit code."""
    from swarmrl.live_view import LiveView

    r = Run(cfg)
    code = 0
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: r.request_stop())
    view = None
    try:
        r.start()
        view = LiveView(r, enabled=sys.stdout.isatty() if display is None else display).start()
        r.train()
    except KeyboardInterrupt:
        r.progress.events.append("stopped by Ctrl-C")
        log.warning("interrupted; shutting down")
        code = 130
    except RunFailed as exc:
        r.progress.events.append(f"failed: {exc}")
        log.error("run failed: %s", exc)
        code = 1
    finally:
        if view is not None:
            view.stop()
        r.shutdown()
        signal.signal(signal.SIGTERM, previous)
        try:
            r.finish()
        except Exception:
            log.exception("could not write the run summary")
    log.info("run finished", extra={"run_dir": str(r.rd.root), "steps": r.progress.step, "reward": r.progress.reward})
    return code
