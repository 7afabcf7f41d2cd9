"""Orchestrator logic without HTTP: leases, admission, verification, strikes, buffer, durable state."""

from __future__ import annotations

import time

import numpy as np
import pytest
from orch_fakes import (
    HASH1,
    FakeVerifier,
    encode,
    make_orchestrator,
    make_submission,
    run_config,
    trusted_logprobs,
)

from orchestrator.buffer import RolloutBuffer
from orchestrator.db import Database
from orchestrator.errors import ApiError
from protocol.batches import ReconcileFirst
from protocol.models import (
    ErrorCode,
    Heartbeat,
    LeaseRequest,
    WorkerRegistration,
    WorkerState,
)
from protocol.operator_models import JoinTokenRequest
from protocol.verdicts import VerdictStatus
from swarmrl.config import RunConfig
from trainer.samples import samples_from_groups


def register(orch, name="w", token=None):
    """A worker; a volunteer of its own (a freshly minted join token) when `token` is "new"."""
    if token == "new":
        token = orch.operators.mint_token(JoinTokenRequest(label=f"v-{name}")).token
    reg = orch.register(WorkerRegistration(name=name), token or orch.cfg.join_tokens[0].get_secret_value())
    return orch.authenticate(reg.secret), reg.secret


def lease(orch, wid, version=0, max_prompts=64):
    return orch.lease(wid, LeaseRequest(loaded_policy_version=version, max_prompts=max_prompts)).lease


def submit(orch, wid, sub):
    return orch.admission.submit(wid, encode(sub), None)


def drain(orch):
    while orch.verification.verify_pending():
        pass


@pytest.fixture
def orch(tmp_path):
    o = make_orchestrator(run_config(tmp_path))
    yield o
    o.db.close()


def code_of(excinfo) -> ErrorCode:
    return excinfo.value.code


def test_seeded_prompt_order_is_reproducible_and_leases_cover_groups(tmp_path):
    a = make_orchestrator(run_config(tmp_path / "a"))
    b = make_orchestrator(run_config(tmp_path / "b"))
    wa, _ = register(a)
    wb, _ = register(b)
    la, lb = lease(a, wa), lease(b, wb)
    assert [p.prompt_id for p in la.prompts] == [p.prompt_id for p in lb.prompts]
    # The order is the config's; the sampling seeds are each run's secret (test_leases.py).
    assert [p.seeds for p in la.prompts] != [p.seeds for p in lb.prompts]
    assert len(la.prompts) == 2 and all(len(p.seeds) == 4 for p in la.prompts)
    # A worker asking for fewer prompts gets fewer, never a choice of which.
    la2 = lease(a, wa, max_prompts=1)
    assert len(la2.prompts) == 1 and la2.prompts[0].prompt_id not in {p.prompt_id for p in la.prompts}
    # Different run seeds give a different order.
    c = make_orchestrator(run_config(tmp_path / "c").model_copy(update={"seed": 8}))
    wc, _ = register(c)
    assert [p.prompt_id for p in lease(c, wc).prompts] != [p.prompt_id for p in la.prompts]


def test_accepted_submission_reaches_buffer_with_advantages(orch):
    wid, _ = register(orch)
    leased = lease(orch, wid)
    rng = np.random.default_rng(0)
    receipt = submit(orch, wid, make_submission(leased, rng))
    assert orch.verification.verdict(wid, receipt.submission_id).status == VerdictStatus.pending
    drain(orch)
    v = orch.verification.verdict(wid, receipt.submission_id)
    assert v.status == VerdictStatus.accepted and len(v.rewards) == 8
    kept = int(orch.db.get_int("groups_kept"))
    dropped = int(orch.db.get_int("groups_dropped_zero_signal"))
    assert kept + dropped == 2
    batch = orch.take_batch(100)
    assert len(samples_from_groups(batch.groups)) == 4 * kept
    for s in samples_from_groups(batch.groups):
        assert s.behaviour_version == 0 and s.behaviour_logprobs.size == s.completion_ids.size
    # Advantages of each kept group are centred.
    by_group = {}
    for s in samples_from_groups(batch.groups):
        by_group.setdefault(s.sample_id.rsplit(":", 1)[0], []).append(s.advantage)
    for advs in by_group.values():
        assert abs(sum(advs)) < 1e-4 and max(advs) > 0
    w = orch.operators.worker_list().workers[0]
    assert w.submissions_accepted == 1 and w.verified_tokens == sum(int(c.token_ids.size)
        for c in make_submission(leased,
        np.random.default_rng(0)).completions)


def test_zero_signal_groups_are_dropped_and_counted(orch):
    wid, _ = register(orch)
    leased = lease(orch, wid)
    submit(orch, wid, make_submission(leased, np.random.default_rng(1), same_tokens=True))
    drain(orch)
    assert orch.db.get_int("groups_dropped_zero_signal") == 2
    assert orch.buffer.depth() == 0
    assert orch.status().groups_dropped_zero_signal == 2


