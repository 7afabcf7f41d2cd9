"""The trainer's batches over restarts of the orchestrator (a new Orchestrator on the same SQLite file):
the states a batch moves through, the reconciliation rule, and versions a trainer crash superseded."""

from __future__ import annotations

import numpy as np
import pytest
from orch_fakes import HASH0, HASH1, encode, make_orchestrator, make_submission, run_config

from orchestrator.errors import ApiError
from protocol.batches import ReconcileFirst
from protocol.models import ErrorCode, LeaseRequest, WorkerRegistration


def fill(orch, groups: int, seed: int = 0):
    """Accepted submissions until at least `groups` groups are ready; returns the worker id."""
    wid = orch.authenticate(orch.register(WorkerRegistration(name="w"),
        orch.cfg.join_tokens[0].get_secret_value()).secret)
    rng = np.random.default_rng(seed)
    while orch.buffer.depth() < groups * 4:
        lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
        orch.admission.submit(wid, encode(make_submission(lease, rng)), None)
        while orch.verification.verify_pending():
            pass
    return wid


def statuses(orch) -> dict[str, str]:
    return {r["batch_id"]: r["status"] for r in orch.db.all("SELECT batch_id, status FROM batches")}


def test_batches_are_numbered_in_take_order_and_move_through_their_states(tmp_path):
    orch = make_orchestrator(run_config(tmp_path))
    fill(orch, 6)
    a, b, c = (orch.take_batch(4, 0) for _ in range(3))
    assert [a.seq, b.seq, c.seq] == [1, 2, 3]
    assert orch.mark_trained(a.batch_id, 0) and orch.mark_trained(b.batch_id, 0)
    assert not orch.mark_trained(a.batch_id, 0)  # only a taken batch becomes trained
    assert orch.status().step == 0  # trained is not committed: nothing counted yet
    gaps = orch.commit_batches({a.batch_id: 0}, {1: HASH1})
    assert gaps == {0: 4} and orch.status().step == 1 and orch.status().policy_version == 1
    assert orch.commit_batches({a.batch_id: 0}, {}) == {}  # twice: nothing
    assert orch.give_back_batch(c.batch_id) == 4
    assert orch.give_back_batch(a.batch_id) == 0  # a committed batch never goes back
    assert statuses(orch) == {a.batch_id: "committed", b.batch_id: "trained", c.batch_id: "returned"}
    # The membership stays after a batch went back: the audit trail of which groups each batch held.
    held = orch.db.all("SELECT batch_seq, COUNT(*) AS n FROM batch_groups GROUP BY batch_seq")
    assert {r["batch_seq"]: r["n"] for r in held} == {1: 1, 2: 1, 3: 1}
    orch.db.close()


def test_a_restart_settles_batches_by_the_trainers_lineage(tmp_path):
    """Three batches in flight when the orchestrator dies: 1 committed, 2 trained (its checkpoint may or
    may not be durable), 3 taken. After the restart no batch goes out until the trainer reconciles;
    whatever its lineage holds is committed, the rest goes back, and nothing is trained twice."""
    cfg = run_config(tmp_path)
    orch = make_orchestrator(cfg)
    fill(orch, 6)
    a, b, c = (orch.take_batch(4, 0) for _ in range(3))
    orch.mark_trained(a.batch_id, 0)
    orch.commit_batches({a.batch_id: 0}, {1: HASH1})
    orch.mark_trained(b.batch_id, 1)
    orch.db.close()

    orch = make_orchestrator(cfg)  # the restart: b and c are still in flight
    assert statuses(orch)[b.batch_id] == "trained" and statuses(orch)[c.batch_id] == "taken"
    with pytest.raises(ReconcileFirst):
        orch.take_batch(4, 1)
    out = orch.reconcile_trainer([[1, 2]], {b.batch_id: 1}, {1: HASH1, 2: "2" * 64})
    assert out == {"committed": 4, "returned": 4}
    assert statuses(orch) == {a.batch_id: "committed", b.batch_id: "committed", c.batch_id: "returned"}
    assert orch.status().policy_version == 2 and orch.status().step == 2
    assert orch.reconcile_trainer([[1, 2]], {}, {}) == {"committed": 0, "returned": 0}  # idempotent
    d = orch.take_batch(100, 2)  # open again: c's groups come back in a new batch
    assert d.seq == 4 and {g.submission_id for g in c.groups} <= {g.submission_id for g in d.groups}
    orch.db.close()


