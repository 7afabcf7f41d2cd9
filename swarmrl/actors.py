"""Ray actors of the trusted cluster, besides the trainer (trainer_actor.py): the verifier pool and the
orchestrator.

- `VerifierActor` wraps `verifier.service.Verifier` in one process; `RayVerifierPool` spreads
  `verify_many` over N of them and is what the orchestrator verifies with.
- `OrchestratorActor` is the orchestrator itself (a subclass, made remote as Ray's util/queue.py makes its
  plain class remote) with its HTTP API in a thread: the trainer calls its `trainer.batch_loop.BatchSource`
  methods (take, give back, mark trained, commit batches, reconcile after a restart: versions, version 0
  included, are announced by the last two), the driver the few others. It is a named actor, so a
  restarted trainer finds it again through Ray.

Every actor may be killed at any instant: Ray restarts it (with the same arguments, so the orchestrator
comes back on the same port and SQLite file), and the driver's supervisor counts the restarts. Each
writes its log to `<run dir>/logs/<component>.log`, where a run that gives up on it points.

Ray is imported inside functions: importing this module does not start or need Ray.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.evaluation import held_out_data
from orchestrator.server import OrchestratorServer
from orchestrator.service import Orchestrator
from orchestrator.verification import Verifier
from swarmrl.config import RunConfig
from swarmrl.run_dir import RunDir
from swarmrl.verify_timeout import VerifyTimeout

log = logging.getLogger(__name__)


def init_ray(address: str = "", num_cpus: int | None = 2) -> None:
    """Connect to a Ray cluster at `address`, or start a local one (num_cpus on this machine)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # ray.init() installs its own SIGTERM handler, which would end the driver at once: the driver's (stop after
    # the current step, what `docker stop` and Kubernetes ask for) is put back.
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def component_logging(rd: RunDir, component: str, level: str = "INFO") -> None:
    """This actor's log in the run folder (besides Ray's), with Python's fatal-error traces: what the
    driver quotes when the component keeps dying."""
    import faulthandler

    from swarmrl.logs import KeyValueFormatter

    rd.logs.mkdir(parents=True, exist_ok=True)
    stream = (rd.logs / f"{component}.log").open("a", buffering=1)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    faulthandler.enable(stream)
    logging.getLogger(__name__).info("%s started", component, extra={"pid": os.getpid()})


