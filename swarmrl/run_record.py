"""What the driver writes about a run: one metrics.jsonl record per durable step, one eval.jsonl record per
evaluated version, the reward the run may stop on, the start-up phases, and summary.md at the end.

The driver (driver.Run) starts and watches the components; this module only records what they report. Its
questions to the orchestrator go through `ask`, which answers a default while the orchestrator restarts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from swarmrl.config import RunConfig
from swarmrl.memory_peaks import MemoryPeaks
from swarmrl.run_dir import RunDir
from swarmrl.tracking import JsonlTracker, Trackers

log = logging.getLogger(__name__)

Ask = Callable[..., Any]  # ask(method, default, *args): the orchestrator's answer, or default


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
    restarts: dict[str, tuple[int, float]] = field(default_factory=dict)  # component -> (restarts, seconds lost)
    session_first_step: int = 0  # the steps metrics.jsonl had when this session started (a resumed run)
    recorded_version: int = 0  # the newest version in metrics.jsonl: a restarted trainer may report a step again
    recorded_eval_version: int = -1  # the newest evaluated version in eval.jsonl
    last_eval: Any = None  # the newest protocol.operator_models.EvalResult
    startup: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in the order they ended
    first_step_s: float | None = None  # launch -> first durable step of this session


class StartupClock:
    """Seconds per start-up phase, logged as each ends, so a slow start says where its time went."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self._last = progress.started

    def done(self, phase: str) -> None:
        now = time.time()
        self.progress.startup[phase] = round(now - self._last, 2)
        self._last = now
        log.info("start-up phase", extra={"phase": phase, "seconds": self.progress.startup[phase],
                                          "since_launch_s": round(now - self.progress.started, 2)})


def _ignore(_method: str, default: Any, *_args: Any) -> Any:
    return default


