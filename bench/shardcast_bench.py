"""Broadcast a 1 GiB checkpoint origin -> 2 relays -> 4 clients on loopback, side by side with references.

Each round measures, in this order, with a cleanup + `sync` + pause between scenarios (ratios are taken
between scenarios of the same round; every round is reported):
  1. nginx_curl   nginx (Debian, sendfile on) serving the shard files; 4 clients = curl, 4 parallel transfers
                  each, writing the shards (no verification): the raw ceiling of this machine.
  2. nginx_ours   the same nginx serving the same files laid out as our read-only API (static files), pulled by
                  our client (signed manifest, per-shard blake3, streamed into place, atomic folder).
                  This is "the same shards served by nginx to the same clients" of issue 3.
  3. origin_direct  our origin server straight to the same 4 clients (our server in nginx's place).
  4. swarmrl      our origin -> 2 relays (mirroring, verifying every shard) -> 4 clients (relays only).
  5. nginx_relays_curl  the same topology with the field's tools and no verification: the nginx origin -> 2
                  nginx caching proxies (proxy_cache, one fetch per shard per relay, streamed to the client while
                  it is cached) -> 4 curl clients, each taking every other shard from each relay. What the relay
                  hop itself costs on this box, whoever implements it.
  6. pypi_shardcast  PRIME-RL's shardcast 0.3.2 (own venv, --pypi-venv): origin -> 2 middle nodes -> 4
                  clients on one 1 GiB file of the same bytes, 64 MiB shards, all its sleeps set to 1 s.
Clients and relays are separate processes; each waits for a "go" line, and t0 is when the version is
visible at the origin (publishing is timed separately). Goodput = clients * bytes / (last client done - t0).
Each scenario also reports the CPU seconds of all its processes (servers, relays, clients): on one shared
2-core box, throughput is CPU-bound, and the relays' mirroring is paid from the same two cores.

    python bench/shardcast_bench.py [--setup] [--rounds 3] [--gib 1] [--clients 4] [--skip-pypi] [--pypi-venv DIR]
--compact and --resident GIB (both for this VM, whose free memory goes back to its host within seconds and
costs a host fault to touch again) put every scenario on the same footing; see shardcast_notes.md. GIB must
cover all the memory a scenario takes fresh: the relay scenarios write (2 relays + 4 clients) x 1 GiB of page
cache besides their processes, and 6 was measured too little for them (12 is enough).
--setup installs the references if missing: Debian's nginx (apt-get) and a venv with shardcast==0.3.2.
Results: bench/results/shardcast_bench.{json,md}. Everything under bench/.work/shardcast-bench-* is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WORK = REPO / "bench" / ".work"
RESULTS = REPO / "bench" / "results"
PYPI_VENV = WORK / "venv-pypi-shardcast"
RUN_ID = "shardcast-bench"


# -------------------------------------------------------------------------------------------------
# Client processes (they wait for "go" on stdin, then report one JSON line)


def client_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--urls", required=True)
    p.add_argument("--pub", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--parallelism", type=int, default=8)
    a = p.parse_args(argv)
    from shardcast.client import ShardcastClient
    from shardcast.sources import describe_stats

    client = ShardcastClient(a.urls.split(","), a.pub, Path(a.dest), run_id=RUN_ID, parallelism=a.parallelism,
        keep_state=False)
    print("ready", flush=True)
    sys.stdin.readline()
    ready = os.times()
    while client.latest_version() is None:
        time.sleep(0.02)
    pulled = client.pull()
    done = os.times()
    user, system = done.user - ready.user, done.system - ready.system
    cpu = {"startup": round(ready.user + ready.system, 3), "pull": round(user + system, 3), "pull_user": round(user,
        3), "pull_system": round(system, 3)}
    print(json.dumps({"t_done": time.time(), "version": pulled.version, "path": str(pulled.path), "cpu_s": cpu,
        "stats": json.loads(describe_stats(client.stats))}), flush=True)


VMSTAT_KEYS = ("pgalloc_normal", "pgfree", "pgfault", "pgmajfault", "pgsteal_kswapd", "pgsteal_direct",
               "pgscan_kswapd", "pgscan_direct", "allocstall_normal", "compact_stall", "nr_dirty", "nr_writeback",
               "pgpgout", "thp_fault_alloc")


def vmstat() -> dict[str, int]:
    """Counters of /proc/vmstat that say how much page work the kernel did (Linux only; empty elsewhere)."""
    try:
        lines = Path("/proc/vmstat").read_text().split("\n")
    except OSError:
        return {}
    pairs = (line.split() for line in lines if line)
    return {k: int(v) for k, v in pairs if k in VMSTAT_KEYS}


CURL_CLIENT = r"""
import json, subprocess, sys, time
urls, dest = sys.argv[1].split(","), sys.argv[2]
args = ["curl", "--silent", "--fail", "--parallel", "--parallel-max", "4"]
for u in urls:
    args += ["-o", dest + "/" + u.rsplit("/", 1)[1], u]
