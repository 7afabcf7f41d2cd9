"""Delta chains through real relays on loopback, and the faults of the delta-broadcast issue: a relay serving
a delta with one flipped byte, a delta against the wrong base, a chain with a missing link, a client that
restarts mid-chain, a worker that joins at version 50 of a chain with anchors every 10. Each must end with
the published weights, bit for bit, or a clear refusal."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from shardcast_helpers import RUN, Trajectory

from shardcast.client import ShardcastClient, ShardcastError
from shardcast.origin import Origin
from shardcast.relay import Relay
from shardcast.server import SHARD_BYTES_SERVED, serve_origin, serve_relay
from shardcast.sources import TransferPolicy
from shardcast.weights import load_version_dir, model_hash
from tools.hostile_relay import HostileRelay

POLICY = TransferPolicy(stall_timeout_s=2.0, rate_window_s=0.5, shard_deadline_s=30.0, pull_deadline_s=60.0,
    request_timeout_s=5.0)


def wait_until(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def same_weights(path, published: dict) -> bool:
    got = load_version_dir(path)
    return set(got) == set(published) and all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
        v.view(torch.uint8)) for k, v in published.items())


@pytest.fixture
def running():
    things: list = []
    yield things
    for t in reversed(things):
        t.stop()


def start_relay(running, upstream: list[str], root, pub, fastest: str | None = None) -> tuple[Relay, str]:
    relay = Relay(upstream, root, pub, run_id=RUN, poll_interval_s=0.05, grace_s=0, policy=POLICY)
    if fastest is not None:  # before the relay's thread starts, no exploring, the others measured slow: files go there
        for url, stats in relay.upstream.stats.items():
            stats.throughput = 1e12 if url == fastest else 1.0
        relay.upstream.sources.explore = 0.0
    server = serve_relay(relay, shard_wait_s=0.5)
    relay.start()
    running += [relay, server]
    return relay, server.url


def test_chain_through_two_relays_is_bit_exact_and_small(tmp_path, key, pub, running):
    traj = Trajectory()
    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=3, shard_bytes=256 << 10, grace_s=0, anchor_every=4)
    server = serve_origin(o)
    running.append(server)
    relay1, r1 = start_relay(running, [server.url], tmp_path / "relay1", pub)
    relay2, r2 = start_relay(running, [r1], tmp_path / "relay2", pub)  # a relay of a relay
    client = ShardcastClient([r2], pub, tmp_path / "client", run_id=RUN, keep_versions=2, policy=POLICY)
    for v in range(10):
        published = traj.next_version()
        m = o.publish(v, published)
        wait_until(lambda: v in relay2.store.complete_versions(), what=f"relay2 to hold version {v}")
        pulled = client.pull(v)
        assert pulled.version == v and same_weights(pulled.path, published) and model_hash(published) == m.model_hash
        if v == 0:
            assert pulled.steps == ["full 0"] and pulled.wire_bytes == m.full_bytes
        else:  # anchors (4, 8) carry a delta too: a follower never downloads the full model again
            assert pulled.steps == [f"held {v - 1}", f"delta {v}"]
            assert pulled.wire_bytes == m.file(m.deltas[0].file).size < 0.2 * m.full_bytes
        assert (m.anchor_version == v) == (v % 4 == 0)
    # Relays hold the window (the newest 3 and the chain back to their anchor), verified file by file.
    assert o.window_floor() == 7 - 7 % 4 == 4
    wait_until(lambda: relay2.store.versions() == o.versions(), what="relay2 to prune like the origin")
    for v in o.versions():
        assert {p.name: p.read_bytes()
            for p in (tmp_path / "relay2" / f"v{v:010d}").iterdir()} == {p.name: p.read_bytes()
            for p in o.version_dir(v).iterdir()}


def test_a_relay_serving_a_delta_with_one_flipped_byte(tmp_path, key, pub, running):
    traj = Trajectory()
    o = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=256 << 10, anchor_every=100)
    server = serve_origin(o)
    running.append(server)
    states = [traj.next_version() for _ in range(3)]
    for v, s in enumerate(states):
        o.publish(v, s)
    delta = o.manifest(2).deltas[0].file

    # A relay's upstream flips a byte of every delta: the relay never lists the file as servable from those
    # bytes; it bans that upstream and takes the file from its other upstream.
    flipper = HostileRelay(server.url, "flip", flip_match="delta")
    running.append(flipper)
    careful, careful_url = start_relay(running, [flipper.url, server.url], tmp_path / "careful", pub,
        fastest=flipper.url)
    wait_until(lambda: careful.store.complete_versions() == [0, 1, 2], what="the relay to mirror the chain")
    assert "signed blake3" in (careful.upstream.stats[flipper.url].banned or "")
    assert (tmp_path / "careful" / "v0000000002" / delta).read_bytes() == (o.version_dir(2) / delta).read_bytes()
    only_flipper = Relay([flipper.url], tmp_path / "fooled", pub, run_id=RUN, policy=POLICY)
    only_flipper.sync_once()
    assert delta in only_flipper.store.missing_shards(2)  # listed (manifest verified), never served

    # A relay whose disk is altered after verification serves a flipped delta: the client catches it per
    # file, bans the relay, and gets the delta from the origin (its fallback).
    client = ShardcastClient([careful_url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
        policy=POLICY)
    assert client.pull(1).steps == ["full 0", "delta 1"]
    careful.stop()
    path = tmp_path / "careful" / "v0000000002" / delta
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    pulled = client.pull(2)
    assert pulled.steps == ["held 1", "delta 2"] and same_weights(pulled.path, states[2])
    assert "signed blake3" in (client.stats[careful_url].banned or "")


def test_a_delta_is_never_applied_to_the_wrong_base(tmp_path, key, pub, running):
    traj = Trajectory()
    o = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=256 << 10, anchor_every=100, max_chain_fraction=10)
    server = serve_origin(o)
    running.append(server)
    for v in range(4):
        o.publish(v, traj.next_version())
    client = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, policy=POLICY)
    old3 = client.pull(3).manifest.model_hash

    # The trainer restarts from version 2 and publishes another version 3: the client's version 3 is no
    # base for the new version 4, whose delta names the new 3's hash.
    traj.restart(2, seed=1)
    o.drop(3)
    new3 = traj.next_version()
    o.publish(3, new3)
    new4 = traj.next_version()
    m4 = o.publish(4, new4)
    assert m4.deltas[0].base_model_hash == model_hash(new3) != old3
    pulled = client.pull(4)
    assert same_weights(pulled.path, new4)
    assert pulled.steps in (["full 3", "delta 4"], ["held 2", "delta 3", "delta 4"])  # never "held 3"

    # Weights held in memory that went bad (a flipped bit in RAM) under a good hash: the delta's signed result
    # hash catches it, the held weights are dropped, and the path is planned again from the disk / origin.
    new5 = traj.next_version()
    o.publish(5, new5)
    v, h, state = client._state
    assert v == 4
    next(iter(state.values())).view(torch.uint8)[0] ^= 1
    pulled = client.pull(5)
    assert same_weights(pulled.path, new5) and pulled.version == 5


def test_a_chain_with_a_missing_link_is_routed_around_or_refused(tmp_path, key, pub, running):
    traj = Trajectory()
    o = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=256 << 10, anchor_every=3, max_chain_fraction=10)
    server = serve_origin(o)
    running.append(server)
    states = {}
    for v in range(6):  # anchors at 0 and 3
        states[v] = traj.next_version()
        o.publish(v, states[v])
    client = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, policy=POLICY)
    assert client.pull(1).version == 1

    o.drop(2)  # gone everywhere: the link 1 -> 2 -> 3 is broken, the anchor at 3 is not
    pulled = client.pull(5)
    assert pulled.steps == ["full 3", "delta 4", "delta 5"] and same_weights(pulled.path, states[5])

    late = ShardcastClient([server.url], pub, tmp_path / "late", run_id=RUN, policy=POLICY)
    o.drop(4)  # now nothing leads to 5 from what `late` can get
    with pytest.raises(ShardcastError, match="no way to version 5 .*no server has versions 4"):
        late.pull(5)
    assert not (tmp_path / "late" / "v0000000005").exists()


def test_a_client_that_restarts_mid_chain_resumes_and_rechecks(tmp_path, key, pub, running):
    traj = Trajectory()
    o = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=256 << 10, anchor_every=100, max_chain_fraction=10)
    server = serve_origin(o)
    running.append(server)
    states = {0: traj.next_version()}
    o.publish(0, states[0])
    ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, policy=POLICY).pull(0)
    for v in range(1, 7):
        states[v] = traj.next_version()
        o.publish(v, states[v])

    # The process dies while the chain's files come in (after three of the six deltas are verified).
    done: set[str] = set()

    def die(url: str, name: str, nbytes: int) -> None:
        if len(done) >= 3 and name not in done:
            raise KeyboardInterrupt("killed")
        done.add(name)

    dying = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, parallelism=1, policy=POLICY,
        on_progress=die, chunk_bytes=4096)
    with pytest.raises(KeyboardInterrupt):
        dying.pull(6)
    assert not (tmp_path / "client" / "v0000000006").exists()

    sent = SHARD_BYTES_SERVED._value.get()
    restarted = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, policy=POLICY)
    pulled = restarted.pull(6)
    assert pulled.steps == ["held 0"] + [f"delta {v}" for v in range(1, 7)] and same_weights(pulled.path, states[6])
    chain = sum(o.manifest(v).file(o.manifest(v).deltas[0].file).size for v in range(1, 7))
    assert SHARD_BYTES_SERVED._value.get() - sent < chain  # the verified deltas were not fetched again

    # A power cut damaged the folder written from the chain: the next process re-checks it (model hash),
    # does not build on it, and still reaches the next version bit for bit.
    shard = sorted((tmp_path / "client" / "v0000000006").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    states[7] = traj.next_version()
    o.publish(7, states[7])
    again = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, policy=POLICY).pull(7)
    assert "held 6" not in again.steps and same_weights(again.path, states[7])


def test_a_worker_joins_at_version_50_of_a_chain_with_anchors_every_10(tmp_path, key, pub, running):
    traj = Trajectory(layers=4, cols=256)
    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=3, shard_bytes=64 << 10, grace_s=0, anchor_every=10,
        max_chain_fraction=10)
    server = serve_origin(o)
    running.append(server)
    states = {}
    for v in range(51):
        states[v] = traj.next_version()
        o.publish(v, states[v])
    # The newest 3 (48-50) and the chain back to their anchors (40): older versions are pruned.
    assert o.versions() == list(range(40, 51)) and [v for v in o.versions()
        if o.manifest(v).anchor_version == v] == [40, 50]
    relay, relay_url = start_relay(running, [server.url], tmp_path / "relay", pub)
    wait_until(lambda: 50 in relay.store.complete_versions(), what="the relay to mirror version 50")

    joiner = ShardcastClient([relay_url], pub, tmp_path / "joiner", run_id=RUN, fallback_urls=[server.url],
        policy=POLICY)
    pulled = joiner.pull()
    full = o.manifest(50).full_bytes
    assert pulled.version == 50 and pulled.steps == ["full 50"] and same_weights(pulled.path, states[50])
    assert pulled.wire_bytes == sum(s.size for s in o.manifest(50).full_shards) == full

    for v in range(51, 56):
        states[v] = traj.next_version()
        o.publish(v, states[v])
    wait_until(lambda: relay.store.complete_versions() == list(range(50, 56)),
        what="the relay to hold 50-55 and prune the rest")
    assert o.versions() == list(range(50, 56))  # the newest 3 and their chain back to 50

    follower = joiner.pull()  # holds 50: deltas only
    assert follower.steps == ["held 50"] + [f"delta {v}" for v in range(51, 56)] and same_weights(follower.path,
        states[55])
    assert follower.wire_bytes < 0.5 * full
    late = ShardcastClient([relay_url], pub, tmp_path / "late", run_id=RUN, policy=POLICY).pull()  # joins at 55
    assert late.steps == ["full 50"] + [f"delta {v}" for v in range(51, 56)] and same_weights(late.path, states[55])
    assert late.wire_bytes == full + follower.wire_bytes < 1.5 * full
    shutil.rmtree(tmp_path / "origin")


def test_write_behind_returns_the_weights_first_and_the_folder_after(tmp_path, key, pub, running):
    traj = Trajectory()
    o = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=256 << 10, anchor_every=100)
    server = serve_origin(o)
    running.append(server)
    states = [traj.next_version() for _ in range(3)]
    for v, s in enumerate(states):
        o.publish(v, s)
    client = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, write_behind=True, keep_versions=1,
        policy=POLICY)
    first = client.pull(0)
    assert first.written.is_set() and same_weights(first.path, states[0])  # a full download is its folder
    pulled = client.pull(2)
    assert pulled.state is not None and model_hash(pulled.state) == o.manifest(2).model_hash
    assert pulled.wait_written(timeout=30) == pulled.path and same_weights(pulled.path, states[2])
    # The next pull waits for that folder before it looks at the disk, and builds on it.
    states.append(traj.next_version())
    o.publish(3, states[3])
    again = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, write_behind=True,
        policy=POLICY).pull(3)
    assert again.steps == ["held 2", "delta 3"] and same_weights(again.wait_written(30), states[3])