def pin_to_cpus(cpus: list[int] | None) -> None:
    """Pin this process to `cpus` (benchmarks use it to stand in for separate machines)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def orchestrator_actor_name(cfg: RunConfig) -> str:
    return f"swarmrl-orchestrator:{cfg.name}"


def model_dir(cfg: RunConfig) -> Path:
    return Path(cfg.model.path) if cfg.model.path else RunDir(cfg.run_dir, create=False).model_dir


def db_path(cfg: RunConfig) -> Path:
    return Path(cfg.orchestrator.db_path) if cfg.orchestrator.db_path else RunDir(cfg.run_dir, create=False).db_path


def orchestrator_args(
    cfg: RunConfig, verifier: Verifier, *, prompts: PromptSet | None = None, relay_urls: list[str] | None = None,
    manifest_public_key: str = "", **kwargs: Any
) -> dict[str, Any]:
    """The arguments of a run's orchestrator, over the run's SQLite file; prompts from the config unless given."""
    if prompts is None:
        prompts = PromptSet.from_config(cfg.data, model_dir(cfg), cfg.seed)
    data = cfg.data
    held = held_out_data(data, cfg.eval) if cfg.eval.every_steps else None  # else a slice of the run's prompts
    eval_prompts = PromptSet.from_config(held, model_dir(cfg), cfg.seed).prompts if held is not None else None
    return dict(
        config=cfg.orchestrator, db=Database(db_path(cfg)), prompts=prompts, verifier=verifier, shape=cfg.step_shape(),
        task_name=data.reward or data.task, task_params=data.reward_params if data.reward else data.task_params,
        run_name=cfg.name, relay_urls=relay_urls, manifest_public_key=manifest_public_key, run_id=cfg.shardcast.run_id,
        evaluation=cfg.eval, eval_prompts=eval_prompts, base_model_dir=model_dir(cfg), **kwargs,
    )


def build_orchestrator(cfg: RunConfig, verifier: Verifier, **kwargs: Any) -> Orchestrator:
    """The orchestrator of a run (`orchestrator_args`), in this process."""
    return Orchestrator(**orchestrator_args(cfg, verifier, **kwargs))


class ShardcastWeights:
    """`weights_for_version` for a verifier: pull (and check) version v from shardcast servers into a
    local folder once, then reuse it. Picklable, so it can travel to a Ray actor."""

    def __init__(self, urls: list[str], public_key_b64: str, dest_root: str, run_id: str,
                 keep_versions: int | None = None):
        self.urls = list(urls)
        self.public_key_b64 = public_key_b64
        self.dest_root = dest_root
        self.run_id = run_id  # manifests of another run are refused
        self.keep_versions = keep_versions  # older folders are deleted (None: all kept; verifier.versions_on_disk)
        self._client: Any = None
        self._paths: dict[int, Path] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"urls": self.urls, "public_key_b64": self.public_key_b64, "dest_root": self.dest_root,
            "run_id": self.run_id, "keep_versions": self.keep_versions}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["urls"], d["public_key_b64"], d["dest_root"], d["run_id"],  # type: ignore[misc]
                      d.get("keep_versions"))

    def __call__(self, version: int) -> Path:
        path = self._paths.get(version)
        if path is None or not path.exists():
            if self._client is None:
                from shardcast.client import ShardcastClient

                self._client = ShardcastClient(self.urls, self.public_key_b64, Path(self.dest_root), run_id=self.run_id,
                                               keep_versions=self.keep_versions)
            path = self._paths[version] = Path(self._client.pull(version).path)
        return path


class VerifierActor:
    """One verifier process. Jobs travel as pickles (pydantic models, numpy arrays)."""

    def __init__(self, config: Any, weights_for_version: Any, tokenizer_dir: str, num_threads: int = 1,
                 cpus: list[int] | None = None, log_to: tuple[str, str] | None = None):
        import torch

        from verifier.service import Verifier as TrustedVerifier

        if log_to is not None:  # (run dir, component name)
            component_logging(RunDir(log_to[0]), log_to[1])
        pin_to_cpus(cpus)
        torch.set_num_threads(max(1, num_threads))
        self.verifier = TrustedVerifier(config, weights_for_version, Path(tokenizer_dir))
        self.started_at = time.time()

    def verify_many(self, jobs: list[Any]) -> list[Any]:
        return self.verifier.verify_many(jobs)

    def ping(self) -> tuple[int, float]:
        """(pid, when this incarnation was ready): the supervisor tells restarts apart by the pid."""
        return os.getpid(), self.started_at

    def check_rewards(self, request: Any, reward_name: str, strict: bool) -> Any:
        """The run's start-up check of its reward, in this actor's reward pool (swarmrl/reward_check.py)."""
        from verifier.reward_preflight import check

        return check(self.verifier.rewards, request, reward_name, strict)


class RayVerifierPool:
    """`verify_many` over a pool of VerifierActors: jobs are split evenly, verified in parallel, and
    the verdicts come back in job order. The actors may change between calls (`set_actors`: the driver
    grows and shrinks the pool, swarmrl/verifier_pool.py); a call keeps the actors it started with."""

    def __init__(self, actors: list[Any], timeout_s: float = 600.0, timeout_slack: float = 3.0,
                 initial_tokens_per_s: float = 20.0):
        if not actors:
            raise ValueError("a verifier pool needs at least one actor")
        self.actors = actors
        # A hung actor must not hang the orchestrator: the call times out, and the orchestrator splits the
        # batch until the submission at fault is alone (orchestrator/verification.py). How long "hung" is
        # follows the call's size and the measured rate (verify_timeout.py); timeout_s is its floor.
        self.timeout = VerifyTimeout(timeout_s, timeout_slack, initial_tokens_per_s)

    @classmethod
    def start(
        cls,
        config: Any,
        weights_for_version: Any,
        tokenizer_dir: str,
        num_actors: int | None = None,
        num_cpus: float = 0.5,
        num_gpus: float = 0.0,
        resources: dict[str, float] | None = None,
        max_restarts: int = 3,
        cpus: list[int] | None = None,
        run_dir: str | None = None,
    ) -> "RayVerifierPool":
        """`max_restarts=-1`: Ray restarts a dead actor every time (the driver's supervisor decides when
        a component has died too often). `run_dir`: each actor logs to logs/verifier-<i>.log there."""
        import ray

        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None,
            max_restarts=max_restarts, max_task_retries=1)(VerifierActor)
        # a pool that follows the load is swarmrl/verifier_pool.py (the driver's)
        n = num_actors or config.actor_bounds()[0]
        actors = [
            remote.remote(config, weights_for_version, tokenizer_dir, cpus=cpus, log_to=(run_dir, f"verifier-{i}")
            if run_dir else None)
            for i in range(n)
        ]
        ray.get([a.ping.remote() for a in actors])  # surface constructor errors now
        return cls(actors, timeout_s=config.timeout_s, timeout_slack=config.timeout_slack,
                   initial_tokens_per_s=config.initial_tokens_per_s)

    def verify_many(self, jobs: list[Any]) -> list[Any]:
        import ray

        if not jobs:
            return []
        actors = self.actors  # this call's actors, whatever set_actors does meanwhile
        if not actors:
            raise RuntimeError("no verifier actor is live")
        n = min(len(actors), len(jobs))
        parts = [jobs[i::n] for i in range(n)]
        tokens = max(sum(job.submission.num_tokens for job in part) for part in parts)
        timeout_s, started = self.timeout.for_call(tokens), time.monotonic()
        futures = [actors[i].verify_many.remote(parts[i]) for i in range(n)]
        done, late = ray.wait(futures, num_returns=len(futures), timeout=timeout_s)
        if late:  # a stuck actor would keep every later call waiting behind it: restart it (Ray's max_restarts)
            for i, f in enumerate(futures):
                if f in late:
                    ray.kill(actors[i], no_restart=False)
            raise TimeoutError(f"{len(late)} verifier actor(s) did not answer within {timeout_s:g} s; restarted")
        results = ray.get(futures)
        self.timeout.observe(tokens, time.monotonic() - started)
        out: list[Any] = [None] * len(jobs)
        for i, verdicts in enumerate(results):
            if len(verdicts) != len(parts[i]):
                raise RuntimeError(f"verifier actor {i} returned {len(verdicts)} verdicts for {len(parts[i])} jobs")
            for j, v in enumerate(verdicts):
                out[i + j * n] = v
        return out

    def set_actors(self, actors: list[Any]) -> None:
        self.actors = list(actors)

    @property
    def parallelism(self) -> int:
        """The live actors: the orchestrator takes batch_size jobs per actor into one call."""
        return max(1, len(self.actors))

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []


class OrchestratorActor(Orchestrator):
    """The orchestrator in a Ray actor: SQLite state, the HTTP API (in a thread), verification through a
    verifier pool, and every method of `Orchestrator` (the trainer's: exactly BatchSource). Besides those,
    only what the actor adds: its URL, a ping, the pool's actors, and shutting the server down. Created
    with max_concurrency > 1 (see `start_orchestrator_actor`), so a trainer blocked in `take_batch` does
    not stop `status`; no method is async (that would make Ray run them all on one event loop)."""

    def __init__(self, config: RunConfig, verifier_actors: list[Any], *, relay_urls: list[str] | None = None,
        manifest_public_key: str = "", origin_url: str = ""):
        component_logging(RunDir(config.run_dir), "orchestrator", config.log_level)
        pin_to_cpus(config.resources.cpu_affinity.get("orchestrator"))
        # The run's verifier.timeout_s, not the pool's default: a call stuck on a dying actor is split
        # and retried after it, so it bounds how long a verifier crash can hold verification back.
        v = config.verifier
        self.pool = RayVerifierPool(verifier_actors, timeout_s=v.timeout_s, timeout_slack=v.timeout_slack,
                                    initial_tokens_per_s=v.initial_tokens_per_s)
        super().__init__(**orchestrator_args(config, self.pool, relay_urls=relay_urls,
            manifest_public_key=manifest_public_key, origin_url=origin_url))
        self.set_verifier_actors(len(verifier_actors), 0)
        self.server = OrchestratorServer(self).start()
        self.started_at = time.time()

    def url(self) -> str:
        return self.server.url

    def ping(self) -> tuple[int, float]:
        return os.getpid(), self.started_at

    def set_verifiers(self, actors: list[Any], pending: int = 0) -> None:
        """The live verifier actors (the driver resized the pool; or, after this actor restarted with its
        first arguments, the pool as it is now). Calls in flight finish on the actors they started on."""
        self.pool.set_actors(actors)
        self.set_verifier_actors(len(actors), pending)

    def shutdown(self) -> None:
        """Stop the HTTP server, then the orchestrator (its threads, SQLite)."""
        self.server.stop()


def start_orchestrator_actor(config: RunConfig, verifier_actors: list[Any], *, max_restarts: int = -1,
    **kwargs: Any) -> Any:
    """The orchestrator actor, named after the run and pinned to the driver's node: on a cluster that is
    the head, where the public API's Service points. Ray restarts it when it dies, on the same port (the
    config's, which the driver fixed); no call is retried, because taking a batch is not idempotent."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(
        num_cpus=0, max_concurrency=8, scheduling_strategy=here, name=orchestrator_actor_name(config),
        max_restarts=max_restarts, max_task_retries=0,
    )(OrchestratorActor)
    return actor.remote(config, verifier_actors, **kwargs)
