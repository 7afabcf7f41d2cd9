"""N trainer ranks on Ray, through the launcher's own code (swarmrl/trainer_group.py): real TrainerActors in
a real placement group, one real gloo process group, FSDP2 on the CPU, the tiny model. Fed the same fixed
batches by a stand-in orchestrator actor, two ranks must train the same weights as one (to float
tolerance) and publish, commit and reconcile exactly the same versions and batches; a rank that dies
restarts the whole group from the last checkpoint, counted by the supervisor."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from protocol.arrays import le_bytes
from protocol.batches import Batch, Lineage, SampleGroup
from swarmrl.actors import orchestrator_actor_name
from swarmrl.config import RunConfig
from swarmrl.driver import Run
from swarmrl.processes import free_port
from swarmrl.run_dir import RunDir
from swarmrl.trainer_group import TrainerDied, TrainerGroup
from trainer import checkpoint as ckpt

K = 2  # samples per group
STEPS = 3  # the one-rank run trains 3 steps; the two-rank run 2, loses a rank, restarts, and trains the 3rd


def fixed_groups(i: int) -> list[SampleGroup]:
    """Batch i: 3 groups of K samples of different lengths, behaviour version i (the trainer's version)."""
    rng = np.random.default_rng(i)
    groups = []
    for g in range(3):
        lengths = rng.integers(1, 30, size=K)
        groups.append(SampleGroup(
            submission_id=f"sub{i}-{g}", prompt_index=0, sample_indices=list(range(K)), behaviour_version=i,
            advantages=le_bytes(rng.normal(size=K), "float64"), rewards=le_bytes(rng.uniform(size=K), "float64"),
            completion_lengths=le_bytes(lengths, "int32"), prompt_ids=le_bytes(rng.integers(3, 50,
            size=int(rng.integers(2, 10))), "int32"),
            completion_ids=le_bytes(rng.integers(3, 50, size=int(lengths.sum())), "int32"),
            logprobs=le_bytes(-rng.uniform(3.5, 4.5, size=int(lengths.sum())), "float32"),
        ))
    return groups


class FixedBatches:
    """The orchestrator's batch interface over fixed batches 0, 1, 2, ... A reconciliation takes back every
    batch the trainer's lineage does not hold (they are served again, under new take sequences), as the
    real orchestrator gives them back to its buffer. Every call the trainer makes is recorded."""

    def __init__(self):
        self.next_batch, self.next_seq, self.seq_batch = 0, 0, {}
        self.calls: list[tuple] = []

    def take_batch(self, n, trainer_version=None, wait_s=0.0):
        if self.next_batch >= STEPS:
            time.sleep(min(wait_s, 0.2))
            return Batch("", [])
        self.next_seq += 1
        i, self.next_batch = self.next_batch, self.next_batch + 1
        self.seq_batch[self.next_seq] = i
        self.calls.append(("take", f"b{i}", trainer_version))
        return Batch(f"b{i}", fixed_groups(i), seq=self.next_seq)

    def give_back_batch(self, batch_id):
        raise AssertionError("every batch served is whole")

    def mark_trained(self, batch_id, trained_from_version):
        self.calls.append(("trained", batch_id, trained_from_version))
        return True

    def commit_batches(self, batches, published):
        self.calls.append(("commit", sorted(batches.items()), sorted(published)))
        return {}

    def reconcile_trainer(self, lineage, from_versions, published, superseded=None):
        held = {self.seq_batch[s] for s in Lineage(lineage)}
        self.next_batch = max(held, default=-1) + 1
        self.calls.append(("reconcile", sorted(held), sorted(from_versions.items()), sorted(published.items()),
            sorted(superseded or {})))
        return {}

    def log(self):
        return self.calls


def run_config(tmp_path, world_size: int) -> RunConfig:
    return RunConfig.model_validate({
        "name": f"ranks{world_size}", "output_dir": str(tmp_path),
        "orchestrator": {"samples_per_prompt": K},
        "shardcast": {"origin_port": free_port("127.0.0.1"), "run_id": "ranks-test"},
        "trainer": {"world_size": world_size, "samples_per_step": 3 * K, "lr": 1e-2, "micro_batch_tokens": 64,
                    "checkpoint_every": 1, "keep_checkpoints": 10, "max_steps": STEPS, "num_threads": 1,
                    "max_staleness": 2},
    })


def train_until(group: TrainerGroup, version: int) -> None:
    for _ in range(20):
        out = group.call("train_step", timeout_s=180)
        if out["version"] >= version:
            return
    raise AssertionError(f"the trainer did not reach version {version}")


def weights(cfg: RunConfig, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.checkpoint_root(cfg.run_dir) / f"step_{version:08d}" / "model" / ckpt.MODEL_FILE))


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_two_ranks_train_publish_and_commit_as_one(ray_cluster, tiny_model_dir, tmp_path):
    ray = ray_cluster
    logs = {}

    # One rank: STEPS steps.
    one = run_config(tmp_path, 1)
    orch = ray.remote(num_cpus=0)(FixedBatches).options(name=orchestrator_actor_name(one)).remote()
    group = TrainerGroup(one, str(tiny_model_dir), str(one.run_dir), str(tmp_path / "key1")).start()
    assert group.placement_group is None and group.call("info", timeout_s=60)["world_size"] == 1
    train_until(group, STEPS)
    group.call("finish", timeout_s=180)
    logs[1] = ray.get(orch.log.remote())
    group.shutdown()

    # Two ranks: a placement group of two bundles, one process group, FSDP2.
    two = run_config(tmp_path, 2)
    orch = ray.remote(num_cpus=0)(FixedBatches).options(name=orchestrator_actor_name(two)).remote()
    group = TrainerGroup(two, str(tiny_model_dir), str(two.run_dir), str(tmp_path / "key2")).start()
    try:
        assert ray.util.placement_group_table(group.placement_group)["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}
        info = group.call("info", timeout_s=60)
        assert info["world_size"] == 2 and info["version"] == 0
        pids = group.pids
        assert pids[0] == info["pid"] and len(set(pids)) == 2
        train_until(group, STEPS - 1)
        group.call("finish", timeout_s=180)

        # Rank 1 dies. The driver's own handling: the whole group starts again from the last checkpoint,
        # counted as one restart of the trainer under the restart policy.
        run = Run(two)
        run.trainers = group
        run.supervisor.watch_actor("trainer", None, RunDir(two.run_dir).logs / "trainer.log", pids[0], time.time())
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(TrainerDied):
            for _ in range(10):
                group.call("train_step", timeout_s=180)
        run._wait_for_trainer(TrainerDied("rank 1 was killed"))
        assert run.supervisor.summary()["trainer"][0] == 1
        info = group.call("info", timeout_s=60)
        assert info["version"] == STEPS - 1 and info["world_size"] == 2
        assert not set(group.pids) & set(pids) and group.pids[0] == info["pid"]
        train_until(group, STEPS)
        group.call("finish", timeout_s=180)
        logs[2] = ray.get(orch.log.remote())
    finally:
        group.shutdown()

    # The same numbers: every version's weights, to float tolerance (summation order differs).
    for version in range(1, STEPS + 1):
        got, want = weights(two, version), weights(one, version)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=2e-4, rtol=0, msg=f"v{version} {name}")
    # Each rank wrote its own shard of the optimizer state (the restart above resumed from them).
    shards = ckpt.checkpoint_root(two.run_dir) / f"step_{STEPS:08d}" / ckpt.OPTIMIZER_DIR
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt.checkpoint_root(one.run_dir) / f"step_{STEPS:08d}" / ckpt.OPTIMIZER_DIR).exists()
    assert not list(ckpt.checkpoint_root(two.run_dir).glob(".*"))  # no shards left outside a checkpoint
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(weights(two, STEPS)[n], base[n]) for n in base)

    # The same batches taken, trained and committed, and the same versions announced with them. The
    # two-rank run also has its restart: a batch taken while rank 1 was dead went back, and came again.
    def kind(run, name):
        return [c[1:] for c in logs[run] if c[0] == name]

    def committed(run):  # (batch, version it was trained from) in commit order, and the versions announced
        # A commit may repeat a batch whose first commit the checkpoint in flight did not know of yet
        # (the background writer): committing again changes nothing, so only the first counts.
        batches = list(dict.fromkeys(b for c in kind(run, "commit") for b in c[0]))
        return batches, [v for c in kind(run, "commit") for v in c[1]]

    assert kind(1, "trained") == kind(2, "trained") == [(f"b{i}", i) for i in range(STEPS)]
    assert committed(1) == committed(2) == ([(f"b{i}", i) for i in range(STEPS)], list(range(1, STEPS + 1)))
    assert kind(1, "take") == [(f"b{i}", i) for i in range(STEPS)]
    assert kind(2, "take") in (kind(1, "take"), kind(1, "take")[:-1] + [("b2", 2)] * 2)
    (first,) = kind(1, "reconcile")
    assert first == ([], [], [(0, first[2][0][1])], [])
    assert kind(2, "reconcile")[0] == first  # version 0 is the same model, with the same hash
    restarted = kind(2, "reconcile")[1]
    # The checkpoint it resumed from holds batches 0 and 1; it still names the batch of its own step (and
    # maybe the one before) as not known to be committed, for the orchestrator to settle.
    assert restarted[0] == [0, 1] and ("b1", 1) in restarted[1] and set(restarted[1]) <= {("b0", 0), ("b1", 1)}
    assert [v for v, _ in restarted[2]] == list(range(STEPS)) and restarted[3] == []