def test_version_too_old_is_refused_before_verification(tmp_path):
    verifier = FakeVerifier()
    orch = make_orchestrator(run_config(tmp_path, async_level=1), verifier)
    wid, _ = register(orch)
    l0 = lease(orch, wid)
    orch.versions.announce({1: HASH1})
    orch.versions.announce({2: "2" * 64})
    # A lease for version 0 generated with version 0: now 0 < 2 - 1.
    with pytest.raises(ApiError) as e:
        submit(orch, wid, make_submission(l0, np.random.default_rng(0), policy_version=0))
    assert code_of(e) == ErrorCode.version_too_old and e.value.min_policy_version == 1 and e.value.status == 409
    drain(orch)
    assert verifier.jobs_seen == 0
    # Leasing with a too-old loaded version is refused too, with the version to pull.
    with pytest.raises(ApiError) as e:
        lease(orch, wid, version=0)
    assert code_of(e) == ErrorCode.version_too_old and e.value.min_policy_version == 1
    l1 = lease(orch, wid, version=1)
    assert l1.min_policy_version == 1 and l1.policy_version == 2
    # Generated with version 1 (>= 2 - 1): accepted for verification.
    submit(orch, wid, make_submission(l1, np.random.default_rng(0), policy_version=1, model_hash=HASH1))
    drain(orch)
    assert verifier.jobs_seen == 1
    assert orch.db.get_int("submissions_accepted") == 1


def test_async_level_zero_is_synchronous(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, async_level=0))
    wid, _ = register(orch)
    leased = lease(orch, wid)
    assert leased.min_policy_version == leased.policy_version == 0
    orch.versions.announce({1: HASH1})
    with pytest.raises(ApiError) as e:
        submit(orch, wid, make_submission(leased, np.random.default_rng(0)))
    assert code_of(e) == ErrorCode.version_too_old and e.value.min_policy_version == 1


def test_a_lease_is_generated_with_the_version_the_worker_declared(tmp_path):
    """A worker holding two versions may not pick, after seeing the seeds, the one whose draws it likes."""
    orch = make_orchestrator(run_config(tmp_path, async_level=2))
    wid, _ = register(orch)
    orch.versions.announce({1: HASH1})
    leased = lease(orch, wid, version=0)
    assert leased.generation_version == 0
    with pytest.raises(ApiError) as e:
        submit(orch, wid, make_submission(leased, np.random.default_rng(0), policy_version=1, model_hash=HASH1))
    assert code_of(e) == ErrorCode.lease_mismatch and e.value.status < 500 and "issued for version 0" in str(e.value)
    submit(orch, wid, make_submission(leased, np.random.default_rng(0), policy_version=0))


def test_future_version_is_refused(orch):
    wid, _ = register(orch)
    leased = lease(orch, wid)
    with pytest.raises(ApiError) as e:
        submit(orch, wid, make_submission(leased, np.random.default_rng(0), policy_version=5))
    assert code_of(e) == ErrorCode.invalid_request


def test_a_rejected_instance_leased_again_may_carry_the_same_rollouts(tmp_path):
    """A prompt instance keeps its seeds when it comes back, so an honest worker that leases it again at the
    same version sends exactly what it sent before. A rejection (here: the trusted side found fault with a
    proof) frees the content's fingerprint; only content still pending or accepted counts as a replay."""
    orch = make_orchestrator(run_config(tmp_path, strikes_to_ban=5, prompts_per_lease=2))
    wid, _ = register(orch)
    first = lease(orch, wid, max_prompts=2)
    rejected = make_submission(first, np.random.default_rng(3), bad=True)
    submit(orch, wid, rejected)
    drain(orch)
    assert orch.verification.verdict(wid,
        orch.db.one("SELECT submission_id FROM submissions")[0]).status == VerdictStatus.rejected
    again = lease(orch, wid, max_prompts=2)
    assert [p.seeds for p in again.prompts] == [p.seeds for p in first.prompts]  # the same instances, the same seeds
    submit(orch, wid, rejected.model_copy(update={"lease_id": again.lease_id}))  # not refused as a replay
    orch.db.close()


def test_duplicates_and_replays_are_refused(orch):
    a, _ = register(orch, "a")
    b, _ = register(orch, "b")
    la = lease(orch, a)
    sub = make_submission(la, np.random.default_rng(0))
    submit(orch, a, sub)
    with pytest.raises(ApiError) as e:
        submit(orch, a, sub)  # same lease again
    assert code_of(e) == ErrorCode.duplicate
    # Worker b replays a's rollouts onto its own lease.
    lb = lease(orch, b)
    replay = sub.model_copy(update={"lease_id": lb.lease_id})
    with pytest.raises(ApiError) as e:
        submit(orch, b, replay)
    assert code_of(e) == ErrorCode.duplicate
    # b cannot submit to a's lease at all (and cannot tell whether it exists).
    la2 = lease(orch, a)
    with pytest.raises(ApiError) as e:
        submit(orch, b, make_submission(la2, np.random.default_rng(5)))
    assert code_of(e) == ErrorCode.not_found
    drain(orch)
    assert orch.db.get_int("submissions_accepted") == 1


def test_lease_shape_must_match(orch):
    wid, _ = register(orch)
    leased = lease(orch, wid)
    sub = make_submission(leased, np.random.default_rng(0))
    with pytest.raises(ApiError) as e:
        submit(orch, wid, sub.model_copy(update={"completions": sub.completions[:-1]}))
    assert code_of(e) == ErrorCode.lease_mismatch
    # Nothing was stored: the right submission still goes through.
    submit(orch, wid, sub)


