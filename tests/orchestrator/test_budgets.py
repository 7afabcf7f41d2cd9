"""Leases, identities and bans are budgets (orchestrator logic, no HTTP): one join token's workers hold at
most their fair share of the generation budget; leases given back unsubmitted cost the token (backoff,
then strikes); a ban sticks across re-registration; identities per token are capped."""

from __future__ import annotations

import time

import numpy as np
import pytest
from orch_fakes import encode, make_orchestrator, make_submission, run_config

from orchestrator.errors import ApiError
from protocol.models import ErrorCode, LeaseRequest, WorkerRegistration
from protocol.operator_models import BanScope, JoinTokenRequest


def small_bound(tmp_path, **orch):
    """Groups of 4, 2 prompts per lease, a bound of (1 + 1) x 8 samples = 4 prompts."""
    cfg = run_config(tmp_path, async_level=1, max_open_leases_per_worker=10, **orch)
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 8})})


def volunteer(orch, name: str, token: str | None = None) -> tuple[str, str, str]:
    """(worker id, secret, join token) of a new volunteer with its own minted token."""
    token = token or orch.operators.mint_token(JoinTokenRequest(label=name)).token
    reg = orch.register(WorkerRegistration(name=name), token)
    return orch.authenticate(reg.secret), reg.secret, token


def ask(orch, wid: str, prompts: int = 2):
    return orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=prompts))


def test_one_token_holds_at_most_its_fair_share_of_the_bound(tmp_path):
    orch = make_orchestrator(small_bound(tmp_path))
    hoarder, _, _ = volunteer(orch, "hoarder")
    honest, _, _ = volunteer(orch, "honest")
    held = [ask(orch, hoarder).lease for _ in range(5)]
    got = [lease for lease in held if lease is not None]
    assert sum(len(lease.prompts) for lease in got) == 2  # half the bound of 4: two live tokens
    refused = ask(orch, hoarder)
    assert refused.lease is None and refused.retry_after_s > 0
    assert orch.metrics.leases_refused_budget._value.get() >= 1
    # The honest volunteer still gets the other half, however many leases the hoarder asked for.
    assert len(ask(orch, honest).lease.prompts) == 2
    orch.db.close()


def test_a_token_that_never_asks_for_leases_takes_no_share(tmp_path, monkeypatch):
    """A flooder's token (it registered, then only sends junk) or a banned one stops counting once its demand
    is old: the workers that generate share the bound among themselves."""
    import orchestrator.lease_shares

    monkeypatch.setattr(orchestrator.lease_shares, "DEMAND_WINDOW_S", 0.3)
    orch = make_orchestrator(small_bound(tmp_path))
    volunteer(orch, "flooder")  # registers, never asks for a lease
    honest, _, _ = volunteer(orch, "honest")
    assert len(ask(orch, honest).lease.prompts) == 2  # both just registered: half the bound of 4 each
    assert ask(orch, honest).lease is None  # its half is held
    time.sleep(0.4)
    assert len(ask(orch, honest).lease.prompts) == 2  # the flooder's demand is old: the whole bound
    orch.db.close()


def test_a_token_alone_may_use_the_whole_bound(tmp_path):
    orch = make_orchestrator(small_bound(tmp_path))
    w, _, _ = volunteer(orch, "alone")
    assert sum(len(ask(orch, w).lease.prompts) for _ in range(2)) == 4
    orch.db.close()


def test_a_token_that_delivers_gets_the_shares_that_hoarders_do_not(tmp_path):
    """Shares are weighted by delivered work: once the honest token's lease is verified and accepted, it
    has a record and may hold most of the bound, while a hoarder that never submits is on probation and
    holds at most the probation pool; a token that lets a lease go loses half its record."""
    cfg = run_config(tmp_path, async_level=7, max_open_leases_per_worker=10, prompts_per_lease=2)
    # bound (1+7) x 8 / 4 = 16 prompts
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 8})})
    orch = make_orchestrator(cfg)
    rng = np.random.default_rng(0)
    honest, _, _ = volunteer(orch, "honest")
    hoarder, _, _ = volunteer(orch, "hoarder")
    honest_token = orch.workers.token_of(honest)
    first = ask(orch, honest).lease
    orch.admission.submit(honest, encode(make_submission(first, rng)), None)
    while orch.verification.verify_pending():
        pass
    hoarded = sum(len(lease.prompts) for lease in (ask(orch, hoarder).lease for _ in range(6)) if lease is not None)
    # the hoarder has no record beside one that has: the probation pool, 10% of 16 prompts, rounded up
    assert hoarded == 2
    got = sum(len(lease.prompts) for lease in (ask(orch, honest).lease for _ in range(8)) if lease is not None)
    # its share is the rest, 14: all that is left of the bound (16, less the 2 accepted prompts in the
    # buffer and the hoarder's 2), more than the equal share of 8 it would get without its record
    assert got == 12
    assert orch.leases.shares.credit(honest_token, time.time()) == pytest.approx(2.0, rel=0.01)
    orch.leases.shares.note_forfeit(honest_token, time.time())
    assert orch.leases.shares.credit(honest_token, time.time()) == pytest.approx(1.0, rel=0.01)
    orch.db.close()


