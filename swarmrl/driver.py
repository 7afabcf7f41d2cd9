"""`swarmrl run`: the whole decentralized loop from one command.

    Ray ─┬─ TrainerActor × trainer.world_size (Trainer; rank 0 also the shardcast Origin: trainer_group.py)
         ├─ VerifierActor × N (verifier.service.Verifier; weights pulled from the origin, signature checked)
         └─ OrchestratorActor (SQLite state + the public HTTP API)
    relay processes           (`swarmrl shardcast relay`, mirroring the origin)
    worker processes          (`swarmrl worker`: join over HTTP with a join token, exactly like volunteers)

The driver starts, watches and stops; no sample passes through it. Each `train_step` of the trainer
actor takes a verified batch from the orchestrator and trains it; its checkpoint, the publishing of its
versions and the commit of the batch follow in the background, and the driver gets back the metrics of
the steps that became durable, logs them and decides when to stop.

Anything may die at any instant: Ray restarts the actors, the supervisor (supervisor.py) restarts the
local processes and counts every restart, and a component that keeps dying stops the run with an error
naming it. The ports are chosen once per run folder (ports.json), so a restarted component, or the whole
run resumed by the same command after the driver died, serves at the same URLs: workers reconnect by
themselves, with their secrets.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from swarmrl.config import RunConfig
from swarmrl.loading import dump_toml
from swarmrl.memory_peaks import MemoryPeaks
from swarmrl.processes import RunFailed, free_port, start_relay, start_worker, wait_until_free
from swarmrl.run_dir import RunDir
from swarmrl.run_record import RunRecord
from swarmrl.supervisor import RestartPolicy, Supervisor
from swarmrl.tracking import make_trackers
from swarmrl.verifier_scaling import VerifierAutoscaler

log = logging.getLogger(__name__)


def ensure_model(cfg: RunConfig, rd: RunDir) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path)
    m = cfg.model
    if m.init_arch and not (rd.model_dir / "config.json").exists():
        from trainer.model_shapes import init_model as make_arch

        log.info("making the base model", extra={"arch": m.init_arch, "layers": m.init_layers, "hidden": m.init_hidden,
            "pretrain_steps": m.init_pretrain_steps})
        make_arch(rd.model_dir, m.init_arch, m.init_seed, not m.tie_embeddings, m.init_layers, m.init_hidden,
            pretrain_steps=m.init_pretrain_steps)
    elif not (rd.model_dir / "config.json").exists():
        from trainer.tiny_model import init_model

        log.info("making the base model", extra={"size": m.init_size, "pretrain_steps": m.init_pretrain_steps,
            "pretrain_target": m.init_pretrain_target})
        init_model(rd.model_dir, m.init_size, m.init_seed, m.tie_embeddings, m.init_pretrain_steps,
                   tool_format=m.init_tool_format, pretrain_target=m.init_pretrain_target,
                   pretrain_max_steps=m.init_pretrain_max_steps)
        made = rd.read_json(rd.model_dir / "swarmrl_model.json")
        log.info("made the base model", extra={k: made.get(k) for k in ("pretrain_steps", "pretrain_echo_accuracy")})
    return rd.model_dir


def fix_ports(cfg: RunConfig, rd: RunDir) -> tuple[RunConfig, dict[str, int]]:
    """Every port the run serves on, chosen once and kept in the run folder: a restarted actor, relay or
    driver serves at the same URL. A port the config sets is used as it is."""
    saved = rd.read_json(rd.ports_path)
    host = cfg.shardcast.host
    ports = {
        "orchestrator": cfg.orchestrator.port or saved.get("orchestrator") or free_port(cfg.orchestrator.host),
        "origin": cfg.shardcast.origin_port or saved.get("origin") or free_port(host),
        **{f"relay-{i}": saved.get(f"relay-{i}") or free_port(host) for i in range(cfg.shardcast.num_relays)},
    }
    rd.write_json(rd.ports_path, ports)
    cfg = cfg.model_copy(update={
        "orchestrator": cfg.orchestrator.model_copy(update={"port": ports["orchestrator"]}),
        "shardcast": cfg.shardcast.model_copy(update={"origin_port": ports["origin"]}),
    })
    return cfg, ports


class Run:
    """All components of one run, started in dependency order and stopped in reverse."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rd = RunDir(cfg.run_dir)
        self.record = RunRecord(cfg, self.rd, ask=self._orch)
        self.progress = self.record.progress
        res = cfg.resources
        self.supervisor = Supervisor(RestartPolicy(res.max_restarts, res.restart_window_s), on_restart=self._restarted)
        self.trainers: Any = None  # the TrainerGroup
        self.trainer: Any = None  # its rank 0
        self.orch: Any = None
        self.pool: Any = None  # swarmrl.verifier_pool.VerifierPool
        self.scaler: VerifierAutoscaler | None = None
        self._next_scale = 0.0
        self.url = ""
        self._stop = threading.Event()
        self._started_ray = False
        self._driver_down_since: float | None = None  # a previous driver of this run died at about this time
        self._pids: dict[str, Any] = {}
        self._leftover_pids: frozenset[int] = frozenset()  # components of a killed previous driver (pids.json)
        self._heartbeat_lock = threading.Lock()
        self.memory = MemoryPeaks()

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        import ray

        from shardcast.keys import load_or_generate_signing_key, public_key_b64
        from swarmrl.actors import ShardcastWeights, init_ray, start_orchestrator_actor
        from swarmrl.reward_check import check_rewards
        from swarmrl.trainer_group import TrainerGroup
        from swarmrl.verifier_pool import VerifierPool

        rd = self.rd
        self._driver_down_since = self._open_session()
        cfg, ports = fix_ports(self.cfg, rd)
        self.cfg = cfg
        rd.write_config(dump_toml(cfg))
        self.record.tracker = make_trackers(cfg.tracking, rd, cfg.name, cfg.model_dump(mode="json"))
        if not cfg.shardcast.run_id:  # made once per run folder; every component checks manifests against it
            cfg = self.cfg = cfg.model_copy(update={"shardcast": cfg.shardcast.model_copy(update={"run_id": rd.run_id(
                cfg.name)})})
        self.record.cfg = cfg
        model_dir = ensure_model(cfg, rd)
        clock = self.record.clock
        clock.done("model")
        if not cfg.ray_address:  # the actors of a driver killed a moment ago may still hold them
            wait_until_free(cfg.orchestrator.host, ports["orchestrator"], leftovers=self._leftover_pids)
            wait_until_free(cfg.shardcast.host, ports["origin"], leftovers=self._leftover_pids)
        # The workers first: their vLLM engine start is the longest phase, and they retry registering until
        # the orchestrator answers at the URL its fixed port gives.
        self.url = f"http://{cfg.orchestrator.host}:{ports['orchestrator']}"
        for i in range(cfg.num_workers):
            self.supervisor.watch_process(f"worker-{i}", lambda i=i: start_worker(self.url, model_dir, rd, i, cfg))
        clock.done("workers spawned")
        key_path = Path(cfg.shardcast.signing_key_path or rd.signing_key)
        public_key = public_key_b64(load_or_generate_signing_key(key_path))  # the trainer loads the same file
        origin_url = f"http://{cfg.shardcast.host}:{ports['origin']}"
        advertised_origin = cfg.shardcast.advertise_origin_url or origin_url
        self._started_ray = not ray.is_initialized() and not cfg.ray_address
        init_ray(cfg.ray_address, num_cpus=None if cfg.ray_address else max(2, os.cpu_count() or 2))
        clock.done("ray")

        # Everything trusted starts at once: each learns the others' URLs from the fixed ports, and a call to
        # an actor still in its constructor waits for it. Below, we wait for each and watch it.
        lo, hi = cfg.verifier.actor_bounds()
        log.info("starting trainer, shardcast origin, relays, verifier pool, orchestrator",
                 extra={"world_size": cfg.trainer.world_size, "min_verifiers": lo, "max_verifiers": hi})
        self.trainers = TrainerGroup(cfg, str(model_dir), str(rd.root), str(key_path)).start()
        self.trainer = self.trainers.leader
        for i in range(cfg.shardcast.num_relays):
            self.supervisor.watch_process(f"relay-{i}", lambda i=i: start_relay(advertised_origin, public_key, rd, i,
                cfg, port=ports[f"relay-{i}"]))
        relay_urls = list(cfg.shardcast.advertise_relay_urls) + [r.url for r in self.supervisor.processes("relay-")]
        weights = ShardcastWeights([advertised_origin], public_key, str(rd.verifier_weights), cfg.shardcast.run_id,
                                   max(cfg.verifier.versions_on_disk, cfg.verifier.keep_versions))
        res = cfg.resources
        self.pool = VerifierPool(
            cfg.verifier, weights, str(model_dir), num_cpus=res.verifier_cpus, num_gpus=res.verifier_gpus,
            resources=res.verifier_resources, cpus=res.cpu_affinity.get("verifier"), run_dir=str(rd.root),
        )
        self.scaler = VerifierAutoscaler(lo, hi, cfg.verifier.scale_up_cooldown_s, cfg.verifier.scale_down_idle_s,
            cfg.verifier.target_drain_s)
        self.pool.grow(lo)
        self.orch = start_orchestrator_actor(cfg, self.pool.requested_handles(),
            relay_urls=relay_urls or [advertised_origin], manifest_public_key=public_key,
            origin_url=cfg.shardcast.public_origin_url or advertised_origin)

        info = self.trainers.call("info")
        if not info["origin_url"].endswith(f":{ports['origin']}") or info["public_key"] != public_key:
            raise RunFailed(f"the origin serves at {info['origin_url']} with key {info['public_key']}, but the others "
                            f"were told {origin_url} with {public_key}")
        self.progress.version = info["version"]
        self.record.resume()
        self.supervisor.watch_actor("trainer", None, rd.logs / "trainer.log", info["pid"], info["started_at"])
        clock.done("trainer")
        try:
            ready = self.pool.wait_live(lo)  # the first min_actors: a constructor error surfaces now
        except RuntimeError as exc:
            raise RunFailed(f"the verifier pool could not start: {exc}") from exc
        for m, pid, started_at in ready:
            self.supervisor.watch_actor(m.name, m.handle, rd.logs / f"{m.name}.log", pid, started_at)
        check_rewards(self.pool.handles(), cfg)  # the reward loads and scores in every reward process, or RunFailed
        clock.done("verifiers")
        served = ray.get(self.orch.url.remote())
        if served != self.url:  # the workers were pointed at self.url
            raise RunFailed(f"the orchestrator serves at {served}, not at {self.url}")
        self.progress.reward_totals = ray.get(self.orch.reward_totals.remote())  # a resumed run starts from here
        pid, started_at = ray.get(self.orch.ping.remote())
        self.supervisor.watch_actor("orchestrator", self.orch, rd.logs / "orchestrator.log", pid, started_at)
        clock.done("orchestrator")
        self.supervisor.ticks.append(self._heartbeat)
        self.supervisor.ticks.append(self._scale_verifiers)
        self.supervisor.ticks.append(lambda: self.memory.sample(self.supervisor.pids()))
        self.supervisor.start()
        self._heartbeat()
        log.info("run started", extra={"url": self.url, "run_dir": str(rd.root), "workers": cfg.num_workers})

    def _open_session(self) -> float | None:
        """When the previous driver of this run was last seen alive, if it was killed (else None). Also
        notes the pids it recorded: what may still hold this run's ports."""
        old = self.rd.open_session()
        if old is None:
            return None
        recorded = self.rd.read_json(self.rd.pids_path)
        self._leftover_pids = frozenset(int(v) for k, v in recorded.items() if k not in ("driver", "url")
            and isinstance(v, int))
        self.progress.events.append(f"resumed after the previous driver (pid {old.get('pid')}) died")
        return float(old.get("heartbeat_at", old.get("started_at", time.time())))

    def _heartbeat(self) -> None:
        """Every second: the driver is alive (session.json), and where everything runs (pids.json). Also
        right after a restart, so pids.json never names a dead process once the run has moved on."""
        with self._heartbeat_lock:  # the supervisor's thread and the main thread (after a trainer restart)
            self.rd.session_heartbeat()
            pids = {"driver": os.getpid(), "url": self.url, **self.supervisor.pids()}
            if pids != self._pids:
                self.rd.write_json(self.rd.pids_path, pids)
                self._pids = pids

    def _scale_verifiers(self) -> None:
        """A supervisor tick: every verifier.scale_period_s, the pool follows the load (verifier_pool.scale)."""
        from swarmrl.verifier_pool import scale

        now = time.time()
        if self.pool is None or self.scaler is None or now < self._next_scale:
            return
        self._next_scale = now + self.cfg.verifier.scale_period_s
        scale(self.pool, self.scaler, self.orch, self.supervisor, self.rd.logs, now)

    def _restarted(self, component: str, seconds_lost: float) -> None:
        """The supervisor restarted a component (or saw Ray do it): count it where operators look."""
        driver = self.progress.restarts.get("driver", (0, 0.0))
        if component == "driver":
            driver = (driver[0] + 1, driver[1] + seconds_lost)
        self.progress.restarts = {**self.supervisor.summary(), **({"driver": driver} if driver[0] else {})}
        self.progress.events.append(f"{component} restarted ({seconds_lost:.1f} s lost)")
        if self.orch is not None:
            self.orch.record_restart.remote(component, seconds_lost)

    # ---------------------------------------------------------------- watching the loop

    def train(self) -> None:
        from ray.exceptions import RayActorError

        from swarmrl.trainer_group import TrainerDied

        cfg, p = self.cfg, self.progress
        deadline = time.time() + cfg.max_minutes * 60 if cfg.max_minutes else None
        while p.version < cfg.trainer.max_steps and not self._stop.is_set():
            if deadline and time.time() > deadline:
                p.events.append("time limit reached")
                break
            self.supervisor.check()
            try:
                out = self.trainers.call("train_step")
            except (RayActorError, TrainerDied) as exc:
                self._wait_for_trainer(exc)
                continue
            if self._driver_down_since is not None:  # the run works again after its driver was killed
                self._restarted_driver()
            for step in out["committed"]:
                self.record.step(step["metrics"], step["staleness"])
            if not out["trained"] and not out["committed"]:
                # No whole batch yet. A converged policy yields only zero-signal groups, so no batch at
                # all: judge it by its accepted rollouts.
                self.record.update_reward(min_completions=cfg.trainer.samples_per_step)
            if self.record.reward_reached():
                break
        self._finish_trainer()

    def _finish_trainer(self) -> None:
        """Make the trainer's last steps durable and committed, and record them."""
        try:
            for step in self.trainers.call("finish", timeout_s=300):
                self.record.step(step["metrics"], step["staleness"])
        except Exception as exc:  # a resumed run reconciles whatever this left in flight
            log.warning("could not finish the trainer's last steps (%s); a resumed run settles them",
                type(exc).__name__)
        self.record.evals()

    def _orch(self, method: str, default: Any, *args: Any, timeout_s: float = 10.0) -> Any:
        """An orchestrator call for display or bookkeeping: it may be restarting (or not started); then `default`."""
        import ray

        if self.orch is None:
            return default
        try:
            return ray.get(getattr(self.orch, method).remote(*args), timeout=timeout_s)
        except Exception:
            return default

    def _wait_for_trainer(self, exc: Exception) -> None:
        """The trainer process died. Ray restarts it (a group of ranks: we restart them all) from its last
        durable checkpoint, and its first step reconciles with the orchestrator (the batches that checkpoint
        holds are committed, the others go back): wait until it answers again, and count the restart."""
        down_since = time.time()
        log.warning("trainer died (%s); waiting for it to resume from its last checkpoint", type(exc).__name__)
        deadline = down_since + self.supervisor.policy.down_timeout_s
        while True:
            self.supervisor.check()
            try:
                if self.trainers.world_size > 1:
                    self.trainers.restart()
                    self.trainer = self.trainers.leader
                info = self.trainers.call("info", timeout_s=60)
                break
            except Exception as e:  # still restarting
                if time.time() > deadline:
                    raise RunFailed(f"the trainer did not come back after a crash: {e}") from e
                time.sleep(1.0)
        self.progress.version = info["version"]
        self.supervisor.restarted("trainer", info["pid"], info["started_at"], down_since)
        self._heartbeat()

    def _restarted_driver(self) -> None:
        assert self._driver_down_since is not None
        lost, self._driver_down_since = time.time() - self._driver_down_since, None
        self._restarted("driver", lost)

    # ---------------------------------------------------------------- stop

    def request_stop(self, reason: str = "") -> None:
        if reason and not self._stop.is_set():
            self.progress.events.append(reason)
        self._stop.set()

    def shutdown(self) -> None:
        import ray

        self.memory.sample(self.supervisor.pids(), force=True)  # before anything ends
        self.supervisor.stop()  # first: nothing may be restarted while we stop it
        for proc in self.supervisor.processes("worker-") + self.supervisor.processes("relay-"):
            proc.stop()
        if self.orch is not None:
            try:
                ray.get(self.orch.shutdown.remote(), timeout=20)
            except Exception:
                pass
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self.record.tracker.close()
        self.rd.close_session()  # a clean end: the next start is not a restart

def run(cfg: RunConfig, display: bool | None = None) -> int:
    """Run to completion. Returns a process exit code. The first Ctrl-C (or SIGTERM) stops after the step
    in progress, with the last steps made durable; a second one stops at once (a resumed run reconciles)."""
    from swarmrl.live_view import LiveView

    r = Run(cfg)
    code = 0

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal code
        if r._stop.is_set():
            raise KeyboardInterrupt
        code = 130 if signum == signal.SIGINT else 0
        log.warning("stopping after the current step (again to stop at once)")
        r.request_stop("stopped by Ctrl-C" if signum == signal.SIGINT else "stopped by SIGTERM")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    view = None
    try:
        r.start()
        view = LiveView(r, enabled=sys.stdout.isatty() if display is None else display).start()
        r.train()
    except KeyboardInterrupt:
        r.progress.events.append("stopped at once by a second Ctrl-C")
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            r.record.summary(r.memory)
        except Exception:
            log.exception("could not write the run summary")
    log.info("run finished", extra={"run_dir": str(r.rd.root), "steps": r.progress.step, "reward": r.progress.reward})
    return code