def test_lease_expiry_reissue_and_late_submission(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, lease_timeout_s=0.2))
    a, _ = register(orch, "a")
    b, _ = register(orch, "b", token="new")  # another volunteer: a's expired lease cools down a's token only
    la = lease(orch, a)
    time.sleep(0.3)
    # Late, even before the sweeper ran:
    with pytest.raises(ApiError) as e:
        submit(orch, a, make_submission(la, np.random.default_rng(0)))
    assert code_of(e) == ErrorCode.lease_expired and e.value.status == 410
    orch.housekeeping()
    assert orch.leases.get(la.lease_id).status == "expired"
    lb = lease(orch, b)
    # The expired lease's prompt instances are handed out again, with the same seeds (no reroll by letting go).
    assert [p.prompt_id for p in lb.prompts] == [p.prompt_id for p in la.prompts]
    assert [p.seeds for p in lb.prompts] == [p.seeds for p in la.prompts]
    with pytest.raises(ApiError) as e:
        submit(orch, a, make_submission(la, np.random.default_rng(1)))
    assert code_of(e) == ErrorCode.lease_expired


def test_release_reissues_prompts(orch):
    a, _ = register(orch, "a")
    la = lease(orch, a)
    assert orch.release(a, la.lease_id).released
    assert not orch.release(a, la.lease_id).released
    la2 = lease(orch, a)
    assert [p.prompt_id for p in la2.prompts] == [p.prompt_id for p in la.prompts]
    with pytest.raises(ApiError) as e:
        submit(orch, a, make_submission(la, np.random.default_rng(0)))
    assert code_of(e) == ErrorCode.lease_expired


def test_open_lease_cap_and_rate_limit(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, max_open_leases_per_worker=2, rate_limit_per_s=5.0))
    wid, secret = register(orch)
    lease(orch, wid)
    lease(orch, wid)
    with pytest.raises(ApiError) as e:
        lease(orch, wid)
    assert code_of(e) == ErrorCode.too_many_leases and e.value.status == 429
    with pytest.raises(ApiError) as e:
        for _ in range(50):
            orch.authenticate(secret)
    assert code_of(e) == ErrorCode.rate_limited and e.value.retry_after_s > 0


def test_ban_after_strikes_and_unban(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, strikes_to_ban=2))
    wid, secret = register(orch)
    leases = []
    for i in range(2):
        leases.append(lease(orch, wid))
        submit(orch, wid, make_submission(leases[-1], np.random.default_rng(i), bad=True))
        drain(orch)
    w = orch.workers.get(wid)
    assert w.strikes == 2 and w.banned and w.rejected == 2
    assert orch.buffer.depth() == 0  # rejected rollouts never reach the buffer
    with pytest.raises(ApiError) as e:
        orch.authenticate(secret)
    assert code_of(e) == ErrorCode.banned
    # A rejected lease's prompts are handed out again (the second lease got the first one's).
    assert [p.prompt_id for p in leases[1].prompts] == [p.prompt_id for p in leases[0].prompts]
    assert orch.leases.reissue_depth() == 2
    rec = orch.operators.set_ban(wid, False, "appeal")
    assert not rec.banned and rec.strikes == 0
    assert orch.authenticate(secret) == wid
    rec = orch.operators.set_ban(wid, True, "operator")
    assert rec.banned
    with pytest.raises(ApiError):
        orch.operators.set_ban("w-nope", True, "")


def test_wrong_model_hash_is_a_strike(orch):
    wid, _ = register(orch)
    leased = lease(orch, wid)
    submit(orch, wid, make_submission(leased, np.random.default_rng(0), model_hash=HASH1))
    drain(orch)
    assert orch.workers.get(wid).strikes == 1


def test_verifier_failure_keeps_submissions_queued(orch):
    wid, _ = register(orch)
    orch.verification.verifier.fail_next = 1
    r = submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(0)))
    orch._stop.set()  # don't sleep in the retry back-off
    assert orch.verification.verify_pending() == 0
    orch._stop.clear()
    drain(orch)
    assert orch.verification.verdict(wid, r.submission_id).status == VerdictStatus.accepted


def test_a_submission_the_verifier_fails_on_never_holds_back_the_others(orch):
    """The pool fails (a crash, a timeout) whenever one poisoned submission is in the batch: the batch is
    split until it is alone, the others get their verdicts, and after three failed attempts on its own it
    is rejected as verification_failed, without a strike (it may be our verifier's fault)."""
    wid, _ = register(orch)
    verifier = orch.verification.verifier
    real = verifier.verify_many
    subs = [submit(orch, wid, make_submission(lease(orch, wid, max_prompts=1), np.random.default_rng(i)))
        for i in range(2)]
    poisoned = subs[0].submission_id
    seen = []

    def flaky(jobs):
        seen.append(len(jobs))
        if any(j.submission_id == poisoned for j in jobs):
            raise TimeoutError("a verifier actor did not answer in time (test)")
        return real(jobs)

    verifier.verify_many = flaky
    orch._stop.set()  # don't sleep in the retry back-off
    while orch.verification.backlog():
        orch.verification.verify_pending()
    assert seen[0] == 2 and seen.count(1) >= 3  # the batch of two, then each alone
    assert orch.verification.verdict(wid, subs[1].submission_id).status == VerdictStatus.accepted
    v = orch.verification.verdict(wid, poisoned)
    assert v.status == VerdictStatus.rejected and v.rejections[0].code.value == "verification_failed"
    assert orch.workers.get(wid).strikes == 0


