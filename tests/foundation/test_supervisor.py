"""The supervisor with real processes and a real Ray actor killed with SIGKILL: what dies comes back and
is counted; what keeps dying stops the run with an error that names it and quotes its log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from swarmrl.processes import Proc, RunFailed
from swarmrl.supervisor import RestartPolicy, Supervisor


def python_proc(tmp_path, name: str, code: str) -> Proc:
    log = tmp_path / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)
    return Proc(name, popen, log)


def wait_until(predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_killed_process_is_restarted_and_counted(tmp_path):
    seen = []
    sup = Supervisor(RestartPolicy(max_restarts=3, window_s=60), on_restart=lambda name, lost: seen.append((name,
        lost)), period_s=0.1)
    proc = sup.watch_process("relay-0", lambda: python_proc(tmp_path, "relay-0", "import time; time.sleep(600)"))
    sup.start()
    try:
        os.kill(proc.popen.pid, signal.SIGKILL)
        wait_until(lambda: seen)
        new = sup.processes("relay-")[0]
        assert new.alive() and new.popen.pid != proc.popen.pid and sup.pids()["relay-0"] == new.popen.pid
        assert seen[0][0] == "relay-0" and 0 <= seen[0][1] < 30
        assert sup.summary()["relay-0"][0] == 1
        sup.check()  # within budget: no failure
    finally:
        sup.stop()
        for p in sup.processes(""):
            p.stop(timeout_s=5)


def test_a_process_that_keeps_dying_stops_the_run_naming_it(tmp_path):
    sup = Supervisor(RestartPolicy(max_restarts=2, window_s=60), on_restart=lambda *_: None, period_s=0.1)
    sup.watch_process("worker-1", lambda: python_proc(tmp_path, "worker-1",
        "print('cannot open the model: no such file', flush=True); raise SystemExit(3)"))
    sup.start()
    try:
        wait_until(lambda: sup.failure is not None)
        with pytest.raises(RunFailed) as e:
            sup.check()
        message = str(e.value)
        assert message.startswith("worker-1 died 3 times within 60 s")
        assert "cannot open the model: no such file" in message and "worker-1.log" in message
        assert sup.summary()["worker-1"][0] == 2  # two restarts, then it gave up
    finally:
        sup.stop()


class Pinger:
    def __init__(self):
        self.started_at = time.time()

    def ping(self):
        return os.getpid(), self.started_at


def test_a_killed_actor_is_noticed_by_its_new_pid(tmp_path):
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(Pinger).remote()
        pid, started = ray.get(actor.ping.remote())
        seen = []
        sup = Supervisor(RestartPolicy(max_restarts=3, window_s=60), on_restart=lambda name, lost: seen.append((name,
            lost)), period_s=0.1)
        sup.watch_actor("verifier-0", actor, tmp_path / "verifier-0.log", pid, started)
        sup.start()
        try:
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: seen)
            assert seen[0][0] == "verifier-0" and sup.pids()["verifier-0"] != pid
            assert ray.get(actor.ping.remote())[0] == sup.pids()["verifier-0"]
            sup.check()
        finally:
            sup.stop()
    finally:
        ray.shutdown()


def test_the_same_budget_holds_for_an_actor(tmp_path):
    """The trainer's restarts are reported by the driver (its train_step call fails): one policy for all."""
    log = tmp_path / "trainer.log"
    log.write_text("loading checkpoint step_00000007\nRuntimeError: CUDA error: an illegal memory access\n")
    sup = Supervisor(RestartPolicy(max_restarts=2, window_s=600), on_restart=lambda *_: None)
    sup.watch_actor("trainer", None, log, pid=100, started_at=0.0)
    for pid in (101, 102):
        sup.restarted("trainer", pid, time.time(), time.time() - 5)
        sup.check()
    sup.restarted("trainer", 103, time.time(), time.time() - 5)
    with pytest.raises(RunFailed) as e:
        sup.check()
    assert str(e.value).startswith("trainer died 3 times within 600 s") and "illegal memory access" in str(e.value)
    assert sup.summary()["trainer"][0] == 3 and 14 < sup.summary()["trainer"][1] < 16


def test_restarts_outside_the_window_do_not_count():
    policy = RestartPolicy(max_restarts=2, window_s=60)
    from collections import deque

    now = 10_000.0
    assert policy.allows(deque([now - 120, now - 90, now - 10]), now)  # only one within the window
    assert not policy.allows(deque([now - 30, now - 10]), now)
