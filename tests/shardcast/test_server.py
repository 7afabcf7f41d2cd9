"""The shard HTTP server: API, Range, path traversal, bad requests, and a relay serving a partial version."""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import httpx
import pytest
from shardcast_helpers import RUN, state_dict

from protocol import api
from protocol.manifests import VersionList
from protocol.models import ErrorBody
from shardcast.origin import Origin
from shardcast.server import ShardServer, serve_origin
from shardcast.store import VersionStore


@pytest.fixture
def served(tmp_path, key):
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20)
    origin.publish(0, state_dict(layers=2))
    origin.publish(1, state_dict(seed=1, layers=2))
    server = serve_origin(origin)
    yield origin, server
    server.stop()


def raw_get(url: str, target: str, headers: str = "") -> tuple[int, bytes]:
    """Send a request line exactly as given (no client-side normalisation of the path)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_versions_manifest_and_shards(served):
    origin, server = served
    with httpx.Client(base_url=server.url) as c:
        assert VersionList.model_validate_json(c.get(api.SHARDCAST_VERSIONS).content).versions == [0, 1]
        r = c.get(api.SHARDCAST_MANIFEST.format(version=1))
        assert r.status_code == 200 and r.content == origin.manifest_bytes(1)
        for s in origin.manifest(1).shards:
            r = c.get(api.SHARDCAST_SHARD.format(version=1, name=s.name))
            assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == s.sha256
            assert r.headers["accept-ranges"] == "bytes" and r.headers["etag"] == f'"{s.sha256}"'
        head = c.head(api.SHARDCAST_SHARD.format(version=1, name=s.name))
        assert head.status_code == 200 and int(head.headers["content-length"]) == s.size and head.content == b""
        assert "shardcast_server_shard_bytes_sent" in c.get("/metrics").text


def test_range_requests(served):
    origin, server = served
    s = origin.manifest(0).shards[0]
    data = (origin.version_dir(0) / s.name).read_bytes()
    path = api.SHARDCAST_SHARD.format(version=0, name=s.name)
    with httpx.Client(base_url=server.url) as c:
        r = c.get(path, headers={"Range": "bytes=100-199"})
        assert r.status_code == 206 and r.content == data[100:200]
        assert r.headers["content-range"] == f"bytes 100-199/{s.size}"
        r = c.get(path, headers={"Range": "bytes=1000-"})
        assert r.status_code == 206 and r.content == data[1000:]
        r = c.get(path, headers={"Range": "bytes=-10"})
        assert r.status_code == 206 and r.content == data[-10:]
        r = c.get(path, headers={"Range": f"bytes=5-{s.size + 100}"})
        assert r.status_code == 206 and r.content == data[5:]
        for bad in (f"bytes={s.size}-", "bytes=20-10", "bytes=-0", "items=1-2", "bytes=-"):
            r = c.get(path, headers={"Range": bad})
            assert r.status_code == 416, bad
            assert r.headers["content-range"] == f"bytes */{s.size}"
        r = c.get(path, headers={"Range": "bytes=0-1,5-9"})  # multi-range: the whole body is allowed
        assert r.status_code == 200 and r.content == data


@pytest.mark.parametrize(
    "target,status",
    [
        ("/v1/versions/0/shards/../manifest.json", 400),
        ("/v1/versions/0/shards/..%2Fmanifest.json", 400),
        ("/v1/versions/0/shards/%2e%2e%2f%2e%2e%2frun-key.pem", 400),
        ("/v1/versions/0/shards/.manifest.json", 400),
        ("/v1/versions/0/shards/a/../../../../etc/passwd", 400),
        ("/v1/versions/0/shards/manifest.json", 404),  # a real file, but not a shard of the manifest
        ("/v1/versions/0/../../run-key.pem", 404),
        ("/v1/versions/99/shards/model-00001-of-00002.safetensors", 404),
        ("/v1/versions/-1/manifest", 404),
        ("/v1/versions/99999999999/manifest", 404),
        ("/etc/passwd", 404),
    ],
)
def test_path_traversal_and_unknown_paths_are_rejected(served, target, status):
    _, server = served
    code, body = raw_get(server.url, target)
    assert code == status
    err = ErrorBody.model_validate_json(body)
    assert err.error.value in ("invalid_request", "not_found")


def test_writes_are_refused_and_garbage_requests_never_500(served):
    _, server = served
    with httpx.Client(base_url=server.url) as c:
        r = c.post(api.SHARDCAST_VERSIONS, content=b"x")
        assert r.status_code == 405 and ErrorBody.model_validate_json(r.content).error.value == "invalid_request"
        assert c.delete(api.SHARDCAST_MANIFEST.format(version=0)).status_code == 405
        assert c.request("BREW", api.SHARDCAST_VERSIONS).status_code == 405
        assert c.get(api.SHARDCAST_VERSIONS).status_code == 200  # the connection was not poisoned
    host, port = server.url.removeprefix("http://").split(":")
    for junk in (b"\x00\x01\x02garbage\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(junk)
            reply = s.recv(4096)
        status = int(reply.split()[1])
        assert 400 <= status < 500 or status == 505, reply[:100]  # 505: HTTP version not supported


def test_relay_store_lists_verified_manifest_and_serves_each_shard_once_verified(tmp_path, key):
    """A version is listed once its manifest is in; a shard is served only after add_shard (verified)."""
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20)
    m = origin.publish(3, state_dict(layers=3))
    store = VersionStore(tmp_path / "relay", keep_versions=2)
    folder = store.begin_partial(3, m, origin.manifest_bytes(3))
    first, second = m.shards[0], m.shards[1]
    (folder / first.name).write_bytes((origin.version_dir(3) / first.name).read_bytes())
    store.add_shard(3, first.name)
    # A second shard's bytes are on disk but not yet verified/added: it must not be served.
    (folder / second.name).write_bytes(b"unverified bytes")
    with ShardServer(store, shard_wait_s=0.0) as server, httpx.Client(base_url=server.url) as c:
        assert c.get(api.SHARDCAST_VERSIONS).json() == {"versions": [3]}
        r = c.get(api.SHARDCAST_SHARD.format(version=3, name=first.name))
        assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == first.sha256
        r = c.get(api.SHARDCAST_SHARD.format(version=3, name=second.name))
        assert r.status_code == 503 and "retry-after" in r.headers
        assert ErrorBody.model_validate_json(r.content).retry_after_s is not None
    # With a wait, a request for a shard still on its way is answered when it arrives.
    (folder / second.name).write_bytes((origin.version_dir(3) / second.name).read_bytes())
    with ShardServer(store, shard_wait_s=30.0) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        arrived = threading.Timer(0.3, store.add_shard, args=(3, second.name))
        arrived.start()
        r = c.get(api.SHARDCAST_SHARD.format(version=3, name=second.name))
        assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == second.sha256
    for s in m.shards[2:]:
        (folder / s.name).write_bytes((origin.version_dir(3) / s.name).read_bytes())
        store.add_shard(3, s.name)
    assert store.complete_versions() == [3] and (tmp_path / "relay" / "v0000000003").is_dir()
    assert not (tmp_path / "relay" / ".partial-v0000000003").exists()


def test_connection_flood_is_refused_with_503_not_served_forever(tmp_path, key):
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20)
    origin.publish(0, state_dict(layers=1))
    with ShardServer(origin, max_connections=2) as server:
        host, port = server.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
        try:
            with socket.create_connection((host, int(port)), timeout=10) as extra:
                reply = extra.recv(4096)
            assert reply.startswith(b"HTTP/1.1 503") and b"rate_limited" in reply
        finally:
            for s in idle:
                s.close()
        # Once the idle connections are gone, requests are served again.
        deadline = 50
        while deadline:
            r = httpx.get(server.url + api.SHARDCAST_VERSIONS)
            if r.status_code == 200:
                break
            deadline -= 1
            threading.Event().wait(0.1)
        assert r.status_code == 200 and r.json() == {"versions": [0]}


def test_one_address_cannot_take_every_connection_nor_hold_one_with_a_trickled_head(tmp_path, key):
    """A slow-loris client: as many connections as it may have, each sending a byte of its request head now
    and then. Its extra connections are refused; each is closed at its head deadline, whatever the trickle;
    another address is served meanwhile."""
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20)
    origin.publish(0, state_dict(layers=1))
    with ShardServer(origin, max_connections=100, max_per_address=4, head_timeout_s=1.5) as server:
        host, port = server.url.removeprefix("http://").split(":")
        loris = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        try:
            with socket.create_connection((host, int(port)), timeout=10) as extra:
                assert extra.recv(4096).startswith(b"HTTP/1.1 503")
            with socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.2", 0)) as other:
                other.sendall(f"GET {api.SHARDCAST_VERSIONS} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert other.recv(4096).startswith(b"HTTP/1.1 200")
            closed_after = []
            t0 = time.monotonic()
            for s in loris:
                s.sendall(b"G")
                s.settimeout(0.25)
            while len(closed_after) < len(loris) and time.monotonic() - t0 < 10:
                for s in loris:
                    if s.fileno() < 0:
                        continue
                    try:
                        s.sendall(b"E")  # a byte every 0.25 s: never silent for the 60 s read timeout
                        if s.recv(4096) == b"":
                            raise ConnectionResetError
                    except TimeoutError:
                        continue
                    except OSError:
                        closed_after.append(time.monotonic() - t0)
                        s.close()
            assert len(closed_after) == len(loris), closed_after  # each closed at its head deadline, not 60 s later
        finally:
            for s in loris:
                s.close()
        for _ in range(50):  # the address may connect again once the server has let go of its sockets
            r = httpx.get(server.url + api.SHARDCAST_VERSIONS)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and r.json() == {"versions": [0]}


def test_a_trusted_proxy_is_not_capped_per_address_but_the_total_cap_holds(tmp_path, key):
    """Behind a Kubernetes ingress every volunteer's download arrives from the ingress pod: capped per address, the
    ingress would carry four downloads at once for the whole swarm. A proxy the operator named is not; the cap on
    all connections still is."""
    origin = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20)
    origin.publish(0, state_dict(layers=1))
    with ShardServer(origin, max_connections=8, max_per_address=4, trusted_proxies=["127.0.0.0/30"]) as server:
        host, port = server.url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(8)]
        try:
            for s in held:
                s.sendall(f"GET {api.SHARDCAST_VERSIONS} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            with socket.create_connection((host, int(port)), timeout=10) as extra:
                assert extra.recv(4096).startswith(b"HTTP/1.1 503")  # over the total
        finally:
            for s in held:
                s.close()
    with pytest.raises(ValueError, match="not an IP address or network"):
        ShardServer(origin, trusted_proxies=["ingress"])


def test_trusted_proxies_reach_the_relays_swarmrl_run_starts(tmp_path):
    from swarmrl.config import RunConfig
    from swarmrl.processes import relay_command

    cfg = RunConfig.model_validate({"shardcast": {"trusted_proxies": ["10.0.0.0/8", "fd00::/8"]}})
    cmd = relay_command("http://origin:9000", "pub", tmp_path / "relay", cfg, port=9200)
    assert cmd[cmd.index("--trusted-proxy") :][:4] == ["--trusted-proxy", "10.0.0.0/8", "--trusted-proxy", "fd00::/8"]
    with pytest.raises(ValueError, match="not an IP address or network"):
        RunConfig.model_validate({"shardcast": {"trusted_proxies": ["10.0.0.0/33"]}})


def test_the_relay_command_refuses_a_trusted_proxy_that_is_not_an_address(tmp_path):
    from typer.testing import CliRunner

    from swarmrl.shardcast_cli import app

    args = ["relay", "--upstream", "http://127.0.0.1:9", "--root", str(tmp_path / "relay"),
            "--public-key", "A" * 43 + "=", "--trusted-proxy", "ingress-nginx"]
    r = CliRunner(env={"COLUMNS": "300"}).invoke(app, args)
    assert r.exit_code == 2 and "not an IP address or network" in r.output, r.output
    assert not (tmp_path / "relay").exists()
