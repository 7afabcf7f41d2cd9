"""Accepted tokens that are not the seed's exact draw (near ties, boundary picks) are counted per worker and
held to the rate honest noise explains: a worker at that rate is never struck, one that steers at every
chance is struck and banned."""

from __future__ import annotations

import numpy as np
from orch_fakes import FakeVerifier, encode, make_orchestrator, make_submission, run_config

from orchestrator.db import Database
from orchestrator.draw_deviations import DeviationLedger
from protocol.models import LeaseRequest, WorkerRegistration
from protocol.verdicts import VerdictStatus


def test_the_ledger_forgives_the_allowed_rate_strikes_past_each_burst_and_bans(tmp_path):
    db = Database(tmp_path / "d.db")
    ledger = DeviationLedger(db, burst=5.0, ban_at=15.0)
    with db.tx() as conn:
        # 1,000 submissions at half the allowance (honest noise sits below it), with bursts now and then: never over.
        assert all(ledger.record(conn, "honest", 1 + (5 if i % 50 == 0 else 0), 2.0) == (0, False) for i in range(1000))
        # One deviation above the allowance per submission: a strike at each 5 it rises past, banned past 15.
        steps = [ledger.record(conn, "steerer", 3, 2.0) for _ in range(16)]
    assert [s for s, _ in steps] == [0, 0, 0, 0, 1] * 3 + [0] and [b for _, b in steps] == [False] * 15 + [True]
    assert ledger.of(["honest"]) == {"honest": (1000 + 5 * 20, 2000.0)}
    db.close()


class DeviatingVerifier(FakeVerifier):
    """Accepts like FakeVerifier, with `near_ties` deviations per submission against an allowance of 1."""

    def __init__(self, near_ties: int):
        super().__init__()
        self.near_ties = near_ties

    def verify_many(self, jobs):
        return [v.model_copy(update={"near_ties": self.near_ties, "near_tie_allowance": 1.0})
            if v.status == VerdictStatus.accepted else v
                for v in super().verify_many(jobs)]


def run_worker(tmp_path, near_ties: int, submissions: int, decay: int = 0, ban_at: float = 100.0):
    orch = make_orchestrator(run_config(tmp_path, strikes_to_ban=3, near_tie_burst=4.0, near_tie_ban=ban_at,
        strike_decay_accepted=decay),
                             DeviatingVerifier(near_ties))
    reg = orch.register(WorkerRegistration(name="w"), orch.cfg.join_tokens[0].get_secret_value())
    wid = orch.authenticate(reg.secret)
    for i in range(submissions):
        if orch.workers.get(wid).banned:
            break
        lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=1)).lease
        orch.admission.submit(wid, encode(make_submission(lease, np.random.default_rng(i))), None)
        while orch.verification.verify_pending():
            pass
    return orch, orch.workers.get(wid)


def test_a_worker_within_the_allowance_is_never_struck(tmp_path):
    orch, w = run_worker(tmp_path, near_ties=1, submissions=30)
    assert w.accepted == 30 and w.strikes == 0 and not w.banned
    record = orch.operators.worker_list().workers[0]  # what GET /v1/workers shows the operator
    assert (record.draw_deviations, record.deviation_allowance) == (30, 30.0)
    orch.db.close()


def test_a_worker_that_deviates_past_the_allowance_is_struck_and_banned(tmp_path):
    orch, w = run_worker(tmp_path, near_ties=3, submissions=30)  # 2 above the allowance each time, burst 4
    assert w.banned and w.accepted == 6  # the bucket rises past 4, 8 and 12 at the 2nd, 4th and 6th: 3 strikes
    orch.db.close()


def test_a_rare_steerer_is_banned_though_its_strikes_decay(tmp_path):
    """Each submission 1 above the allowance: a strike every 4th, decayed by the next 3 accepted, so the strikes
    alone never reach 3; but the bucket only drains by the allowance, and passes near_tie_ban."""
    orch, w = run_worker(tmp_path, near_ties=2, submissions=45, decay=3, ban_at=30.0)
    assert w.banned and w.accepted == 31 and "exact draw" in w.ban_reason  # excess 31 > 30 at the 31st
    orch.db.close()
