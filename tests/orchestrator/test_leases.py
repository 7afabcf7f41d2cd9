"""Leases as LeaseBook issues them: built without re-validating the run's own prompt arrays, so check
that what is stored and sent is exactly what full validation accepts, and that a prompt the wire
contract refuses is still refused."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from orch_fakes import make_prompts, run_config
from pydantic import ValidationError

from orchestrator.data import Prompt, PromptSet
from orchestrator.db import Database
from orchestrator.leases import LeaseBook
from protocol.models import TaskLease


@pytest.fixture
def book(tmp_path):
    cfg = run_config(tmp_path, max_open_leases_per_worker=100)
    db = Database(cfg.orchestrator.db_path)
    yield LeaseBook(db, make_prompts(cfg), cfg.orchestrator)
    db.close()


def test_issued_lease_is_what_full_validation_gives(book):
    for _ in range(3):  # a prompt's first lease validates it; later leases reuse it
        lease = book.issue("w1", 2, 0, time.time())
        row = book.get(lease.lease_id)
        # The stored row is the lease's JSON, and it passes the wire contract.
        assert row.body == lease.model_dump_json()
        again = TaskLease.model_validate_json(row.body, context={"vocab_size": book.prompts.vocab_size})
        assert again.model_dump_json() == lease.model_dump_json()
        for p, i in zip(lease.prompts, row.prompt_indices):
            assert p.prompt_id == book.prompts.prompts[i].prompt_id
            assert p.token_ids.dtype == np.int32 and np.array_equal(p.token_ids, book.prompts.prompts[i].token_ids)
            assert len(p.seeds) == lease.samples_per_prompt and all(0 <= s < 2**63 for s in p.seeds)
            # Shared by every lease of this prompt: nobody may write to it.
            assert not p.token_ids.flags.writeable
            with pytest.raises(ValueError):
                p.token_ids[0] = 1


def test_prompt_refused_by_the_wire_contract_is_still_refused(tmp_path):
    cfg = run_config(tmp_path, prompts_per_lease=1, max_open_leases_per_worker=100)
    bad_id = Prompt(SimpleNamespace(prompt_id="has spaces"), np.array([1, 2], dtype=np.int32))
    negative = Prompt(SimpleNamespace(prompt_id="neg"), np.array([3, -1], dtype=np.int32))
    for prompt in (bad_id, negative):
        db = Database(tmp_path / f"{prompt.prompt_id}.sqlite")
        book = LeaseBook(db, PromptSet([prompt], seed=0, vocab_size=64), cfg.orchestrator)
        for _ in range(2):  # every time, not only the first
            with pytest.raises(ValidationError):
                book.issue("w1", 1, 0, time.time())
        db.close()


def test_seeds_are_secret_per_run_and_survive_a_restart(tmp_path):
    """Seeds come from the run's own secret: another run with the same config and the same lease
    sequence gets other seeds (so nobody can precompute a draw from our source and config), while a
    restart of the same run keeps issuing from the same stream (its database holds the key)."""
    cfg = run_config(tmp_path, max_open_leases_per_worker=100)
    prompts = make_prompts(cfg)
    db = Database(tmp_path / "a.sqlite")
    a = LeaseBook(db, prompts, cfg.orchestrator)
    first = a.sample_seeds(7, 16)
    assert first == a.sample_seeds(7, 16) and first != a.sample_seeds(8, 16)
    assert len(set(first)) == 16 and all(0 <= s < 2**63 for s in first)
    db.close()
    db = Database(tmp_path / "a.sqlite")
    assert LeaseBook(db, prompts, cfg.orchestrator).sample_seeds(7, 16) == first
    db.close()
    other = Database(tmp_path / "b.sqlite")
    assert LeaseBook(other, prompts, cfg.orchestrator).sample_seeds(7, 16) != first
    other.close()


def test_lease_pins_the_version_the_worker_declared(book):
    lease = book.issue("w1", 1, 5, time.time(), loaded_version=4)
    assert lease.generation_version == 4 and lease.min_policy_version <= 4 <= lease.policy_version
    assert TaskLease.model_validate_json(book.get(lease.lease_id).body).generation_version == 4


def drawn(book, lease):
    """(prompt index, instance, seeds) per prompt of a lease, as stored and as sent."""
    row = book.get(lease.lease_id)
    return [(i, s, p.seeds) for i, s, p in zip(row.prompt_indices, row.instances, lease.prompts)]


def test_a_prompt_instance_keeps_its_seeds_whoever_leases_it_again(book):
    """Giving a lease back (released, expired, rejected) cannot reroll it: the next lease of the same prompt
    instances, to the same worker or another, carries exactly the same seeds. A new instance of the same
    prompt (the next epoch of the stream) draws new ones."""
    first = book.issue("w1", 2, 0, time.time())
    seen = drawn(book, first)
    assert [s for _, s, _ in seen] == [0, 1]  # instances are the prompt cursor's positions
    assert book.release(first.lease_id, "w1")
    again = book.issue("w1", 2, 0, time.time())  # the same worker
    assert drawn(book, again) == seen and again.lease_id != first.lease_id
    assert book.release(again.lease_id, "w1")
    other = book.issue("w2", 2, 0, time.time())  # another worker
    assert drawn(book, other) == seen
    assert book.expire(time.time() + 3600) == [other.lease_id]
    expired_again = book.issue("w3", 2, 0, time.time())
    assert drawn(book, expired_again) == seen
    with book.db.tx() as db:  # submitted and rejected
        assert book.mark_submitted(db, expired_again.lease_id)
        book.finish(db, expired_again.lease_id, accepted=False)
    rejected_again = book.issue("w1", 2, 0, time.time())
    assert drawn(book, rejected_again) == seen
    with book.db.tx() as db:
        assert book.mark_submitted(db, rejected_again.lease_id)
        book.finish(db, rejected_again.lease_id, accepted=True)
    # The rest of the epoch, then the next: every prompt comes back as a new instance, with new seeds.
    n = len(book.prompts)
    by_instance = {s: (i, seeds) for i, s, seeds in seen}
    while len(by_instance) < 2 * n:
        by_instance.update({s: (i, seeds) for i, s, seeds in drawn(book, book.issue("w1", 2, 0, time.time()))})
    assert sorted(by_instance) == list(range(2 * n))
    for s in range(n):
        index, seeds = by_instance[s]
        later = [t for t in range(n, 2 * n) if by_instance[t][0] == index]
        assert len(later) == 1 and by_instance[later[0]][1] != seeds
        assert seeds == book.sample_seeds(s, book.config.samples_per_prompt)
    assert len({tuple(seeds) for _, seeds in by_instance.values()}) == 2 * n


def test_a_reissued_instance_keeps_its_seeds_across_a_restart(tmp_path):
    cfg = run_config(tmp_path, max_open_leases_per_worker=100)
    prompts = make_prompts(cfg)
    db = Database(cfg.orchestrator.db_path)
    book = LeaseBook(db, prompts, cfg.orchestrator)
    released, held = book.issue("w1", 2, 0, time.time()), book.issue("w1", 2, 0, time.time())
    before = {lease.lease_id: drawn(book, lease) for lease in (released, held)}
    assert book.release(released.lease_id, "w1")
    db.close()
    db = Database(cfg.orchestrator.db_path)  # the orchestrator restarts; `held` is still open
    book = LeaseBook(db, prompts, cfg.orchestrator)
    assert drawn(book, book.issue("w2", 2, 0, time.time())) == before[released.lease_id]
    book.expire(time.time() + 3600)  # `held` expires after the restart
    assert drawn(book, book.issue("w2", 2, 0, time.time())) == before[held.lease_id]
    db.close()


def test_a_database_from_before_prompt_instances_is_migrated(tmp_path):
    """An older database: its reissue rows and open leases have no instance. Each such prompt gets a fresh
    instance (above any cursor position), kept from then on."""
    import sqlite3

    from orchestrator.leases import LEGACY_INSTANCE

    cfg = run_config(tmp_path, max_open_leases_per_worker=100)
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE leases (lease_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, worker_id TEXT NOT NULL, "
        "prompt_indices TEXT NOT NULL, "
        "body TEXT NOT NULL, issued_at REAL NOT NULL, deadline REAL NOT NULL, status TEXT NOT NULL, request_id TEXT, "
        "token_id TEXT, eval_version INTEGER);"
        "CREATE TABLE reissue (seq INTEGER PRIMARY KEY AUTOINCREMENT, prompt_index INTEGER NOT NULL);"
        "INSERT INTO reissue (prompt_index) VALUES (5);"
        "INSERT INTO leases VALUES ('L-old', 1, 'w0', '[7]', '{}', 0, 1, 'open', NULL, NULL, NULL);"
    )
    old.commit()
    old.close()
    db = Database(path)
    book = LeaseBook(db, make_prompts(cfg), cfg.orchestrator)
    first = book.issue("w1", 1, 0, time.time())
    assert drawn(book, first) == [(5, LEGACY_INSTANCE + 1, book.sample_seeds(LEGACY_INSTANCE + 1, 4))]
    book.expire(time.time() + 3600)  # the old open lease and the new one go back
    again = [drawn(book, book.issue("w1", 1, 0, time.time()))[0] for _ in range(2)]
    by_index = {i: (s, seeds) for i, s, seeds in again}
    assert by_index[5] == (LEGACY_INSTANCE + 1, first.prompts[0].seeds)  # kept once given
    assert by_index[7][0] > LEGACY_INSTANCE + 1  # the old open lease's prompt: a fresh instance too
    db.close()


def test_the_free_window_follows_the_measured_generation_time(tmp_path):
    """A release is free only before the lease could have been generated: with no measurement, within
    FREE_HOLD of the lease time; once accepted leases show how fast prompts are generated, within half of
    the fastest time (the token's own or the swarm's p10) for that many prompts."""
    from orchestrator.release_costs import FREE_HOLD, ReleaseCosts

    db = Database(tmp_path / "costs.sqlite")
    LeaseBook(db, make_prompts(run_config(tmp_path)), run_config(tmp_path).orchestrator)  # the leases table
    with db.tx() as conn:
        costs = ReleaseCosts(conn)
    assert costs.free_window("t1", 30.0, 2) == pytest.approx(FREE_HOLD * 30.0)
    assert costs.units("t1", 2, 0.0, 30.0, 0.05 * 30.0, 2, 0.25) == 0  # 5% of the lease: free without a measurement
    costs.note_accepted("t1", 2, 100.0, 102.0)  # 1 s per prompt
    assert costs.free_window("t1", 30.0, 2) == pytest.approx(1.0)
    assert costs.free_window("t2", 30.0, 4) == pytest.approx(2.0)  # another token: the swarm's speed
    assert costs.units("t1", 2, 0.0, 30.0, 0.01, 2, 0.25) == 0  # given back at once (shutting down): free
    # 5%: charged, at least the floor
    assert costs.units("t1", 2, 0.0, 30.0, 0.05 * 30.0, 2, 0.25) == pytest.approx(0.25)
    assert costs.units("t1", 2, 0.0, 30.0, 15.0, 2, 0.25) == pytest.approx(0.5)  # half the lease: half a lease's worth
    costs.note_accepted("t2", 2, 0.0, 60.0)  # a slow token: the swarm's p10 still bounds its window
    assert costs.free_window("t2", 30.0, 2) == pytest.approx(1.0)
    db.close()