def test_heartbeat_only_as_itself(orch):
    a, _ = register(orch, "a")
    b, _ = register(orch, "b")
    ack = orch.heartbeat(a, a, Heartbeat(state=WorkerState.generating, loaded_policy_version=0, tokens_per_s=12.5))
    assert ack.policy_version == 0 and ack.min_policy_version == 0
    with pytest.raises(ApiError) as e:
        orch.heartbeat(a, b, Heartbeat(state=WorkerState.idle))
    assert code_of(e) == ErrorCode.forbidden
    rec = {w.worker_id: w for w in orch.operators.worker_list().workers}[a]
    assert rec.state == WorkerState.generating and rec.tokens_per_s == 12.5 and rec.online


def test_secrets_are_stored_hashed(orch, tmp_path):
    wid, secret = register(orch)
    raw = open(orch.db.path, "rb").read() + open(orch.db.path + "-wal", "rb").read()
    assert secret.encode() not in raw
    assert orch.workers.get(wid).secret_hash != secret
    with pytest.raises(ApiError) as e:
        orch.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B"))
    assert code_of(e) == ErrorCode.unauthorized


def test_buffer_batches_survive_restart_exactly_once(tmp_path):
    cfg = run_config(tmp_path)
    orch = make_orchestrator(cfg)
    wid, secret = register(orch)
    rng = np.random.default_rng(3)
    for _ in range(3):
        submit(orch, wid, make_submission(lease(orch, wid, max_prompts=2), rng))
        drain(orch)
    total = orch.buffer.depth()
    assert total > 0
    b1 = orch.take_batch(4)
    orch.commit_batches({b1.batch_id: 0}, {1: HASH1})
    b2 = orch.take_batch(4)  # taken, never committed: the "crash"
    assert b2.groups
    orch.db.close()

    orch2 = make_orchestrator(cfg)
    assert orch2.authenticate(secret) == wid  # workers reconnect with their secret
    assert orch2.status().policy_version == 1 and orch2.status().step == 1
    # b2 is still taken: only the trainer knows whether it trained it, so nothing goes out before it says.
    with pytest.raises(ReconcileFirst):
        orch2.take_batch(1000)
    assert orch2.reconcile_trainer([[b1.seq, b1.seq]], {}, {1: HASH1}) == {"committed": 0, "returned": b2.num_samples}
    rest = orch2.take_batch(1000)
    ids_1 = {s.sample_id for s in samples_from_groups(b1.groups)}
    ids_rest = {s.sample_id for s in samples_from_groups(rest.groups)}
    assert not ids_1 & ids_rest
    assert {s.sample_id for s in samples_from_groups(b2.groups)} <= ids_rest
    assert len(ids_1) + len(ids_rest) == total
    orch2.commit_batches({rest.batch_id: 1}, {2: "2" * 64})
    assert orch2.commit_batches({rest.batch_id: 1}, {}) == {}  # committing twice changes nothing
    assert len(set(orch2.buffer.trained_sample_ids())) == total == len(orch2.buffer.trained_sample_ids())
    hist = orch2.status().staleness_histogram
    assert sum(hist.values()) == total


def test_stale_samples_are_dropped_when_taken(tmp_path):
    cfg = run_config(tmp_path)
    cfg.trainer.max_staleness = 1
    orch = make_orchestrator(cfg)
    wid, _ = register(orch)
    submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(4)))
    drain(orch)
    n = orch.buffer.depth()
    batch = orch.take_batch(100, trainer_version=3)
    assert batch.groups == [] and batch.dropped_stale == n
    assert orch.status().samples_dropped_stale == n


def test_the_take_and_the_commit_drop_the_same_groups_as_stale(tmp_path):
    """Two groups of each behaviour version 0..3: one of each taken without the trainer's version and
    committed by the step starting at 3, the other dropped when taken for that step (max_staleness 1).
    Both paths mark versions 0 and 1 stale, and the counters hold one tally: trained by gap, dropped."""
    db = Database(tmp_path / "s.sqlite")
    buffer = RolloutBuffer(db, max_staleness=1)
    with db.tx() as conn:
        for i, version in enumerate([0, 1, 2, 3, 0, 1, 2, 3]):
            conn.execute(
                "INSERT INTO sample_groups (submission_id, prompt_index, num_samples, sample_indices, "
                "behaviour_version, "
                "created_at, status, advantages, rewards, completion_lengths, prompt_ids, completion_ids, logprobs) "
                "VALUES (?, 0, 2, '[0, 1]', ?, 0, 'ready', x'', x'', x'', x'', x'', x'')",
                (f"S{i}", version),
            )
    taken = buffer.take(8)  # no trainer version: nothing dropped before the step
    assert [g.behaviour_version for g in taken.groups] == [0, 1, 2, 3] and taken.dropped_stale == 0
    with db.tx() as conn:
        assert buffer.commit(conn, taken.batch_id, 3) == {0: 2, 1: 2}
    assert buffer.take(8, trainer_version=3).dropped_stale == 4
    rows = db.all("SELECT submission_id, behaviour_version AS v, status FROM sample_groups ORDER BY seq")
    assert {(r["v"], r["status"]) for r in rows[:4]} == {(0, "stale"), (1, "stale"), (2, "trained"), (3, "trained")}
    assert {(r["v"], r["status"]) for r in rows[4:]} == {(0, "stale"), (1, "stale"), (2, "taken"), (3, "taken")}
    assert buffer.staleness_histogram() == {"0": 2, "1": 2}
    assert db.get_int("samples_dropped_stale") == 8 and db.get_int("samples_trained") == 4
    db.close()


