"""Local processes that `swarmrl run` starts beside the Ray actors: shardcast relays and inference
workers. A worker joins through the public HTTP API with a join token, exactly like a volunteer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from swarmrl.config import RunConfig
from swarmrl.run_dir import RunDir


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


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _pinner(cfg: RunConfig, component: str):
    cpus = cfg.resources.cpu_affinity.get(component)  # type: ignore[call-overload]
    return (lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None


def start_relay(origin_url: str, public_key: str, rd: RunDir, index: int, cfg: RunConfig) -> Proc:
    rd.logs.mkdir(parents=True, exist_ok=True)
    log_path = rd.logs / f"relay-{index}.log"
    sc = cfg.shardcast
    cmd = swarmrl_command() + [
        "shardcast", "relay",
        "--upstream", origin_url,
        "--root", str(rd.relay_dir(index)),
        "--public-key", public_key,
        "--run-id", sc.run_id,
        "--host", sc.host,
        "--keep-versions", str(sc.keep_versions),
        "--poll-interval-s", str(sc.relay_poll_interval_s),
        "--parallelism", str(sc.relay_parallelism),
        "--shard-wait-s", str(sc.relay_shard_wait_s),
        "--grace-s", str(sc.delete_grace_s),
    ]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_path.open("ab"), env=child_env(1), text=True, preexec_fn=_pinner(cfg, "relays"))
    assert popen.stdout is not None
    line = popen.stdout.readline()  # the relay announces {"url": ...} once it listens
    if not line:
        raise RunFailed(f"relay {index} did not start; see {log_path}")
    return Proc(f"relay-{index}", popen, log_path, url=json.loads(line)["url"])


def start_worker(url: str, model_dir: Path, rd: RunDir, index: int, cfg: RunConfig) -> Proc:
    rd.logs.mkdir(parents=True, exist_ok=True)
    log_path = rd.logs / f"worker-{index}.log"
    cmd = swarmrl_command() + [
        "worker",
        "--orchestrator", url,
        "--join-token", cfg.orchestrator.join_tokens[0],
        "--name", f"local-{index}",
        "--model", str(model_dir),
        "--work-dir", str(rd.workers / f"worker-{index}"),
        "--no-display",
        "--log-level", cfg.log_level,
    ]
    # The worker's own settings travel as overrides of its config section.
    for key, value in cfg.worker.engine.model_dump().items():
        cmd += [f"--engine.{key}", json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    for key in ("max_prompts_per_lease", "num_threads"):
        cmd += [f"--{key}", str(getattr(cfg.worker, key))]
    out = log_path.open("ab")
    popen = subprocess.Popen(cmd, stdout=out, stderr=out, env=child_env(max(1, cfg.worker.num_threads)), preexec_fn=_pinner(cfg, "workers"))
    return Proc(f"worker-{index}", popen, log_path)
