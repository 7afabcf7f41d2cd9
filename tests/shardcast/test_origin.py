"""Origin: atomic publish, keep-K deletion that spares versions in use, a full disk."""

from __future__ import annotations

import pytest
from shardcast_helpers import RUN, state_dict, tmpfs

from shardcast.origin import Origin
from shardcast.store import MANIFEST_FILE, DiskFullError


def test_publish_writes_signed_shards_and_reloads_after_restart(tmp_path, key, pub):
    import hashlib

    from shardcast.keys import verify_manifest

    origin = Origin(tmp_path, key, run_id=RUN, keep_versions=3, shard_bytes=1 << 20)
    m = origin.publish(7, state_dict(layers=3))
    verify_manifest(m, pub)
    folder = origin.version_dir(7)
    assert sorted(p.name for p in folder.iterdir()) == sorted([s.name for s in m.shards] + [MANIFEST_FILE])
    for s in m.shards:
        data = (folder / s.name).read_bytes()
        assert len(data) == s.size and hashlib.sha256(data).hexdigest() == s.sha256
    with pytest.raises(FileExistsError):
        origin.publish(7, state_dict(layers=1))
    (tmp_path / ".tmp-leftover-from-a-crash").mkdir()
    again = Origin(tmp_path, key, run_id=RUN, keep_versions=3)
    assert again.versions() == [7] and again.latest() == 7 and again.manifest(7) == m
    assert not (tmp_path / ".tmp-leftover-from-a-crash").exists()


def test_failed_publish_leaves_no_version(tmp_path, key):
    origin = Origin(tmp_path / "origin", key, run_id=RUN)
    with pytest.raises(TypeError, match="model.norm.weight.*expected a dense torch.Tensor"):
        origin.publish(1, {"model.norm.weight": "not a tensor"})
    with pytest.raises(ValueError):
        origin.publish(1, {})
    assert origin.versions() == [] and list((tmp_path / "origin").iterdir()) == []


def test_keeps_last_k_but_never_deletes_a_version_being_downloaded(tmp_path, key):
    origin = Origin(tmp_path, key, run_id=RUN, keep_versions=2, shard_bytes=1 << 20, grace_s=0)
    for v in range(3):
        origin.publish(v, state_dict(seed=v, layers=2))
    assert origin.versions() == [1, 2]
    assert not (tmp_path / "v0000000000").exists()

    # A response in flight holds version 1 open: publishing more must not delete it.
    shard = origin.manifest(1).shards[0]
    with origin.open_shard(1, shard.name) as (f, entry):
        origin.publish(3, state_dict(seed=3, layers=2))
        origin.publish(4, state_dict(seed=4, layers=2))
        assert origin.versions() == [1, 3, 4]  # 2 was idle and went; 1 is in use
        assert len(f.read()) == entry.size
    assert origin.prune() == [1]
    assert origin.versions() == [3, 4]

    # A local reader (a verifier loading weights) holds a version the same way.
    with origin.hold(3) as folder:
        origin.publish(5, state_dict(seed=5, layers=2))
        origin.publish(6, state_dict(seed=6, layers=2))
        assert 3 in origin.versions() and (folder / MANIFEST_FILE).is_file()
    origin.prune()
    assert origin.versions() == [5, 6]


def test_grace_period_spares_a_version_between_two_requests(tmp_path, key):
    origin = Origin(tmp_path, key, run_id=RUN, keep_versions=1, shard_bytes=1 << 20, grace_s=3600)
    origin.publish(0, state_dict(layers=2))
    origin.manifest_bytes(0)  # a client just started on version 0
    origin.publish(1, state_dict(seed=1, layers=2))
    origin.publish(2, state_dict(seed=2, layers=2))
    assert 0 in origin.versions(), "a version touched within the grace period was deleted"
    origin.grace_s = 0
    origin.prune()
    assert origin.versions() == [2]


def test_disk_full_gives_a_clear_error_and_no_half_written_version(key):
    with tmpfs(3 << 20) as root:
        origin = Origin(root, key, run_id=RUN, keep_versions=3, shard_bytes=1 << 20)
        small = origin.publish(0, state_dict(layers=1))
        with pytest.raises(DiskFullError, match="no space left.*nothing was published"):
            origin.publish(1, state_dict(seed=1, layers=6))
        assert origin.versions() == [0]
        assert sorted(p.name for p in root.iterdir()) == ["v0000000000"]
        assert origin.manifest(0) == small
        # After the failure the space is free again and publishing works.
        origin.publish(1, state_dict(seed=1, layers=1))
        assert origin.versions() == [0, 1]
