"""A run folder never shadows a package: `swarmrl run` may be started from inside its own run folder, and
`python -m` (how the launcher starts relays and workers) puts the current folder first on the module
path. A folder there named like one of our modules (the old layout had `shardcast/origin/`, which made
`shardcast.origin` an empty namespace package) breaks every import of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from swarmrl.processes import child_env, swarmrl_command
from swarmrl.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "shardcast", "verifier", "inference_worker", "trainer", "orchestrator", "swarmrl")


def laid_out_run_dir(root: Path) -> RunDir:
    """A run folder with every directory the launcher, the trainer and the workers create in it."""
    rd = RunDir(root / "runs" / "demo")
    for d in (rd.checkpoints / "step_00000001", rd.origin_dir / "v0000000001", rd.relay_dir(0) / "v0000000001",
              rd.verifier_weights, rd.model_dir, rd.logs, rd.workers / "worker-0" / "weights"):
        d.mkdir(parents=True, exist_ok=True)
    return rd


def test_every_module_imports_from_inside_a_run_folder(tmp_path):
    rd = laid_out_run_dir(tmp_path)
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts) for pkg in PACKAGES for p in (REPO / pkg).glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    code = (
        "import importlib, sys\n"
        "sys.path.insert(0, '')  # what `python -m` does\n"
        f"bad = []\n"
        f"for m in {modules!r}:\n"
        "    mod = importlib.import_module(m)\n"
        "    if getattr(mod, '__file__', None) is None or mod.__file__.startswith(sys.path[0] or '.'):\n"
        "        bad.append(m)\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=rd.root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_launchers_children_start_from_inside_a_run_folder(tmp_path):
    rd = laid_out_run_dir(tmp_path)
    for args in (["shardcast", "relay", "--help"], ["worker", "--help"]):
        out = subprocess.run(swarmrl_command() + args, cwd=rd.root, env=child_env(1), capture_output=True, text=True,
            timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Usage" in out.stdout


def test_the_run_folder_and_its_config_are_the_owners_only(tmp_path):
    rd = RunDir(tmp_path / "runs" / "secret-run")
    rd.write_config('admin_token = "**********"\n')
    assert rd.root.stat().st_mode & 0o077 == 0 and rd.config_path.stat().st_mode & 0o077 == 0


LISTENER = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(600)")


def test_a_resumed_run_ends_its_dead_drivers_leftover_that_holds_a_port_and_nothing_else():
    """A process that the previous (killed) driver recorded, still holding the run's port after the grace
    period, is killed; one that is not on record is left alone and the port is a clear error naming it."""
    import pytest

    from swarmrl.processes import RunFailed, port_holders, wait_until_free

    procs = [subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        recorded, stranger = procs
        ports = [int(p.stdout.readline()) for p in procs]
        assert [pid for pid, _ in port_holders(ports[0])] == [recorded.pid]
        wait_until_free("127.0.0.1", ports[0], timeout_s=30, leftovers=frozenset({recorded.pid, 1}), grace_s=0.5)
        assert recorded.wait(10) == -9  # (had it not been killed, the wait would have raised RunFailed)
        with pytest.raises(RunFailed, match=f"held by pid {stranger.pid}"):
            wait_until_free("127.0.0.1", ports[1], timeout_s=1.5, leftovers=frozenset({recorded.pid}), grace_s=0.5)
        assert stranger.poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_runs_ports_are_drawn_outside_the_kernels_ephemeral_range():
    """A port picked by bind(0) sits where Ray's agents and every outgoing connection land, so one of them
    can take it before the component serves on it; the run's ports come from below that range, and a port
    someone already listens on is never chosen."""
    import socket

    from swarmrl.processes import STABLE_PORTS, free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    held = []
    try:
        for _ in range(20):
            port = free_port("127.0.0.1")
            assert STABLE_PORTS[0] <= port < min(low, STABLE_PORTS[1] + 1), port
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))  # still free: the chooser did not leave it bound
            sock.listen()
            held.append(sock)
        assert len({s.getsockname()[1] for s in held}) == len(held)  # a listening port is never handed out again
    finally:
        for sock in held:
            sock.close()
