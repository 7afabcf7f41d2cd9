"""The exactly-once audit reads a real orchestrator's SQLite file and a checkpoint's lineage: it counts a
clean run as clean, and it does catch a sample trained twice and one lost."""

from __future__ import annotations

import json

import numpy as np
from orch_fakes import HASH1, encode, make_orchestrator, make_submission, run_config

from protocol.models import LeaseRequest, WorkerRegistration
from swarmrl.audit import audit_run


def checkpoint(run_dir, step: int, lineage: list[list[int]]) -> None:
    """What the audit reads of a checkpoint: trainer_state.json's step and lineage."""
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "data_cursor": {"lineage": lineage}}))


def setup(tmp_path):
    cfg = run_config(tmp_path)
    (tmp_path / "test").mkdir(exist_ok=True)
    (tmp_path / "test" / "config.toml").write_text("[orchestrator]\nsamples_per_prompt = 4\n")
    orch = make_orchestrator(cfg)
    wid = orch.authenticate(orch.register(WorkerRegistration(name="w"),
        orch.cfg.join_tokens[0].get_secret_value()).secret)
    rng = np.random.default_rng(1)
    while orch.buffer.depth() < 12:
        lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
        orch.admission.submit(wid, encode(make_submission(lease, rng)), None)
        while orch.verification.verify_pending():
            pass
    return orch, tmp_path / "test"


def test_a_clean_run_is_counted_as_clean(tmp_path):
    orch, run_dir = setup(tmp_path)
    a, b = orch.take_batch(4, 0), orch.take_batch(4, 0)
    orch.commit_batches({a.batch_id: 0}, {1: HASH1})
    orch.give_back_batch(b.batch_id)
    orch.db.close()
    checkpoint(run_dir, 1, [[1, 1]])
    audit = audit_run(run_dir, tmp_path / "orchestrator.sqlite")
    assert audit.problems == []
    assert audit.trained_once == 4 and audit.buffered == audit.accepted - audit.zero_signal - 4
    assert audit.lost == audit.trained_twice == 0
    assert audit.batches == {"committed": 1, "returned": 1} and audit.versions == 2 and audit.versions_consecutive


def test_the_audit_catches_a_sample_trained_twice_and_one_lost(tmp_path):
    orch, run_dir = setup(tmp_path)
    a = orch.take_batch(4, 0)
    orch.give_back_batch(a.batch_id)  # its groups go back ...
    b = orch.take_batch(4, 0)  # ... and are taken again
    c = orch.take_batch(4, 0)
    orch.commit_batches({b.batch_id: 0, c.batch_id: 0}, {1: HASH1})
    orch.db.close()
    # A lineage that holds a (returned) and b (the same groups), and not c (committed): what a broken
    # reconciliation would leave.
    checkpoint(run_dir, 1, [[1, 2]])
    audit = audit_run(run_dir, tmp_path / "orchestrator.sqlite")
    assert audit.trained_twice == 4 and audit.lost == 4
    assert "4 samples trained twice" in audit.problems and "4 samples lost" in audit.problems
