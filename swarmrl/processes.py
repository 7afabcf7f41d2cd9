"""Local processes that `swarmrl run` starts beside the Ray actors: shardcast relays and inference
workers. A worker joins through the public HTTP API with a join token, exactly like a volunteer.

Each dies with the driver (the kernel sends it SIGTERM when the driver's thread that started it ends, even
on a kill -9): a resumed run starts its own, on the same ports, and none is left behind.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from swarmrl.config import RunConfig
from swarmrl.run_dir import RunDir

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A component died for good; the message says which and why."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def swarmrl_command() -> list[str]:
    """`swarmrl` in this interpreter. `-P` (Python >= 3.11; PYTHONSAFEPATH in `child_env` for the same):
    the current folder, which may be a run folder, is not put first on the module path."""
    return [sys.executable, "-P", "-m", "swarmrl"] if sys.version_info >= (3, 11) else [sys.executable, "-m", "swarmrl"]


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONSAFEPATH"] = "1"
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Ray's workers listen on 10002-19999 (its default min/max_worker_port); the kernel's ephemeral range
# (ip_local_port_range, 32768-60999 by default) is where every bind to port 0 and every outgoing
# connection lands. A port the run keeps for its life is drawn between the two.
STABLE_PORTS = (20000, 32767)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str, tries: int = 200) -> int:
    """A free port outside the kernel's ephemeral range: a port chosen by bind(0) can be taken by any
    process that binds port 0 before we serve on it (Ray starts several such listeners right after),
    or again while a component restarts on the same port. Falls back to bind(0) if none is free."""
    lo, hi = STABLE_PORTS[0], min(STABLE_PORTS[1], _ephemeral_low() - 1)
    rng = random.SystemRandom()
    for _ in range(tries if hi > lo else 0):
        port = rng.randint(lo, hi)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_holders(port: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes with a listening TCP socket on `port` (Linux /proc; [] elsewhere
    or where we may not look)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                out.append((int(proc.name), cmd[:200]))
        except OSError:
            continue
    return out


def wait_until_free(host: str, port: int, timeout_s: float = 60.0, leftovers: frozenset[int] = frozenset(),
    grace_s: float = 15.0) -> None:
    """Wait for a port that a process of a killed run may still hold (Ray's actors die with their driver,
    a few seconds later). `leftovers`: the pids that the killed driver of this run folder recorded
    (pids.json); one of them still holding the port after `grace_s` is SIGKILLed. Only those: a process
    we did not start is never touched, and then the port is an error after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    kill_at = time.monotonic() + grace_s
    while True:
        if leftovers and time.monotonic() > kill_at:
            for pid, cmd in port_holders(port):
                if pid in leftovers:
                    log.warning(
                        "pid %d of the previous driver's run still holds port %d after %.0f s; killing it (%s)", pid,
                        port, grace_s, cmd[:80])
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            kill_at = float("inf")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    held = "; ".join(f"pid {pid}: {cmd}" for pid, cmd in port_holders(port)) or "no process of ours"
                    raise RunFailed(f"port {port} on {host} is still in use after {timeout_s:.0f} s (another run of "
                        f"this config?); "
                                    f"held by {held}") from None
        time.sleep(0.5)


def _child_setup(cfg: RunConfig, component: str):
    """In the child, before exec: die with the driver (Linux PR_SET_PDEATHSIG), pin to its CPUs if asked."""
    cpus = cfg.resources.cpu_affinity.get(component)  # type: ignore[call-overload]

    def setup() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except OSError:  # not Linux: children outlive a killed driver
            pass
        if cpus:
            os.sched_setaffinity(0, set(cpus))

    return setup


def relay_command(origin_url: str, public_key: str, root: Path, cfg: RunConfig, port: int = 0) -> list[str]:
    sc = cfg.shardcast
    return swarmrl_command() + [
        "shardcast", "relay",
        "--upstream", origin_url,
        "--root", str(root),
        "--public-key", public_key,
        "--run-id", sc.run_id,
        "--host", sc.host,
        "--port", str(port),
        "--keep-versions", str(sc.keep_versions),
        "--poll-interval-s", str(sc.relay_poll_interval_s),
        "--parallelism", str(sc.relay_parallelism),
        "--shard-wait-s", str(sc.relay_shard_wait_s),
        "--grace-s", str(sc.delete_grace_s),
    ] + [arg for proxy in sc.trusted_proxies for arg in ("--trusted-proxy", proxy)]


def start_relay(origin_url: str, public_key: str, rd: RunDir, index: int, cfg: RunConfig, port: int = 0) -> Proc:
    rd.logs.mkdir(parents=True, exist_ok=True)
    log_path = rd.logs / f"relay-{index}.log"
    sc = cfg.shardcast
    cmd = relay_command(origin_url, public_key, rd.relay_dir(index), cfg, port)
    if port:
        wait_until_free(sc.host, port)
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_path.open("ab"), env=child_env(1), text=True,
        preexec_fn=_child_setup(cfg, "relays"))
    assert popen.stdout is not None
    line = popen.stdout.readline()  # the relay announces {"url": ...} once it listens
    if not line:
        raise RunFailed(f"relay {index} did not start; see {log_path}")
    return Proc(f"relay-{index}", popen, log_path, url=json.loads(line)["url"])


def worker_command(url: str, model_dir: Path, work_dir: Path, index: int, cfg: RunConfig) -> list[str]:
    """`swarmrl worker ...` for a local worker: the run's worker settings travel as overrides of its config."""
    cmd = swarmrl_command() + [
        "worker",
        "--orchestrator", url,
        "--name", f"local-{index}",
        "--model", str(model_dir),
        "--work-dir", str(work_dir),
        "--no-display",
        "--log-level", cfg.log_level,
    ]
    for key, value in cfg.worker.engine.model_dump().items():
        cmd += [f"--engine.{key}", json.dumps(value) if value is None or isinstance(value, (list, dict))
            else str(value)]
    for key in ("max_prompts_per_lease", "num_threads"):
        cmd += [f"--{key}", str(getattr(cfg.worker, key))]
    # A local worker starts with the run, before its orchestrator answers (driver.Run.start): it retries
    # registering at least every 2 s, not after a backoff grown to tens of seconds while the run started.
    cmd += ["--backoff_max_s", str(min(cfg.worker.backoff_max_s, 2.0))]
    return cmd


def start_worker(url: str, model_dir: Path, rd: RunDir, index: int, cfg: RunConfig) -> Proc:
    rd.logs.mkdir(parents=True, exist_ok=True)
    log_path = rd.logs / f"worker-{index}.log"
    cmd = worker_command(url, model_dir, rd.workers / f"worker-{index}", index, cfg)
    out = log_path.open("ab")
    env = child_env(max(1, cfg.worker.num_threads))
    # not in argv, which any local user can read
    env["SWARMRL_JOIN_TOKEN"] = cfg.orchestrator.join_tokens[0].get_secret_value()
    popen = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, preexec_fn=_child_setup(cfg, "workers"))
    return Proc(f"worker-{index}", popen, log_path)
