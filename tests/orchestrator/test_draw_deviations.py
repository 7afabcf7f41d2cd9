"""Accepted tokens that are not the seed's exact draw (near ties, boundary picks) are counted per worker and
held to the rate honest noise explains: a worker at that rate is never struck, one that steers at every
chance is struck and banned."""

from __future__ import annotations

import numpy as np
from orch_fakes import FakeVerifier, encode, make_orchestrator, make_submission, run_config

from orchestrator.db import Database
from orchestrator.draw_deviations import DeviationLedger
from protocol.models import LeaseRequest, VerdictStatus, WorkerRegistration


def test_the_ledger_forgives_the_allowed_rate_and_strikes_past_the_burst(tmp_path):
    db = Database(tmp_path / "d.db")
    ledger = DeviationLedger(db, burst=5.0)
    with db.tx() as conn:
        # 1,000 submissions at half the allowance (honest noise sits below it), with bursts now and then: never over.
        assert not any(ledger.record(conn, "honest", 1 + (5 if i % 50 == 0 else 0), 2.0) for i in range(1000))
        # One deviation above the allowance per submission: the sixth passes the burst, then it starts over.
        over = [ledger.record(conn, "steerer", 3, 2.0) for _ in range(12)]
    assert over == [False] * 5 + [True] + [False] * 5 + [True]
    assert ledger.of(["honest"]) == {"honest": (1000 + 5 * 20, 2000.0)}
    db.close()


class DeviatingVerifier(FakeVerifier):
    """Accepts like FakeVerifier, with `near_ties` deviations per submission against an allowance of 1."""

    def __init__(self, near_ties: int):
        super().__init__()
        self.near_ties = near_ties

    def verify_many(self, jobs):
        return [v.model_copy(update={"near_ties": self.near_ties, "near_tie_allowance": 1.0}) if v.status == VerdictStatus.accepted else v
                for v in super().verify_many(jobs)]


def run_worker(tmp_path, near_ties: int, submissions: int):
    orch = make_orchestrator(run_config(tmp_path, strikes_to_ban=3, near_tie_burst=4.0, strike_decay_accepted=0), DeviatingVerifier(near_ties))
    reg = orch.register(WorkerRegistration(name="w"), orch.cfg.join_tokens[0].get_secret_value())
    wid = orch.authenticate(reg.secret)
    for i in range(submissions):
        if orch.workers.get(wid).banned:
            break
        lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=1)).lease
        orch.submit(wid, encode(make_submission(lease, np.random.default_rng(i))), None)
        while orch.verification.verify_pending():
            pass
    return orch, orch.workers.get(wid)


def test_a_worker_within_the_allowance_is_never_struck(tmp_path):
    orch, w = run_worker(tmp_path, near_ties=1, submissions=30)
    assert w.accepted == 30 and w.strikes == 0 and not w.banned
    orch.db.close()


def test_a_worker_that_deviates_past_the_allowance_is_struck_and_banned(tmp_path):
    orch, w = run_worker(tmp_path, near_ties=3, submissions=30)  # 2 above the allowance each time, burst 4
    assert w.banned and w.accepted == 9  # a strike at the 3rd, 6th and 9th submission
    orch.db.close()