def test_pending_submissions_are_verified_after_restart(tmp_path):
    cfg = run_config(tmp_path)
    orch = make_orchestrator(cfg)
    wid, _ = register(orch)
    r = submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(0)))
    orch.db.close()  # crash before verification
    orch2 = make_orchestrator(cfg)
    orch2.start()
    try:
        deadline = time.time() + 10
        while orch2.verification.verdict(wid,
            r.submission_id).status == VerdictStatus.pending and time.time() < deadline:
            time.sleep(0.05)
        assert orch2.verification.verdict(wid, r.submission_id).status == VerdictStatus.accepted
    finally:
        orch2.stop()


def test_take_batch_waits_for_samples(orch):
    orch.start()
    try:
        wid, _ = register(orch)
        assert orch.take_batch(1, wait_s=0.2).groups == []
        submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(2)))
        got = orch.take_batch(1, wait_s=10)
        # one whole group, though n < its size
        assert len(samples_from_groups(got.groups)) == orch.cfg.samples_per_prompt
    finally:
        orch.stop()


def test_batches_are_whole_groups_oldest_first(orch):
    """The buffer stores and hands out whole GRPO groups: a batch is the oldest ready groups until they
    hold n samples (a group is never split), and each group's samples travel together."""
    wid, _ = register(orch)
    k = orch.cfg.samples_per_prompt
    rng = np.random.default_rng(11)
    for _ in range(20):
        if orch.buffer.depth() >= 4 * k:
            break
        submit(orch, wid, make_submission(lease(orch, wid), rng))
        drain(orch)
    seqs = [r[0] for r in orch.db._db.execute("SELECT seq FROM sample_groups WHERE status='ready' ORDER BY seq")]

    def group_keys(batch):
        return [s.sample_id.rsplit(":", 1)[0] for s in samples_from_groups(batch.groups)]

    b1 = orch.take_batch(k)  # exactly one group
    assert len(samples_from_groups(b1.groups)) == k and len(set(group_keys(b1))) == 1
    b2 = orch.take_batch(k + 1)  # one group is not enough: two
    assert len(samples_from_groups(b2.groups)) == 2 * k and len(set(group_keys(b2))) == 2
    # Oldest first: the batches hold the first three groups in insertion order.
    taken = orch.db._db.execute("SELECT seq, batch_id FROM sample_groups WHERE status='taken' ORDER BY seq").fetchall()
    assert [seq for seq, _ in taken] == seqs[:3]
    assert [b for _, b in taken] == [b1.batch_id, b2.batch_id, b2.batch_id]
    # Every member of a group, each once.
    for batch in (b1, b2):
        by_group: dict[str, list[int]] = {}
        for s in samples_from_groups(batch.groups):
            key, sample_index = s.sample_id.rsplit(":", 1)
            by_group.setdefault(key, []).append(int(sample_index))
        assert all(sorted(v) == list(range(k)) for v in by_group.values())
    # The per-sample view matches: one row per sample, with the group's status and batch.
    view = orch.db._db.execute("SELECT sample_id FROM samples WHERE batch_id=? ORDER BY sample_id", (b2.batch_id,
        )).fetchall()
    assert [r[0] for r in view] == sorted(s.sample_id for s in samples_from_groups(b2.groups))
    assert orch.give_back_batch(b2.batch_id) == 2 * k
    assert orch.buffer.status_counts()["taken"] == k


def test_a_step_must_hold_whole_groups(tmp_path):
    run_config(tmp_path)  # 64 per step, groups of 4: fine
    with pytest.raises(ValueError, match="multiple of"):
        RunConfig.model_validate({**run_config(tmp_path).model_dump(), "trainer": {"samples_per_step": 10}})