print("ready", flush=True)
sys.stdin.readline()
subprocess.run(args, check=True)
print(json.dumps({"t_done": time.time()}), flush=True)
"""

# Runs in the PyPI venv. Its servers bind 0.0.0.0 in code; we bind them to loopback only (our rule).
PYPI_ROLE = r"""
import json, os, sys, time
import shardcast.server as srv
_init = srv.ShardcastServer.__init__
def _loopback(self, address, *a, **k):
    _init(self, ("127.0.0.1", address[1]), *a, **k)
srv.ShardcastServer.__init__ = _loopback
role = sys.argv[1]
if role == "origin":
    from shardcast import OriginServer
    data, port, file, shard = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    os.makedirs(data, exist_ok=True)
    open(os.path.join(data, "data1.bin"), "wb").write(b"x" * 1024)  # its downloader probes this file
    origin = OriginServer(data, port)
    print("ready", flush=True)
    sys.stdin.readline()
    t = time.time()
    version = origin.broadcast(file, shard)
    print(json.dumps({"t_published": time.time(), "publish_s": time.time() - t, "version": version}), flush=True)
    sys.stdin.readline()
elif role == "middle":
    from shardcast import MiddleNode
    upstream, data, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.makedirs(data, exist_ok=True)
    open(os.path.join(data, "data1.bin"), "wb").write(b"x" * 1024)
    node = MiddleNode([upstream], data, port, check_interval=1)
    print("ready", flush=True)
    sys.stdin.readline()
elif role == "client":
    from shardcast import ClientNode
    servers, out = sys.argv[2].split(","), sys.argv[3]
    client = ClientNode(servers, out)
    print("ready", flush=True)
    sys.stdin.readline()
    while True:
        versions = client.list_available_versions()
        if versions:
            break
        time.sleep(0.05)
    version = sorted(versions)[-1]
    path = client.download_version(version)
    print(json.dumps({"t_done": time.time(), "ok": path is not None, "path": path}), flush=True)
