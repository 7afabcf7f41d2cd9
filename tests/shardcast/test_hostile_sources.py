"""Relays cannot stall a worker: drip-feeding, stalling, head-dripping, size-lying and other-run relays, on
real loopback servers. Every pull runs under the client's own pull deadline (the bound), must end with the
published bytes from the healthy sources, and must have left the bad source for the reason it deserved."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from shardcast_helpers import RUN, state_dict

from inference_worker.weights import WeightsKeeper
from shardcast.client import ShardcastClient, ShardcastError
from shardcast.origin import Origin
from shardcast.relay import Relay
from shardcast.server import ShardServer, serve_origin, serve_relay
from shardcast.sources import TransferPolicy
from shardcast.store import VersionStore
from shardcast.transfer import ServerPool
from tools.hostile_relay import HostileRelay

# Tight enough that a test of a bad source takes seconds; the pull deadline is the bound every test keeps.
POLICY = TransferPolicy(
    stall_timeout_s=1.0, min_rate_bytes_per_s=64 << 10, rate_window_s=0.5, slow_factor=0.25, slow_cooldown_s=60.0,
    shard_deadline_s=30.0, pull_deadline_s=45.0, request_timeout_s=3.0,
)


def files_of(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture
def origin(tmp_path, key):
    o = Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=3, shard_bytes=1 << 20)
    o.publish(0, state_dict(seed=0, layers=8))  # 8 shards of 1 MiB
    server = serve_origin(o)
    yield o, server
    server.stop()


@pytest.fixture
def hostile():
    made: list[HostileRelay] = []

    def make(upstream: str, mode: str, **kw) -> HostileRelay:
        made.append(HostileRelay(upstream, mode, **kw))
        return made[-1]

    yield make
    for h in made:
        h.stop()


def pull_within_deadline(client: ShardcastClient, version: int | None = None):
    t0 = time.monotonic()
    pulled = client.pull(version)
    return pulled, time.monotonic() - t0


@pytest.mark.parametrize("mode", ["drip", "stall", "silent"])
def test_a_relay_that_drips_or_stalls_is_left_and_the_origin_finishes_the_pull(tmp_path, pub, origin, hostile, mode):
    o, server = origin
    bad = hostile(server.url, mode, rate=1000)  # 1 KB/s: the relay of the issue
    client = ShardcastClient([bad.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
        parallelism=4, policy=POLICY, seed=0)
    pulled, seconds = pull_within_deadline(client)
    assert files_of(pulled.path) == files_of(o.version_dir(0)) | {"manifest.json": (
        pulled.path / "manifest.json").read_bytes()}
    s = client.stats[bad.url]
    assert s.slow >= 1 and s.banned is None  # left for being slow, not banned: its bytes were right
    assert any("/shards/" in r for r in bad.requests)  # it was tried first (the only primary)
    assert client.stats[server.url].bytes >= o.manifest(0).total_bytes - bad.bytes_sent
    print(f"{mode}: pull done in {seconds:.1f}s, {bad.bytes_sent} bytes from the bad relay")


def test_a_relay_that_says_not_yet_forever_is_left_for_the_origin(tmp_path, pub, origin, hostile):
    """'Not yet' (503) is what an honest relay says while a listed file is still on its way; said for longer
    than a stall, the file comes from the origin instead of waiting for its deadline."""
    o, server = origin
    bad = hostile(server.url, "not_yet")
    client = ShardcastClient([bad.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
        parallelism=2, policy=POLICY, seed=0)
    pulled, _ = pull_within_deadline(client)  # before: every file held to its deadline, then the pull failed
    assert files_of(pulled.path) == files_of(o.version_dir(0)) | {"manifest.json": (
        pulled.path / "manifest.json").read_bytes()}
    assert any("/shards/" in r for r in bad.requests)  # it was asked first (the only primary)
    assert client.stats[server.url].bytes >= o.manifest(0).total_bytes and client.stats[bad.url].slow >= 1


@pytest.mark.parametrize("listing", [[], [0]])
def test_a_relay_that_lists_nothing_new_cannot_freeze_a_worker_on_an_old_version(tmp_path, key, pub, origin, hostile,
    listing):
    """The worker's keeper pulls the newest version its relays list, up to the one the orchestrator announced;
    a relay that lists nothing, or only old versions, holds it back for `relay_lag_s`, then it asks by number."""
    o, server = origin
    o.publish(1, state_dict(seed=1, layers=2))
    bad = hostile(server.url, "listing", listing=listing)
    keeper = WeightsKeeper(tmp_path / "worker", relay_lag_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.3,
                           make_client=lambda urls, pub_key, dest, **kw: ShardcastClient(urls, pub_key, dest,
                           policy=POLICY, **kw)).start()
    stop = threading.Event()
    timer = threading.Timer(30.0, stop.set)
    timer.start()
    try:
        keeper.set_sources([bad.url], pub, RUN, origin_url=server.url)
        keeper.observe(1)
        ready = keeper.wait_for(1, stop)
    finally:
        timer.cancel()
        keeper.stop()
    assert ready is not None and ready.version == 1, keeper.last_error
    assert files_of(ready.path) == files_of(o.version_dir(1)) | {"manifest.json": (
        ready.path / "manifest.json").read_bytes()}


@pytest.mark.parametrize("run_id", [RUN, None])  # None: the relay follows the run upstream signs
def test_an_upstream_listing_versions_it_cannot_prove_does_not_keep_a_relay_from_mirroring(tmp_path, pub, origin,
    hostile, run_id):
    """20,000 fake versions above the real ones: the relay asks for one of their manifests per sync (no server
    proves it), stops believing that upstream's listing for the sync, and mirrors what the origin signs."""
    o, server = origin
    liar = hostile(server.url, "listing", listing=list(range(1000, 21_000)))
    relay = Relay([liar.url, server.url], tmp_path / "relay", pub, run_id=run_id, policy=POLICY)
    assert relay.sync_once() == [0] and relay.run_id == RUN
    o.publish(1, state_dict(seed=1, layers=2))
    assert relay.sync_once() == [0, 1]
    asked = [r for r in liar.requests if r.endswith("/manifest")]
    assert len(asked) <= 4, asked  # per sync: one fake version listed, and one the follow check reads