def test_new_identities_share_the_probation_pool_and_a_new_volunteer_still_gets_work(tmp_path):
    """Beside a token with a record, tokens without one hold the probation pool together however many
    there are (a Sybil crowd), and each new volunteer can still get work from it to earn a record; with
    the crowd gone, the token with a record may use the whole bound again."""
    cfg = run_config(tmp_path, async_level=9, max_open_leases_per_worker=10, prompts_per_lease=2, probation_share=0.2)
    # bound (1+9) x 8 / 4 = 20 prompts
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 8})})
    orch = make_orchestrator(cfg)
    rng = np.random.default_rng(1)
    honest, _, _ = volunteer(orch, "honest")
    first = ask(orch, honest).lease
    orch.admission.submit(honest, encode(make_submission(first, rng)), None)
    while orch.verification.verify_pending():
        pass
    crowd = [volunteer(orch, f"sybil{i}")[0] for i in range(6)]
    held = sum(len(lease.prompts) for w in crowd for lease in (ask(orch, w).lease for _ in range(3))
        if lease is not None)
    assert held == 4  # the pool: 20% of 20 prompts, for all six together
    got = sum(len(lease.prompts) for lease in (ask(orch, honest).lease for _ in range(10)) if lease is not None)
    assert got == 20 - 2 - 4  # the rest of the bound, less its 2 accepted prompts in the buffer
    # A new honest volunteer gets work from the pool once the crowd lets go of it.
    newcomer, _, _ = volunteer(orch, "newcomer")
    assert ask(orch, newcomer).lease is None
    for lease in list(orch.leases._open.values()):
        if orch.leases.get(lease.lease_id).worker_id in crowd:
            orch.leases.release(lease.lease_id, orch.leases.get(lease.lease_id).worker_id)
    assert len(ask(orch, newcomer).lease.prompts) >= 1
    orch.db.close()


def test_hoarding_costs_backoff_then_strikes_then_a_ban_that_sticks(tmp_path):
    orch = make_orchestrator(small_bound(tmp_path, lease_timeout_s=0.2, lease_cooldown_s=30.0,
        lease_debt_per_strike=2.0, strikes_to_ban=2))
    w, secret, token = volunteer(orch, "hoarder")
    # First lease held to its deadline and let go: the first lease of debt is free (a crash costs only the lease).
    assert ask(orch, w).lease is not None
    time.sleep(0.25)
    orch.housekeeping()
    assert ask(orch, w).lease is not None
    # Second: debt 2, one strike and a cooldown; the token gets no lease while it lasts.
    time.sleep(0.25)
    orch.housekeeping()
    assert orch.workers.get(w).strikes == 1
    resp = ask(orch, w)
    assert resp.lease is None and resp.retry_after_s > 10
    tok = orch.tokens.get(orch.workers.token_of(w))
    assert tok.lease_debt == pytest.approx(2.0, abs=0.05) and tok.cooldown_until > time.time()
    # A fresh identity under the same token does not wipe the debt: the cooldown is the token's.
    w2, _, _ = volunteer(orch, "hoarder2", token)
    assert ask(orch, w2).lease is None
    # Let the cooldown pass (as if), hoard twice more: the second strike bans the token (the default scope).
    with orch.db.tx() as db:
        db.execute("UPDATE join_tokens SET cooldown_until=0")
    for _ in range(2):
        assert ask(orch, w).lease is not None
        time.sleep(0.25)
        orch.housekeeping()
        with orch.db.tx() as db:
            db.execute("UPDATE join_tokens SET cooldown_until=0")
    assert orch.workers.get(w).banned and orch.workers.get(w2).banned  # every identity of the token
    for _ in range(3):  # re-registering with the banned token: refused, every time
        with pytest.raises(ApiError) as e:
            orch.register(WorkerRegistration(name="again"), token)
        assert e.value.code == ErrorCode.banned
    with pytest.raises(ApiError) as e:
        orch.authenticate(secret)
    assert e.value.code == ErrorCode.banned
    orch.db.close()