"""


# -------------------------------------------------------------------------------------------------
# Orchestration helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Processes started by this benchmark; stopped by pid at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict | None = None, wait_ready: bool = True, cwd: Path = REPO,
        role: str = "client", log: Path | None = None) -> subprocess.Popen:
        stderr = open(log, "w") if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd,
            env={**os.environ, **(env or {})})
        proc.role = role  # type: ignore[attr-defined]
        self.procs.append(proc)
        if wait_ready:
            line = proc.stdout.readline()
            if not line:
                tail = log.read_text()[-800:] if log is not None else ""
                raise RuntimeError(f"{role} {[a for a in args if len(a) < 300]} exited before it was ready: {tail}")
            proc.ready_line = line  # type: ignore[attr-defined]
        return proc

    def cpu_by_process(self) -> list[dict]:
        """User + system CPU seconds of every running process of ours (and its threads), from /proc."""
        out = []
        tick = os.sysconf("SC_CLK_TCK")
        for proc in self.procs:
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields[11], [12]: utime, stime; [13], [14]: of waited-for children (curl under its wrapper)
            out.append({"role": getattr(proc, "role", "?"), "cpu_s": round(sum(int(x) for x in fields[11:15]) / tick,
                2)})
        return out

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def go(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()


def results_of(procs: list[subprocess.Popen], timeout: float = 600) -> list[dict]:
    out: list[dict | None] = [None] * len(procs)

    def read(i: int) -> None:
        line = procs[i].stdout.readline()
        out[i] = json.loads(line) if line.strip() else {"error": f"exit {procs[i].wait()}"}

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [o if o is not None else {"error": "timeout"} for o in out]


COMPACT = False  # --compact: settle() also has the kernel compact free memory


def settle() -> None:
    os.sync()
    if COMPACT:
        try:
            Path("/proc/sys/vm/compact_memory").write_text("1\n")
        except OSError as e:
            raise SystemExit(f"--compact needs a writable /proc/sys/vm/compact_memory (root): {e}") from None
    time.sleep(3)


RESIDENT_GIB = 0.0  # --resident: touch this much memory right before each scenario


def make_resident(gib: float) -> float:
    """Touch `gib` GiB of fresh memory and free it; returns the seconds it took. This box is a VM that hands
    free memory back to its host within seconds (free page reporting); the next touch of such a page costs
    a host fault, ~2.3 CPU-s of system time per GiB here against ~0.05 for a page freed a moment ago. Large
    page-cache writes (1 MiB splices) draw on that memory, 16 KiB writes (curl's) hardly do, so without this
    a scenario's cost depends on where the free memory happens to be (shardcast_notes.md). After it, every
    scenario starts with memory the VM holds, as a machine without a hypervisor always does, provided `gib`
    exceeds what the scenario takes: what it takes beyond that is still paid for."""
    import torch

    if gib <= 0:
        return 0.0
    t = time.perf_counter()
    torch.ones(int(gib * (1 << 30)), dtype=torch.uint8)  # written, then freed at once
    return round(time.perf_counter() - t, 2)


def free_blocks_mib() -> dict[str, float]:
    """Free memory of the Normal zone in blocks of at least 64 KiB (order 4) and 2 MiB (order 9), from
    /proc/buddyinfo: how much room the page cache has for large folios, which need contiguous pages."""
    try:
        line = next(x for x in Path("/proc/buddyinfo").read_text().splitlines() if "Normal" in x)
    except (OSError, StopIteration):
        return {}
    counts = [int(c) for c in line.split("Normal", 1)[1].split()]  # free blocks of 4 KiB << order

    def mib(lowest: int) -> float:
        return round(sum(n * (4 << order) for order, n in enumerate(counts) if order >= lowest) / 1024, 1)

    return {"order>=4": mib(4), "order>=9": mib(9)}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def summarize(name: str, t0: float, results: list[dict], bytes_per_client: int, extra: dict | None = None) -> dict:
    ok = all("error" not in r and r.get("ok", True) for r in results)
    done = max(r["t_done"] for r in results) if ok else None
    seconds = done - t0 if ok else None
    row = {
        "scenario": name,
        "ok": ok,
        "seconds_until_all_clients_done": round(seconds, 3) if ok else None,
        "per_client_seconds": [round(r["t_done"] - t0, 3) for r in results if "t_done" in r],
        "aggregate_goodput_MBps": round(len(results) * bytes_per_client / seconds / 1e6, 1) if ok else None,
    }
    if all("cpu_s" in r for r in results):  # our clients: CPU before "go" (interpreter, imports) and for the pull
        row["client_cpu_s"] = {k: round(sum(r["cpu_s"][k] for r in results), 2) for k in ("startup", "pull",
            "pull_user", "pull_system")}
    if not ok:
        row["errors"] = results
    row.update(extra or {})
    print(json.dumps(row), flush=True)
    return row


# -------------------------------------------------------------------------------------------------
# Scenarios


def nginx_conf(work: Path, name: str, workers: int, port: int, locations: str, http_extra: str = "") -> str:
    """One nginx instance's config: its pid, logs and temp folders under `work`, prefixed with `name`."""
    return f"""
worker_processes {workers};
daemon off;
user root;
pid {work}/{name}.pid;
error_log {work}/{name}-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 100000;
  client_body_temp_path {work}/{name}-body;
  proxy_temp_path {work}/{name}-proxy;
  fastcgi_temp_path {work}/{name}-fastcgi;
  uwsgi_temp_path {work}/{name}-uwsgi;
  scgi_temp_path {work}/{name}-scgi;
  default_type application/octet-stream;
{http_extra}
  server {{
    listen 127.0.0.1:{port};
{locations}
  }}
}}
"""


# The origin: the shard files and our read-only API's two JSON answers, as static files.
NGINX_ORIGIN_LOCATIONS = """
    location = /v1/versions {{ default_type application/json; alias {api}/versions.json; }}
    location = /v1/versions/{version}/manifest {{ default_type application/json; alias {vdir}/manifest.json; }}
    location /v1/versions/{version}/shards/ {{ alias {vdir}/; }}
"""

# A caching relay in front of the nginx origin: each shard is fetched upstream once (concurrent requests for
# it wait on the lock) and streamed to the first client while it is written to the cache.
NGINX_RELAY_HTTP = """
  proxy_cache_path {work}/nginx-relay{i}-cache levels=1 keys_zone=relay{i}:10m max_size=8g \
inactive=60m use_temp_path=off;
  upstream origin {{ server {upstream}; keepalive 16; }}
"""
NGINX_RELAY_LOCATIONS = """
    location / {{
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_cache relay{i};
      proxy_cache_valid 200 60m;
      proxy_cache_lock on;
      proxy_cache_lock_timeout 120s;
      proxy_cache_lock_age 120s;
      proxy_max_temp_file_size 0;
    }}
"""


def start_nginx(work: Path, conf_name: str, conf_text: str, port: int, probe: str) -> tuple[subprocess.Popen, str]:
    conf = work / conf_name
    conf.write_text(conf_text)
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(work)], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"nginx did not start; see the error log next to {conf}")