def test_a_database_with_a_per_sample_buffer_is_refused_not_misread(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE samples (seq INTEGER PRIMARY KEY, sample_id TEXT, status TEXT)")
        db.execute("INSERT INTO samples (sample_id, status) VALUES ('S1:0:0', 'ready')")
    with pytest.raises(RuntimeError, match="older swarmrl"):
        Database(path)
    with sqlite3.connect(path) as db:  # untouched
        assert db.execute("SELECT sample_id, status FROM samples").fetchall() == [("S1:0:0", "ready")]


def test_status_reports_run(orch):
    wid, _ = register(orch)
    l1 = lease(orch, wid)
    submit(orch, wid, make_submission(l1, np.random.default_rng(6)))
    l2 = lease(orch, wid)
    submit(orch, wid, make_submission(l2, np.random.default_rng(7), bad=True))
    drain(orch)
    st = orch.status()
    assert st.submissions_accepted == 1 and st.submissions_rejected == 1 and st.acceptance_rate == 0.5
    assert st.workers_online == 1 and st.rollout_tokens_per_s > 0 and st.mean_reward is not None
    # The run's reward totals count the accepted submission's completions only, zero-signal groups included.
    reward_sum, completions = orch.reward_totals()
    assert completions == len(l1.prompts) * l1.samples_per_prompt and reward_sum / completions == pytest.approx(
        st.mean_reward)
    orch.housekeeping()
    assert orch.windows.history[-1]["workers_online"] == 1


def test_status_reports_the_verification_queue_pool_and_throughput(orch):
    """What the autoscaler and the operator read: the queue, submissions in and verified per second,
    verified tokens per second, and the pool's live and pending actors (also as Prometheus gauges)."""
    from prometheus_client import generate_latest

    wid, _ = register(orch)
    subs = []
    for seed in (8, 9):
        subs.append(make_submission(lease(orch, wid), np.random.default_rng(seed)))
        submit(orch, wid, subs[-1])
    orch.set_verifier_actors(2, 1)
    st = orch.status()
    assert st.verify_queue == 2 and st.verify_in_per_s > 0 and st.verify_out_per_s == 0 and st.verify_tokens_per_s == 0
    assert (st.verifier_actors, st.verifier_actors_pending) == (2, 1)
    drain(orch)
    st = orch.status()
    assert st.verify_queue == 0 and st.verify_out_per_s > 0 and st.verify_out_per_s == pytest.approx(st.verify_in_per_s)
    tokens = sum(s.num_tokens for s in subs)
    assert st.verify_tokens_per_s == pytest.approx(tokens * st.verify_out_per_s / 2)
    orch.housekeeping()
    text = generate_latest(orch.metrics.registry).decode()
    assert 'swarmrl_verifier_actors{state="live"} 2.0' in text
    assert 'swarmrl_verifier_actors{state="pending"} 1.0' in text
    assert "swarmrl_verify_queue 0.0" in text and 'swarmrl_verify_rate_per_s{what="out"}' in text
    assert orch.windows.history[-1]["verifier_actors"] == 2


@pytest.mark.parametrize("actors", [1, 2])
def test_a_bigger_pool_verifies_a_bigger_batch_per_call(tmp_path, actors):
    """batch_size jobs per actor of the pool (its `parallelism`): a grown pool splits a bigger batch
    instead of cutting the same batch into smaller, costlier calls."""
    verifier = FakeVerifier()
    if actors > 1:
        verifier.parallelism = actors
    o = make_orchestrator(run_config(tmp_path), verifier)  # verify_batch=8
    try:
        wid, _ = register(o)
        for seed in range(12):
            submit(o, wid, make_submission(lease(o, wid), np.random.default_rng(seed)))
        assert o.verification.verify_pending() == (8 if actors == 1 else 12)
        assert verifier.jobs_seen == (8 if actors == 1 else 12)
    finally:
        o.db.close()


def test_finished_run_hands_out_no_leases(orch):
    wid, _ = register(orch)
    orch.set_finished("trainer crashed")
    resp = orch.lease(wid, LeaseRequest(loaded_policy_version=0))
    assert resp.lease is None and resp.retry_after_s > 0
    st = orch.status()
    assert st.finished and st.error == "trainer crashed"


def test_nested_transactions_are_savepoints(tmp_path):
    st = Database(tmp_path / "s.sqlite")

    def add(n: int) -> None:
        with st.tx() as db:
            Database.add(db, "a", n)

    with st.tx():
        add(1)
        with pytest.raises(RuntimeError):
            with st.tx():
                add(10)
                raise RuntimeError("inner fails")
        add(100)
    assert st.get_int("a") == 101  # the inner block alone was undone; the rest committed together
    with pytest.raises(RuntimeError):
        with st.tx():
            add(1000)
            raise RuntimeError("outer fails")
    assert st.get_int("a") == 101
    st.close()


def test_backpressure_when_verification_is_behind(orch, monkeypatch):
    import orchestrator.lease_requests as lease_requests

    monkeypatch.setattr(lease_requests, "MAX_VERIFY_BACKLOG", 1)
    wid, _ = register(orch)
    submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(0)))  # queued, not verified
    resp = orch.lease(wid, LeaseRequest(loaded_policy_version=0))
    assert resp.lease is None and resp.retry_after_s > 0
    drain(orch)
    assert orch.lease(wid, LeaseRequest(loaded_policy_version=0)).lease is not None


def test_submissions_not_kept_in_memory_are_read_back(orch, monkeypatch):
    import orchestrator.verification as verification

    monkeypatch.setattr(verification, "MAX_PARSED_PENDING", 0)
    wid, _ = register(orch)
    r = submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(0)))
    assert not orch.verification._pending
    drain(orch)
    assert orch.verification.verdict(wid, r.submission_id).status == VerdictStatus.accepted


