"""Lease deadlines from the lease's size and its worker's verified rate (orchestrator/lease_deadlines.py), on
real SQLite with injected clocks: slow honest workers get the time their leases need, fast ones a shorter
deadline, and only accepted work moves a worker's rate."""

from __future__ import annotations

import numpy as np
import pytest
from orch_fakes import encode, make_orchestrator, make_prompts, make_submission, run_config

from orchestrator.config import OrchestratorConfig
from orchestrator.db import Database
from orchestrator.lease_deadlines import lease_seconds, sample_token_cap
from orchestrator.leases import LeaseBook
from protocol.models import LeaseRequest, WorkerRegistration

# A Qwen3-0.6B-shaped lease on a 2-core CPU (docs/real-sizes.md): 2 prompts x 4 samples x 512 tokens.
PROMPTS, K, MAX_TOKENS = 2, 4, 512
LEASE_TOKENS = PROMPTS * K * MAX_TOKENS
T0 = 1_000_000.0


def real_size(tmp_path, **orch):
    base = dict(prompts_per_lease=PROMPTS, samples_per_prompt=K, max_open_leases_per_worker=2,
        new_worker_tokens_per_s=4.0, sampling={"max_tokens": MAX_TOKENS, "temperature": 1.0})
    return run_config(tmp_path, **{**base, **orch})


def open_book(cfg) -> LeaseBook:
    return LeaseBook(Database(cfg.orchestrator.db_path), make_prompts(cfg), cfg.orchestrator)


def lease_for(book: LeaseBook, worker: str, now: float) -> tuple[str, float]:
    """A lease issued at `now`: its id and how long it may take."""
    lease = book.issue(worker, PROMPTS, 0, now)
    return lease.lease_id, lease.deadline - now


def deliver(book: LeaseBook, lease_id: str, at: float, tokens: int, accepted: bool = True) -> None:
    """The lease's submission of `tokens` arrives at `at` and its verdict says `accepted`."""
    with book.db.tx() as db:
        assert book.mark_submitted(db, lease_id, now=at)
        book.finish(db, lease_id, accepted, generated=tokens)


def measured(book: LeaseBook, worker: str, tokens_per_s: float, now: float = T0) -> float:
    """One accepted full lease generated at `tokens_per_s`; then how long the worker's next lease may take."""
    lease_id, _ = lease_for(book, worker, now)
    deliver(book, lease_id, now + LEASE_TOKENS / tokens_per_s, LEASE_TOKENS)
    return lease_for(book, worker, now + 10_000)[1]


def test_the_rule_keeps_slack_within_floor_and_cap():
    assert lease_seconds(4096, 4.0, 3.0, 60.0, 3600.0) == pytest.approx(3072.0)  # slack x 1024 s
    assert lease_seconds(64, 1000.0, 3.0, 60.0, 3600.0) == 60.0  # a toy lease: the floor
    assert lease_seconds(4096, 0.5, 3.0, 60.0, 3600.0) == 3600.0  # the cap
    assert lease_seconds(4096, 0.5, 3.0, 7200.0, 3600.0) == 7200.0  # a floor set above the cap wins


def test_a_slow_worker_gets_the_time_its_size_needs_and_a_fast_one_less(tmp_path):
    book = open_book(real_size(tmp_path))
    slow = measured(book, "cpu", 4.0)  # 1024 s for the lease
    medium = measured(book, "small-gpu", 100.0)  # ~41 s
    fast = measured(book, "gpu", 4000.0)  # ~1 s
    assert slow == pytest.approx(3.0 * LEASE_TOKENS / 4.0)  # three times what it needs
    assert medium == pytest.approx(3.0 * LEASE_TOKENS / 100.0)
    assert fast == book.config.lease_timeout_s  # the floor
    assert fast < medium < slow
    book.db.close()


def test_an_unknown_worker_gets_the_new_worker_rate_and_the_cap_holds(tmp_path):
    book = open_book(real_size(tmp_path))
    assert lease_for(book, "new", T0)[1] == pytest.approx(3.0 * LEASE_TOKENS / 4.0)  # 3072 s, under the cap
    book.db.close()
    capped = open_book(real_size(tmp_path / "capped", new_worker_tokens_per_s=1.0, lease_timeout_max_s=1800.0))
    assert lease_for(capped, "new", T0)[1] == 1800.0
    capped.db.close()


