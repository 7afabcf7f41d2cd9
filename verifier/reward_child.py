"""The reward pool's worker process: its limits, the task resolver, one scoring call and its checks.

This module runs inside the pool's children (`verifier.reward_pool` starts them), so it imports only the
standard library, `environments.tasks` and `verifier.trl_rewards`: never torch, never the service. The
parent owns the wall-clock limit (it SIGKILLs a child whose current completion runs too long); the child
owns the limits that the kernel enforces: address space, CPU seconds per completion, no core files, and
death with the pool owner.

Wire format (multiprocessing Connection, pickled):
  parent -> child: a chunk, (specs, rows): the distinct (task, params, returns, trl) and one (spec index,
      item, text, completion ids or None) per completion; None asks the child to exit. `returns` is
      "reward" (a float in [0, 1]; unbounded for a plug-in called in TRL's form, `trl` true:
      verifier.trl_rewards) or "text" (a string of at most MAX_OUTPUT_CHARS: an environment's tool output).
  child -> parent: ("ready", pid) once; then lists of (index, value, status, kind, message, t_start,
      t_end), sent when the chunk is done or FLUSH_S after the previous list, whichever comes first.
  shared `progress` (two doubles): [t_start, index] of the completion running now, written before it
      starts. Times are time.monotonic(), one clock for all processes on Linux. The parent reads
      t_start for the deadline and, after a kill, the index to know which completion was running.
      Index LOADING: the child is loading a task it has not seen (importing a plug-in's module), which
      is bounded by start_timeout_s, not by a completion's limit, and has no CPU limit (as at start).
"""

from __future__ import annotations

import fcntl
import math
import numbers
import os
import resource
import select
import signal
import sys
import time
from typing import Any, Callable

from environments.tasks import TASKS, TaskItem, get_task, import_plugin
from verifier.trl_rewards import TrlReward

MAX_MESSAGE_CHARS = 300
# A tool's output becomes an observation that the verifier tokenizes and compares: far more than any
# episode cap holds (protocol.limits.MAX_COMPLETION_TOKENS), and small enough to cross a pipe cheaply.
MAX_OUTPUT_CHARS = 16_384
# Results wait at most this long in the child: a chunk (~20 ms of work, see reward_pool.TARGET_CHUNK_S)
# comes back in one or a few messages, each one a wake-up of the parent; and a kill loses (requeues) at
# most this much honest work, since results not yet sent die with the child.
FLUSH_S = 0.01
LOADING = -2.0  # progress[1] while the child loads a task for the chunk it got

Scorer = Callable[[TaskItem, str, Any], Any]  # (item, text, completion ids or None) -> the raw value


class LoadError(Exception):
    """The task could not be resolved (unknown name, bad params, import failure, not callable)."""


def params_key(params: dict[str, Any]) -> tuple:
    return tuple(sorted((str(k), repr(v)) for k, v in params.items()))


def _task_reward(task: str, params: dict[str, Any]) -> Scorer:
    try:
        reward = get_task(task, **params).reward
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    return lambda item, text, ids: reward(item, text)


def resolve(task: str, params: dict[str, Any], trl: bool = False) -> Scorer:
    """A task's `reward(item, text)` (a built-in, or a task plug-in "module:Class" that get_task makes), or a
    reward plug-in `module:function` called as fn(text, item, **params), or in TRL's form when `trl`."""
    if task in TASKS:
        return _task_reward(task, params)
    if ":" not in task:
        raise LoadError(f"unknown task {task!r}: not one of {sorted(TASKS)} and not 'module:function'")
    try:
        fn = import_plugin(task, "reward")
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    if isinstance(fn, type):  # a class is a task plug-in, whatever the reward style
        return _task_reward(task, params)
    if trl:
        try:
            return TrlReward.load(task, fn, params)
        except ValueError as exc:
            raise LoadError(str(exc)) from None
    if not callable(fn):
        raise LoadError(f"reward {task!r} is a {type(fn).__name__}, not a function")
    return lambda item, text, ids: fn(text, item, **params)