def test_generation_never_runs_more_than_async_level_steps_ahead(tmp_path):
    """AReaL's bound: untrained samples (leased, pending or buffered) cover at most async_level + 1 steps."""
    for async_level in (0, 1):
        config = run_config(tmp_path / f"a{async_level}", async_level=async_level, max_open_leases_per_worker=8)
        config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"samples_per_step": 8})})
        orch = make_orchestrator(config)
        wid, _ = register(orch)
        granted = [lease(orch, wid) for _ in range(async_level + 1)]  # 2 prompts x 4 samples = one step each
        assert all(leased is not None for leased in granted)
        refused = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2))
        assert refused.lease is None and refused.retry_after_s > 0
        # Submitted and verified samples still count until the trainer has consumed them.
        rng = np.random.default_rng(3)
        for leased in granted:
            submit(orch, wid, make_submission(leased, rng))
        drain(orch)
        depth = orch.buffer.depth()
        if depth == 8 * (async_level + 1):  # no group was dropped for zero signal
            assert orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease is None
        batch = orch.take_batch(depth)
        orch.commit_batches({batch.batch_id: 0}, {1: HASH1})
        assert lease(orch, wid, version=1) is not None
        assert orch.status().wait_for_trainer_s > 0
        orch.db.close()


def test_lease_demands_a_version_that_will_not_be_stale_when_trained(tmp_path):
    """Samples queue behind the untrained ones; their behaviour version must still be within
    max_staleness of the trainer's version when they are trained, or they would be generated for nothing."""
    config = run_config(tmp_path, async_level=2, max_open_leases_per_worker=8)
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"samples_per_step": 8,
        "max_staleness": 2})})
    orch = make_orchestrator(config)
    wid, _ = register(orch)
    first = [lease(orch, wid) for _ in range(2)]  # 16 untrained samples: two steps' worth
    assert [leased.min_policy_version for leased in first] == [0, 0]
    for v in range(1, 6):
        orch.versions.announce({v: f"{v:064x}"})
    # Trained 2 steps from now at version >= 5 + 2: a version-3 worker (allowed by async_level) would be stale.
    with pytest.raises(ApiError) as e:
        orch.lease(wid, LeaseRequest(loaded_policy_version=3, max_prompts=2))
    assert code_of(e) == ErrorCode.version_too_old and e.value.min_policy_version == 5
    granted = orch.lease(wid, LeaseRequest(loaded_policy_version=5, max_prompts=2)).lease
    assert granted is not None and granted.min_policy_version == 5
    orch.db.close()


def test_a_retried_lease_request_gets_the_same_lease(orch):
    """A worker whose first answer was lost (timeout, dropped connection) retries with the same
    idempotency key: it must get the lease it already holds, not a second, orphaned one."""
    wid, _ = register(orch)
    req = LeaseRequest(loaded_policy_version=0, max_prompts=2, request_id="r-retry-1")
    first = orch.lease(wid, req).lease
    again = orch.lease(wid, req).lease
    assert again.lease_id == first.lease_id and again.model_dump(mode="json") == first.model_dump(mode="json")
    assert orch.leases.open_leases(wid, time.time()) == 1
    other = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2, request_id="r-retry-2")).lease
    assert other.lease_id != first.lease_id


def test_buffer_samples_carry_the_submitted_arrays_exactly(orch):
    """The trainer's samples (decoded for a whole batch at once, without TrainSample's checks) hold
    exactly the prompt, tokens and logprobs that were submitted, with the dtypes TrainSample's own
    constructor gives, and pass that constructor's checks."""
    from trainer.samples import TrainSample

    wid, _ = register(orch)
    subs = {}
    for seed in range(2):  # two submissions, so a batch spans several submissions and groups
        leased = lease(orch, wid)
        sub = make_submission(leased, np.random.default_rng(seed))
        receipt = submit(orch, wid, sub)
        subs[receipt.submission_id] = (leased, sub)
    drain(orch)
    batch = orch.take_batch(100)
    # The batch travels to the trainer (Ray pickles it) as groups; samples are decoded on the far side.
    import pickle

    travelled = pickle.loads(pickle.dumps(batch))
    assert travelled.num_samples == batch.num_samples
    assert [s.sample_id for s in samples_from_groups(travelled.groups)] == [s.sample_id
        for s in samples_from_groups(batch.groups)]
    assert len(samples_from_groups(batch.groups)) == orch.db.get_int("groups_kept") * 4 > 0
    for s in samples_from_groups(batch.groups):
        sid, p, k = s.sample_id.rsplit(":", 2)
        leased, sub = subs[sid]
        c = next(c for c in sub.completions if (c.prompt_index, c.sample_index) == (int(p), int(k)))
        assert s.prompt_ids.dtype == np.int64 and s.completion_ids.dtype == np.int64
        assert s.behaviour_logprobs.dtype == np.float32
        assert s.prompt_ids.tolist() == leased.prompts[int(p)].token_ids.tolist()
        assert s.completion_ids.tolist() == c.token_ids.tolist()
        assert np.array_equal(s.behaviour_logprobs, trusted_logprobs(c))  # the verifier's, never the worker's
        TrainSample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.advantage, s.reward, s.behaviour_version,
            s.sample_id)