def test_a_crashed_worker_loses_only_its_lease(tmp_path):
    orch = make_orchestrator(small_bound(tmp_path, lease_timeout_s=0.2))
    w, _, token = volunteer(orch, "crasher")
    assert ask(orch, w).lease is not None
    time.sleep(0.25)
    orch.housekeeping()  # the worker died holding it: expired, prompts re-issued
    restarted, _, _ = volunteer(orch, "crasher-again", token)
    lease = ask(orch, restarted).lease
    assert lease is not None and orch.workers.get(w).strikes == 0
    rng = np.random.default_rng(0)
    orch.admission.submit(restarted, encode(make_submission(lease, rng)), None)
    while orch.verification.verify_pending():
        pass
    # halved by the acceptance
    assert orch.tokens.get(orch.workers.token_of(restarted)).lease_debt == pytest.approx(0.5, abs=0.05)
    orch.db.close()


def test_a_released_lease_costs_in_proportion_to_the_time_held(tmp_path):
    orch = make_orchestrator(small_bound(tmp_path, lease_timeout_s=1.0))
    w, _, _ = volunteer(orch, "releaser")
    at_once = ask(orch, w).lease
    orch.release(w, at_once.lease_id)  # given back at once: free
    token_id = orch.workers.token_of(w)
    assert orch.tokens.get(token_id).lease_debt == 0
    held = ask(orch, w).lease
    time.sleep(0.5)
    orch.release(w, held.lease_id)
    assert orch.tokens.get(token_id).lease_debt == pytest.approx(0.5, abs=0.15)
    orch.db.close()


def test_identities_per_token_are_capped_and_registrations_rate_limited(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, max_identities_per_token=2, registrations_per_min_per_token=6.0))
    token = orch.operators.mint_token(JoinTokenRequest(label="sybil")).token
    for i in range(2):
        orch.register(WorkerRegistration(name=f"s{i}"), token)
    with pytest.raises(ApiError) as e:
        orch.register(WorkerRegistration(name="s2"), token)
    assert e.value.code == ErrorCode.too_many_identities and e.value.status == 429
    listed = {t.token_id: t for t in orch.operators.token_list().tokens}[orch.tokens.authenticate(token).token_id]
    assert listed.live_identities == 2 and listed.registrations == 2
    # A token registers its quota at once, then at its per-minute rate: a flood of re-registrations is refused.
    other = orch.operators.mint_token(JoinTokenRequest(label="churn", max_identities=100)).token
    codes = []
    for i in range(8):
        try:
            orch.register(WorkerRegistration(name=f"c{i}"), other)
            codes.append("ok")
        except ApiError as exc:
            codes.append(exc.code.value)
    assert codes.count("ok") == 2 and codes.count("rate_limited") == 6
    orch.db.close()


def test_an_identity_ban_leaves_the_token_and_a_token_ban_does_not(tmp_path):
    orch = make_orchestrator(run_config(tmp_path))
    a, _, token = volunteer(orch, "a")
    b, _, _ = volunteer(orch, "b", token)
    orch.operators.set_ban(a, True, "operator", BanScope.identity)
    assert orch.workers.get(a).banned and not orch.workers.get(b).banned
    volunteer(orch, "c", token)  # the token may still register
    orch.operators.set_ban(b, True, "operator", BanScope.token)
    with pytest.raises(ApiError) as e:
        orch.register(WorkerRegistration(name="d"), token)
    assert e.value.code == ErrorCode.banned
    orch.operators.set_ban(b, False, "appeal")  # unbanning the worker lifts its token's ban
    volunteer(orch, "e", token)
    orch.db.close()


def test_a_revoked_token_registers_nothing_and_its_workers_are_banned(tmp_path):
    orch = make_orchestrator(run_config(tmp_path))
    w, secret, token = volunteer(orch, "leaver")
    lease = ask(orch, w).lease
    rec = orch.operators.revoke_token(orch.workers.token_of(w), "left the project")
    assert rec.revoked
    with pytest.raises(ApiError) as e:
        orch.register(WorkerRegistration(name="back"), token)
    assert e.value.code == ErrorCode.unauthorized
    with pytest.raises(ApiError) as e:
        orch.authenticate(secret)
    assert e.value.code == ErrorCode.banned
    assert orch.leases.get(lease.lease_id).status == "released"  # its prompts go back at once
    orch.db.close()


@pytest.mark.parametrize("name,stored", [("ａｄｍｉｎ", "admin"), ("worker-1", "worker-1"),
                                          ("ｗｏｒｋｅｒ．２", "worker.2")])
