"""The multi-host test's virtual network survives Docker's firewall rules (issue #34, item 5).

dockerd sets the host's iptables FORWARD policy to DROP, which cuts bridges that forward in the host's
network namespace. deploy/netns/multihost.py's bridge forwards inside the switch's own namespace, and
its setup adds an ACCEPT rule for that bridge there (only there). This test sends bytes across the bridge
(worker host -> orchestrator host) with whatever the host's FORWARD policy is (DROP while Docker runs),
and again with the switch namespace's own FORWARD policy set to DROP, which only the rule lets through.
Fast (a few seconds); skipped where network namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from netns_topology import netns_topology

SERVER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], 8123)); s.listen()\n"
    "print('ready', flush=True)\n"
    "while True:\n c,_=s.accept(); c.sendall(b'across the bridge'); c.close()\n"
)
CLIENT = (
    "import socket,sys\n"
    "try:\n c=socket.create_connection((sys.argv[1], 8123), timeout=3); print(c.recv(100).decode())\n"
    "except OSError as e: print('failed:', e)\n"
)


def _host_forward_policy() -> str:
    if shutil.which("iptables") is None:
        return "unknown (no iptables)"
    res = subprocess.run(["iptables", "-w", "5", "-S", "FORWARD"], capture_output=True, text=True)
    return next((ln.split()[-1] for ln in res.stdout.splitlines() if ln.startswith("-P FORWARD")), "unknown")


@pytest.fixture
def topology():
    with netns_topology(prefix=f"srlfw{os.getpid() % 100000}") as topo:
        yield topo


def test_bridge_forwards_with_forward_policy_drop(topology):
    orch = topology.hosts["orch"]
    server = subprocess.Popen(["ip", "netns", "exec", topology.ns("orch"), sys.executable, "-S", "-c", SERVER, orch],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"

        def send() -> str:
            res = subprocess.run(["ip", "netns", "exec", topology.ns("w1"), sys.executable, "-S", "-c", CLIENT, orch],
                capture_output=True, text=True, timeout=30)
            return res.stdout.strip()

        host_policy = _host_forward_policy()
        assert send() == "across the bridge", f"host FORWARD policy {host_policy}"

        if shutil.which("iptables") is None:
            pytest.skip("iptables is not installed: the namespace's own DROP policy cannot be set")
        sw = ["ip", "netns", "exec", topology.switch, "iptables", "-w", "5"]
        rules = subprocess.run([*sw, "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
        assert "swarmrl-netns-bridge" in rules and "-j ACCEPT" in rules, rules
        subprocess.run([*sw, "-P", "FORWARD", "DROP"], check=True)  # the switch namespace's own table only
        t0 = time.monotonic()
        assert send() == "across the bridge", rules
        assert time.monotonic() - t0 < 10
    finally:
        server.kill()
        server.wait(10)
    # The host's table is untouched: no rule of ours there.
    if shutil.which("iptables"):
        host_rules = subprocess.run(["iptables", "-w", "5", "-S"], capture_output=True, text=True).stdout
        assert "swarmrl-netns-bridge" not in host_rules