def test_a_relay_listing_fake_newer_versions_cannot_fail_a_pull_of_the_newest(tmp_path, pub, origin, hostile):
    o, server = origin
    o.publish(1, state_dict(seed=1, layers=2))
    liar = hostile(server.url, "listing", listing=[0] + list(range(2**31 - 8, 2**31)))  # 404s their manifests
    client = ShardcastClient([liar.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
        policy=POLICY)
    pulled, _ = pull_within_deadline(client)
    assert pulled.version == 1 and files_of(pulled.path) == files_of(o.version_dir(1)) | {"manifest.json": (
        pulled.path / "manifest.json").read_bytes()}
    assert sum(r.endswith("/manifest") for r in liar.requests) <= 2  # one fake version per listing read, not eight
    alone = ShardcastClient([liar.url], pub, tmp_path / "alone", run_id=RUN, policy=POLICY)  # no origin to turn to
    with pytest.raises(ShardcastError, match="no listed version could be fetched"):
        alone.pull()


def test_a_replayed_manifest_of_a_re_published_version_is_refused_with_the_announced_hash(tmp_path, pub, origin):
    """A trainer restart re-publishes version 1 with other weights. A relay keeps serving the first version 1
    (signed, of this run). A worker that asks for the hash the orchestrator announces takes the current one
    from the origin, which it does not blame; without the hash it would take the replayed one."""
    o, server = origin
    o.publish(1, state_dict(seed=1, layers=2))
    shutil.copytree(tmp_path / "origin", tmp_path / "replayed")
    stale = ShardServer(VersionStore(tmp_path / "replayed", keep_versions=3))
    try:
        o.drop(1)
        current = o.publish(1, state_dict(seed=11, layers=2))
        first = ShardcastClient([stale.url], pub, tmp_path / "unpinned", run_id=RUN, policy=POLICY).pull(1)
        assert first.manifest.model_hash != current.model_hash  # the replay is validly signed: only the hash tells

        client = ShardcastClient([stale.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
            policy=POLICY)
        pulled = client.pull(1, model_hash=current.model_hash)
        assert pulled.manifest.model_hash == current.model_hash
        assert files_of(pulled.path) == files_of(o.version_dir(1)) | {"manifest.json": (
            pulled.path / "manifest.json").read_bytes()}
        # Neither is blamed: the stale server proves its bytes with the first version 1's manifest, signed earlier.
        assert client.stats[server.url].banned is None and client.stats[stale.url].banned is None
        with pytest.raises(ShardcastError, match="not the announced"):  # the stale relay alone cannot serve it
            ShardcastClient([stale.url], pub, tmp_path / "alone", run_id=RUN, policy=POLICY).pull(1,
                model_hash=current.model_hash)
    finally:
        stale.stop()


def test_a_version_re_published_under_a_reader_is_read_again_not_blamed_on_its_servers(tmp_path, pub, origin):
    """A server still has the first version 1's manifest but none of its files; the origin has re-published
    version 1. A client that took the old manifest finds the origin's bytes do not match it: the origin proves
    a manifest signed later, so the client is the stale one (no ban). A relay that listed the old manifest
    drops it and mirrors the new one."""
    o, server = origin
    o.publish(1, state_dict(seed=1, layers=2))
    shutil.copytree(tmp_path / "origin", tmp_path / "replayed")
    for f in (tmp_path / "replayed").glob("v0000000001/*.safetensors"):
        f.unlink()
    replayer = ShardServer(VersionStore(tmp_path / "replayed", keep_versions=3))
    try:
        o.drop(1)
        current = o.publish(1, state_dict(seed=11, layers=2))
        client = ShardcastClient([replayer.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
            policy=POLICY)
        with pytest.raises(ShardcastError, match="re-published"):
            client.pull(1)
        assert client.stats[server.url].banned is None
        assert client.pull(1, model_hash=current.model_hash).manifest.model_hash == current.model_hash

        relay = Relay([replayer.url], tmp_path / "relay", pub, run_id=RUN, policy=POLICY)
        relay.sync_once()  # lists the old version 1; its files are nowhere
        assert relay.store.manifest(1).model_hash != current.model_hash and 1 not in relay.store.complete_versions()
        relay.upstream = Relay([server.url], tmp_path / "x", pub, run_id=RUN, policy=POLICY).upstream
        relay.sync_once()  # the origin's bytes prove the newer manifest: the old listing goes
        assert relay.sync_once() == [0, 1] and relay.store.manifest(1).model_hash == current.model_hash
        assert relay.upstream.stats[server.url].banned is None
    finally:
        replayer.stop()


def test_a_relay_just_above_the_floor_loses_to_a_faster_relay(tmp_path, pub, origin, hostile, running_relays):
    """Dripping at 300 KB/s beats the absolute floor (64 KiB/s) but not a quarter of the healthy relay's rate."""
    o, server = origin
    slow = hostile(server.url, "drip", rate=300_000)
    healthy = running_relays(server.url)
    client = ShardcastClient([slow.url, healthy], pub, tmp_path / "client", run_id=RUN, parallelism=2, policy=POLICY,
        seed=1)
    client.stats[healthy].throughput = 50e6  # as measured by an earlier pull
    pulled, _ = pull_within_deadline(client)
    assert files_of(pulled.path) == files_of(o.version_dir(0)) | {"manifest.json": (
        pulled.path / "manifest.json").read_bytes()}
    if client.stats[slow.url].bytes or slow.bytes_sent:
        assert client.stats[slow.url].slow >= 1
    assert client.stats[healthy].bytes > o.manifest(0).total_bytes / 2


def test_a_relay_that_drips_its_response_heads_cannot_hold_a_listing_or_a_file(tmp_path, pub, origin, hostile):
    o, server = origin
    bad = hostile(server.url, "drip_head", head_interval_s=0.3)  # never silent for a whole stall timeout
    client = ShardcastClient([bad.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
        parallelism=2, policy=POLICY)
    t0 = time.monotonic()
    assert client.latest_version() == 0  # its listing missed the request deadline: the origin's listing answered
    assert time.monotonic() - t0 < POLICY.request_timeout_s + 2  # the listing is bounded by the request deadline
    pulled, _ = pull_within_deadline(client, 0)
    assert pulled.version == 0 and client.stats[bad.url].slow >= 1


def test_size_lies_are_caught_before_any_body_is_read(tmp_path, pub, origin, hostile):
    o, server = origin
    huge = hostile(server.url, "huge")  # files claim a terabyte
    client = ShardcastClient([huge.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
        parallelism=2, policy=POLICY)
    pulled, _ = pull_within_deadline(client)
    assert pulled.version == 0 and "Content-Length" in (client.stats[huge.url].banned or "")

    big_manifest = hostile(server.url, "huge_manifest")  # the manifest claims a gigabyte, and would send it
    client = ShardcastClient([big_manifest.url], pub, tmp_path / "client2", run_id=RUN, fallback_urls=[server.url],
        policy=POLICY)
    pulled, _ = pull_within_deadline(client, 0)
    assert pulled.version == 0 and any(r.endswith("/manifest") for r in big_manifest.requests)
    assert big_manifest.manifest_bytes_sent < 64 << 20  # refused at the head; what went out sits in socket buffers


def test_another_runs_manifest_signed_with_the_same_key_is_refused(tmp_path, key, pub, origin):
    o, server = origin
    # An earlier run with the same key: its versions are newer and its version 0 is other weights.
    earlier = Origin(tmp_path / "earlier", key, run_id="demo-earlier-run", shard_bytes=1 << 20)
    earlier.publish(0, state_dict(seed=5, layers=2))
    earlier.publish(9, state_dict(seed=9, layers=2))
    stale = serve_origin(earlier)
    try:
        client = ShardcastClient([stale.url], pub, tmp_path / "client", run_id=RUN, fallback_urls=[server.url],
            policy=POLICY)
        pulled, _ = pull_within_deadline(client, 0)
        assert files_of(pulled.path) == files_of(o.version_dir(0)) | {"manifest.json": (
            pulled.path / "manifest.json").read_bytes()}
        assert "belongs to run 'demo-earlier-run'" in (client.stats[stale.url].banned or "")

        lone = ShardcastClient([stale.url], pub, tmp_path / "lone", run_id=RUN, policy=POLICY)
        with pytest.raises(ShardcastError, match="belongs to run"):
            lone.pull()
        assert list((tmp_path / "lone").iterdir()) == []

        # A relay of this run never lists the earlier run's versions; one that follows its upstream's run
        # does, and drops them when the key signs a new run.
        relay = Relay([stale.url], tmp_path / "relay", pub, run_id=RUN, policy=POLICY)
        assert relay.sync_once() == [] and relay.versions() == []
        follower = Relay([stale.url], tmp_path / "follower", pub, run_id=None, policy=POLICY)
        assert follower.sync_once() == [0, 9] and follower.run_id == "demo-earlier-run"
        follower.upstream = Relay([server.url], tmp_path / "x", pub, run_id=None, policy=POLICY).upstream
        # its v0 was signed before: not followed
        assert follower.sync_once() == [0, 9] and follower.run_id == "demo-earlier-run"
        o.publish(1, state_dict(seed=1, layers=2))  # the new run signs its next version
        assert follower.sync_once() == [0, 1] and follower.run_id == RUN
        assert follower.store.manifest(0).model_hash == o.manifest(0).model_hash

        # The other way round: an upstream replaying the earlier run's versions (numbered higher, signed
        # before the newest of this run) does not take over a relay that follows this run.
        follower = Relay([stale.url, server.url], tmp_path / "follower2", pub, run_id=None, policy=POLICY)
        assert follower.sync_once() == [0, 1] and follower.run_id == RUN
    finally:
        stale.stop()


def test_version_folders_of_another_run_on_disk_are_not_trusted(tmp_path, key, pub, origin):
    o, server = origin
    other = Origin(tmp_path / "other", key, run_id="demo-earlier-run", shard_bytes=1 << 20)
    other.publish(0, state_dict(seed=5, layers=2))
    import shutil

    (tmp_path / "client").mkdir()
    shutil.copytree(other.version_dir(0), tmp_path / "client" / "v0000000000")  # left by the earlier run
    client = ShardcastClient([server.url], pub, tmp_path / "client", run_id=RUN, policy=POLICY)
    pulled = client.pull(0)
    assert pulled.manifest.run_id == RUN and files_of(pulled.path) == files_of(o.version_dir(0)) | {"manifest.json": (
        pulled.path / "manifest.json").read_bytes()}
    # The origin of this run, restarted on a folder holding another run's version, drops it.
    assert Origin(tmp_path / "other", key, run_id=RUN).versions() == []


@pytest.fixture
def running_relays(tmp_path, pub):
    made = []

    def make(upstream: str) -> str:
        relay = Relay([upstream], tmp_path / f"relay{len(made)}", pub, run_id=RUN, poll_interval_s=0.05, policy=POLICY)
        server = serve_relay(relay, shard_wait_s=0.5)
        relay.start()
        made.append((relay, server))
        deadline = time.monotonic() + 30
        while relay.store.complete_versions() == [] and time.monotonic() < deadline:
            time.sleep(0.05)
        return server.url

    yield make
    for relay, server in made:
        server.stop()
        relay.stop()


def test_a_restarted_relay_follows_its_run_after_the_run_resumed_from_an_earlier_version(tmp_path, key, pub):
    """A relay restarted on its folder holds versions its run signed before it stopped and resumed from an earlier
    checkpoint (deploy/compose.yaml's down/up): it follows the run again, drops those, and mirrors what the resumed
    run signs under the same numbers. (Before: `not followed`, and the stale version was served on.)"""
    first = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20, deltas=False)
    for v in (0, 1, 2):
        first.publish(v, state_dict(seed=v, layers=2))
    server = serve_origin(first)
    relay = Relay([server.url], tmp_path / "relay", pub, run_id=None, policy=POLICY)
    assert relay.sync_once() == [0, 1, 2]
    server.stop()
    # The run resumes from its checkpoint of version 1: its origin still has versions 0 and 1, not 2.
    (tmp_path / "resumed").mkdir()
    for v in (0, 1):
        shutil.copytree(first.version_dir(v), tmp_path / "resumed" / first.version_dir(v).name)
    resumed = Origin(tmp_path / "resumed", key, run_id=RUN, shard_bytes=1 << 20, deltas=False)
    assert resumed.versions() == [0, 1]
    server = serve_origin(resumed)
    try:
        restarted = Relay([server.url], tmp_path / "relay", pub, run_id=None, policy=POLICY)
        assert restarted.sync_once() == [0, 1] and restarted.run_id == RUN
        time.sleep(0.01)  # the resumed run's version 2 is signed later than the dropped one
        resumed.publish(2, state_dict(seed=7, layers=2))
        assert restarted.sync_once() == [0, 1, 2]
        assert restarted.store.manifest(2).model_hash == resumed.manifest(2).model_hash != first.manifest(2).model_hash
    finally:
        server.stop()


@pytest.mark.parametrize("run_id", [RUN, None], ids=["run-given", "follows"])
def test_a_running_relay_drops_the_line_its_run_abandoned_when_it_resumed(tmp_path, key, pub, run_id):
    """The trusted cluster crashes and resumes from an earlier checkpoint; a relay run by someone else keeps
    running through it. Once the resumed run signs a version number the relay holds, the relay drops what it
    holds of the abandoned line and mirrors the new one (before: it served the old version 2 until it aged out,
    and every worker pinned to the new version's hash had to go around it)."""
    first = Origin(tmp_path / "origin", key, run_id=RUN, shard_bytes=1 << 20, deltas=False)
    for v in (0, 1, 2, 3):
        first.publish(v, state_dict(seed=v, layers=2))
    server = serve_origin(first)
    relay = Relay([server.url], tmp_path / "relay", pub, run_id=run_id, keep_versions=5, policy=POLICY)
    assert relay.sync_once() == [0, 1, 2, 3]
    server.stop()
    (tmp_path / "resumed").mkdir()
    for v in (0, 1):
        shutil.copytree(first.version_dir(v), tmp_path / "resumed" / first.version_dir(v).name)
    resumed = Origin(tmp_path / "resumed", key, run_id=RUN, shard_bytes=1 << 20, deltas=False)
    server = serve_origin(resumed, port=server.port)  # the cluster came back at the same address
    try:
        assert relay.sync_once() == [0, 1, 2, 3]  # only the checkpoint's version is newer upstream: nothing to drop
        time.sleep(0.01)
        resumed.publish(2, state_dict(seed=7, layers=2))
        assert relay.sync_once() == [0, 1, 2]  # 3 belongs to the abandoned line too
        assert relay.store.manifest(2).model_hash == resumed.manifest(2).model_hash != first.manifest(2).model_hash
        # An upstream still serving the abandoned line (a relay that never saw the resume, or a replayer) lists
        # version 3 of it, genuinely signed: a relay beside it does not mirror it, nor does this one re-mirror it.
        old = serve_origin(first)
        try:
            for r in (relay, Relay([old.url, server.url], tmp_path / "other", pub, run_id=run_id, keep_versions=5,
                                   policy=POLICY)):
                r.upstream = ServerPool([old.url, server.url], pub, run_id=r.run_id or "", policy=POLICY)
                assert r.sync_once() == [0, 1, 2] and r.sync_once() == [0, 1, 2]
                assert r.store.manifest(2).model_hash == resumed.manifest(2).model_hash
                assert 3 not in r.store.versions()
        finally:
            old.stop()
        resumed.publish(3, state_dict(seed=8, layers=2))
        assert relay.sync_once() == [0, 1, 2, 3]
        assert relay.store.manifest(3).model_hash == resumed.manifest(3).model_hash
    finally:
        server.stop()
