"""Rewards computed in a pool of long-lived worker processes, with a hard time limit per completion.

A completion's text comes from an untrusted worker, and some texts make honest reward code run for
minutes (`\\boxed{9^{9^{9^{9}}}}` in math-verify) or exhaust memory. So no reward runs in the verifier's
process: `RewardPool.score_many` sends completions to child processes (`verifier.reward_child`) and
returns one `RewardResult` (verifier.reward_requests) per completion, always, whatever the reward code does:

  ok         the reward, a float in [0, 1] (a finite float for a plug-in in TRL's form, verifier/trl_rewards.py)
  error      the reward raised, or returned NaN / inf / a value outside [0, 1] / not a number (a TRL reward: None,
             kind "none"), or the task could not be loaded: reward 0, and the message says which (logged
             once per task and kind); RewardResult.kind says which
  timed_out  it ran past `time_limit_s` (wall) or `cpu_limit_s` (CPU): its process was SIGKILLed and
             replaced; reward 0
  crashed    its process died while scoring it (segfault, os._exit, OOM killer): replaced; reward 0
  skipped    not scored because its group (submission) already had `group_failure_budget` timeouts or
             crashes: reward 0. One submission cannot make the pool spend more than budget x limit on it.

The last three are not scores: a verified completion's text is the policy's draw, not the worker's choice,
and third-party scorers hang or crash on some of it. The orchestrator counts them per reward and kind,
drops the completion's GRPO group (never trained with the 0) and charges nobody (orchestrator/reward_failures.py).

The same pool runs multi-turn environments' tools on the trusted side (a request with returns="text",
environments.registry.tool_output): the call text comes from an untrusted worker just like a completion's,
so the tool gets the same limits and statuses, and its output string comes back in RewardResult.output.

Batching and the per-completion limit: completions go to an idle child in chunks (one IPC message), and
results come back in one message per chunk (or per 10 ms of work). Before each completion the child
writes its index and start time (time.monotonic(), one clock for all processes on Linux) into a small
shared array, so the parent's deadline is per completion: that start + time_limit_s. On a deadline the
parent SIGKILLs the child's process group, reads the results the child sent before it died (the socket
keeps them) and the index it was running: that completion timed out; completions after it, and any that
finished but whose results died with the child (< 10 ms of work), go back to the front of the queue,
unblamed. A child that dies on its own is handled the same way, with status crashed. Loading a task the child
has not seen (importing a plug-in's module) is not charged to a completion: it gets start_timeout_s.

`warm` scores one request once in every process: the run's start-up check (verifier/reward_preflight.py).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import signal
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Mapping, Sequence

from environments.registry import REWARD_ENTRY, TOOL_ENTRY
from environments.tasks import TASKS
from verifier.reward_child import child_main, params_key
from verifier.reward_config import RewardPoolConfig
from verifier.reward_processes import ChildProcess, exit_text, kill_all, kill_child
from verifier.reward_requests import RewardRequest, RewardResult, RewardStatus, req_kind

log = logging.getLogger(__name__)

__all__ = ["RewardPool", "RewardPoolConfig", "RewardPoolError"]

# Imported once in the forkserver, so a replacement child (after a kill) does not import math-verify /
# sympy again (~0.7 s of CPU each time). "__main__" is the standard library's default, kept.
FORKSERVER_PRELOAD = ["__main__", "verifier.reward_child", "math_verify"]
# Chunks are sized so that honest completions of one chunk take about this long. Each chunk costs a round
# trip that waits for both processes to be scheduled: on the loaded 2-core VM, math's time outside the
# reward calls was 79-205 us per completion at 5 ms, 41-117 us at 20 ms, no better at 50 ms or 32 per
# chunk. Larger chunks cost little otherwise: completions queued behind a hung one in its chunk are
# requeued when it is killed, and only wait in calls that already last a time limit.
TARGET_CHUNK_S = 0.02
START_FAILURES_TO_GIVE_UP = 3
MAX_UNBLAMED_RETRIES = 2
MAX_WARMUP_SPECS = 16


class RewardPoolError(RuntimeError):
    """The pool cannot run at all (its processes fail to start): a deployment problem, not a bad completion."""


@dataclass
class _Call:
    reqs: list[RewardRequest]
    results: list[RewardResult | None]
    queue: deque
    spec: list[tuple] = field(default_factory=list)  # per request: its (task, params key, returns)
    failures: Counter = field(default_factory=Counter)  # per group: timed-out and crashed completions
    retries: Counter = field(default_factory=Counter)  # per request: requeues after a death that was not its fault
    one_per_child: set[int] | None = None  # warm(): the pids that already took one request of this call


class RewardPool:
    def __init__(self, config: RewardPoolConfig | None = None, warmup: Sequence[tuple[str, Mapping[str, Any]]] = ()):
        """`warmup`: (task, params) loaded in every child before it takes work (more are added as seen)."""
        self.config = config or RewardPoolConfig()
        self._ctx = mp.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            # Process-wide, and ignored if the forkserver is already running (then children import lazily).
            self._ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._warmup: dict[tuple, tuple[str, dict, bool]] = {}
        for task, params in warmup:
            self._warmup[(task, params_key(dict(params)))] = (task, dict(params), self._trl(task, "reward"))
        self._procs: list[ChildProcess] = []
        self._live: list = []  # (Process, lifeline write end), shared with the finalizer (which must not hold self)
        self._finalizer = weakref.finalize(self, kill_all, self._live)
        self._lock = threading.Lock()
        self._closed = False
        self._start_failures = 0
        self._ewma_s = 0.0
        self._logged: set[tuple] = set()
        self.counts: Counter[str] = Counter()  # completions per status, for metrics
        self.restarts = 0
        try:
            for _ in range(self.config.processes):
                self._start()
            while any(not p.ready for p in self._procs):
                self._step(None)
        except BaseException:
            self._finalizer()
            raise

    # ------------------------------------------------------------------------------------------
    def score_many(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order. Raises only RewardPoolError (children cannot start) or after close()."""
        reqs = list(requests)
        return self._run(_Call(reqs, [None] * len(reqs), deque(range(len(reqs)))))

    def warm(self, request: RewardRequest) -> list[RewardResult]:
        """Score `request` once in each process of the pool, each in a process of its own: every process loads
        the task and makes its first call now, under the limits, rather than on a completion. One result per
        process (a replacement of one that died takes its place)."""
        n = len(self._procs)
        return self._run(_Call([request] * n, [None] * n, deque(range(n)), one_per_child=set()))

    def _run(self, call: _Call) -> list[RewardResult]:
        if not call.reqs:
            return []
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            keys: dict[tuple, tuple] = {}  # requests usually share one params object: key it once
            for r in call.reqs:
                ident = (r.task, id(r.params), r.returns)
                if ident not in keys:
                    keys[ident] = (r.task, params_key(dict(r.params)), r.returns)
                    self._note_spec(keys[ident][:2], r)
                call.spec.append(keys[ident])
            try:
                while call.queue or any(p.chunk for p in self._procs):
                    self._step(call)
            finally:
                for p in [p for p in self._procs if p.chunk]:  # only when an exception escaped the loop
                    p.chunk = []
                    self._replace(p, None, "abandoned")
        return call.results  # type: ignore[return-value]  # every slot is set when the loop ends

    def score(self, request: RewardRequest) -> RewardResult:
        return self.score_many([request])[0]

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Ask the children to exit, SIGKILL any that do not within 2 s, and reap them all."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in self._procs:
                try:
                    p.conn.send(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for p in self._procs:
                p.proc.join(max(0.0, deadline - time.monotonic()))
            self._finalizer()  # kills and reaps whatever is left
            for p in self._procs:
                p.conn.close()
            self._procs.clear()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    def _note_spec(self, key: tuple, r: RewardRequest) -> None:
        """Remember a task for the warm-up of children started from now on."""
        if key not in self._warmup and len(self._warmup) < MAX_WARMUP_SPECS:
            self._warmup[key] = (r.task, dict(r.params), self._trl(r.task, r.returns))

    def _trl(self, task: str, returns: str) -> bool:
        """Whether a task is called in TRL's form: the run's reward plug-in under style "trl"; never a built-in
        task, an environment's reward or a tool (swarmrl's own code)."""
        ours = task in TASKS or task in (REWARD_ENTRY, TOOL_ENTRY)
        return self.config.style == "trl" and returns == "reward" and not ours

    def _start(self) -> None:
        cfg = self.config
        parent_conn, child_conn = self._ctx.Pipe()
        # Only this process holds the write end, so its death is the child's SIGIO (reward_child.die_with_parent).
        # One pipe per child: the SIGIO owner is a property of the pipe's open file, shared by all its copies.
        lifeline_r, lifeline_w = self._ctx.Pipe(duplex=False)
        progress = self._ctx.RawArray("d", 2)  # [start time, index] of the completion running in the child
        args = (child_conn, lifeline_r, progress, cfg.memory_limit_mb, cfg.cpu_limit_s, list(cfg.import_paths),
            list(self._warmup.values()))
        proc = self._ctx.Process(target=child_main, args=args, name="swarmrl-reward", daemon=True)
        proc.start()
        child_conn.close()  # the child's end lives only in the child now, so its death is EOF here
        lifeline_r.close()
        p = ChildProcess(proc, parent_conn, progress, time.monotonic() + cfg.start_timeout_s)
        p.lifeline = lifeline_w
        self._procs.append(p)
        self._live.append((proc, lifeline_w))

    def _step(self, call: _Call | None) -> None:
        """Dispatch what can go out, then handle one round of events: results, ready children, deaths, deadlines."""
        if call is not None:
            self._dispatch(call)
        limit, load_limit = self.config.time_limit_s, self.config.start_timeout_s
        now = time.monotonic()
        busy = [p for p in self._procs if p.chunk or not p.ready]
        deadlines = [p.deadline(limit, load_limit) if p.ready else p.ready_by for p in busy]
        timeout = min(1.0, max(0.0, min(deadlines, default=now + 1.0) - now))
        readable = wait([p.conn for p in self._procs], timeout)
        for p in list(self._procs):
            if p.conn in readable:
                self._drain(p, call)
        for p in list(self._procs):
            if p not in self._procs:
                continue
            if not p.ready and time.monotonic() > p.ready_by:
                self._replace(p, call, "start")
            elif p.chunk and time.monotonic() > p.deadline(limit, load_limit):
                self._drain(p, call)  # results may have come in since the wait
                if p in self._procs and p.chunk and time.monotonic() > p.deadline(limit, load_limit):
                    self._replace(p, call, "timeout")

    def _dispatch(self, call: _Call) -> None:
        budget = self.config.group_failure_budget
        for p in self._procs:
            if not call.queue:
                return
            if not p.ready or p.chunk or (call.one_per_child is not None and p.pid in call.one_per_child):
                continue
            size = 1 if call.one_per_child is not None else self._chunk_size(len(call.queue))
            chunk: list[int] = []
            while call.queue and len(chunk) < size:
                i = call.queue.popleft()
                group = call.reqs[i].group
                if budget is not None and group is not None and call.failures[group] >= budget:
                    self._settle(call, i, 0.0, RewardStatus.skipped, "budget",
                        f"not scored: its submission already had {budget} timed-out or crashed completions", 0.0)
                    continue
                chunk.append(i)
            if not chunk:
                continue
            if call.one_per_child is not None:
                call.one_per_child.add(p.pid)
            specs: dict[tuple, int] = {}
            for i in chunk:
                specs.setdefault(call.spec[i], i)  # first request of each distinct spec carries its params
            where = {key: n for n, key in enumerate(specs)}
            firsts = [call.reqs[i] for i in specs.values()]
            msg = (
                [(r.task, dict(r.params), r.returns, self._trl(r.task, r.returns)) for r in firsts],
                [(where[call.spec[i]], call.reqs[i].item, call.reqs[i].text, call.reqs[i].completion_ids)
                 for i in chunk],
            )
            p.progress[0], p.progress[1] = 0.0, -1.0  # the child is idle: nothing of this chunk has started
            try:
                p.conn.send(msg)
            except (OSError, ValueError):  # it died while idle: nobody to blame, requeue
                call.queue.extendleft(reversed(chunk))
                self._replace(p, call, "died")
                continue
            p.chunk, p.done, p.sent_at = chunk, 0, time.monotonic()

    def _chunk_size(self, queued: int) -> int:
        size = min(self.config.max_batch, math.ceil(queued / len(self._procs)))  # spread a batch over all children
        if self._ewma_s > 0:
            size = min(size, int(TARGET_CHUNK_S / self._ewma_s))
        return max(1, size)

    def _drain(self, p: ChildProcess, call: _Call | None) -> None:
        try:
            while p.conn.poll():
                self._on_message(p, p.conn.recv(), call)
        except Exception:  # EOF, or a message cut short by a death: the child is gone
            self._replace(p, call, "died")

    def _on_message(self, p: ChildProcess, msg: Any, call: _Call | None) -> None:
        if isinstance(msg, tuple) and msg[0] == "ready":
            p.ready = True
            self._start_failures = 0
            return
        for index, value, status, kind, message, t0, t1 in msg:
            if call is None or index != p.done or index >= len(p.chunk):
                raise RuntimeError(f"reward process {p.pid} sent result {index} out of turn")
            self._settle(call, p.chunk[index], value, RewardStatus(status), kind, message, t1 - t0)
            self._ewma_s = (t1 - t0) if self._ewma_s == 0 else 0.9 * self._ewma_s + 0.1 * (t1 - t0)
            p.done += 1
        if p.done == len(p.chunk):
            p.chunk, p.done = [], 0

    def _replace(self, p: ChildProcess, call: _Call | None, cause: str) -> None:
        """Kill `p` (if alive), settle the completion it was running, requeue the rest, start a new child."""
        killed_at, loading = time.monotonic(), p.loading()
        kill_child(p.proc)
        try:  # everything the child sent before it died is still in the socket
            while p.chunk and p.conn.poll():
                self._on_message(p, p.conn.recv(), call)
        except Exception:
            pass
        code = p.proc.exitcode
        log.info("reward process %d replaced: %s, %s, %d of %d completions of its chunk done, progress %s",
                 p.pid, cause, exit_text(code), p.done, len(p.chunk), list(p.progress))
        if p.chunk and call is not None:
            # The child is dead, so `progress` is final: the index of the completion it was running (or of one
            # whose result died with it; -1 if it never started the chunk).
            k = max(int(p.progress[1]), p.done)
            running = p.chunk[k]
            # results lost with it, and not started
            call.queue.extendleft(reversed(p.chunk[p.done:k] + p.chunk[k + 1:]))
            task, limit, ran = call.reqs[running].task, self.config.time_limit_s, killed_at - p.running_since()
            # Not its fault if it had not started (the child died between completions) or had only just started
            # (a result came in between our last read and the kill). Requeued, but not forever.
            innocent = not loading and (int(p.progress[1]) < p.done or (cause == "timeout" and ran < limit))
            if loading:  # one of the chunk's tasks hangs or dies when it loads: a new child must not load it at start
                for i in p.chunk:
                    self._warmup.pop(call.spec[i][:2], None)
            if innocent and call.retries[running] < MAX_UNBLAMED_RETRIES:
                call.retries[running] += 1
                call.queue.appendleft(running)
            elif cause == "timeout" and loading:
                load_limit = self.config.start_timeout_s
                what = f"loading {req_kind(call.reqs[running])} {task!r} (importing its module)"
                message = f"{what} took more than start_timeout_s = {load_limit:g} s; its process was killed"
                self._settle(call, running, 0.0, RewardStatus.timed_out, "load", message, ran)
            elif cause == "timeout":
                self._settle(call, running, 0.0, RewardStatus.timed_out, "wall",
                    f"{req_kind(call.reqs[running])} {task!r} ran past the {limit:g} s limit; its process was killed",
                    ran)
            elif code == -signal.SIGXCPU:
                self._settle(call, running, 0.0, RewardStatus.timed_out, "cpu",
                    f"{req_kind(call.reqs[running])} {task!r} used more than {self.config.cpu_limit_s} CPU seconds; "
                    f"its process was killed", ran)
            else:
                self._settle(call, running, 0.0, RewardStatus.crashed, exit_text(code),
                    f"{req_kind(call.reqs[running])} {task!r} killed its process ({exit_text(code)})", ran)
        elif cause == "start" or not p.ready:
            self._start_failures += 1
            log.warning("reward process %d did not start (%s, %s)", p.pid, cause, exit_text(code))
        p.conn.close()
        p.lifeline.close()
        self._procs.remove(p)
        self._live.remove((p.proc, p.lifeline))
        if p.proc.exitcode is not None:
            p.proc.close()
        self.restarts += 1
        if self._start_failures >= START_FAILURES_TO_GIVE_UP:
            raise RewardPoolError(f"{self._start_failures} reward processes in a row failed to start; see the log")
        if not self._closed:
            self._start()

    def _settle(self, call: _Call, i: int, value: float | str, status: RewardStatus, kind: str, message: str,
        seconds: float) -> None:
        """`value`: the child's reward, or a "text" call's output; 0.0 for what the parent settles itself."""
        req = call.reqs[i]
        if req.returns == "text":
            output = value if isinstance(value, str) else ""
            call.results[i] = RewardResult(0.0, status, message, seconds, output=output, kind=kind)
        else:
            call.results[i] = RewardResult(float(value), status, message, seconds, kind=kind)
        self.counts[status.value] += 1
        if status in (RewardStatus.timed_out, RewardStatus.crashed) and req.group is not None:
            call.failures[req.group] += 1
        if status is not RewardStatus.ok and (req.task, status, kind) not in self._logged:
            self._logged.add((req.task, status, kind))
            log.warning("reward %s: %s (logged once per task and kind; RewardPool.counts has the totals)",
                status.value, message)