def run_nginx(work: Path, vdir: Path, version: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    api = work / "nginx-api"
    api.mkdir(exist_ok=True)
    (api / "versions.json").write_text(json.dumps({"versions": [version]}))
    conf = nginx_conf(work, "nginx", 2, port, NGINX_ORIGIN_LOCATIONS.format(api=api, vdir=vdir, version=version))
    return start_nginx(work, "nginx.conf", conf, port, "/v1/versions")


def scenario_nginx_curl(work: Path, url: str, manifest, n_clients: int, procs: Procs) -> dict:
    return _curl_pull(work, "nginx_curl", [url], manifest, n_clients, procs)


def scenario_nginx_relays_curl(work: Path, origin_url: str, manifest, n_clients: int, procs: Procs) -> dict:
    """curl through 2 nginx caching relays (cold caches) in front of the nginx origin."""
    relays = []
    try:
        for i in range(2):
            port = free_port()
            http_extra = NGINX_RELAY_HTTP.format(work=work, i=i, upstream=origin_url.removeprefix("http://"))
            conf = nginx_conf(work, f"nginx-relay{i}", 1, port, NGINX_RELAY_LOCATIONS.format(i=i), http_extra)
            relays.append(start_nginx(work, f"nginx-relay{i}.conf", conf, port, "/v1/versions"))
        return _curl_pull(work, "nginx_relays_curl", [url for _, url in relays], manifest, n_clients, procs)
    finally:
        for proc, _ in relays:
            proc.terminate()
            proc.wait(10)
        for i in range(2):
            shutil.rmtree(work / f"nginx-relay{i}-cache", ignore_errors=True)


def _curl_pull(work: Path, scenario: str, servers: list[str], manifest, n_clients: int, procs: Procs) -> dict:
    """4 curl clients; with several servers, client i takes shard j from server (i + j) mod n."""
    clients = []
    for i in range(n_clients):
        urls = ",".join(f"{servers[(i + j) % len(servers)]}/v1/versions/{manifest.version}/shards/{s.name}" for j,
            s in enumerate(manifest.shards))
        dest = work / f"curl-client{i}"
        dest.mkdir()
        clients.append(procs.start([sys.executable, "-c", CURL_CLIENT, urls, str(dest)]))
    t0 = time.time()
    go(clients)
    res = results_of(clients)
    row = summarize(scenario, t0, res, manifest.total_bytes, {"verified": False})
    for i in range(n_clients):
        assert dir_bytes(work / f"curl-client{i}") == manifest.total_bytes
        shutil.rmtree(work / f"curl-client{i}")
    return row


def start_our_clients(work: Path, tag: str, urls: list[str], pub: str, n_clients: int, procs: Procs,
    parallelism: int = 8) -> list[subprocess.Popen]:
    return [
        procs.start([sys.executable, __file__, "_client", "--urls", ",".join(urls), "--pub", pub, "--dest",
        str(work / f"{tag}-client{i}"), "--parallelism", str(parallelism)],
                    log=work / f"{tag}-client{i}.log")
        for i in range(n_clients)
    ]


def check_our_clients(work: Path, tag: str, manifest, res: list[dict], n_clients: int) -> None:
    for i in range(n_clients):
        log = work / f"{tag}-client{i}.log"
        if "error" in res[i]:  # reported in the scenario's row, with the end of its log
            res[i]["log_tail"] = log.read_text()[-1500:] if log.exists() else ""
            shutil.rmtree(work / f"{tag}-client{i}", ignore_errors=True)
            continue
        path = work / f"{tag}-client{i}" / f"v{manifest.version:010d}"
        assert res[i].get("version") == manifest.version, res[i]
        for s in manifest.shards:
            assert (path / s.name).stat().st_size == s.size
        shutil.rmtree(work / f"{tag}-client{i}")


def scenario_nginx_ours(work: Path, url: str, manifest, pub: str, n_clients: int, procs: Procs,
    parallelism: int = 8) -> dict:
    clients = start_our_clients(work, "nginx", [url], pub, n_clients, procs, parallelism)
    t0 = time.time()
    go(clients)
    res = results_of(clients)
    row = summarize("nginx_ours", t0, res, manifest.total_bytes, {"verified": True})
    check_our_clients(work, "nginx", manifest, res, n_clients)
    return row


def scenario_origin_direct(work: Path, origin, manifest, pub: str, n_clients: int, procs: Procs,
    parallelism: int = 8) -> dict:
    """Our origin server straight to the clients: the same job as nginx_ours, our server instead of nginx."""
    from shardcast.server import serve_origin

    server = serve_origin(origin, "127.0.0.1", 0)
    try:
        clients = start_our_clients(work, "direct", [server.url], pub, n_clients, procs, parallelism)
        t0 = time.time()
        go(clients)
        res = results_of(clients)
    finally:
        server.stop()
    row = summarize("origin_direct", t0, res, manifest.total_bytes, {"verified": True})
    check_our_clients(work, "direct", manifest, res, n_clients)
    return row


def scenario_swarmrl(work: Path, origin, manifest, pub: str, n_clients: int, procs: Procs, relay_parallelism: int,
    parallelism: int = 8) -> dict:
    from shardcast.server import serve_origin

    port = free_port()
    origin_url = f"http://127.0.0.1:{port}"
    relay_urls = []
    for i in range(2):
        relay = procs.start(
            [sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", "relay", "--upstream", origin_url,
             "--root", str(work / f"relay{i}"), "--public-key", pub, "--run-id", RUN_ID, "--poll-interval-s", "0.05",
             "--log-level", "ERROR", "--parallelism", str(relay_parallelism)],
            role="relay",
        )
        relay_urls.append(json.loads(relay.ready_line)["url"])
    clients = start_our_clients(work, "swarmrl", relay_urls, pub, n_clients, procs, parallelism)
    go(clients)  # they poll the relays, which list nothing until the origin serves
    t0 = time.time()
    server = serve_origin(origin, "127.0.0.1", port)  # the version becomes visible now
    try:
        res = results_of(clients)
    finally:
        server.stop()
    row = summarize("swarmrl", t0, res, manifest.total_bytes, {"verified": True, "client_stats": [r.get("stats")
        for r in res]})
    check_our_clients(work, "swarmrl", manifest, res, n_clients)
    return row


def scenario_pypi(work: Path, vdir: Path, manifest, n_clients: int, shard_bytes: int, procs: Procs) -> dict:
    python = str(PYPI_VENV / "bin" / "python")
    # -E -P: never import our own `shardcast` (same import name), neither from the cwd nor from a PYTHONPATH that
    # names this repository (as our tests' environment does)
    pypi = [python, "-E", "-P", "-c", PYPI_ROLE]
    if not Path(python).exists():
        return {"scenario": "pypi_shardcast", "ok": False,
            "error": f"no venv at {PYPI_VENV}: python -m venv ... && pip install shardcast==0.3.2"}
    # PyPI shardcast broadcasts one file: the same bytes, our shards concatenated.
    blob = work / "checkpoint.bin"
    with open(blob, "wb") as out:
        for s in manifest.shards:
            with open(vdir / s.name, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    size = blob.stat().st_size
    env = {"SHARDCAST_FAST_RETRY_INTERVAL": "1", "SHARDCAST_SLOW_RETRY_INTERVAL": "1", "SHARDCAST_LOG_LEVEL": "WARNING"}
    settle()
    try:
        return _run_pypi(work, pypi, env, blob, size, n_clients, shard_bytes, procs)
    except RuntimeError as e:  # a reference that fails is reported, and the run goes on
        return {"scenario": "pypi_shardcast", "ok": False, "error": str(e)[:2000]}


def _run_pypi(work: Path, pypi: list[str], env: dict, blob: Path, size: int, n_clients: int, shard_bytes: int,
    procs: Procs) -> dict:
    port = free_port()
    origin = procs.start(pypi + ["origin", str(work / "pypi-origin"), str(port), str(blob), str(shard_bytes)], env=env,
        cwd=work, role="origin", log=work / "pypi-origin.log")
    middle_urls = []
    for i in range(2):
        mport = free_port()
        procs.start(pypi + ["middle", f"http://127.0.0.1:{port}", str(work / f"pypi-middle{i}"), str(mport)], env=env,
            cwd=work, role="relay", log=work / f"pypi-middle{i}.log")
        middle_urls.append(f"http://127.0.0.1:{mport}")
    time.sleep(1.5)  # its middle nodes must have polled the (empty) origin once before clients probe them
    clients = [procs.start(pypi + ["client", ",".join(middle_urls), str(work / f"pypi-client{i}")], env=env, cwd=work,
        log=work / f"pypi-client{i}.log") for i in range(n_clients)]
    go(clients)
    go([origin])
    published = json.loads(origin.stdout.readline())
    res = results_of(clients)
    row = summarize("pypi_shardcast", published["t_published"], res, size, {"verified": "whole-file checksum only",
        "publish_s": round(published["publish_s"], 2), "sleeps_s": 1})
    return row


RATIOS = {  # name: (numerator scenario, denominator scenario); goodput over goodput, measured in the same round
    "swarmrl_relays_over_nginx_curl": ("swarmrl", "nginx_curl"),
    "origin_direct_over_nginx_curl": ("origin_direct", "nginx_curl"),
    "swarmrl_relays_over_nginx_ours": ("swarmrl", "nginx_ours"),
    "origin_direct_over_nginx_ours": ("origin_direct", "nginx_ours"),
    "nginx_ours_over_nginx_curl": ("nginx_ours", "nginx_curl"),
    "swarmrl_relays_over_pypi_shardcast": ("swarmrl", "pypi_shardcast"),
    "nginx_relays_curl_over_nginx_curl": ("nginx_relays_curl", "nginx_curl"),
    "swarmrl_relays_over_nginx_relays_curl": ("swarmrl", "nginx_relays_curl"),
}


def round_ratios(rows: list[dict]) -> dict[str, float | None]:
    by = {r["scenario"]: r for r in rows}
    out = {}
    for name, (a, b) in RATIOS.items():
        x, y = by.get(a, {}).get("aggregate_goodput_MBps"), by.get(b, {}).get("aggregate_goodput_MBps")
        out[name] = round(x / y, 3) if x and y else None
    return out


def spread(values: list[float]) -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return "—"
    mid = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return f"{mid:.3g} [{values[0]:.3g}–{values[-1]:.3g}]"


def write_results(out: str, rounds: list[list[dict]], meta: dict) -> None:
    ratios = [round_ratios(rows) for rows in rounds]
    doc = {"meta": meta, "rounds": [{"scenarios": rows, "ratios": r} for rows, r in zip(rounds, ratios)]}
    Path(out + ".json").write_text(json.dumps(doc, indent=2) + "\n")
    scenarios = list(dict.fromkeys(r["scenario"] for rows in rounds for r in rows))
    lines = [
        "# shardcast broadcast benchmark",
        "",
        f"`{meta['command']}` — {meta['when']}, {meta['gib']} GiB in {meta['shards']} shards, {meta['clients']} "
        f"clients, loopback, "
        f"{os.cpu_count()} cores shared with other jobs (load before: {meta['loadavg_before']}, after: "
        f"{meta.get('loadavg_after')}). "
        f"{len(rounds)} rounds after one warm-up pull (origin_direct, not in the tables; its figures are in the "
        f"JSON's meta); in each round, every scenario ran once, in this order, with a cleanup + sync + pause between"
        + (" and free memory compacted before each (--compact)" if meta.get("compact") else "")
        + (f"; right before each, {meta['resident_gib']} GiB of memory touched and freed (--resident), so that no "
        f"scenario starts on memory this VM had handed back to its host." if meta.get("resident_gib") else "."),
        "",
        "Median [min–max] over the rounds:",
        "",
        "| scenario | verified | all clients done (s) | aggregate goodput (MB/s) | CPU s, all processes |",
        "|---|---|---|---|---|",
    ]
    for name in scenarios:
        rs = [r for rows in rounds for r in rows if r["scenario"] == name]
        lines.append(
            f"| {name} | {rs[0].get('verified')} | {spread([r.get('seconds_until_all_clients_done') for r in rs])} | "
            f"{spread([r.get('aggregate_goodput_MBps') for r in rs])} | "
            f"{spread([r.get('cpu_seconds_all_processes') for r in rs])} |"
        )
    lines += ["", "Where the CPU seconds went, per round (our clients: before \"go\" / during the pull):", ""]
    for name in scenarios:
        cells = []
        for rows in rounds:
            for r in rows:
                if r["scenario"] == name and r.get("cpu_seconds_by_role"):
                    cell = ", ".join(f"{k} {v}" for k, v in r["cpu_seconds_by_role"].items())
                    if r.get("client_cpu_s"):
                        cell += f" (clients {r['client_cpu_s']['startup']} / {r['client_cpu_s']['pull']})"
                    cells.append(cell)
        if cells:
            lines.append(f"- {name}: " + "; ".join(cells))
    lines += ["",
        "Free memory in blocks of 2 MiB or more before each scenario (MiB, per round; large folios need them):", ""]
    for name in scenarios:
        cells = [str(r.get("free_MiB_in_blocks_before", {}).get("order>=9", "—")) for rows in rounds for r in rows
            if r["scenario"] == name]
        lines.append(f"- {name}: " + ", ".join(cells))
    lines += ["", "Goodput ratios, each from scenarios of the same round:", "",
        "| ratio | median [min–max] | every round |", "|---|---|---|"]
    for name in RATIOS:
        vals = [r[name] for r in ratios]
        if any(v is not None for v in vals):
            lines.append(f"| {name} | {spread(vals)} | {', '.join('—' if v is None else str(v) for v in vals)} |")
    lines += ["", "Every run (all clients done, s / goodput MB/s):", ""]
    for name in scenarios:
        cells = [f"{r.get('seconds_until_all_clients_done')} / {r.get('aggregate_goodput_MBps')}" for rows in rounds
            for r in rows if r["scenario"] == name]
        lines.append(f"- {name}: " + "; ".join(cells))
    lines += ["",
        f"publish (origin: split, serialize, sha256 and blake3, fsync, sign) of {meta['gib']} GiB: "
        f"{meta['publish_s']} s"]
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def setup_references(pypi_venv: Path) -> None:
    """nginx (Debian's package) and PyPI shardcast 0.3.2 in its own venv: the benchmark's references."""
    if shutil.which("nginx") is None:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "nginx"], check=True)
        if Path("/run/nginx.pid").exists():  # the package may start its service: stop it (our nginx runs on its own)
            subprocess.run(["nginx", "-s", "stop"], check=False)
    if not (pypi_venv / "bin" / "python").exists():
        subprocess.run(["python3", "-m", "venv", str(pypi_venv)], check=True)  # the system Python: not our venv
        subprocess.run([str(pypi_venv / "bin" / "pip"), "install", "-q", "shardcast==0.3.2"], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--shard-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3,
        help="every scenario once per round; ratios are taken within a round")
    p.add_argument("--skip-pypi", action="store_true")
    p.add_argument("--pypi-rounds", type=int, default=1, help="rounds that include PyPI shardcast (slow: its sleeps)")
    p.add_argument("--skip-nginx", action="store_true")
    p.add_argument("--setup", action="store_true", help="install nginx and the PyPI shardcast venv if missing")
    p.add_argument("--pypi-venv", default=str(WORK / "venv-pypi-shardcast"))
    p.add_argument("--relay-parallelism", type=int, default=2)
    p.add_argument("--client-parallelism", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "shardcast_bench"))
    p.add_argument("--compact", action="store_true",
        help="compact free memory before every scenario (root): each starts from the same unfragmented state")
    p.add_argument("--resident", type=float, default=0.0, metavar="GIB",
                   help="touch GIB of memory right before every scenario, so that none starts on memory this VM "
                   "handed back to its host; "
                        "twice the page cache a scenario writes, 2 x (relays + clients) x --gib, covers it (12 at the "
                        "defaults)")
    a = p.parse_args()

    import torch

    from shardcast.keys import generate_signing_key, public_key_b64
    from shardcast.origin import Origin

    global PYPI_VENV, COMPACT, RESIDENT_GIB
    PYPI_VENV = Path(a.pypi_venv)
    COMPACT = a.compact
    RESIDENT_GIB = a.resident
    if a.setup:
        setup_references(PYPI_VENV)
    WORK.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shardcast-bench-", dir=WORK))
    procs = Procs()
    rounds: list[list[dict]] = []
    meta = {"command": "python " + " ".join(["bench/shardcast_bench.py"] + sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gib": a.gib, "clients": a.clients,
            "loadavg_before": [round(x, 2) for x in os.getloadavg()], "compact": a.compact, "resident_gib": a.resident}
    try:
        key = generate_signing_key(work / "run-key.pem")
        pub = public_key_b64(key)
        shard_bytes = a.shard_mib << 20
        # bf16 tensors of shard_bytes each, HF-style names: 1 GiB = 16 shards of 64 MiB.
        n = max(1, int(a.gib * (1 << 30)) // shard_bytes)
        cols = shard_bytes // 2 // 4096
        g = torch.Generator().manual_seed(0)
        state = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4096, cols, generator=g).to(torch.bfloat16)
            for i in range(n)}
        origin = Origin(work / "origin", key, run_id=RUN_ID, keep_versions=2, shard_bytes=shard_bytes)
        t = time.perf_counter()
        manifest = origin.publish(1, state)
        meta["publish_s"] = round(time.perf_counter() - t, 2)
        meta["shards"] = len(manifest.shards)
        meta["total_bytes"] = manifest.total_bytes
        del state
        vdir = origin.version_dir(1)
        settle()

        def measured(rows: list[dict], run) -> dict:
            """Run one scenario; add the CPU seconds of every process it used (children reaped, plus ours)."""
            resident_s = make_resident(RESIDENT_GIB)  # before the CPU is read: not the scenario's work
            c0, s0 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
            vm0, free0 = vmstat(), free_blocks_mib()
            row = run()
            vm1 = vmstat()
            # The kernel's page work during the scenario (4 KiB pages): the clients' extra CPU through relays is system
            # time.
            row["vmstat_delta"] = {k: vm1[k] - vm0[k] for k in vm0 if k in vm1 and vm1[k] != vm0[k]}
            row["free_MiB_in_blocks_before"] = free0
            if RESIDENT_GIB:
                row["made_resident_before"] = {"GiB": RESIDENT_GIB, "seconds": resident_s}
            by_process = procs.cpu_by_process()
            procs.stop_all()
            c1, s1 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
            own = (s1.ru_utime - s0.ru_utime) + (s1.ru_stime - s0.ru_stime)
            cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime) + own
            row["cpu_seconds_all_processes"] = round(cpu, 1)
            # Where it went: the bench process hosts our origin server; relays are read from /proc before they stop;
            # "other" is nginx and curl (or what a process did after /proc was read).
            roles = {"bench process (our origin server)": round(own, 2)}
            for p in by_process:
                roles[p["role"]] = round(roles.get(p["role"], 0) + p["cpu_s"], 2)
            roles["other"] = round(cpu - sum(roles.values()), 2)
            row["cpu_seconds_by_role"] = roles
            row["round"] = len(rounds)
            rows.append(row)
            settle()
            return row

        def with_nginx(scenario):
            def run():
                proc, url = run_nginx(work, vdir, 1)
                try:
                    return scenario(url)
                finally:
                    proc.terminate()
                    proc.wait(10)
            return run

        # A warm-up pull, not reported: the first scenario after the publish took 2-4x the kernel time of the
        # same scenario later (origin_direct 6.8 vs 1.8 CPU-s of client system time; nginx_curl 13.3 vs 6.1-8.6
        # CPU-s), which favoured whichever scenario ran second in round 1 (shardcast_notes.md).
        warmup = measured([], lambda: scenario_origin_direct(work, origin, manifest, pub, a.clients, procs,
            a.client_parallelism))
        meta["warmup_origin_direct"] = {k: warmup.get(k) for k in ("seconds_until_all_clients_done", "client_cpu_s",
            "vmstat_delta")}
        for i in range(a.rounds):
            rows: list[dict] = []
            if not a.skip_nginx:
                measured(rows, with_nginx(lambda url: scenario_nginx_curl(work, url, manifest, a.clients, procs)))
                measured(rows, with_nginx(lambda url: scenario_nginx_ours(work, url, manifest, pub, a.clients, procs,
                    a.client_parallelism)))
            measured(rows, lambda: scenario_origin_direct(work, origin, manifest, pub, a.clients, procs,
                a.client_parallelism))
            measured(rows, lambda: scenario_swarmrl(work, origin, manifest, pub, a.clients, procs, a.relay_parallelism,
                a.client_parallelism))
            if not a.skip_nginx:
                measured(rows, with_nginx(lambda url: scenario_nginx_relays_curl(work, url, manifest, a.clients,
                    procs)))
            for j in range(2):
                shutil.rmtree(work / f"relay{j}", ignore_errors=True)
            if not a.skip_pypi and i < a.pypi_rounds:
                measured(rows, lambda: scenario_pypi(work, vdir, manifest, a.clients, shard_bytes, procs))
                for j in ("pypi-origin", "pypi-middle0", "pypi-middle1", "pypi-client0", "pypi-client1",
                    "pypi-client2", "pypi-client3", "checkpoint.bin"):
                    shutil.rmtree(work / j,
                        ignore_errors=True) if (work / j).is_dir() else (work / j).unlink(missing_ok=True)
            rounds.append(rows)
        meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        write_results(a.out, rounds, meta)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        client_main(sys.argv[2:])
    else:
        main()