def check_value(value: Any) -> tuple[float, str, str]:
    """(reward, kind, message): kind is "" for a valid reward in [0, 1], else why it is not one."""
    if not isinstance(value, numbers.Real):  # bool, int, float, numpy scalars pass; str, None, complex do not
        return 0.0, "not_a_number", f"returned a {type(value).__name__}, not a number"
    try:
        v = float(value)
    except (OverflowError, ValueError, TypeError):
        return 0.0, "out_of_range", "returned a number that is not a finite float"
    if math.isnan(v):
        return 0.0, "nan", "returned NaN"
    if not 0.0 <= v <= 1.0:
        return 0.0, "out_of_range", f"returned {v!r}, outside [0, 1]"
    return v, "", ""


def check_text(value: Any) -> tuple[str, str, str]:
    """(text, kind, message): kind is "" for a valid tool output, else why it is not one."""
    if not isinstance(value, str):
        return "", "not_text", f"returned a {type(value).__name__}, not a str"
    if len(value) > MAX_OUTPUT_CHARS:
        return "", "too_long", f"returned {len(value)} characters, over {MAX_OUTPUT_CHARS}"
    return value, "", ""


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load(scorers: dict[tuple, Scorer | LoadError], task: str, params: dict, trl: bool = False) -> Scorer | LoadError:
    """The task's scorer, resolved once per process; a failed load is remembered too (no import per completion)."""
    key = (task, params_key(params), trl)
    if key not in scorers:
        try:
            scorers[key] = resolve(task, params, trl)
        except LoadError as exc:
            scorers[key] = exc
    return scorers[key]


def score_one(scorer: Scorer | LoadError, task: str, item: TaskItem, text: str, returns: str = "reward",
              ids: Any = None) -> tuple[float | str, str, str, str]:
    """(value, status, kind, message) for one completion; never raises for anything the called code does.
    value: the reward (returns "reward"; 0.0 on failure) or the output text (returns "text"; "" on failure)."""
    empty: float | str = "" if returns == "text" else 0.0
    what = "tool" if returns == "text" else "reward"
    if isinstance(scorer, LoadError):
        return empty, "error", "load", str(scorer)[:MAX_MESSAGE_CHARS]
    try:
        value = scorer(item, text, ids)
    except (Exception, SystemExit, KeyboardInterrupt, GeneratorExit) as exc:  # MemoryError (RLIMIT_AS) lands here
        return empty, "error", type(exc).__name__, f"{what} {task!r} raised {_describe(exc)}"[:MAX_MESSAGE_CHARS]
    if returns == "text":
        result, kind, message = check_text(value)
    else:
        result, kind, message = scorer.check(value) if isinstance(scorer, TrlReward) else check_value(value)
    if kind:
        return empty, "error", kind, f"{what} {task!r} {message}"[:MAX_MESSAGE_CHARS]
    return result, "ok", "", ""


