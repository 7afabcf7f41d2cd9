"""The volunteer loop: register, heartbeat, keep weights fresh, lease -> generate -> submit, forever.

Threads: the main thread leases, generates (vLLM) and submits; a heartbeat thread reports state and
collects verdicts; the weights keeper downloads new policy versions. Only the main thread touches the
engine, so a new version is swapped in between two tasks.

How each answer is handled:
- network errors / 5xx: the client retries with backoff + jitter; after that the loop backs off and tries
  again, forever (an orchestrator restart looks like this, then `unauthorized`);
- `unauthorized`: the orchestrator no longer knows our secret (it restarted): register again;
- `version_too_old`: raise our minimum to its `min_policy_version`, wait for that version, drop the task;
- `lease_expired`: drop the rollouts (the prompts went to someone else); shrink leases if we were slow;
- `payload_too_large`: release the task and halve the prompts per lease;
- `rate_limited` / `too_many_leases`: wait as told;
- `banned`: stop, exit code 3. A bad join token: exit code 2.
- SIGTERM / SIGINT: stop leasing, finish and submit the current task, exit 0. A second signal aborts
  the current task, releases it explicitly and exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from inference_worker import client as c
from inference_worker.base_model import fetch_base_model
from inference_worker.config import WorkerConfig
from inference_worker.display import LiveDisplay, WorkerStats, credit_line
from inference_worker.engine_start import EngineStarter
from inference_worker.verdicts import Verdicts
from inference_worker.weights import WeightsKeeper
from protocol import staleness
from protocol.models import Heartbeat, RolloutSubmission, TaskLease, WorkerState
from protocol.retry import backoff_delays

log = logging.getLogger(__name__)

EXIT_OK, EXIT_REFUSED, EXIT_BANNED = 0, 2, 3


class Worker:
    def __init__(self, config: WorkerConfig, *, engine_factory: Callable | None = None,
        keeper: WeightsKeeper | None = None):
        self.config = config
        self.drain = threading.Event()  # stop leasing; finish or release the current task
        self._done = threading.Event()  # background threads stop
        self._reregister = threading.Event()
        self.exit_code = EXIT_OK
        self.stats = WorkerStats()
        kw = dict(timeout_s=config.request_timeout_s, backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s)
        self.client = c.OrchestratorClient(config.orchestrator_url, retries=config.retries, **kw)
        self.beat_client = c.OrchestratorClient(config.orchestrator_url, retries=0, **kw)
        self.work_dir = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="swarmrl-worker-"))
        self.keeper = keeper or WeightsKeeper(self.work_dir / "weights", backoff_max_s=min(10.0, config.backoff_max_s))
        self._engine_factory = engine_factory
        self.starter = EngineStarter(config, engine_factory)
        self.engine = None
        self.max_prompts = config.max_prompts_per_lease
        self.min_version = 0
        self.heartbeat_interval_s = 5.0
        self.verdicts = Verdicts(self.stats)
        self._run_model_checked = False  # asked the run for its base model files (without --model)
        self._lock = threading.Lock()
        self._delays = backoff_delays(config.backoff_initial_s, config.backoff_max_s)

    # ----------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.starter.start_early()
        self.keeper.start()
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        enabled = self.config.display and sys.stdout.isatty()
        try:
            with LiveDisplay(self.stats, enabled):
                while not self.drain.is_set():
                    if not self._ensure_registered() or not self._ensure_base_model() or not self._ensure_weights():
                        continue
                    self._task_once()
        finally:
            self._set_state(WorkerState.draining)
            self._done.set()
            beat.join(timeout=5)
            self.keeper.stop()
            self.verdicts.settle(self.client)
            self._leave()
            self.client.close()
            self.beat_client.close()
            self.starter.close()
            if self._engine_factory is None and self.engine is not None:
                self.engine.close()
        log.info("worker stopped: %d tasks submitted, %d accepted, %d rejected; credit of the join token: %s",
            self.stats.tasks_submitted, self.stats.accepted, self.stats.rejected, credit_line(self.stats.credit))
        return self.exit_code

    def stop(self, code: int | None = None) -> None:
        if code is not None:
            self.exit_code = code
        self.drain.set()

    def _set_state(self, state: WorkerState) -> None:
        self.stats.state = state

    def _backoff(self) -> None:
        self.drain.wait(next(self._delays))

    # ----------------------------------------------------------------------------------------------
    # Registration and heartbeats

    def _ensure_registered(self) -> bool:
        if self.client.secret is not None and not self._reregister.is_set():
            return True
        try:
            reg = self.client.register(self.config.join_token.get_secret_value(), self.config.name, device=_device())
        except c.Banned as e:
            log.error("registration refused: %s", e)
            self.stop(EXIT_BANNED)
            return False
        except (c.Unauthorized, c.Forbidden, c.InvalidRequest) as e:
            log.error("registration refused (check --join-token / --name): %s", e)
            self.stop(EXIT_REFUSED)
            return False
        except (c.OrchestratorUnavailable, c.OrchestratorError) as e:
            self.stats.event(f"orchestrator unreachable: {e}")
            log.warning("cannot register yet: %s", e)
            self._backoff()
            return False
        with self._lock:
            self.beat_client.secret, self.beat_client.worker_id = reg.secret, reg.worker_id
        self.verdicts.forget()
        self._reregister.clear()
        self._delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s)
        self.heartbeat_interval_s = reg.heartbeat_interval_s
        self.stats.worker_id = reg.worker_id
        self.stats.orchestrator_version = reg.policy_version
        self.min_version = staleness.min_policy_version(reg.policy_version, reg.async_level)
        self.keeper.set_sources(reg.relay_urls, reg.manifest_public_key, reg.run_id, reg.origin_url)
        self.keeper.observe(reg.policy_version, reg.policy_model_hash)
        self.stats.credit = reg.credit
        self.stats.event(f"registered as {reg.worker_id}")
        log.info("registered as %s (policy version %d, async level %d); credit of the join token so far: %s",
            reg.worker_id, reg.policy_version, reg.async_level, credit_line(reg.credit))
        return True

    def _ensure_base_model(self) -> bool:
        """Without --model: the run's config and tokenizer, fetched once (base_model.py)."""
        if self.starter.model or self._run_model_checked:
            return True
        try:
            folder = fetch_base_model(self.client, self.work_dir)
        except (c.OrchestratorUnavailable, c.OrchestratorError) as e:
            self.stats.event(f"base model files: {e}")
            log.warning("cannot fetch the run's base model files yet: %s", e)
            self._backoff()
            return False
        self._run_model_checked = True
        if folder is not None:
            self.starter.use_run_model(folder)
        return True

    def _leave(self) -> None:
        """The last heartbeat, `stopped`: the run revokes this identity's secret and counts it gone at once, so a
        restart with the same join token registers without waiting for it to time out."""
        if self.client.secret is None or self._reregister.is_set() or self.exit_code == EXIT_BANNED:
            return
        try:
            loaded = self.engine.policy_version if self.engine is not None else None
            self.client.heartbeat(Heartbeat(state=WorkerState.stopped, loaded_policy_version=loaded), retries=0)
        except (c.OrchestratorUnavailable, c.OrchestratorError) as e:
            log.info("could not tell the run that this worker left (%s): it counts as gone after a timeout", e)

    def _heartbeat_loop(self) -> None:
        while not self._done.wait(self.heartbeat_interval_s):
            if self.beat_client.secret is None or self._reregister.is_set():
                continue
            loaded = self.engine.policy_version if self.engine is not None else None
            try:
                ack = self.beat_client.heartbeat(Heartbeat(state=self.stats.state, loaded_policy_version=loaded,
                    tokens_per_s=min(self.stats.tokens_per_s, 1e9)))
            except c.Unauthorized:
                self._reregister.set()
                continue
            except c.Banned as e:
                log.error("banned: %s", e)
                self.stop(EXIT_BANNED)
                return
            except (c.OrchestratorUnavailable, c.OrchestratorError) as e:
                log.debug("heartbeat failed: %s", e)
                continue
            self.heartbeat_interval_s = ack.heartbeat_interval_s
            self.stats.orchestrator_version = ack.policy_version
            self.min_version = max(self.min_version, ack.min_policy_version)
            self.keeper.observe(ack.policy_version, ack.policy_model_hash)
            self.verdicts.poll(self.beat_client)

    # ----------------------------------------------------------------------------------------------
    # Weights

    def _ensure_weights(self) -> bool:
        loaded = self.engine.policy_version if self.engine is not None else None
        if loaded is None or loaded < self.min_version:
            self._set_state(WorkerState.downloading)
            self.stats.event(f"waiting for policy version >= {self.min_version}")
            pulled = self.keeper.wait_for(self.min_version, self.drain)
            if pulled is None:
                return False
        else:
            pulled = self.keeper.ready
            if pulled is None or pulled.version <= loaded:
                return True  # newest we have; the next version downloads in the background
        if self.engine is None:
            self._set_state(WorkerState.starting)
            self.engine = self.starter.engine_for(pulled.wait_written())
            # Starting the engine takes seconds; meanwhile the keeper may have pulled newer versions and
            # pruned this one (a worker restarted mid-run meets a stream of new versions): load the newest.
            pulled = self.keeper.ready or pulled
        if pulled.state is None or getattr(getattr(self.engine, "config", None), "multiprocess", True):
            pulled.wait_written()  # the engine reads the version folder
        took = self.engine.reload(pulled.path, pulled.version, pulled.manifest.model_hash, state=pulled.state)
        self.stats.loaded_version = pulled.version
        self.stats.event(f"loaded policy version {pulled.version} ({took:.2f} s)")
        return True

    # ----------------------------------------------------------------------------------------------
    # Tasks

    def _task_once(self) -> None:
        self._set_state(WorkerState.idle)
        try:
            resp = self.client.lease(self.engine.policy_version, self.max_prompts, self.config.lease_wait_s)
        except c.OrchestratorUnavailable as e:
            self.stats.reconnects += 1
            self.stats.event(f"orchestrator unreachable: {e}")
            self._backoff()
            return
        except c.OrchestratorError as e:
            self._on_error(e, None)
            return
        self._delays = backoff_delays(self.config.backoff_initial_s, self.config.backoff_max_s)
        if resp.lease is None:
            self.drain.wait(max(resp.retry_after_s, 0.05))
            return
        lease = resp.lease
        received = time.time()
        if self.drain.is_set():
            self._release(lease, "worker is shutting down")
            return
        if lease.min_policy_version > self.engine.policy_version:
            self.min_version = max(self.min_version, lease.min_policy_version)
            self._release(lease, f"loaded policy version {self.engine.policy_version} is below the lease's minimum")
            return
        self._generate_and_submit(lease, received)

    def _generate_and_submit(self, lease: TaskLease, received: float) -> None:
        from inference_worker.engine import LeaseNotGeneratable

        self._set_state(WorkerState.generating)
        version, model_hash = self.engine.policy_version, self.engine.model_hash
        try:
            completions = self.engine.generate(lease)
        except LeaseNotGeneratable as e:
            self._release(lease, str(e))
            return
        except BaseException:  # a second signal (KeyboardInterrupt) or an engine failure
            self._release(lease, "worker aborted the task")
            raise
        st = self.engine.last_stats
        self.stats.tokens_per_s = st.tokens_per_s
        self.stats.tokens_generated += st.tokens
        if time.time() > lease.deadline:
            self.stats.expired += 1
            self._shrink_if_slow(lease, received, st.seconds)
            self._release(lease, "generation finished after the lease deadline")
            return
        sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=version, model_hash=model_hash,
            completions=completions)
        self._submit(lease, sub, received, st.seconds)

    def _submit(self, lease: TaskLease, sub: RolloutSubmission, received: float, gen_seconds: float) -> None:
        while True:
            try:
                receipt = self.client.submit(sub)
            except c.Duplicate:
                self.stats.tasks_submitted += 1  # an earlier attempt got through; its answer was lost
                return
            except (c.OrchestratorUnavailable, c.RateLimited) as e:
                if time.time() < lease.deadline:
                    self.stats.event(f"submit failed, retrying: {e}")
                    time.sleep(next(self._delays))  # also while draining: this task is still to be finished
                    continue
                self.stats.expired += 1
                self.stats.event(f"gave up on {lease.lease_id}: deadline passed while the orchestrator was unreachable")
                return
            except c.LeaseExpired as e:
                self.stats.expired += 1
                self.stats.event(f"{lease.lease_id} expired: {e.body.detail}")
                log.warning("lease %s expired before submission: %s", lease.lease_id, e)
                self._shrink_if_slow(lease, received, gen_seconds)
                return
            except c.OrchestratorError as e:
                self._on_error(e, lease)
                return
            self.stats.tasks_submitted += 1
            self.verdicts.submitted(receipt.submission_id)
            self.stats.event(f"submitted {lease.lease_id} ({sub.num_tokens} tokens)")
            return

    def _on_error(self, e: c.OrchestratorError, lease: TaskLease | None) -> None:
        """A refusal of a lease request or a submission."""
        self.stats.event(str(e))
        if isinstance(e, c.Unauthorized):
            log.warning("orchestrator does not know us any more (%s); registering again", e.body.detail)
            self.stats.reconnects += 1
            self._reregister.set()  # the lease belonged to the old identity: nothing to release
            return
        if isinstance(e, c.Banned):
            log.error("banned: %s", e)
            self.stop(EXIT_BANNED)
            return
        if isinstance(e, c.VersionTooOld):
            new_min = e.min_policy_version if e.min_policy_version is not None else (self.engine.policy_version
                or 0) + 1
            log.info("policy version too old; moving to >= %d", new_min)
            self.min_version = max(self.min_version, new_min)
            self.keeper.observe(self.min_version)
        elif isinstance(e, c.PayloadTooLarge):
            self.max_prompts = max(1, self.max_prompts // 2)
            log.warning("submission too large; prompts per lease now %d", self.max_prompts)
        elif isinstance(e, (c.RateLimited, c.TooManyLeases)):
            wait = e.body.retry_after_s or next(self._delays)
            self.drain.wait(min(wait, self.config.backoff_max_s))
        else:  # invalid_request, lease_mismatch, forbidden, not_found: a bug on one side; log it loudly
            log.error("orchestrator refused: %s", e)
            if lease is not None:
                self.stats.rejected += 1
            self._backoff()
        if lease is not None:
            self._release(lease, f"{e.code.value}: {e.body.detail}")

    def _shrink_if_slow(self, lease: TaskLease, received: float, gen_seconds: float) -> None:
        if gen_seconds > 0.8 * max(lease.deadline - received, 0.0) and self.max_prompts > 1:
            self.max_prompts = max(1, self.max_prompts // 2)
            log.warning("leases take us too long; prompts per lease now %d", self.max_prompts)

    def _release(self, lease: TaskLease, reason: str) -> None:
        try:
            self.client.release(lease.lease_id, reason)
        except (c.OrchestratorUnavailable, c.OrchestratorError) as e:
            log.info("could not release %s: %s", lease.lease_id, e)
            return
        self.stats.released += 1
        self.stats.event(f"released {lease.lease_id}: {reason}")


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)}"[:64]
    except Exception:
        pass
    return "cpu"


def run_worker(config: WorkerConfig, **kwargs) -> int:
    """Run the loop until SIGTERM / SIGINT (drain), a ban or a refused registration; returns the exit code."""
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    worker = Worker(config, **kwargs)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        def on_signal(signum, frame):
            if worker.drain.is_set():
                raise KeyboardInterrupt  # second signal: abort the task (it is released), exit
            log.info("signal %d: finishing the current task, then stopping", signum)
            worker.stats.event("draining: no new tasks")
            worker.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        return worker.run()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
