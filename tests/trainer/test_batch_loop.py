"""The trainer takes its own batches: a real orchestrator (its buffer, batches, commit and versions) as the
batch source, the real Trainer on the tiny model with its real checkpoints, and the loop between them,
including the restarts of either side."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from environments.tasks import get_task
from orchestrator.buffer import build_groups
from orchestrator.config import OrchestratorConfig, StepShape
from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.service import Orchestrator
from protocol.batches import Lineage
from protocol.models import Completion, FinishReason, RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from trainer import checkpoint as ckpt
from trainer.batch_loop import BatchLoop, SourceUnavailable
from trainer.config import TrainerConfig
from trainer.tiny_model import make_tokenizer
from trainer.train import Trainer

K = 4  # group size


class NoVerifier:
    def verify_many(self, jobs):
        raise AssertionError("nothing is verified in these tests")


def make_orchestrator(tmp_path, shape: StepShape) -> Orchestrator:
    """An orchestrator over tmp_path/o.sqlite: calling it again is a restart."""
    tok = make_tokenizer()
    prompts = PromptSet.from_items(get_task("toy").make_prompts(8, 0), tok, 0, vocab_size=64)
    return Orchestrator(OrchestratorConfig(samples_per_prompt=K), Database(tmp_path / "o.sqlite"), prompts,
        NoVerifier(), shape=shape)


class Publisher:
    def __init__(self):
        self.hashes: dict[int, str] = {}

    def __call__(self, version, state):
        self.hashes[version] = f"{version:064x}"
        return self.hashes[version]


def make_trainer(tiny_model_dir, run_dir, publish, **cfg) -> Trainer:
    config = TrainerConfig(**{"lr": 1e-3, "samples_per_step": 2 * K, "max_staleness": 2, "checkpoint_every": 1, **cfg})
    return Trainer(config, tiny_model_dir, run_dir, publish=publish, defer_io=True)


def durable_lineage(run_dir) -> Lineage:
    latest = ckpt.latest_checkpoint(ckpt.checkpoint_root(run_dir))
    if latest is None:
        return Lineage()
    return Lineage(json.loads((latest / "trainer_state.json").read_text())["data_cursor"].get("lineage"))


class Checked:
    """The orchestrator as the batch source, asserting the durability barrier on every commit: the latest
    checkpoint on disk already includes every batch being committed. The calls named in `down` fail as
    if the orchestrator were unreachable."""

    def __init__(self, orch: Orchestrator, run_dir):
        self.orch, self.run_dir, self.down, self.commits = orch, run_dir, set(), []

    def __getattr__(self, name):
        method = getattr(self.orch, name)

        def call(*args, **kwargs):
            if name in self.down:
                raise SourceUnavailable(name)
            if name == "commit_batches":
                lineage = durable_lineage(self.run_dir)
                seqs = {b: s for s, b, _ in self.orch.batches.unsettled()}
                assert all(seqs[b] in lineage for b in args[0] if b in seqs), (args[0], lineage.ranges)
                self.commits.append(dict(args[0]))
            return method(*args, **kwargs)

        return call


def batch_status(orch: Orchestrator) -> dict[str, str]:
    return {r["batch_id"]: r["status"] for r in orch.db.all("SELECT batch_id, status FROM batches")}


def add_group(orch: Orchestrator, seed: int, version: int = 0) -> None:
    """One accepted group of K samples, as a verdict adds it (rewards vary, so it has signal)."""
    rng = np.random.default_rng(seed)
    lease = TaskLease(
        lease_id=f"L{seed}", prompts=[TaskPrompt(prompt_id="p", token_ids=[1, 5, 6, 7], seeds=list(range(K)))],
        samples_per_prompt=K, sampling=SamplingParams(max_tokens=8), policy_version=version, min_policy_version=0,
        deadline=time.time() + 60,
    )
    comps = [
        Completion(prompt_index=0, sample_index=i, token_ids=rng.integers(3, 40, size=n), logprobs=-rng.uniform(1, 3,
        size=n).astype(np.float32),
                   finish_reason=FinishReason.length, proofs=[b"x"])
        for i, n in enumerate(rng.integers(2, 8, size=K))
    ]
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=version, model_hash="0" * 64, completions=comps)
    groups = build_groups(f"S{seed}", sub, lease, [0.0, 0.25, 0.5, 1.0])
    with orch.db.tx() as db:
        orch.buffer.add(db, groups)
    orch.buffer.added(groups.num_samples)


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_the_trainer_takes_trains_and_commits_its_own_batches(tiny_model_dir, tmp_path, mini_batches):
    shape = StepShape(samples_per_step=2 * K, mini_batches=mini_batches, max_staleness=2)
    orch = make_orchestrator(tmp_path, shape)
    publish = Publisher()
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", publish, mini_batches=mini_batches)
    source = Checked(orch, tmp_path / "run")
    loop = BatchLoop(trainer, source, samples_per_step=2 * K, wait_s=0.05, versions=lambda: dict(publish.hashes))

    add_group(orch, seed=1)
    assert orch.versions.model_hash(0) == ""  # nobody announces version 0 but the trainer's first reconciliation
    assert loop.step() is None  # half a batch: nothing trained, the group goes back
    assert orch.versions.model_hash(0) == publish.hashes[0] and orch.versions.current == 0
    assert orch.buffer.depth() == K and trainer.version == 0
    assert list(batch_status(orch).values()) == ["returned"]

    add_group(orch, seed=2)
    result = loop.step()
    assert result is not None and trainer.version == mini_batches
    assert result.metrics["time/wait_for_rollouts"] > 0 and result.metrics["samples/trained"] == 2 * K
    loop.finish()  # waits for the writer: checkpoint, publish, commit
    assert [r.batch_id for r in loop.committed()] == [result.batch_id] and loop.committed() == []
    # Every version the step made is published (after its checkpoint) and announced with its hash.
    assert set(publish.hashes) == set(range(mini_batches + 1))
    assert all(orch.verification.versions.model_hash(v) == publish.hashes[v] for v in range(mini_batches + 1))
    # One commit, after the checkpoint that holds the batch was on disk (Checked asserts it).
    assert source.commits == [{result.batch_id: 0}]
    st = orch.status()
    assert st.step == 1 and st.policy_version == mini_batches and st.buffer_depth == 0
    assert batch_status(orch)[result.batch_id] == "committed"
    # The checkpoint names the batch (its take sequence) and nothing is left uncommitted.
    seq = orch.db.one("SELECT seq FROM batches WHERE batch_id=?", (result.batch_id,))[0]
    assert list(durable_lineage(tmp_path / "run")) == [seq] and trainer.data_cursor["uncommitted"] == {}
    # Staleness against the version the step started from, as the trainer counts it, for any mini_batches.
    assert result.staleness == {0: 2 * K} and st.staleness_histogram == {"0": 2 * K}
    loop.close()
    orch.db.close()


class Unfiltered(Checked):
    """A source whose take does not drop stale groups first (a take without the trainer's version)."""

    def take_batch(self, n, trainer_version=None, wait_s=0.0):
        return self.orch.take_batch(n, None, wait_s)


def test_the_trainer_and_the_orchestrator_tally_a_step_alike(tiny_model_dir, tmp_path):
    """The trainer's step tallies what it trains and drops; the orchestrator's commit tallies the same step
    from its stored groups. Handed groups 0 to 3 versions behind with max_staleness 1, the loop reports and
    the orchestrator records the same samples trained and dropped, by the same version gaps."""
    batch = 4 * K
    orch = make_orchestrator(tmp_path, StepShape(samples_per_step=batch, max_staleness=1))
    publish = Publisher()
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", publish, samples_per_step=batch, max_staleness=1)
    source = Unfiltered(orch, tmp_path / "run")
    loop = BatchLoop(trainer, source, samples_per_step=batch, wait_s=0.05, versions=lambda: dict(publish.hashes))
    for step in range(3):
        for seed in range(4):
            add_group(orch, seed=10 * step + seed, version=trainer.version)
        assert loop.step() is not None
    assert trainer.version == 3
    for seed, version in enumerate([3, 2, 1, 0]):
        add_group(orch, seed=100 + seed, version=version)
    result = loop.step()
    loop.finish()
    assert result is not None and trainer.version == 4
    # The trainer: gaps 0 and 1 trained, 2 and 3 dropped; its metrics count every sample it was handed.
    assert trainer.last_staleness.trained == result.staleness == {0: K, 1: K}
    assert trainer.last_staleness.dropped == {2: K, 3: K}
    assert result.metrics["samples/dropped_stale"] == 2 * K and result.metrics["samples/trained"] == 2 * K
    assert {g: result.metrics[f"staleness/{g}"] for g in range(4)} == {0: K, 1: K, 2: K, 3: K}
    # The orchestrator: the same groups trained and stale, the same histogram and drop count.
    rows = orch.db.all("SELECT behaviour_version AS v, status FROM sample_groups WHERE submission_id LIKE 'S10_'")
    assert {r["v"]: r["status"] for r in rows} == {3: "trained", 2: "trained", 1: "stale", 0: "stale"}
    st = orch.status()
    assert st.staleness_histogram == {"0": 3 * batch + K, "1": K}  # the 3 earlier steps trained at gap 0
    assert st.samples_dropped_stale == result.metrics["samples/dropped_stale"] == 2 * K
    assert orch.buffer.status_counts() == {"trained": 3 * batch + 2 * K, "stale": 2 * K}
    loop.close()
    orch.db.close()


def test_a_trainer_restart_commits_what_its_checkpoint_holds_and_gives_back_the_rest(tiny_model_dir, tmp_path):
    """checkpoint_every = 2. Batches a and b are in the checkpoint of version 2, but its commit fails (the
    orchestrator is unreachable) and the trainer dies: the restarted trainer commits them. It then trains
    c (version 3, no checkpoint) while d is taken but never received, and dies: the next one gives both
    back. In the end every group is in exactly one committed batch."""
    shape = StepShape(samples_per_step=2 * K, max_staleness=4)
    orch = make_orchestrator(tmp_path, shape)
    publish = Publisher()
    run = tmp_path / "run"

    def new_loop() -> tuple[Trainer, BatchLoop, Checked]:
        trainer = make_trainer(tiny_model_dir, run, publish, checkpoint_every=2, max_staleness=4)
        source = Checked(orch, run)
        return trainer, BatchLoop(trainer, source, samples_per_step=2 * K, wait_s=0.05,
            versions=lambda: dict(publish.hashes)), source

    trainer, loop, source = new_loop()
    orch.versions.announce({0: publish.hashes[0]})
    for seed in range(8):
        add_group(orch, seed)
    a = loop.step()
    source.down = {"commit_batches"}  # b's checkpoint holds a and b; its commit fails
    b = loop.step()
    loop._flush()
    assert a and b and trainer.version == 2 and loop.needs_reconcile
    assert batch_status(orch) == {a.batch_id: "trained", b.batch_id: "trained"}  # told "trained", never committed
    assert list(durable_lineage(run)) == [1, 2]
    loop.close()  # the trainer dies

    trainer, loop, source = new_loop()
    assert trainer.version == 2
    assert loop.reconcile() == {"committed": 4 * K, "returned": 0}
    # The old trainer never reported a and b (their commit failed); their checkpoint has their metrics.
    assert [(r.batch_id, r.metrics["version"]) for r in loop.committed()] == [(a.batch_id, 1.0), (b.batch_id, 2.0)]
    c = loop.step()
    loop._flush()
    d = orch.take_batch(2 * K, trainer.version)
    assert c and d.groups and trainer.version == 3
    loop.close()  # dies again, version 3 not durable

    trainer, loop, source = new_loop()
    assert trainer.version == 2
    assert loop.reconcile() == {"committed": 0, "returned": 4 * K}
    st = batch_status(orch)
    assert st[a.batch_id] == st[b.batch_id] == "committed" and st[c.batch_id] == st[d.batch_id] == "returned"
    assert orch.status().policy_version == 2  # version 3 was never announced: it was never durable
    assert loop.step() and loop.step()  # the returned groups are trained again
    loop.finish()
    assert trainer.version == 4 and orch.status().policy_version == 4
    committed = [r[0]
        for r in orch.db.all("SELECT group_seq FROM batch_groups bg JOIN batches b ON b.seq = bg.batch_seq WHERE "
        "b.status='committed'")]
    assert sorted(committed) == list(range(1, 9))  # every group in exactly one committed batch
    assert orch.buffer.status_counts() == {"trained": 8 * K}
    assert orch.db.get_int("reconcile_conflicts") == 0
    loop.close()
    orch.db.close()


def test_an_orchestrator_restart_is_reconciled_by_the_live_trainer(tiny_model_dir, tmp_path):
    """The orchestrator restarts while the trainer is alive: one batch the trainer trained (its checkpoint
    not yet written) and one it took without ever receiving are both "taken" in SQLite. The restarted
    orchestrator hands out nothing until the trainer reconciles; the trainer makes its state durable
    first, so the trained batch is committed and the lost one goes back."""
    orch = make_orchestrator(tmp_path, StepShape(samples_per_step=2 * K, max_staleness=4))
    publish = Publisher()
    run = tmp_path / "run"
    trainer = make_trainer(tiny_model_dir, run, publish, checkpoint_every=2, max_staleness=4)
    orch.versions.announce({0: publish.hashes[0]})
    loop = BatchLoop(trainer, Checked(orch, run), samples_per_step=2 * K, wait_s=0.05,
        versions=lambda: dict(publish.hashes))
    for seed in range(6):
        add_group(orch, seed)
    trained = loop.step()  # version 1: no checkpoint yet
    loop._flush()  # the writer told the orchestrator "trained" (and published version 1, not durable)
    lost = orch.take_batch(2 * K, 1)  # taken, but the answer never reached the trainer
    orch.db.close()

    orch2 = make_orchestrator(tmp_path, StepShape(samples_per_step=2 * K, max_staleness=4))  # the restart
    assert not orch2.reconciled
    loop.source = Checked(orch2, run)
    assert loop.step() is None and loop.needs_reconcile  # ReconcileFirst
    result = loop.step()  # reconciles (writing the checkpoint of version 1 first), then trains
    assert result is not None
    loop.finish()
    st = batch_status(orch2)
    assert st[trained.batch_id] == "committed" and st[lost.batch_id] == "returned"
    assert st[result.batch_id] == "committed"
    assert orch2.status().policy_version == trainer.version == 2
    loop.close()
    orch2.db.close()
