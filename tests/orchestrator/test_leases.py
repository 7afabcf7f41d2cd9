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