class RunRecord:
    def __init__(self, cfg: RunConfig, rd: RunDir, ask: Ask = _ignore):
        self.cfg, self.rd, self.ask = cfg, rd, ask
        self.progress = Progress()
        self.tracker: Trackers = Trackers([JsonlTracker(rd)])  # the configured backends join in Run.start
        self.clock = StartupClock(self.progress)

    def resume(self) -> None:
        """Carry on from the run folder's records: a resumed run's steps count on from the last one (trackers
        want a step that only grows), and versions and evaluations already recorded are not recorded again."""
        p, rows = self.progress, list(self.rd.read_metrics())
        p.step = p.session_first_step = max((int(r.get("step", 0)) for r in rows), default=0)
        p.recorded_version = max((int(r.get("version", 0)) for r in rows), default=0)
        p.recorded_eval_version = max((int(r.get("policy_version", -1)) for r in self.rd.read_evals()), default=-1)

    def step(self, metrics: dict[str, Any], gaps: dict[int, int]) -> None:
        """A step the trainer made durable: one metrics.jsonl record (and the configured trackers)."""
        p = self.progress
        if int(metrics["version"]) <= p.recorded_version:
            return  # reported before the trainer (or this driver) restarted
        if p.first_step_s is None:
            p.first_step_s = round(time.time() - p.started, 2)
            log.info("first trained step", extra={"since_launch_s": p.first_step_s})
        p.step += 1
        p.version = p.recorded_version = int(metrics["version"])
        self.update_reward(min_completions=1)
        p.status = self.ask("status", p.status)  # for display only
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
            # A restarted orchestrator counts from 0 again: then all it counted is new.
            waited = st.wait_for_trainer_s - p.wait_for_trainer_total
            record["time/wait_for_trainer"] = waited if waited >= 0 else st.wait_for_trainer_s
            p.wait_for_trainer_total = st.wait_for_trainer_s
            record.update(
                rollout_tokens_per_s=st.rollout_tokens_per_s,
                trained_samples_per_s=st.trained_samples_per_s,
                acceptance_rate=st.acceptance_rate,
                workers_online=st.workers_online,
                buffer_depth=st.buffer_depth,
                groups_dropped_zero_signal=st.groups_dropped_zero_signal,
                groups_dropped_unscored=st.groups_dropped_unscored,
            )
            if st.curriculum is not None:  # a task with difficulty levels (docs/tasks.md)
                record["task_level"] = st.curriculum.level
                if st.curriculum.pass_rate is not None:
                    record["task_pass_rate"] = st.curriculum.pass_rate
        p.last_metrics = record
        self.tracker.log(p.step, record)
        self.evals()
        reward = None if p.reward is None else round(p.reward, 3)
        log.info("step", extra={"step": p.step, "version": p.version, "reward": reward})

    def evals(self) -> None:
        """Evaluations on held-out prompts finished since the last call, one eval.jsonl record per version."""
        p = self.progress
        if not self.cfg.eval.every_steps:
            return
        for r in self.ask("eval_results", [], p.recorded_eval_version):  # [] while the orchestrator restarts
            self.rd.append_eval({"time": round(time.time(), 3), "step": p.step, **r.model_dump()})
            p.recorded_eval_version, p.last_eval = r.policy_version, r
            log.info("evaluation", extra={"policy_version": r.policy_version, "avg_reward": r.avg_reward,
                                          "pass_at": r.pass_at})

    def update_reward(self, min_completions: int) -> None:
        """The mean reward of every rollout accepted since the last update, zero-signal groups included
        (the trained samples alone leave out the groups that are all wrong or all right)."""
        p = self.progress
        reward_sum, completions = self.ask("reward_totals", p.reward_totals)
        if completions - p.reward_totals[1] >= min_completions:
            p.reward = (reward_sum - p.reward_totals[0]) / (completions - p.reward_totals[1])
            p.rewards.append(p.reward)
            p.reward_totals = (reward_sum, completions)

    def reward_reached(self) -> bool:
        cfg, p = self.cfg, self.progress
        if cfg.stop_reward is not None and len(p.rewards) == p.rewards.maxlen and min(p.rewards) >= cfg.stop_reward:
            p.events.append(f"reward >= {cfg.stop_reward} for {p.rewards.maxlen} steps")
            return True
        return False

    def summary(self, memory: MemoryPeaks) -> None:
        """summary.md, reward.png and memory.json: what an operator reads after the run."""
        from swarmrl.live_view import eval_line, reward_failures_line

        p, st = self.progress, self.progress.status
        self.rd.plot()
        rows = [r for r in self.rd.read_metrics() if r.get("reward_mean") is not None]
        first = rows[0]["reward_mean"] if rows else None
        last = None if p.reward is None else round(p.reward, 3)
        lines = [
            f"# Run `{self.cfg.name}`",
            "",
            f"- optimizer steps this session: {p.step - p.session_first_step} (run: {p.step}); policy version: "
            f"{p.version}",
            f"- wall time: {(time.time() - p.started) / 60:.1f} min",
            f"- start-up, seconds per phase: {p.startup}; first trained step {p.first_step_s} s after launch",
            f"- mean reward: first step {first if first is None else round(first, 3)}, last {last}",
        ]
        if st is not None:
            lines += [
                f"- acceptance rate: {st.acceptance_rate:.3f}",
                f"- submissions accepted / rejected: {st.submissions_accepted} / {st.submissions_rejected}",
                f"- groups dropped for zero signal: {st.groups_dropped_zero_signal}",
                f"- rewards not computed (no strike; their groups dropped): {reward_failures_line(st)}",
                f"- tokens accepted as near ties of the seeded draw: {st.near_tie_tokens} of {st.verified_tokens}",
                f"- staleness histogram (version gap: samples): {st.staleness_histogram}",
            ]
        else:
            lines.append("- acceptance rate: n/a")
        if p.last_eval is not None:
            lines.append(f"- {eval_line(p.last_eval)}")
        lines += [
            f"- async_level: {self.cfg.orchestrator.async_level}, workers: {self.cfg.num_workers}",
            *(f"- restarts of {name} this session: {n} ({lost:.1f} s lost)" for name, (n, lost) in sorted(
                p.restarts.items())),
            *memory.summary_lines(),
            *(f"- event: {e}" for e in p.events),
            "",
            "Files: config.toml, metrics.jsonl, eval.jsonl (with eval.every_steps), reward.png, memory.json, "
            "checkpoints/, logs/.",
        ]
        self.rd.write_summary(lines)
        self.rd.write_json(self.rd.root / "memory.json", memory.report())
