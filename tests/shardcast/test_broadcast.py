"""Real broadcast on loopback: an origin, two relays, three clients, and the faults of issue 3 item 5."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from shardcast_helpers import REPO, RUN, start_cli, state_dict, stop_proc, tmpfs

from protocol import api
from shardcast.client import ShardcastClient, ShardcastError
from shardcast.file_fetch import FileJob
from shardcast.keys import public_key_b64
from shardcast.origin import Origin
from shardcast.relay import Relay
from shardcast.server import REQUESTS, SHARD_BYTES_SERVED, ShardServer, serve_origin, serve_relay
from shardcast.store import MANIFEST_FILE, DiskFullError, FolderInUse, VersionStore, lock_folder
from shardcast.transfer import ServerPool
from shardcast.weights import load_version_dir, model_hash


def wait_until(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def relay_has(url: str, version: int) -> bool:
    try:
        return version in httpx.get(url + api.SHARDCAST_VERSIONS, timeout=5).json()["versions"]
    except httpx.HTTPError:
        return False


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture
def origin(tmp_path, key):
    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=3, shard_bytes=1 << 20)
    o.publish(0, state_dict(seed=0, layers=8))
    server = serve_origin(o)
    yield o, server
    server.stop()


@pytest.fixture
def running():
    """Collects relays and servers to stop at the end of a test."""
    things: list = []
    yield things
    for t in reversed(things):
        t.stop()


def start_relay(running, upstream: list[str], root: Path, pub: str, **kw) -> tuple[Relay, ShardServer]:
    relay = Relay(upstream, root, pub, run_id=RUN, poll_interval_s=0.05, **kw)
    server = serve_relay(relay)
    relay.start()
    running += [relay, server]
    return relay, server


def test_origin_two_relays_three_clients(tmp_path, pub, origin, running):
    o, origin_server = origin
    relay1, r1 = start_relay(running, [origin_server.url], tmp_path / "relay1", pub)
    # The second relay mirrors the first (a relay of a relay) and starts empty.
    relay2, r2 = start_relay(running, [r1.url], tmp_path / "relay2", pub)
    orders = [[r1.url, r2.url, origin_server.url], [r2.url, r1.url], [r2.url]]
    clients = [ShardcastClient(urls, pub, tmp_path / f"client{i}", run_id=RUN, parallelism=4, seed=i) for i,
        urls in enumerate(orders)]
    wait_until(lambda: relay_has(r2.url, 0), what="relay2 to list version 0")

    results: dict[int, object] = {}

    def pull(i: int) -> None:
        try:
            results[i] = clients[i].pull()
        except Exception as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = files_of(o.version_dir(0))
    for i in range(3):
        pulled = results[i]
        assert not isinstance(pulled, Exception), pulled
        assert pulled.version == 0 and pulled.path == tmp_path / f"client{i}" / "v0000000000"
        assert files_of(pulled.path) == expected
        assert model_hash(load_version_dir(pulled.path)) == o.manifest(0).model_hash
        assert not any(p.name.startswith(".") for p in pulled.path.iterdir())

    # A new version flows through both relays; every client gets it; relays keep the window.
    o.publish(1, state_dict(seed=1, layers=8))
    wait_until(lambda: relay_has(r2.url, 1), what="version 1 at relay2")
    for c in clients:
        assert c.latest_version() == 1
        assert c.pull().version == 1
    # A relay serves each shard as soon as it is verified and marks the version complete a moment later.
    wait_until(lambda: relay1.store.complete_versions() == [0, 1], what="relay1 to complete version 1")
    wait_until(lambda: relay2.store.complete_versions() == [0, 1], what="relay2 to complete version 1")
    assert files_of(tmp_path / "relay2" / "v0000000001") == files_of(o.version_dir(1))


def test_relay_killed_mid_download_client_finishes_elsewhere(tmp_path, pub, origin, running):
    o, origin_server = origin
    proc, info = start_cli("relay", "--upstream", origin_server.url, "--root", str(tmp_path / "doomed"),
        "--public-key", pub, "--poll-interval-s", "0.05")
    try:
        doomed = info["url"]
        _, healthy = start_relay(running, [origin_server.url], tmp_path / "healthy", pub)
        wait_until(lambda: relay_has(doomed, 0) and relay_has(healthy.url, 0), what="both relays to list version 0")
        killed = threading.Event()

        def on_progress(url: str, shard: str, done: int) -> None:
            if url == doomed and not killed.is_set():
                os.kill(proc.pid, signal.SIGKILL)  # the relay's host dies while it sends us a shard
                proc.wait()
                killed.set()

        client = ShardcastClient([doomed, healthy.url], pub, tmp_path / "client", run_id=RUN, parallelism=2, seed=0,
            on_progress=on_progress, chunk_bytes=64 << 10)
        client.stats[doomed].throughput = 1e12  # it looks fastest, so it is picked first
        client.stats[healthy.url].throughput = 1.0
        pulled = client.pull()
        assert killed.is_set(), "the doomed relay was never used"
        assert files_of(pulled.path) == files_of(o.version_dir(0))
        assert client.stats[healthy.url].bytes > 0
    finally:
        stop_proc(proc)


def test_tampering_relay_is_detected_per_shard_and_avoided(tmp_path, pub, origin, running):
    o, origin_server = origin
    relay, bad = start_relay(running, [origin_server.url], tmp_path / "compromised", pub)
    wait_until(lambda: relay.store.complete_versions() == [0], what="relay to mirror version 0")
    # The relay host is compromised after verification: every shard on its disk is altered in place.
    for s in o.manifest(0).shards:
        with open(tmp_path / "compromised" / "v0000000000" / s.name, "r+b") as f:
            f.seek(s.size // 2)
            byte = f.read(1)
            f.seek(s.size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    parallelism = 2
    client = ShardcastClient([bad.url, origin_server.url], pub, tmp_path / "client", run_id=RUN,
        parallelism=parallelism, seed=0)
    client.stats[bad.url].throughput = 1e12
    client.stats[origin_server.url].throughput = 1.0
    pulled = client.pull()
    assert files_of(pulled.path) == files_of(o.version_dir(0))
    assert "signed blake3" in (client.stats[bad.url].banned or "")
    # Detected per shard: at most one shard per download thread came from the bad relay, not the whole version.
    shard_size = max(s.size for s in o.manifest(0).shards)
    assert client.stats[bad.url].bytes <= parallelism * shard_size < o.manifest(0).total_bytes


def _unsigned_server(tmp_path, running) -> str:
    forger = Origin(tmp_path / "unsigned", Ed25519PrivateKey.generate(), run_id=RUN, shard_bytes=1 << 20)
    m = forger.publish(6, state_dict(seed=66, layers=2))
    (forger.version_dir(6) / MANIFEST_FILE).write_text(m.model_copy(update={"signature": ""}).model_dump_json())
    server = ShardServer(VersionStore(tmp_path / "unsigned", keep_versions=3))
    running.append(server)
    return server.url


def test_forged_and_unsigned_manifests_are_rejected(tmp_path, pub, origin, running):
    o, origin_server = origin
    # A forger signs a newer "version" with its own key; another server offers an unsigned one.
    forger = Origin(tmp_path / "forger", Ed25519PrivateKey.generate(), run_id=RUN, shard_bytes=1 << 20)
    forger.publish(5, state_dict(seed=55, layers=2))
    forged = serve_origin(forger)
    running.append(forged)
    unsigned = _unsigned_server(tmp_path, running)

    client = ShardcastClient([forged.url, unsigned, origin_server.url], pub, tmp_path / "client", run_id=RUN, seed=0)
    pulled = client.pull()
    assert pulled.version == 0 and files_of(pulled.path) == files_of(o.version_dir(0))
    assert "forged" in client.stats[forged.url].banned
    assert "unsigned" in client.stats[unsigned].banned
    assert not (tmp_path / "client" / "v0000000005").exists() and not (tmp_path / "client" / "v0000000006").exists()

    lone = ShardcastClient([forged.url], pub, tmp_path / "lone", run_id=RUN)
    with pytest.raises(ShardcastError, match="forged"):
        lone.pull()
    assert list((tmp_path / "lone").iterdir()) == []

    # A relay never lists (so never serves) a version whose manifest does not verify.
    relay = Relay([forged.url, unsigned], tmp_path / "relay", pub, run_id=RUN)
    assert relay.sync_once() == [] and relay.versions() == []


def test_client_disk_full_is_a_clear_error_and_leaves_nothing(tmp_path, pub, origin):
    o, origin_server = origin
    total = o.manifest(0).total_bytes
    # Not enough room from the start: refused before downloading.
    with tmpfs(total // 2) as small:
        client = ShardcastClient([origin_server.url], pub, small / "dest", run_id=RUN)
        with pytest.raises(DiskFullError, match="needs"):
            client.pull()
        assert list((small / "dest").iterdir()) == []
    # Room at the start, but another process fills the disk mid-download.
    with tmpfs(total + (2 << 20)) as fs:
        filler = fs / "filler"

        def fill_disk(url, shard, done):
            if not filler.exists():
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * (256 << 10))
                            f.flush()
                    except OSError as e:
                        assert e.errno == errno.ENOSPC

        client = ShardcastClient([origin_server.url], pub, fs / "dest", run_id=RUN, on_progress=fill_disk,
            chunk_bytes=256 << 10)
        with pytest.raises(DiskFullError, match="no space left"):
            client.pull()
        assert list((fs / "dest").iterdir()) == [], "a half-written version was left behind"
        filler.unlink()
        plain = ShardcastClient([origin_server.url], pub, fs / "dest", run_id=RUN)
        assert files_of(plain.pull().path) == files_of(o.version_dir(0))


def test_resume_partial_download(tmp_path, pub, origin):
    """A pull interrupted earlier resumes: verified shards are kept, partial ones continue with Range."""
    o, origin_server = origin
    m = o.manifest(0)
    src = o.version_dir(0)
    staging = tmp_path / "client" / ".partial-v0000000000"
    staging.mkdir(parents=True)
    (staging / MANIFEST_FILE).write_bytes(m.model_dump_json().encode())
    done, half, garbage = m.shards[0], m.shards[1], m.shards[2]
    (staging / done.name).write_bytes((src / done.name).read_bytes())
    (staging / f".{half.name}.part").write_bytes((src / half.name).read_bytes()[: half.size // 2])
    (staging / f".{garbage.name}.part").write_bytes(b"\x42" * (garbage.size // 2))  # a corrupt leftover

    sent_before = SHARD_BYTES_SERVED._value.get()
    ranged_before = REQUESTS.labels("shard", "206")._value.get()
    client = ShardcastClient([origin_server.url], pub, tmp_path / "client", run_id=RUN, parallelism=1)
    pulled = client.pull()
    assert files_of(pulled.path) == files_of(src)
    assert REQUESTS.labels("shard", "206")._value.get() - ranged_before == 2
    rest = sum(s.size for s in m.shards[3:])
    expected = (half.size - half.size // 2) + (garbage.size - garbage.size // 2) + garbage.size + rest
    assert _served_since(sent_before, expected) == expected
    assert client.stats[origin_server.url].banned is None  # a bad resume is nobody's fault: start over


def test_origin_keeps_a_version_that_is_being_downloaded(tmp_path, pub, key):
    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=1, shard_bytes=1 << 20)  # default grace period
    o.publish(0, state_dict(layers=6))
    published = threading.Event()

    def publish_more(url, shard, done):
        if not published.is_set():
            published.set()
            o.publish(1, state_dict(seed=1, layers=2))
            o.publish(2, state_dict(seed=2, layers=2))

    with serve_origin(o) as server:
        client = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, parallelism=1,
            on_progress=publish_more, chunk_bytes=64 << 10)
        pulled = client.pull(0)
        assert published.is_set() and pulled.version == 0
        assert files_of(pulled.path) == files_of(o.version_dir(0))
        assert 0 in o.versions()  # beyond keep_versions=1, but in use: kept for the grace period
    o.grace_s = 0
    o.prune()
    assert o.versions() == [2]


def test_cli_origin_relay_pull(tmp_path, tiny_model_dir):
    from shardcast.keys import load_or_generate_signing_key

    # Published here (torch is already loaded); the origin process then serves the folder without torch.
    Origin(tmp_path / "origin", load_or_generate_signing_key(tmp_path / "key.pem"), run_id=RUN,
        shard_bytes=64 << 10).publish(4, load_version_dir(tiny_model_dir))
    origin_proc, origin_info = start_cli("origin", "--root", str(tmp_path / "origin"), "--key",
        str(tmp_path / "key.pem"), "--run-id", RUN)
    try:
        pub = origin_info["public_key"]
        assert origin_info["versions"] == [4]
        # No --run-id: the relay follows the run its upstream signs.
        relay_proc, relay_info = start_cli("relay", "--upstream", origin_info["url"], "--root",
            str(tmp_path / "relay"), "--public-key", pub, "--poll-interval-s", "0.05")
        try:
            wait_until(lambda: relay_has(relay_info["url"], 4), what="the relay to list version 4")
            import json
            import subprocess
            import sys

            out = subprocess.run(
                [sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", "pull", "--server",
                relay_info["url"], "--public-key", pub, "--run-id", RUN, "--dest", str(tmp_path / "dest")],
                capture_output=True, text=True, timeout=120, check=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            assert result["version"] == 4
            original = load_version_dir(tiny_model_dir)
            pulled = load_version_dir(Path(result["path"]))
            assert set(pulled) == set(original) and all((pulled[k] == original[k]).all() for k in original)
            assert result["model_hash"] == model_hash(original)
            bad = subprocess.run(
                [sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", "pull", "--server",
                relay_info["url"], "--public-key", public_key_b64(Ed25519PrivateKey.generate()), "--run-id", RUN,
                "--dest", str(tmp_path / "dest2")],
                capture_output=True, text=True, timeout=120,
            )
            assert bad.returncode == 1 and "forged" in bad.stderr and not (tmp_path / "dest2" / "v0000000004").exists()
            other_run = subprocess.run(
                [sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", "pull", "--server",
                relay_info["url"], "--public-key", pub, "--run-id", "a-later-run", "--dest", str(tmp_path / "dest4")],
                capture_output=True, text=True, timeout=120,
            )
            assert other_run.returncode == 1 and f"belongs to run '{RUN}'" in other_run.stderr and not (
                tmp_path / "dest4" / "v0000000004").exists()
            garbled = subprocess.run(
                [sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", "pull", "--server",
                relay_info["url"], "--public-key", "A" * 44, "--run-id", RUN, "--dest", str(tmp_path / "dest3")],
                capture_output=True, text=True, timeout=120,
            )
            assert garbled.returncode == 2 and "public-key" in garbled.stderr
        finally:
            stop_proc(relay_proc)
    finally:
        stop_proc(origin_proc)


def _served_since(before: float, want: float, timeout_s: float = 10.0) -> float:
    """Shard bytes the servers counted since `before`. The server thread counts after sendfile returns, which can
    be after the client has read every byte: wait (briefly) for the count to reach `want` before comparing."""
    deadline = time.monotonic() + timeout_s
    while SHARD_BYTES_SERVED._value.get() - before < want and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # and a little longer, so that a count above `want` is seen too
    return SHARD_BYTES_SERVED._value.get() - before


def _flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 1]))


def test_restarted_relay_rehashes_its_disk_before_serving(tmp_path, pub, origin):
    o, origin_server = origin
    m = o.manifest(0)
    first = Relay([origin_server.url], tmp_path / "relay", pub, run_id=RUN)
    assert first.sync_once() == [0]
    _flip_byte(tmp_path / "relay" / "v0000000000" / m.shards[1].name)  # damaged while the relay was down

    again = Relay([origin_server.url], tmp_path / "relay", pub, run_id=RUN)
    assert again.versions() == [0]  # the manifest re-verified; no shard is served before it is re-hashed
    with ShardServer(again.store) as server, httpx.Client(base_url=server.url) as c:
        assert c.get(api.SHARDCAST_SHARD.format(version=0, name=m.shards[0].name)).status_code == 503
        sent_before = SHARD_BYTES_SERVED._value.get()
        assert again.sync_once() == [0]
        # Only the damaged shard was fetched again from the origin.
        assert _served_since(sent_before, m.shards[1].size) == m.shards[1].size
        for s in m.shards:
            r = c.get(api.SHARDCAST_SHARD.format(version=0, name=s.name))
            assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == s.sha256


def test_client_rechecks_a_version_folder_from_an_earlier_process(tmp_path, pub, origin):
    o, origin_server = origin
    m = o.manifest(0)
    pulled = ShardcastClient([origin_server.url], pub, tmp_path / "client", run_id=RUN).pull()
    _flip_byte(pulled.path / m.shards[2].name)  # e.g. unsynced pages lost in a power cut
    sent_before = SHARD_BYTES_SERVED._value.get()
    again = ShardcastClient([origin_server.url], pub, tmp_path / "client", run_id=RUN).pull()
    assert again.path == pulled.path and files_of(again.path) == files_of(o.version_dir(0))
    assert _served_since(sent_before, m.shards[2].size) == m.shards[2].size


def test_readers_never_see_a_half_published_version(tmp_path, key, pub):
    """While versions are being published, every listed version has a signed manifest and all its shards."""
    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=10, shard_bytes=256 << 10)
    seen: list[int] = []
    problems: list[str] = []
    done = threading.Event()

    with serve_origin(o) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        def reader() -> None:
            from shardcast.keys import parse_verified_manifest

            while not done.is_set():
                for v in c.get(api.SHARDCAST_VERSIONS).json()["versions"]:
                    if v in seen:
                        continue
                    m = parse_verified_manifest(c.get(api.SHARDCAST_MANIFEST.format(version=v)).content, pub, v,
                        run_id=RUN)
                    for s in m.shards:
                        r = c.get(api.SHARDCAST_SHARD.format(version=v, name=s.name))
                        if r.status_code != 200 or hashlib.sha256(r.content).hexdigest() != s.sha256:
                            problems.append(f"v{v} {s.name}: HTTP {r.status_code}")
                    seen.append(v)

        t = threading.Thread(target=reader)
        t.start()
        for v in range(4):
            o.publish(v, state_dict(seed=v, layers=4))
        wait_until(lambda: len(seen) == 4 or not t.is_alive(), what="the reader to check every version")
        done.set()
        t.join()
    assert problems == [] and sorted(seen) == [0, 1, 2, 3]
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "origin").iterdir())


def test_client_keeps_only_its_newest_versions(tmp_path, pub, origin):
    o, origin_server = origin
    client = ShardcastClient([origin_server.url], pub, tmp_path / "client", run_id=RUN, keep_versions=1)
    first = client.pull()
    o.publish(1, state_dict(seed=1, layers=2))
    second = client.pull()
    assert second.version == 1 and second.path.is_dir() and not first.path.exists()


def test_a_second_relay_on_the_same_folder_waits_until_the_first_is_gone(tmp_path, pub, origin):
    """Two relay processes on one folder would write the same `.part` files, fail the signed digest and ban
    their honest upstream. A relay told to stop (SIGTERM, what a killed driver's children get) frees its
    port at once and its folder moments later; the next one on the folder starts only then."""
    o, origin_server = origin
    root = tmp_path / "relay"
    args = ["relay", "--upstream", origin_server.url, "--root", str(root), "--public-key", pub, "--run-id", RUN,
        "--poll-interval-s", "0.05"]
    first, first_info = start_cli(*args)
    second = None
    try:
        wait_until(lambda: relay_has(first_info["url"], 0), what="the first relay to mirror version 0")
        second = subprocess.Popen([sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", *args],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, _ = select.select([second.stdout], [], [], 3.0)
        assert not ready and second.poll() is None, "the second relay started while the first held the folder"
        assert (root / ".lock").read_text().strip() == str(first.pid)
        first.send_signal(signal.SIGTERM)
        ready, _, _ = select.select([second.stdout], [], [], 30.0)
        assert ready, "the second relay did not start after the first stopped"
        assert first.poll() is not None
        info = json.loads(second.stdout.readline())
        wait_until(lambda: relay_has(info["url"], 0), what="the second relay to serve version 0")
        assert (root / ".lock").read_text().strip() == str(second.pid)
        assert files_of(root / "v0000000000") == files_of(o.version_dir(0))
    finally:
        stop_proc(first)
        if second is not None:
            stop_proc(second)


def test_a_folder_held_by_another_process_is_refused_with_its_pid(tmp_path):
    held = lock_folder(tmp_path / "relay", wait_s=0, what="relay")
    try:
        with pytest.raises(FolderInUse, match=rf"in use by another relay \(pid {os.getpid()}\)"):
            lock_folder(tmp_path / "relay", wait_s=0.3, what="relay")
    finally:
        os.close(held)
    os.close(lock_folder(tmp_path / "relay", wait_s=0, what="relay"))  # free once its holder let go


def test_a_whole_length_part_left_by_a_killed_download_is_refetched_and_blames_no_server(tmp_path, pub, origin):
    """The splice path sizes `.part` to the whole file before the bytes arrive, so a download killed with
    SIGKILL leaves a file of the right length and the wrong bytes. The next process on the folder must start
    that file over, not ban the server it asks next (a restarted relay banned the origin, its only upstream,
    for bytes the origin never sent, and the run stalled)."""
    o, origin_server = origin
    manifest = o.manifest(0)
    folder = tmp_path / "mirror"
    folder.mkdir()
    for s in manifest.shards:  # what a process killed right after it sized its files leaves
        with open(folder / f".{s.name}.part", "wb") as f:
            f.truncate(s.size)
    pool = ServerPool([origin_server.url], pub, run_id=RUN, parallelism=2)
    pool.download_files([FileJob(0, s, folder) for s in manifest.shards])
    want = {name: data for name, data in files_of(o.version_dir(0)).items() if name != MANIFEST_FILE}
    assert files_of(folder) == want  # every shard verified and in place, no `.part` left
    assert pool.stats[origin_server.url].banned is None and pool.stats[origin_server.url].failures == 0


def test_the_verifiers_weight_cache_keeps_a_bounded_number_of_versions(tmp_path, key, pub):
    """swarmrl.actors.ShardcastWeights (the verifiers' weights for a version): it kept every version it ever pulled,
    1.7 GB after a 110-step demo run, and would fill a disk in tens of steps at 0.6B. Now the newest keep_versions
    stay; an older one asked again is pulled again."""
    import pickle

    from swarmrl.actors import ShardcastWeights

    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=10, shard_bytes=1 << 20)
    server = serve_origin(o)
    try:
        for v in range(6):
            o.publish(v, state_dict(seed=v, layers=2))
        weights = pickle.loads(pickle.dumps(ShardcastWeights([server.url], pub, str(tmp_path / "vw"), RUN, 3)))
        for v in range(6):
            assert weights(v).is_dir()
        held = sorted(p.name for p in (tmp_path / "vw").iterdir() if p.is_dir() and not p.name.startswith("."))
        assert len(held) == 3, held
        assert (weights(1) / "manifest.json").exists()  # pruned, then pulled again
    finally:
        server.stop()
