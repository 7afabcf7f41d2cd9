"""The reward pool's child processes as the parent holds them (verifier.reward_pool starts them; they run
verifier.reward_child): the handle of a child with the chunk it is working on, how a child is killed
with everything it started, and how its end reads in a log line."""

from __future__ import annotations

import os
import signal
from typing import Any

from verifier.reward_child import LOADING


class ChildProcess:
    """One child and what it is doing: `chunk` holds request indices, `done` how many have results."""

    def __init__(self, proc: Any, conn: Any, progress: Any, ready_by: float):
        self.proc, self.conn, self.progress, self.pid = proc, conn, progress, proc.pid
        self.ready = False
        self.ready_by = ready_by
        self.chunk: list[int] = []
        self.done = 0
        self.sent_at = 0.0
        self.lifeline: Any = None

    def running_since(self) -> float:
        """When the completion now running started (the chunk's send time until the child says otherwise)."""
        return max(self.sent_at, self.progress[0])

    def loading(self) -> bool:
        """Whether the child is loading a task for its chunk (verifier.reward_child.LOADING)."""
        return self.progress[1] == LOADING

    def deadline(self, time_limit_s: float, load_limit_s: float) -> float:
        """When the chunk's work now running must end: a completion's limit, or a task's load limit. The index is
        read first: the child writes a load's end time before the index that follows it (reward_child)."""
        limit = load_limit_s if self.loading() else time_limit_s
        return self.running_since() + limit


def kill_child(proc: Any) -> None:
    """SIGKILL a child and its process group (anything a plug-in started), and reap it."""
    if proc.exitcode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # not yet its own group leader, or already gone
        proc.kill()
    proc.join(5)


def kill_all(live: list) -> None:
    for proc, lifeline in list(live):
        kill_child(proc)
        lifeline.close()
    live.clear()


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