def test_a_restart_with_nothing_in_flight_needs_no_reconciliation(tmp_path):
    cfg = run_config(tmp_path)
    orch = make_orchestrator(cfg)
    fill(orch, 2)
    a = orch.take_batch(4, 0)
    orch.commit_batches({a.batch_id: 0}, {1: HASH1})
    orch.db.close()
    orch = make_orchestrator(cfg)
    assert orch.reconciled and orch.take_batch(4, 1).num_samples == 4
    orch.db.close()


def test_a_superseded_version_is_refused_without_a_strike(tmp_path):
    """Version 1 was trained after the trainer's last checkpoint and lost with it; a relay still serves
    its old weights. A worker that generated with them is told to move on, and is not blamed."""
    orch = make_orchestrator(run_config(tmp_path))
    wid = fill(orch, 1)
    old = "a" * 64
    orch.reconcile_trainer([], {}, {0: HASH0}, superseded={1: old})
    orch.commit_batches({}, {1: HASH1})  # version 1 trained again, durable, announced
    lease = orch.lease(wid, LeaseRequest(loaded_policy_version=1, max_prompts=2)).lease
    with pytest.raises(ApiError) as e:
        orch.admission.submit(wid, encode(make_submission(lease, np.random.default_rng(9), policy_version=1,
            model_hash=old)), None)
    assert e.value.code == ErrorCode.version_too_old and e.value.min_policy_version == 2
    assert orch.workers.get(wid).strikes == 0
    # The current hash of version 1 is accepted as usual, and a re-publication also supersedes.
    r = orch.admission.submit(wid, encode(make_submission(lease, np.random.default_rng(9), policy_version=1,
        model_hash=HASH1)), None)
    assert r.submission_id
    orch.versions.announce({1: "b" * 64})
    assert orch.verification.versions.is_superseded(1, HASH1) and not orch.verification.versions.is_superseded(1,
        "b" * 64)
    orch.db.close()


def test_a_batch_counts_as_untrained_until_it_is_committed(tmp_path):
    """Its version is announced only at the commit, so leases plan from a version that does not hold it
    yet: its samples must still count as ahead of that version (or leases plan one version short). A
    batch that goes back counts as before; the count after a restart is the one kept step by step."""
    cfg = run_config(tmp_path)
    orch = make_orchestrator(cfg)
    fill(orch, 3)

    def untrained() -> int:
        with orch.db.tx() as db:
            return orch.leases.untrained_samples(db)

    start = untrained()
    a, b = orch.take_batch(4, 0), orch.take_batch(4, 0)
    orch.mark_trained(a.batch_id, 0)
    orch.mark_trained(b.batch_id, 0)
    assert untrained() == start
    orch.commit_batches({a.batch_id: 0}, {1: HASH1})
    assert untrained() == start - 4
    orch.db.close()
    orch = make_orchestrator(cfg)  # recounted from the tables: b is still ahead of version 1
    assert untrained() == start - 4
    orch.reconcile_trainer([[1, 1]], {}, {})  # b was not in the checkpoint: back in the buffer
    assert untrained() == start - 4
    orch.db.close()


def test_the_trainer_side_is_exactly_batch_source_and_the_actor_adds_no_forwarders():
    """The Ray actor is the orchestrator made remote: its trainer side is `BatchSource`, method for
    method; it adds only what an actor needs (no forwarder to the orchestrator), and no async method
    (Ray would then run every method on one event loop, and a trainer waiting in take_batch would hold
    up status)."""
    import inspect

    from orchestrator.service import Orchestrator
    from swarmrl.actors import OrchestratorActor
    from trainer.batch_loop import BatchSource

    trainer_side = {n for n in vars(BatchSource) if not n.startswith("_")}
    assert trainer_side == {"take_batch", "give_back_batch", "mark_trained", "commit_batches", "reconcile_trainer"}
    for name in trainer_side:
        assert inspect.signature(getattr(Orchestrator, name)) == inspect.signature(getattr(BatchSource, name)), name
    assert issubclass(OrchestratorActor, Orchestrator)
    assert {n for n in vars(OrchestratorActor) if not n.startswith("_")} == {"url", "ping", "set_verifiers", "shutdown"}
    assert not inspect.getmembers(OrchestratorActor, inspect.iscoroutinefunction)