def test_a_toy_sized_lease_keeps_the_floor(tmp_path):
    cfg = run_config(tmp_path, new_worker_tokens_per_s=4.0, lease_timeout_s=60.0)  # 2 x 4 x 8 tokens: 48 s
    book = open_book(cfg)
    assert lease_for(book, "toy", T0)[1] == 60.0
    book.db.close()


def test_an_environment_lease_is_sized_by_its_episode_cap():
    cfg = OrchestratorConfig(environment="calculator", sampling={"max_tokens": 512})
    assert sample_token_cap(cfg) == 96  # the calculator's episode cap, below sampling.max_tokens
    assert sample_token_cap(OrchestratorConfig(sampling={"max_tokens": 512})) == 512


def test_a_measured_rate_survives_a_restart(tmp_path):
    cfg = real_size(tmp_path)
    book = open_book(cfg)
    before = measured(book, "cpu", 8.0)
    book.db.close()
    again = open_book(cfg)
    assert lease_for(again, "cpu", T0 + 20_000)[1] == pytest.approx(before)
    assert before == pytest.approx(3.0 * LEASE_TOKENS / 8.0)  # not the new-worker rate
    again.db.close()


def test_rejected_submissions_do_not_move_a_deadline(tmp_path):
    book = open_book(real_size(tmp_path))
    fast = measured(book, "w", 4000.0)
    for i in range(5):  # held almost to the deadline each time, then rejected
        lease_id, left = lease_for(book, "w", T0 + 20_000 * (i + 1))
        deliver(book, lease_id, T0 + 20_000 * (i + 1) + left - 1, LEASE_TOKENS, accepted=False)
    assert lease_for(book, "w", T0 + 200_000)[1] == fast
    with book.db.tx() as db:
        assert book.deadlines.rate(db, "w") == pytest.approx(4000.0)
    book.db.close()


def test_only_a_verified_submission_times_its_worker(tmp_path):
    """Through the orchestrator: an accepted submission records its verified tokens; a rejected one (a bad
    proof), nothing."""
    orch = make_orchestrator(run_config(tmp_path))
    token = orch.cfg.join_tokens[0].get_secret_value()
    wid = orch.authenticate(orch.register(WorkerRegistration(name="w"), token).secret)
    rng = np.random.default_rng(0)

    def submit(bad: bool):
        lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
        sub = make_submission(lease, rng, bad=bad)
        orch.admission.submit(wid, encode(sub), None)
        while orch.verification.verify_pending():
            pass
        return sub

    def timed() -> tuple[float, int] | None:
        row = orch.db.one("SELECT tokens, leases FROM worker_rates WHERE worker_id=?", (wid,))
        return None if row is None else (row[0], row[1])

    submit(bad=True)
    assert timed() is None  # rejected: the worker is still a new worker
    accepted = submit(bad=False)
    assert timed() == (accepted.num_tokens, 1)
    submit(bad=True)
    assert timed() == (accepted.num_tokens, 1)
    orch.db.close()


@pytest.mark.parametrize("concurrent", [1, 2])
def test_an_honest_slow_worker_is_never_expired(tmp_path, concurrent):
    """A 0.6B-like worker at 4 tokens/s (2 x 4 x 512 tokens: up to 1024 s a lease) through 30 leases, from
    its first (the new-worker rate) on; completions of varying length; with `concurrent` = 2 it holds two
    leases and generates them one after the other, so the second waits for the first."""
    book = open_book(real_size(tmp_path))
    rng = np.random.default_rng(0)
    now = T0
    for _ in range(30 // concurrent):
        held = [book.issue("cpu", PROMPTS, 0, now) for _ in range(concurrent)]
        for lease in held:
            tokens = int(rng.integers(LEASE_TOKENS // 4, LEASE_TOKENS + 1))
            now += tokens / 4.0
            assert book.expire(now) == []  # still open when its submission arrives
            deliver(book, lease.lease_id, now, tokens)
        now += 1.0
    assert book.counts() == {"done": 30 // concurrent * concurrent}
    book.db.close()