def test_worker_names_are_normalized(name, stored):
    assert WorkerRegistration(name=name).name == stored


@pytest.mark.parametrize("name", ["аdmin", "a b", "../etc", "-x", "x" * 65, "名前", "admin\u200b"])
def test_worker_names_outside_the_safe_set_are_refused(name):
    with pytest.raises(ValueError):
        WorkerRegistration(name=name)


def submit_at_once(orch, wid: str, rng) -> None:
    """Lease, generate (the fake is instant) and submit: an accepted lease that shows prompts are fast."""
    lease = ask(orch, wid).lease
    orch.admission.submit(wid, encode(make_submission(lease, rng)), None)
    while orch.verification.verify_pending():
        pass
    assert orch.leases.get(lease.lease_id).status == "done"


def test_a_release_after_the_measured_generation_time_is_charged(tmp_path):
    """The free window follows the measured generation time, not a fixed share of the lease: before any
    lease was accepted a release at 5% of the lease time is free; once a lease was generated and submitted
    within milliseconds, the same release could have followed scoring the draws, and is charged."""
    orch = make_orchestrator(small_bound(tmp_path, lease_timeout_s=10.0))
    w, _, _ = volunteer(orch, "releaser")
    token_id = orch.workers.token_of(w)
    early = ask(orch, w).lease
    time.sleep(0.5)  # 5% of the lease time
    assert orch.release(w, early.lease_id).released
    assert orch.tokens.get(token_id).lease_debt == 0 and not orch.leases.get(early.lease_id).charged
    submit_at_once(orch, w, np.random.default_rng(0))
    late = ask(orch, w).lease
    time.sleep(0.5)
    assert orch.release(w, late.lease_id).released
    assert orch.leases.get(late.lease_id).charged == 1
    assert orch.tokens.get(token_id).lease_debt == pytest.approx(orch.cfg.release_floor)  # 5% of a lease, but the floor
    st = orch.status()
    assert (st.releases_free, st.releases_charged) == (1, 1)
    orch.db.close()


def test_a_token_that_gives_back_scored_leases_is_seen_and_bounded(tmp_path):
    """A token that gives back more than max_release_ratio of its leases after their free window shows in
    /v1/workers, /v1/status and /metrics, and may hold one prompt at a time while an honest token gets its
    share; a restart keeps what it did (derived from the leases table)."""
    from prometheus_client import generate_latest

    cfg = run_config(tmp_path, async_level=7, max_open_leases_per_worker=10, prompts_per_lease=2)
    # bound (1+7) x 8 / 4 = 16 prompts
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 8})})
    orch = make_orchestrator(cfg)
    rng = np.random.default_rng(0)
    picky, _, _ = volunteer(orch, "picky")
    honest, _, _ = volunteer(orch, "honest")
    for w in (picky, honest):
        submit_at_once(orch, w, rng)
    for _ in range(3):  # generated and scored (as far as the orchestrator can tell), then given back
        lease = ask(orch, picky).lease
        time.sleep(0.3)
        orch.release(picky, lease.lease_id)
    picky_token = orch.workers.token_of(picky)
    records = {r.worker_id: r for r in orch.operators.worker_list().workers}
    assert (records[picky].leases_released, records[picky].releases_charged) == (3, 3)
    assert records[picky].token_release_ratio == pytest.approx(0.75)  # 3 of its 4 ended leases
    assert (records[honest].leases_released, records[honest].token_release_ratio) == (0, 0.0)
    st = orch.status()
    assert (st.releases_free, st.releases_charged, st.max_token_release_ratio) == (0, 3, pytest.approx(0.75))
    metrics = generate_latest(orch.metrics.registry).decode()
    assert 'swarmrl_leases_released_total{charged="true"} 3.0' in metrics
    assert 'swarmrl_leases_released_total{charged="false"} 0.0' in metrics
    # Bounded: one prompt at a time for the picky token; the honest one gets whole leases.
    assert orch.tokens.get(picky_token).cooldown_until == 0  # not the cooldown: the debt is below a lease
    assert len(ask(orch, picky).lease.prompts) == 1
    assert ask(orch, picky).lease is None
    assert len(ask(orch, honest).lease.prompts) == 2
    orch.db.close()
    restarted = make_orchestrator(cfg)
    assert restarted.leases.costs.ratio(picky_token) == pytest.approx(0.75)
    assert restarted.leases.costs.free_window(picky_token, 30.0, 2) < 0.5  # the measured speed too
    assert restarted.status().releases_charged == 3
    restarted.db.close()