def test_untrained_counters_match_the_rows_through_every_transition(tmp_path):
    """The async bound reads two counters kept alongside the lease and sample rows; after each kind of
    transition (issue, submit, accept, reject, release, expire, take, stale drop, give back, commit,
    restart) they equal a recount of the rows."""
    # counters, not budgets
    cfg = run_config(tmp_path, max_open_leases_per_worker=10, strikes_to_ban=100, lease_cooldown_s=0)
    cfg.trainer.max_staleness = 1
    orch = make_orchestrator(cfg)
    k = cfg.orchestrator.samples_per_prompt

    def recount() -> int:
        db = orch.db._db
        leased = db.execute("SELECT COALESCE(SUM(json_array_length(prompt_indices)), 0) FROM leases WHERE status IN "
            "('open', 'submitted')").fetchone()[0]
        buffered = db.execute("SELECT COUNT(*) FROM samples WHERE status IN ('ready', 'taken')").fetchone()[0]
        return int(leased) * k + int(buffered)

    def check() -> None:
        with orch.db.tx() as db:
            assert orch.leases.untrained_samples(db) == recount()

    wid, _ = register(orch)
    rng = np.random.default_rng(5)
    l1, l2, l3, l4 = (lease(orch, wid) for _ in range(4))
    check()
    submit(orch, wid, make_submission(l1, rng))  # accepted
    submit(orch, wid, make_submission(l2, rng, bad=True))  # rejected: its prompts go back
    check()
    drain(orch)
    assert orch.buffer.depth() > 0
    check()
    orch.release(wid, l3.lease_id)
    orch.housekeeping(now=time.time() + 3600)  # l4 expires
    check()
    b = orch.take_batch(2)
    check()
    orch.give_back_batch(b.batch_id)
    check()
    b = orch.take_batch(2)
    orch.commit_batches({b.batch_id: 0}, {1: HASH1})
    check()
    for _ in range(20):  # two groups: one to take, one left to go stale
        if orch.buffer.depth() >= 2 * k:
            break
        submit(orch, wid, make_submission(lease(orch, wid, version=1), rng, model_hash=HASH1))
        drain(orch)
    orch.take_batch(1)  # taken, never committed
    check()
    dropped = orch.take_batch(100, trainer_version=3)  # everything left is stale for version 3
    assert dropped.dropped_stale > 0
    check()
    orch.db.close()
    # restart: the taken batch stays taken (the trainer settles it); the counters recounted
    orch = make_orchestrator(cfg)
    check()


def test_groups_of_another_size_never_leave_a_batch_short(tmp_path):
    """Groups of 4 and 3 (a run resumed with another group size): a batch of 8 takes groups until it
    holds 8 or more, never stopping short while more are ready."""
    db = Database(tmp_path / "s.sqlite")
    buffer = RolloutBuffer(db)
    with db.tx() as conn:
        for i, size in enumerate([4, 3, 3, 4]):
            conn.execute(
                "INSERT INTO sample_groups (submission_id, prompt_index, num_samples, sample_indices, "
                "behaviour_version, created_at, "
                "status, advantages, rewards, completion_lengths, prompt_ids, completion_ids, logprobs) "
                "VALUES (?, 0, ?, ?, 0, 0, 'ready', x'', x'', x'', x'', x'', x'')",
                (f"S{i}", size, str(list(range(size)))),
            )
    groups = buffer.take(8).groups
    assert [g.submission_id for g in groups] == ["S0", "S1", "S2"] and sum(g.num_samples for g in groups) == 10
    groups = buffer.take(8).groups  # only 4 left: all of them
    assert [g.submission_id for g in groups] == ["S3"]
    db.close()


def test_unusable_rewards_are_a_rejection_without_a_strike(orch):
    """An accepted verdict whose rewards cannot be used (NaN, or not one per completion) is recorded as
    rejected with the reason, at once (never left pending), and the worker is not blamed for it."""
    wid, _ = register(orch)
    verifier = orch.verification.verifier
    real = verifier.verify_many

    def nan_rewards(jobs):
        return [v.model_copy(update={"rewards": [float("nan")] * len(v.rewards)}) if v.rewards else v
            for v in real(jobs)]

    verifier.verify_many = nan_rewards
    r = submit(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(0)))
    drain(orch)
    v = orch.verification.verdict(wid, r.submission_id)
    assert v.status == VerdictStatus.rejected and v.rejections[0].code.value == "reward_error"
    assert "finite" in v.rejections[0].message
    w = orch.workers.get(wid)
    assert w.rejected == 1 and w.strikes == 0 and not w.banned
    assert orch.buffer.depth() == 0 and orch.db.get_int("submissions_rejected") == 1


def test_no_lease_before_the_first_policy_version_is_announced(tmp_path):
    """Version 0 is announced by the trainer's first reconcile; a worker that asks before it is told to come
    back (a rollout then could not be checked against a model hash, and would cost it a strike)."""
    from orch_fakes import HASH0, make_prompts

    from orchestrator.service import Orchestrator

    config = run_config(tmp_path)
    orch = Orchestrator(config.orchestrator, Database(config.orchestrator.db_path), make_prompts(config),
                        FakeVerifier(), shape=config.step_shape(), task_name=config.data.task, run_name=config.name)
    wid, _ = register(orch)
    resp = orch.lease(wid, LeaseRequest(loaded_policy_version=0))
    assert resp.lease is None and resp.retry_after_s and resp.retry_after_s > 0
    orch.versions.announce({0: HASH0})
    assert lease(orch, wid) is not None
