"""Several "hosts" on one Linux machine: network namespaces joined by veth pairs to a bridge.

    srl<id>-sw      the switch: bridge br0, one veth end per host; it holds no address
    srl<id>-orch    10.213.0.1  `swarmrl run` (Ray, trainer, shardcast origin, verifiers, orchestrator API)
    srl<id>-relay   10.213.0.2  `swarmrl shardcast relay --upstream http://10.213.0.1:<origin port>`
    srl<id>-w1/w2   10.213.0.11/12  `swarmrl worker --orchestrator http://10.213.0.1:<port>`

The 10.213.0.0/24 network exists only inside these namespaces, so every byte between the components
crosses a virtual link (nothing is on the host's loopback). Needs root and iproute2 (`ip netns`).

Run it by hand (as root):  python deploy/netns/multihost.py --max-steps 4 --out /tmp/multihost
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.213.0"
HOSTS = {"orch": f"{SUBNET}.1", "relay": f"{SUBNET}.2", "w1": f"{SUBNET}.11", "w2": f"{SUBNET}.12"}
ORCH_PORT = 8000
ORIGIN_PORT = 9100
RELAY_PORT = 9200
JOIN_TOKEN = "netns-join-token"
ADMIN_TOKEN = "netns-admin-token"


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says exactly why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def check_netns_support() -> None:
    """Raise NetnsUnavailable with the reason if this machine cannot make network namespaces."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"creating network namespaces needs root (euid is {os.geteuid()})")
    probe = f"srlprobe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {res.stderr.strip() or res.returncode}")
    try:
        res = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if res.returncode != 0:
            raise NetnsUnavailable(f"cannot create a veth pair in a namespace: {res.stderr.strip()}")
        res = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if res.returncode != 0:
            raise NetnsUnavailable(f"cannot create a bridge in a namespace: {res.stderr.strip()}")
    finally:
        _ip("netns", "del", probe, check=False)


def allow_bridge_forwarding(ns: str) -> bool:
    """Let the switch's bridge forward whatever the firewall defaults are; True if a rule was added.

    Docker sets the FORWARD policy of the host's filter table to DROP. That chain belongs to the host's
    network namespace: the bridge here forwards inside the switch's own namespace, and br_netfilter
    (bridge-nf-call-iptables, on wherever Docker loaded it) hands bridged frames to *that* namespace's
    tables, which start empty with ACCEPT policies. So Docker does not cut this bridge (measured with
    dockerd 20.10 running, FORWARD DROP: tests/deploy/test_netns_firewall.py). The ACCEPT rule makes it
    hold even where a namespace's FORWARD policy is DROP; it lives in the switch namespace only, never in
    the host's tables, and goes away with the namespace (`Topology.down`).
    """
    if shutil.which("iptables") is None:
        return False
    res = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", "5", "-I", "FORWARD", "-i", "br0", "-o", "br0",
        "-j", "ACCEPT", "-m", "comment", "--comment", "swarmrl-netns-bridge"], capture_output=True, text=True)
    return res.returncode == 0


