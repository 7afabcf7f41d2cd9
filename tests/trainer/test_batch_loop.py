"""The trainer takes its own batches: a real orchestrator (its buffer, commit and versions) as the batch
source, the real Trainer on the tiny model, and the loop between them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.buffer import build_groups
from orchestrator.config import OrchestratorConfig, StepShape
from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.service import Orchestrator
from protocol.models import Completion, FinishReason, RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from trainer.batch_loop import BatchLoop
from trainer.config import TrainerConfig
from trainer.tiny_model import make_tokenizer
from trainer.train import Trainer
from verifier.tasks import get_task

K = 4  # group size


class NoVerifier:
    def verify_many(self, jobs):
        raise AssertionError("nothing is verified in these tests")


def make_orchestrator(tmp_path, shape: StepShape) -> Orchestrator:
    tok = make_tokenizer()
    prompts = PromptSet.from_items(get_task("toy").make_prompts(8, 0), tok, 0, vocab_size=64)
    return Orchestrator(OrchestratorConfig(samples_per_prompt=K), Database(tmp_path / "o.sqlite"), prompts, NoVerifier(), shape=shape)


def add_group(orch: Orchestrator, seed: int, version: int = 0) -> None:
    """One accepted group of K samples, as a verdict adds it (rewards vary, so it has signal)."""
    rng = np.random.default_rng(seed)
    lease = TaskLease(
        lease_id=f"L{seed}", prompts=[TaskPrompt(prompt_id="p", token_ids=[1, 5, 6, 7], seeds=list(range(K)))], samples_per_prompt=K,
        sampling=SamplingParams(max_tokens=8), policy_version=version, min_policy_version=0, deadline=time.time() + 60,
    )
    comps = [
        Completion(prompt_index=0, sample_index=i, token_ids=rng.integers(3, 40, size=n), logprobs=-rng.uniform(1, 3, size=n).astype(np.float32),
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
    hashes = {}

    def publish(version, state):
        hashes[version] = f"{version:064x}"
        return hashes[version]

    cfg = TrainerConfig(lr=1e-3, samples_per_step=2 * K, mini_batches=mini_batches, max_staleness=2)
    trainer = Trainer(cfg, tiny_model_dir, tmp_path / "run", publish=publish)
    orch.publish_version(0, hashes[0])
    loop = BatchLoop(trainer, orch, samples_per_step=2 * K, wait_s=0.05)

    add_group(orch, seed=1)
    assert loop.step() is None  # half a batch: nothing trained, the group goes back
    assert orch.buffer.depth() == K and trainer.version == 0

    add_group(orch, seed=2)
    result = loop.step()
    assert result is not None
    assert trainer.version == mini_batches and trainer.last_published == {v: hashes[v] for v in range(1, mini_batches + 1)}
    assert result.metrics["time/wait_for_rollouts"] > 0 and result.metrics["samples/trained"] == 2 * K
    # The batch id and the version the step started from are in the data cursor (and so in the checkpoint).
    assert trainer.data_cursor == {"last_batch_id": result.batch_id, "last_batch_from_version": 0}
    # One commit: the batch is trained, the step counted, every version it published is known with its hash.
    st = orch.status()
    assert st.step == 1 and st.policy_version == mini_batches and st.buffer_depth == 0
    assert all(orch.verification.versions.model_hash(v) == hashes[v] for v in range(mini_batches + 1))
    # Staleness against the version the step started from, as the trainer counts it, for any mini_batches.
    assert result.staleness == {0: 2 * K} and st.staleness_histogram == {"0": 2 * K}
    assert result.metrics["staleness/0"] == 2 * K
    orch.db.close()


def test_a_restarted_trainer_reconciles_the_batches_it_left(tiny_model_dir, tmp_path):
    """The batch the trainer's checkpoint trained is committed; one it held when it died goes back."""
    orch = make_orchestrator(tmp_path, StepShape(samples_per_step=K, max_staleness=2))
    for seed in range(3):
        add_group(orch, seed)
    trained = orch.take_batch(K, 0)  # trained and checkpointed, then the trainer died before committing
    in_flight = orch.take_batch(K, 1)  # taken by the next step, which never finished
    assert orch.buffer.status_counts()["taken"] == 2 * K
    out = orch.reconcile_trainer(trained.batch_id, 0, 1, "1" * 64)
    assert out == {"committed": K, "returned": K}
    counts = orch.buffer.status_counts()
    assert counts.get("trained") == K and counts.get("ready") == 2 * K and "taken" not in counts
    assert orch.status().policy_version == 1 and orch.verification.versions.model_hash(1) == "1" * 64
    assert in_flight.batch_id not in orch.buffer.taken_batches()
    orch.db.close()
