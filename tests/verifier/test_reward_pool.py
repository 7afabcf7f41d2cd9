"""The reward pool: per-completion time limits, failures of every kind, plug-in rewards, no processes left."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from environments.tasks import TaskItem, get_task
from verifier.reward_pool import RewardPool, RewardPoolConfig
from verifier.reward_requests import RewardRequest, RewardStatus

LIMIT_S = 2.0
BOMB = r"\boxed{9^{9^{9^{9}}}}"
REPO = Path(__file__).resolve().parents[2]

PLUGINS = '''
import ctypes, os, time

def exact(text, item):
    return 1.0 if text.strip() == item.answer else 0.0

def scaled(text, item, scale=1.0):
    return min(1.0, scale * len(text) / 10)

def sleepy(text, item):
    time.sleep(3600)

def spin(text, item):
    while True:
        pass

def boom(text, item):
    raise ValueError("boom")

def exits(text, item):
    raise SystemExit(3)

def nan(text, item):
    return float("nan")

def too_big(text, item):
    return 1.5

def negative(text, item):
    return -0.1

def inf(text, item):
    return float("inf")

def string(text, item):
    return "0.5"

def nothing(text, item):
    return None

def np_nan(text, item):
    import numpy
    return numpy.float64("nan")

def np_half(text, item):
    import numpy
    return numpy.float32(0.5)

def cplx(text, item):
    return 0.5 + 0j

def a_list(text, item):
    return [1.0]

def type_error(text, item):
    return text + 1

def true(text, item):
    return True

def die(text, item):
    os._exit(1)

def segfault(text, item):
    ctypes.string_at(0)

def hog(text, item):
    block = bytearray(10 * 2**30)  # 10 GB
    return 1.0

def echo(text, item):
    return text + "|" + item.answer

def long_text(text, item):
    return "x" * 20000

not_callable = 0.5
'''
MOD = "swarmrl_test_rewards"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plugins")
    (d / f"{MOD}.py").write_text(PLUGINS)
    return d


@pytest.fixture(scope="module")
def pool(plugin_dir):
    cfg = RewardPoolConfig(processes=2, time_limit_s=LIMIT_S, memory_limit_mb=1024, cpu_limit_s=4,
        import_paths=[str(plugin_dir)])
    with RewardPool(cfg, warmup=[("math", {})]) as p:
        yield p


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie holds no memory or CPU; reaping it is init's job)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def honest_requests() -> tuple[list[RewardRequest], list[float]]:
    """Completions of the three built-in tasks and a plug-in, with their rewards computed in this process."""
    reqs = []
    math_item = TaskItem("m", "what is 6*7?", "42")
    for text in [r"\boxed{42}", "the answer is 42", r"$\frac{84}{2}$", "41", "no idea", r"\boxed{42.0}"]:
        reqs.append(RewardRequest("math", math_item, text, group="honest-math"))
    for item in get_task("toy", digits=4).make_prompts(5, seed=1):
        for text in (item.answer, item.answer[:2], "abc"):
            reqs.append(RewardRequest("toy", item, text, params={"digits": 4}, group="honest-toy"))
    for item in get_task("countdown").make_prompts(3, seed=2):
        for text in (item.answer, "1+2", "oops"):
            reqs.append(RewardRequest("countdown", item, text, group="honest-countdown"))
    item = TaskItem("p", "say 7", "7")
    reqs += [RewardRequest(f"{MOD}:exact", item, t) for t in ("7", "8")]
    expected = [get_task(r.task, **r.params).reward(r.item, r.text) for r in reqs[:-2]] + [1.0, 0.0]
    return reqs, expected


def assert_honest(results, expected) -> None:
    assert [r.status for r in results] == [RewardStatus.ok] * len(expected)
    assert [r.reward for r in results] == expected


# --------------------------------------------------------------------------------------------------


def test_math_bomb_times_out_and_the_rest_of_the_batch_is_scored_exactly(pool):
    honest, expected = honest_requests()
    bomb = RewardRequest("math", TaskItem("b", "what is 1?", "1"), BOMB, group="attacker")
    pids = pool.pids()
    started = time.monotonic()
    results = pool.score_many([bomb, *honest[:10], bomb, *honest[10:]])
    elapsed = time.monotonic() - started
    assert elapsed < 10 * LIMIT_S
    for r in (results[0], results[11]):
        assert r.status == RewardStatus.timed_out and r.reward == 0.0
        assert LIMIT_S <= r.seconds < 10 * LIMIT_S
        assert "limit" in r.message
    assert_honest(results[1:11] + results[12:], expected)
    assert not set(pids) & set(pool.pids()), "both children ran a bomb and were replaced"
    assert len(pool.pids()) == 2


def test_honest_rewards_equal_in_process_rewards_in_large_batches(pool):
    honest, expected = honest_requests()
    results = pool.score_many(honest * 20)
    assert_honest(results, expected * 20)
    assert pool.score_many([]) == []


@pytest.mark.parametrize(
    "fn, status, words",
    [
        ("boom", RewardStatus.error, "raised ValueError: boom"),
        ("exits", RewardStatus.error, "raised SystemExit: 3"),
        ("nan", RewardStatus.error, "NaN"),
        ("too_big", RewardStatus.error, "1.5, outside [0, 1]"),
        ("negative", RewardStatus.error, "outside [0, 1]"),
        ("inf", RewardStatus.error, "outside [0, 1]"),
        ("string", RewardStatus.error, "a str, not a number"),
        ("nothing", RewardStatus.error, "a NoneType, not a number"),
        ("np_nan", RewardStatus.error, "NaN"),
        ("cplx", RewardStatus.error, "a complex, not a number"),
        ("a_list", RewardStatus.error, "a list, not a number"),
        ("type_error", RewardStatus.error, "raised TypeError"),
        ("hog", RewardStatus.error, "MemoryError"),
        ("die", RewardStatus.crashed, "exit code 1"),
        ("segfault", RewardStatus.crashed, "SIGSEGV"),
        ("sleepy", RewardStatus.timed_out, "limit"),
    ],
)
def test_a_bad_plugin_gets_reward_zero_and_the_pool_keeps_working(pool, fn, status, words):
    honest, expected = honest_requests()
    bad = RewardRequest(f"{MOD}:{fn}", TaskItem("x", "p", "1"), "text", group="bad")
    started = time.monotonic()
    results = pool.score_many([*honest[:4], bad, *honest[4:]])
    assert time.monotonic() - started < 10 * LIMIT_S
    r = results[4]
    assert (r.status, r.reward) == (status, 0.0), r
    assert words in r.message and f"{MOD}:{fn}" in r.message
    assert_honest(results[:4] + results[5:], expected)
    assert_honest(pool.score_many(honest), expected)  # and after it
    assert len(pool.pids()) == 2


def test_valid_plugin_values_and_params(pool):
    item = TaskItem("x", "p", "1")
    results = pool.score_many([
        RewardRequest(f"{MOD}:true", item, "t"),
        RewardRequest(f"{MOD}:np_half", item, "t"),
        RewardRequest(f"{MOD}:scaled", item, "abcde", params={"scale": 0.1}),
        RewardRequest(f"{MOD}:scaled", item, "abcde", params={"scale": 4.0}),
    ])
    assert [(r.status, r.reward) for r in results] == [(RewardStatus.ok, 1.0), (RewardStatus.ok, 0.5),
        (RewardStatus.ok, 0.05), (RewardStatus.ok, 1.0)]
    assert all(type(r.reward) is float for r in results)


@pytest.mark.parametrize(
    "task, params, words",
    [
        ("nosuchtask", {}, "unknown task 'nosuchtask'"),
        ("swarmrl_no_such_module:fn", {}, "cannot load reward 'swarmrl_no_such_module:fn': ModuleNotFoundError"),
        (f"{MOD}:missing", {}, "AttributeError"),
        (f"{MOD}:not_callable", {}, "is a float, not a function"),
        ("toy", {"digits": 99}, "digits must be in [1, 32]"),
        ("toy", {"colour": "red"}, "bad parameters"),
    ],
)
def test_a_task_that_cannot_load_is_an_error_not_a_crash(pool, task, params, words):
    pids = pool.pids()
    results = pool.score_many([RewardRequest(task, TaskItem("x", "p", "1"), "1", params=params)] * 3)
    assert all(r.status == RewardStatus.error and r.reward == 0.0 and words in r.message for r in results), results
    assert pool.pids() == pids


def test_each_kind_of_error_is_logged_once(pool, caplog):
    item = TaskItem("x", "p", "1")
    with caplog.at_level(logging.WARNING, logger="verifier.reward_pool"):
        for _ in range(3):
            pool.score_many([RewardRequest(f"{MOD}:boom", item, "a")] * 5 + [RewardRequest(f"{MOD}:nan", item,
                "a")] * 5)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("ValueError" in m for m in messages) <= 1  # 0 if an earlier test already logged it
    assert sum("NaN" in m for m in messages) <= 1
    assert pool.counts["error"] >= 30


@pytest.mark.parametrize("fn, status", [("sleepy", RewardStatus.timed_out), ("die", RewardStatus.crashed), ("boom",
    RewardStatus.error)])
def test_only_the_completion_that_was_running_is_blamed(plugin_dir, fn, status):
    """One process, one chunk: the honest completions before the bad one finish in microseconds, so their
    results are still in the child (not yet sent) when it is killed or dies; they must be scored again, not blamed."""
    cfg = RewardPoolConfig(processes=1, time_limit_s=0.5, import_paths=[str(plugin_dir)])
    item = TaskItem("x", "copy:12=", "12")
    honest = [RewardRequest("toy", item, "12")] * 3
    with RewardPool(cfg) as p:
        results = p.score_many([*honest, RewardRequest(f"{MOD}:{fn}", item, "t"), *honest])
    assert [r.status for r in results] == [RewardStatus.ok] * 3 + [status] + [RewardStatus.ok] * 3
    assert [r.reward for r in results] == [1.0] * 3 + [0.0] + [1.0] * 3


class _DiesWhenUnpickled:
    def __reduce__(self):
        return (os._exit, (1,))


def test_a_chunk_that_kills_its_child_before_any_completion_starts_is_not_requeued_forever(pool):
    """A worker controls only the text, so this cannot come from one; the pool must still end."""
    item = TaskItem("x", "copy:12=", "12", {"poison": _DiesWhenUnpickled()})
    r = pool.score(RewardRequest("toy", item, "12"))
    assert r.status == RewardStatus.crashed and r.reward == 0.0 and "exit code 1" in r.message
    assert pool.score(RewardRequest("toy", TaskItem("x", "copy:12=", "12"), "12")).reward == 1.0


def test_cpu_limit_kills_a_spinning_reward(plugin_dir):
    cfg = RewardPoolConfig(processes=1, time_limit_s=60, cpu_limit_s=1, import_paths=[str(plugin_dir)])
    with RewardPool(cfg) as p:
        started = time.monotonic()
        r = p.score(RewardRequest(f"{MOD}:spin", TaskItem("x", "p", "1"), "t"))
        assert time.monotonic() - started < 20
        assert r.status == RewardStatus.timed_out and "CPU seconds" in r.message
        assert p.score(RewardRequest("toy", TaskItem("x", "copy:12=", "12"), "12")).reward == 1.0


def test_group_failure_budget_skips_the_rest_of_a_bad_submission(plugin_dir):
    cfg = RewardPoolConfig(processes=2, time_limit_s=0.5, group_failure_budget=2, import_paths=[str(plugin_dir)])
    item = TaskItem("x", "copy:12=", "12")
    bad = [RewardRequest(f"{MOD}:sleepy", item, "t", group="attacker")] * 6
    good = [RewardRequest("toy", item, "12", group=f"honest-{i}") for i in range(6)]
    with RewardPool(cfg) as p:
        started = time.monotonic()
        results = p.score_many(bad + good)
        elapsed = time.monotonic() - started
    statuses = [r.status for r in results[:6]]
    # At most one completion per process can be in flight when the budget runs out.
    assert 2 <= statuses.count(RewardStatus.timed_out) <= 3
    assert statuses.count(RewardStatus.timed_out) + statuses.count(RewardStatus.skipped) == 6
    assert all(r.reward == 0.0 for r in results[:6])
    assert [r.reward for r in results[6:]] == [1.0] * 6
    assert elapsed < 10 * 3 * 0.5


def test_close_leaves_no_process_and_refuses_work(plugin_dir):
    p = RewardPool(RewardPoolConfig(processes=2, import_paths=[str(plugin_dir)]))
    item = TaskItem("x", "copy:12=", "12")
    p.score_many([RewardRequest(f"{MOD}:die", item, "t"), RewardRequest("toy", item, "12")])  # one replaced on the way
    pids = p.pids()
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    p.close()
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []  # not even a zombie
    with pytest.raises(RuntimeError, match="closed"):
        p.score(RewardRequest("toy", item, "12"))
    p.close()  # twice is fine


def test_a_garbage_collected_pool_leaves_no_process():
    def make() -> list[int]:
        p = RewardPool(RewardPoolConfig(processes=2))
        return p.pids()

    pids = make()
    gc.collect()
    assert wait_gone(pids, 10) == []


def test_children_die_with_their_parent(plugin_dir, tmp_path):
    """The parent is SIGKILLed while one child sleeps inside a reward and the other is idle."""
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f'''
        from environments.tasks import TaskItem
        import os, signal, sys, threading, time
        from verifier.reward_pool import RewardPool, RewardPoolConfig
        from verifier.reward_requests import RewardRequest
        if __name__ == "__main__":
            pool = RewardPool(RewardPoolConfig(processes=2, time_limit_s=600, import_paths=[{str(plugin_dir)!r}]))
            req = RewardRequest("{MOD}:sleepy", TaskItem("x", "p", "1"), "t")
            threading.Thread(target=pool.score, args=(req,), daemon=True).start()
            time.sleep(1.0)
            print(" ".join(map(str, pool.pids())), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    '''))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
        cwd=tmp_path)
    assert out.returncode == -9, out.stderr
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 2
    assert wait_gone(pids, 10) == []


def test_config_defaults_and_validation():
    cfg = RewardPoolConfig()
    assert 1 <= cfg.processes <= 4 and cfg.time_limit_s == 2.0 and cfg.start_method == "forkserver"
    for bad in ({"processes": 0}, {"time_limit_s": 0}, {"memory_limit_mb": 1}, {"start_method": "fork"}, {"nope": 1}):
        with pytest.raises(ValueError):
            RewardPoolConfig(**bad)


def test_text_calls_return_their_output_under_the_same_limits(pool):
    """Tool calls of multi-turn environments (returns="text"): the string comes back; a value that is not
    a string, a string over the cap, and a call that hangs each get an empty output and a status, in a batch
    whose honest calls (text and reward alike) come back exactly."""
    honest, expected = honest_requests()
    item = TaskItem("x", "p", "ans")
    text = lambda fn, t="call": RewardRequest(f"{MOD}:{fn}", item, t, group=fn, returns="text")  # noqa: E731
    calls = [text("echo", "a"), text("string"), text("true"), text("long_text"), text("sleepy"), text("echo", "b")]
    results = pool.score_many(calls[:3] + honest + calls[3:])
    got = results[:3] + results[-3:]
    assert [(r.status, r.output) for r in got] == [
        (RewardStatus.ok, "a|ans"), (RewardStatus.ok, "0.5"), (RewardStatus.error, ""), (RewardStatus.error, ""),
        (RewardStatus.timed_out, ""), (RewardStatus.ok, "b|ans")]
    assert "not a str" in got[2].message and "over 16384" in got[3].message and got[4].message.startswith("tool ")
    assert_honest(results[3:-3], expected)