@dataclass
class Topology:
    """Namespaces + veth + bridge. `up()` builds it, `down()` removes everything it made."""

    prefix: str = field(default_factory=lambda: f"srl{os.getpid() % 100000}")
    hosts: dict[str, str] = field(default_factory=lambda: dict(HOSTS))
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def up(self) -> "Topology":
        sw = self.switch
        _ip("netns", "add", sw)
        self.made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        allow_bridge_forwarding(sw)
        for host, addr in self.hosts.items():
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")  # Ray, vLLM and the servers also use loopback
            # One veth pair per host: `eth0` inside the host, `v-<host>` on the switch's bridge.
            _ip("-n", sw, "link", "add", f"v-{host}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", f"v-{host}", "master", "br0")
            _ip("-n", sw, "link", "set", f"v-{host}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            # A default route on the link, so "which interface reaches the internet" (Ray's node-IP
            # discovery) answers eth0's address instead of failing. Nothing is behind it.
            _ip("-n", ns, "route", "add", "default", "dev", "eth0")
        return self

    def down(self) -> None:
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its veth ends
        self.made.clear()

    def popen(self, host: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
        **kw) -> subprocess.Popen:
        """Start `cmd` inside the host's namespace. `ip netns exec` execs the command, so the PID is the command's."""
        log = log_path.open("ab")
        return subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, **kw)

    def http_get(self, host: str, url: str, headers: dict[str, str] | None = None,
        timeout_s: float = 10.0) -> tuple[int, str]:
        """GET `url` from inside a host's namespace (the test process itself is not on the virtual network)."""
        code = (
            "import json,sys,urllib.request,urllib.error\n"
            "req=urllib.request.Request(sys.argv[1],headers=json.loads(sys.argv[2]))\n"
            "try:\n r=urllib.request.urlopen(req,timeout=float(sys.argv[3])); print(r.status); "
            "sys.stdout.write(r.read().decode())\n"
            "except urllib.error.HTTPError as e: print(e.code); sys.stdout.write(e.read().decode())\n"
            "except Exception as e: print(0); sys.stdout.write(repr(e))\n"
        )
        res = subprocess.run(
            ["ip", "netns", "exec", self.ns(host), sys.executable, "-c", code, url, json.dumps(headers or {}),
            str(timeout_s)],
            capture_output=True, text=True, timeout=timeout_s + 20,
        )
        status, _, body = res.stdout.partition("\n")
        return (int(status) if status.strip().isdigit() else 0), body


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
    """Stop one process we started (by its PID; its session for children such as Ray's)."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Children in the process's own session (Ray's GCS/raylet started by `ray.init()`): by process group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def child_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=str(threads),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/swarmrl-netns-vllm-cache")
    # Proxies would send in-namespace traffic nowhere.
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(key, None)
    env["NO_PROXY"] = env["no_proxy"] = "*"
    return env


SWARMRL = [sys.executable, "-m", "swarmrl"]

# Small enough for a few minutes on 2 cores (the e2e test's settings).
FAST = [
    "--model.init_size", "tiny",
    "--orchestrator.samples_per_prompt", "4",
    "--orchestrator.prompts_per_lease", "2",
    "--orchestrator.sampling.max_tokens", "8",
    "--trainer.samples_per_step", "16",
    "--trainer.checkpoint_every", "1",
    "--trainer.num_threads", "1",
    "--shardcast.shard_bytes", str(256 << 10),
]
WORKER_FAST = ["--max_prompts_per_lease", "2", "--engine.kv_cache_bytes", str(64 << 20), "--num_threads", "1"]


@dataclass
class Cluster:
    """The four hosts running the real processes of one run."""

    topo: Topology
    out: Path
    max_steps: int = 4
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    public_key: str = ""

    @property
    def run_dir(self) -> Path:
        return self.out / "netns"

    @property
    def orch_url(self) -> str:
        return f"http://{self.topo.hosts['orch']}:{ORCH_PORT}"

    @property
    def origin_url(self) -> str:
        return f"http://{self.topo.hosts['orch']}:{ORIGIN_PORT}"

    @property
    def relay_url(self) -> str:
        return f"http://{self.topo.hosts['relay']}:{RELAY_PORT}"

    def log(self, name: str) -> Path:
        return self.out / f"{name}.log"

    def start_run(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        key_path = self.out / "signing_key.pem"
        res = subprocess.run([*SWARMRL, "shardcast", "keygen", "--out", str(key_path)], capture_output=True, text=True,
            cwd=REPO, env=child_env(), check=True)
        self.public_key = json.loads(res.stdout.strip().splitlines()[-1])["public_key"]
        orch = self.topo.hosts["orch"]
        cmd = [
            *SWARMRL, "run", "--config", str(REPO / "configs" / "demo.toml"),
            "--name", "netns", "--output_dir", str(self.out),
            "--num_workers", "0",
            "--trainer.max_steps", str(self.max_steps),
            "--orchestrator.host", orch, "--orchestrator.port", str(ORCH_PORT),
            "--orchestrator.join_tokens", json.dumps([JOIN_TOKEN]),
            "--orchestrator.admin_token", ADMIN_TOKEN,
            "--shardcast.host", orch, "--shardcast.origin_port", str(ORIGIN_PORT),
            "--shardcast.num_relays", "0",
            "--shardcast.advertise_relay_urls", json.dumps([self.relay_url]),
            "--shardcast.signing_key_path", str(key_path),
            *FAST,
        ]
        self.procs["run"] = self.topo.popen("orch", cmd, self.log("run"), env=child_env(), cwd=REPO)

    def start_relay(self) -> None:
        cmd = [
            *SWARMRL, "shardcast", "relay",
            "--upstream", self.origin_url,
            "--root", str(self.out / "relay-root"),
            "--public-key", self.public_key,
            "--host", self.topo.hosts["relay"], "--port", str(RELAY_PORT),
            "--poll-interval-s", "0.5",
        ]
        self.procs["relay"] = self.topo.popen("relay", cmd, self.log("relay"), env=child_env(), cwd=REPO)

    def start_worker(self, host: str) -> None:
        cmd = [
            *SWARMRL, "worker",
            "--orchestrator", self.orch_url,
            "--join-token", JOIN_TOKEN,
            "--name", f"netns-{host}",
            "--model", str(self.run_dir / "base_model"),
            "--work-dir", str(self.out / f"work-{host}"),
            "--no-display",
            *WORKER_FAST,
        ]
        self.procs[host] = self.topo.popen(host, cmd, self.log(host), env=child_env(), cwd=REPO)

    def healthy(self, host: str, url: str) -> bool:
        status, _ = self.topo.http_get(host, url, timeout_s=5)
        return status == 200

    def stop(self) -> None:
        for name in ("w1", "w2", "relay"):
            if name in self.procs:
                stop_process(self.procs[name], timeout_s=10)
        if "run" in self.procs:
            stop_process(self.procs["run"], timeout_s=60, sig=signal.SIGINT)


def wait_for(predicate, timeout_s: float, what: str, procs: dict[str, subprocess.Popen] | None = None,
    poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for name, proc in (procs or {}).items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited (code {proc.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def launch(topo: Topology, out: Path, max_steps: int) -> Cluster:
    """Start orchestrator host, relay host and two worker hosts, in dependency order."""
    c = Cluster(topo, out, max_steps)
    c.start_run()
    wait_for(lambda: c.healthy("orch", c.origin_url + "/v1/versions"), 120,
        "the shardcast origin on the orchestrator host", c.procs)
    c.start_relay()
    wait_for(lambda: c.healthy("relay", c.relay_url + "/v1/versions"), 60, "the relay", c.procs)
    wait_for(lambda: c.healthy("w1", c.orch_url + "/healthz"), 120, "the orchestrator API seen from worker host 1",
        c.procs)
    wait_for(lambda: (c.run_dir / "base_model" / "config.json").exists(), 30, "the run's base model folder", c.procs)
    for host in ("w1", "w2"):
        c.start_worker(host)
    return c


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/swarmrl-multihost"))
    ap.add_argument("--max-steps", type=int, default=4)
    args = ap.parse_args()
    check_netns_support()
    topo = Topology().up()
    cluster = None
    try:
        cluster = launch(topo, args.out, args.max_steps)
        code = cluster.procs["run"].wait(timeout=600)
        print(json.dumps({"run_exit_code": code, "steps": len(metrics_rows(cluster.run_dir)), "logs": str(args.out)}))
        return code
    finally:
        if cluster is not None:
            cluster.stop()
        topo.down()


if __name__ == "__main__":
    sys.exit(main())