# --------------------------------------------------------------------------------------------------
# the process


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def die_with_parent(lifeline_fd: int) -> None:
    """The pool owner holds the only write end of the lifeline pipe. When it closes (the owner exits or is
    killed), the kernel sends SIGIO to our process group, and SIGIO's default action ends it: no thread,
    no GIL needed, so it works while a reward is stuck in C code. PR_SET_PDEATHSIG would not do: our parent
    is the forkserver, which outlives the owner for as long as any of its children is alive."""
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(lifeline_fd, fcntl.F_SETOWN, -os.getpgrp())
    fcntl.fcntl(lifeline_fd, fcntl.F_SETFL, fcntl.fcntl(lifeline_fd, fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([lifeline_fd], [], [], 0)[0]:  # nothing is ever written: readable means the owner is gone
        os._exit(0)


def apply_limits(memory_limit_mb: int | None) -> None:
    """Limits the kernel enforces, so they hold even when the parent is stalled."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU / SIGSEGV must not write core files
    if memory_limit_mb:
        # On top of what is mapped now: the forkserver may carry the parent's __main__ imports, which a
        # reward did not allocate and must not be charged for. Hard limit too: a plug-in cannot raise it.
        limit = _vm_size_bytes() + memory_limit_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _CpuLimit:
    """RLIMIT_CPU is per process and cumulative, so each completion gets `soft = used + cpu_limit_s`. Past it
    the kernel sends SIGXCPU, whose default action ends the process; the parent reports timed_out.
    The soft limit is whole seconds: it moves only when used CPU crosses one, so a completion always has
    between cpu_limit_s and cpu_limit_s + 1 seconds, and most completions cost one getrusage call."""

    def __init__(self, cpu_limit_s: int | None):
        self.limit = cpu_limit_s
        self.soft = 0
        self.hard = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def arm(self) -> None:
        if self.limit:
            used = _cpu_seconds()
            if used + self.limit > self.soft:
                self.soft = math.ceil(used) + self.limit
                if self.hard != resource.RLIM_INFINITY:
                    self.soft = min(self.soft, self.hard)
                resource.setrlimit(resource.RLIMIT_CPU, (self.soft, self.hard))

    def lift(self) -> None:
        """No CPU limit while a task loads (start_timeout_s bounds it, as at start); re-armed before a completion."""
        if self.limit:
            resource.setrlimit(resource.RLIMIT_CPU, (self.hard, self.hard))
            self.soft = -1


WARMUP_ITEM = TaskItem("warmup", "", "1", {"nums": [1], "target": 1})


def child_main(conn, lifeline, progress, memory_limit_mb: int | None, cpu_limit_s: int | None, import_paths: list[str],
               warmup: list[tuple[str, dict, bool]]) -> None:
    os.setsid()  # our own process group: the parent's kill, and SIGIO, also reach anything a plug-in started
    die_with_parent(lifeline.fileno())
    apply_limits(memory_limit_mb)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop; ^C goes to it
    sys.path[:0] = [p for p in import_paths if p not in sys.path]
    cpu = _CpuLimit(cpu_limit_s)
    scorers: dict[tuple, Scorer | LoadError] = {}
    for task, params, trl in warmup:
        # Load (imports a plug-in's module) and, for our own built-in tasks only, score once: math-verify's
        # first call builds its parsers (~60 ms), which must not be charged to a real completion's limit.
        # A plug-in is not called: it could hang on any input, and this child must become ready (the
        # run's start-up check calls it once per process, under the limits: verifier/reward_preflight.py).
        scorer = load(scorers, task, params, trl)
        if task in TASKS and not isinstance(scorer, LoadError):
            try:
                scorer(WARMUP_ITEM, "1", None)
            except Exception:
                pass  # a real completion will report it
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if chunk is None:
            return
        specs, rows = chunk  # distinct (task, params, returns, trl), then (spec index, item, text, ids) per completion
        if any((task, params_key(params), trl) not in scorers for task, params, _, trl in specs):
            progress[1] = LOADING  # the index first: LOADING with the dispatch's start reads as the send time
            progress[0] = time.monotonic()
            cpu.lift()
            fns = [load(scorers, task, params, trl) for task, params, _, trl in specs]
            progress[0] = time.monotonic()  # so the index that follows is never paired with the load's start
        else:
            fns = [load(scorers, task, params, trl) for task, params, _, trl in specs]
        results, flushed = [], time.monotonic()
        for index, (s, item, text, ids) in enumerate(rows):
            cpu.arm()
            t0 = time.monotonic()
            progress[1] = index
            progress[0] = t0  # one aligned 8-byte store: the parent never reads half of it
            value, status, kind, message = score_one(fns[s], specs[s][0], item, text, specs[s][2], ids)
            t1 = time.monotonic()
            results.append((index, value, status, kind, message, t0, t1))
            if t1 - flushed >= FLUSH_S or index == len(rows) - 1:
                conn.send(results)
                results, flushed = [], t1
