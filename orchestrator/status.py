"""Status and metrics: /v1/status (`run_status`), the Prometheus metrics of one orchestrator, the rates over
the last minute that /v1/status and the dashboard show, the dashboard's history, and the time workers
waited for the trainer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator import reward_failures
from orchestrator.release_costs import RELEASED_CHARGED, RELEASED_FREE
from protocol.operator_models import RestartCount, RunStatus

WINDOW_S = 60.0  # throughput and acceptance are reported over this window
HISTORY_EVERY_S = 2.0
HISTORY_POINTS = 1800


class Metrics:
    """Prometheus metrics of one orchestrator (own registry, so several can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_refused = Counter("swarmrl_requests_refused", "Requests refused, by error code", ["code"],
            registry=r)
        self.submissions = Counter("swarmrl_submissions", "Submissions queued for verification", registry=r)
        self.verdicts = Counter("swarmrl_verdicts", "Verdicts, by status", ["status"], registry=r)
        self.rejections = Counter("swarmrl_rejections", "Rejection reasons", ["code"], registry=r)
        self.leases_issued = Counter("swarmrl_leases_issued", "Leases issued", registry=r)
        self.leases_refused_async_bound = Counter(
            "swarmrl_leases_refused_async_bound",
            "Lease requests refused because generation is async_level versions ahead of the trainer (high: the "
            "trainer is the bottleneck)",
            registry=r,
        )
        self.leases_refused_budget = Counter(
            "swarmrl_leases_refused_budget",
            "Lease requests refused because the worker's join token holds its share of the generation budget or is "
            "cooling down",
            registry=r,
        )
        self.leases_expired = Counter("swarmrl_leases_expired", "Leases expired", registry=r)
        # No per-token label (tokens may be many): /v1/workers has each worker's counts and token ratio.
        self.leases_released = Counter(
            "swarmrl_leases_released",
            "Leases given back unsubmitted; charged: after their free window (they could have been generated and "
            "scored)", ["charged"], registry=r,
        )
        for charged in ("true", "false"):
            self.leases_released.labels(charged)
        self.groups_dropped = Counter("swarmrl_groups_dropped_zero_signal", "Groups dropped for zero signal",
            registry=r)
        # orchestrator/reward_failures.py: never a strike; the completion's group is dropped, not trained
        self.reward_failures = Counter(
            "swarmrl_reward_failures",
            "Completions whose trusted reward could not be computed, by reward and kind "
            "(error, timed_out, crashed, skipped)",
            ["reward", "kind"], registry=r,
        )
        self.groups_dropped_unscored = Counter(
            "swarmrl_groups_dropped_unscored", "Groups dropped because a completion's reward could not be computed",
            registry=r
        )
        self.verified_tokens = Counter("swarmrl_verified_tokens", "Tokens in accepted submissions", registry=r)
        self.near_tie_tokens = Counter(
            "swarmrl_near_tie_tokens",
            "Accepted tokens that were not the seed's draw on the verifier's logits, within the near-tie margin",
            registry=r
        )
        self.draw_margin = Histogram(
            "swarmrl_draw_margin_logits",
            "Largest near-tie margin of an accepted submission that had near ties (logits)", buckets=(1e-6, 1e-5, 1e-4,
            1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0), registry=r,
        )
        self.bans = Counter("swarmrl_bans", "Workers banned for strikes", registry=r)
        self.buffer_depth = Gauge("swarmrl_buffer_depth", "Verified samples waiting for the trainer", registry=r)
        self.policy_version = Gauge("swarmrl_policy_version", "Current policy version", registry=r)
        self.workers_online = Gauge("swarmrl_workers_online", "Workers seen recently", registry=r)
        self.verify_queue = Gauge("swarmrl_verify_queue", "Submissions waiting for verification", registry=r)
        self.verifier_actors = Gauge(
            "swarmrl_verifier_actors",
            "Verifier actors: live (verifying) and pending (requested, waiting for a place; on KubeRay a node)",
            ["state"], registry=r
        )
        self.verify_rate = Gauge(
            "swarmrl_verify_rate_per_s",
            "Over the last minute: submissions queued (in), verdicts (out) and the tokens of those verdicts (tokens) "
            "per second; "
            "in above out means the verifier pool is the bottleneck", ["what"], registry=r,
        )
        self.verify_seconds = Histogram("swarmrl_verify_seconds", "Wall time of one verify_many call", registry=r)
        # The newest finished evaluation on held-out prompts (orchestrator/evaluation.py).
        self.eval_version = Gauge("swarmrl_eval_policy_version", "Policy version of the newest finished evaluation",
            registry=r)
        self.eval_avg_reward = Gauge("swarmrl_eval_avg_reward", "avg@k: mean trusted reward of the held-out samples",
            registry=r)
        self.eval_pass_at = Gauge("swarmrl_eval_pass_at_k", "pass@k on the held-out prompts (unbiased estimator)",
            ["k"], registry=r)
        self.eval_completion_tokens = Gauge("swarmrl_eval_completion_tokens",
            "Mean completion length of the held-out samples (tokens)", registry=r)
        self.task_level = Gauge("swarmrl_task_level", "Difficulty level new prompts are made at (a task with levels)",
                                registry=r)

    def observe_eval(self, result: Any) -> None:
        """A finished evaluation (protocol.operator_models.EvalResult); versions finish in order, mostly: keep the
        newest."""
        if result.policy_version < getattr(self, "_eval_newest", -1):
            return
        self._eval_newest = result.policy_version
        self.eval_version.set(result.policy_version)
        self.eval_avg_reward.set(result.avg_reward if result.avg_reward is not None else float("nan"))
        for k, v in result.pass_at.items():
            self.eval_pass_at.labels(k).set(v)
        self.eval_completion_tokens.set(result.mean_completion_tokens if result.mean_completion_tokens is not None
            else float("nan"))


class RunWindows:
    """Events of the last WINDOW_S seconds (accepted and rejected submissions, trained samples), the
    dashboard's history, and the time lease requests were refused by the async bound."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._accepted: deque[tuple[float, int, float, int]] = deque()  # (t, tokens, reward sum, completions)
        self._rejected: deque[float] = deque()
        self._verdicts: deque[tuple[float, int]] = deque()  # (t, tokens of the submission), accepted or not
        self._arrivals: deque[float] = deque()  # submissions queued for verification
        self._trained: deque[tuple[float, int]] = deque()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._bound_since: float | None = None
        self._bound_total = 0.0

    def accepted(self, tokens: int, reward_sum: float, completions: int) -> None:
        with self._lock:
            self._accepted.append((time.time(), tokens, reward_sum, completions))

    def rejected(self) -> None:
        with self._lock:
            self._rejected.append(time.time())

    def verified(self, tokens: int) -> None:
        with self._lock:
            self._verdicts.append((time.time(), tokens))

    def arrived(self) -> None:
        with self._lock:
            self._arrivals.append(time.time())

    def trained(self, samples: int) -> None:
        with self._lock:
            self._trained.append((time.time(), samples))

    def bound_reached(self, now: float) -> None:
        with self._lock:
            if self._bound_since is None:
                self._bound_since = now

    def bound_cleared(self, now: float) -> None:
        with self._lock:
            if self._bound_since is not None:
                self._bound_total += now - self._bound_since
                self._bound_since = None

    def wait_for_trainer_s(self, now: float) -> float:
        """Seconds lease requests were refused because generation was async_level steps ahead: high
        means the trainer is the bottleneck."""
        with self._lock:
            return self._bound_total + (now - self._bound_since if self._bound_since is not None else 0.0)

    def rates(self, now: float) -> dict[str, Any]:
        """Rates over the last WINDOW_S seconds (or since start, if shorter)."""
        span = max(1e-3, min(WINDOW_S, now - self.started_at))
        with self._lock:
            for dq in (self._accepted, self._rejected, self._trained, self._verdicts, self._arrivals):
                while dq and now - (dq[0] if isinstance(dq[0], float) else dq[0][0]) > WINDOW_S:
                    dq.popleft()
            tokens = sum(e[1] for e in self._accepted)
            reward_sum = sum(e[2] for e in self._accepted)
            completions = sum(e[3] for e in self._accepted)
            n_acc, n_rej = len(self._accepted), len(self._rejected)
            trained = sum(e[1] for e in self._trained)
            verdicts, verdict_tokens = len(self._verdicts), sum(e[1] for e in self._verdicts)
            arrivals = len(self._arrivals)
        return {
            "rollout_tokens_per_s": tokens / span,
            "trained_samples_per_s": trained / span,
            "submissions_per_s": (n_acc + n_rej) / span,
            "verify_in_per_s": arrivals / span,
            "verify_out_per_s": verdicts / span,
            "verify_tokens_per_s": verdict_tokens / span,
            "acceptance": n_acc / (n_acc + n_rej) if n_acc + n_rej else None,
            "mean_reward": reward_sum / completions if completions else None,
        }


def run_status(o: Any) -> RunStatus:
    """/v1/status of an orchestrator (orchestrator/service.py): its counters, rates and concepts."""
    now = time.time()
    c = o.db.counters()
    accepted, rejected = int(c.get("submissions_accepted", 0)), int(c.get("submissions_rejected", 0))
    rates = o.windows.rates(now)
    return RunStatus(
        run_name=o.run_name,
        step=int(c.get("step", 0)),
        policy_version=o.versions.current,
        async_level=o.cfg.async_level,
        buffer_depth=o.buffer.depth(),
        workers_online=o.workers.count_online(now),
        acceptance_rate=accepted / (accepted + rejected) if accepted + rejected else 0.0,
        submissions_accepted=accepted,
        submissions_rejected=rejected,
        groups_dropped_zero_signal=int(c.get("groups_dropped_zero_signal", 0)),
        groups_dropped_unscored=int(c.get("groups_dropped_unscored", 0)),
        reward_failures=reward_failures.from_counters(c),
        samples_dropped_stale=int(c.get("samples_dropped_stale", 0)),
        verified_tokens=int(c.get("verified_tokens", 0)),
        near_tie_tokens=int(c.get("near_tie_tokens", 0)),
        rollout_tokens_per_s=rates["rollout_tokens_per_s"],
        trained_samples_per_s=rates["trained_samples_per_s"],
        mean_reward=rates["mean_reward"],
        wait_for_trainer_s=o.windows.wait_for_trainer_s(now),
        verify_queue=o.verification.backlog(),
        verify_in_per_s=rates["verify_in_per_s"],
        verify_out_per_s=rates["verify_out_per_s"],
        verify_tokens_per_s=rates["verify_tokens_per_s"],
        verifier_actors=o.verifier_actors[0],
        verifier_actors_pending=o.verifier_actors[1],
        staleness_histogram=o.buffer.staleness_histogram(),
        restarts=restarts(c),
        finished=o.finished,
        error=o.error,
        eval_latest=o.evals.latest(),
        evals_open=o.evals.open_rounds(),
        releases_free=int(c.get(RELEASED_FREE, 0)),
        releases_charged=int(c.get(RELEASED_CHARGED, 0)),
        max_token_release_ratio=o.leases.costs.highest_ratio(),
        curriculum=o.prompts.curriculum_state(),
    )


def restarts(counters: dict[str, float]) -> dict[str, RestartCount]:
    names = [k.split(":", 1)[1] for k in counters if k.startswith("restarts:")]
    return {n: RestartCount(count=int(counters[f"restarts:{n}"]), seconds_lost=round(counters.get(f"restart_s:{n}",
        0.0), 3)) for n in sorted(names)}


def record_history(metrics: Metrics, windows: RunWindows, st: RunStatus, now: float) -> None:
    """Each housekeeping pass: the gauges of /metrics, and a point of the dashboard's history."""
    rates = windows.rates(now)
    metrics.buffer_depth.set(st.buffer_depth)
    metrics.workers_online.set(st.workers_online)
    metrics.policy_version.set(st.policy_version)
    metrics.verify_queue.set(st.verify_queue)
    for what, key in (("in", "verify_in_per_s"), ("out", "verify_out_per_s"), ("tokens", "verify_tokens_per_s")):
        metrics.verify_rate.labels(what).set(rates[key])
    if st.curriculum is not None:
        metrics.task_level.set(st.curriculum.level)
    windows.history.append(
        {
            "t": now,
            "step": st.step,
            "policy_version": st.policy_version,
            "mean_reward": rates["mean_reward"],
            "rollout_tokens_per_s": rates["rollout_tokens_per_s"],
            "submissions_per_s": rates["submissions_per_s"],
            "acceptance": rates["acceptance"],
            "workers_online": st.workers_online,
            "buffer_depth": st.buffer_depth,
            "verify_queue": st.verify_queue,
            "verifier_actors": st.verifier_actors,
            "task_level": st.curriculum.level if st.curriculum is not None else None,
        }
    )
