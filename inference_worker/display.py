"""What the worker is doing, as numbers (`WorkerStats`) and as a rich live panel on a terminal."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from protocol.models import Credit, WorkerState


@dataclass
class WorkerStats:
    state: WorkerState = WorkerState.starting
    worker_id: str | None = None
    loaded_version: int | None = None
    orchestrator_version: int | None = None
    tokens_per_s: float = 0.0  # of the last task
    tokens_generated: int = 0
    tasks_submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    expired: int = 0
    released: int = 0
    reconnects: int = 0
    credit: Credit = field(default_factory=Credit)  # the join token's, over the run (from registration on)
    last_event: str = ""
    started_at: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def event(self, text: str) -> None:
        with self.lock:
            self.last_event = f"{time.strftime('%H:%M:%S')} {text}"

    def render(self):
        from rich.table import Table

        t = Table(title="swarmrl worker", show_header=False, min_width=48)
        t.add_column(style="bold")
        t.add_column()
        rows = [
            ("state", self.state.value),
            ("worker", self.worker_id or "-"),
            ("policy version", f"{self._v(self.loaded_version)} loaded / {self._v(self.orchestrator_version)} current"),
            ("tokens/s", f"{self.tokens_per_s:,.0f}"),
            ("tokens generated", f"{self.tokens_generated:,}"),
            ("tasks submitted", str(self.tasks_submitted)),
            ("accepted / rejected", f"[green]{self.accepted}[/] / [red]{self.rejected}[/]"),
            ("expired / released", f"{self.expired} / {self.released}"),
            ("credit (join token)", credit_line(self.credit)),
            ("uptime", f"{time.time() - self.started_at:,.0f} s"),
            ("last", self.last_event or "-"),
        ]
        for k, v in rows:
            t.add_row(k, v)
        return t

    @staticmethod
    def _v(v: int | None) -> str:
        return "-" if v is None else str(v)


def credit_line(credit: Credit) -> str:
    return f"{credit.accepted:,} accepted, {credit.rejected:,} rejected, {credit.verified_tokens:,} verified tokens"


class LiveDisplay:
    """A rich Live panel refreshed twice a second; does nothing when disabled (tests, no TTY)."""

    def __init__(self, stats: WorkerStats, enabled: bool):
        self.stats = stats
        self.enabled = enabled
        self._live = None

    def __enter__(self) -> "LiveDisplay":
        if self.enabled:
            from rich.live import Live

            self._live = Live(get_renderable=self.stats.render, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
