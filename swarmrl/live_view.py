"""The live view of `swarmrl run`: step, version, reward, throughput, acceptance, staleness, workers."""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def render(run: Any) -> Table:
    p = run.progress
    st = p.status
    table = Table(title=f"swarmrl · {run.cfg.name}", show_header=False, expand=False, min_width=56)
    table.add_column(style="bold cyan")
    table.add_column()
    elapsed = time.time() - p.started
    table.add_row("step / max", f"{p.step} / {run.cfg.trainer.max_steps}  ({elapsed / 60:.1f} min)")
    table.add_row("policy version", str(p.version))
    table.add_row("mean reward", "—" if p.reward is None else f"{p.reward:.3f}")
    if st is not None:
        table.add_row("rollout tokens/s", f"{st.rollout_tokens_per_s:,.0f}")
        table.add_row("trained samples/s", f"{st.trained_samples_per_s:.2f}")
        table.add_row("acceptance",
            f"{st.acceptance_rate:.1%}  ({st.submissions_accepted} ok / {st.submissions_rejected} rejected)")
        table.add_row("staleness (gap: samples)", ", ".join(f"{k}: {v}" for k,
            v in sorted(st.staleness_histogram.items())) or "—")
        table.add_row("buffer",
            f"{st.buffer_depth} samples; {st.groups_dropped_zero_signal} zero-signal groups dropped")
        if st.reward_failures:
            table.add_row("rewards not computed", reward_failures_line(st))
        table.add_row("workers online", str(st.workers_online))
        table.add_row("verifiers", verifiers_line(st))
        if st.eval_latest is not None or st.evals_open:
            table.add_row("eval (held out)", (eval_line(st.eval_latest) if st.eval_latest
                else "—") + f"; {st.evals_open} open")
        if st.restarts:  # over the whole run, driver restarts included
            table.add_row("restarts (time lost)", restarts_line(st.restarts))
    last = p.last_metrics
    for key in ("time/wait_for_rollouts", "time/wait_for_trainer", "time/train"):
        if key in last:
            table.add_row(key, f"{last[key]:.2f} s")
    table.add_row("api", run.url or "starting…")
    for event in p.events[-3:]:
        table.add_row("event", event)
    return table


def eval_line(r: Any) -> str:
    """The newest evaluation on held-out prompts, for the summary and the live view."""
    passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in r.pass_at.items())
    avg = "—" if r.avg_reward is None else f"{r.avg_reward:.3f}"
    tokens = "—" if r.mean_completion_tokens is None else f"{r.mean_completion_tokens:.1f}"
    partial = "" if r.complete else f" (partial: {r.prompts}/{r.prompts_planned} prompts)"
    return f"eval of version {r.policy_version}: avg@{r.samples_per_prompt} {avg}, {passes}, {tokens} tokens{partial}"


def verifiers_line(st: Any) -> str:
    """The pool, its queue and its throughput: a queue that grows while in/s > verified/s is the bottleneck."""
    return (f"{st.verifier_actors} live, {st.verifier_actors_pending} pending; queue {st.verify_queue} "
            f"({st.verify_in_per_s:.2f}/s in, {st.verify_out_per_s:.2f}/s verified, {st.verify_tokens_per_s:,.0f} "
            f"tok/s)")


def reward_failures_line(st: Any) -> str:
    """Rewards that timed out, crashed or were skipped (never a strike), and the groups dropped for them."""
    per_reward = "; ".join(f"{name}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
                           for name, kinds in sorted(st.reward_failures.items()))
    return f"{per_reward or 'none'}; {st.groups_dropped_unscored} groups dropped"


def restarts_line(restarts: dict[str, Any]) -> str:
    return ", ".join(f"{name} {r.count} ({r.seconds_lost:.0f} s)" for name, r in sorted(restarts.items()))


class LiveView:
    """Refreshes the table from a thread; off when stdout is not a terminal (logs only)."""

    def __init__(self, run: Any, enabled: bool, refresh_s: float = 1.0):
        self.run = run
        self.enabled = enabled
        self.refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None

    def start(self) -> "LiveView":
        if self.enabled:
            self._live = Live(render(self.run), console=Console(), refresh_per_second=2, transient=False)
            self._live.start()
            self._thread = threading.Thread(target=self._loop, daemon=True, name="progress")
            self._thread.start()
        return self

    def _loop(self) -> None:
        import ray

        while not self._stop.wait(self.refresh_s):
            try:
                self.run.progress.status = ray.get(self.run.orch.status.remote(), timeout=5)
            except Exception:
                pass
            if self._live is not None:
                self._live.update(render(self.run))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._live is not None:
            self._live.update(render(self.run))
            self._live.stop()
