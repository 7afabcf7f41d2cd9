"""Rewards the trusted side could not compute (timed out, crashed, skipped) are never the worker's doing: no
strike, full credit, and the completion's GRPO group is dropped instead of trained with a made-up 0, counted
per reward and kind where an operator looks. And strikes decay with accepted work, never for a cheater."""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace

import numpy as np
import pytest
from orch_fakes import (
    FakeVerifier,
    encode,
    make_orchestrator,
    make_prompts,
    make_submission,
    run_config,
    trusted_logprobs,
)
from prometheus_client import generate_latest

from orchestrator.db import Database
from orchestrator.service import Orchestrator
from orchestrator.verification import default_make_job
from protocol.models import LeaseRequest, WorkerRegistration
from protocol.verdicts import RewardStatus, VerdictStatus


def register(orch):
    reg = orch.register(WorkerRegistration(name="w"), orch.cfg.join_tokens[0].get_secret_value())
    return orch.authenticate(reg.secret)


def lease(orch, wid):
    return orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=64)).lease


def submit_and_drain(orch, wid, sub):
    sid = orch.admission.submit(wid, encode(sub), None).submission_id
    while orch.verification.verify_pending():
        pass
    return orch.verification.verdict(wid, sid)


def kept_prompts(orch, submission_id):
    return {r[0] for r in orch.db.all("SELECT prompt_index FROM sample_groups WHERE submission_id=?", (submission_id,))}


def untrained_matches_rows(orch) -> bool:
    """The async bound's counters equal a recount of the lease and sample rows (nothing leaks room)."""
    k = orch.cfg.samples_per_prompt
    leased = orch.db.one("SELECT COALESCE(SUM(json_array_length(prompt_indices)), 0) FROM leases WHERE status IN "
        "('open', 'submitted')")[0]
    buffered = orch.db.one("SELECT COUNT(*) FROM samples WHERE status IN ('ready', 'taken')")[0]
    with orch.db.tx() as db:
        return orch.leases.untrained_samples(db) == int(leased) * k + int(buffered)


class StatusVerifier(FakeVerifier):
    """Accepts like FakeVerifier, with rewards 0/1 alternating in every group (so every group has a
    signal), and the given reward statuses (reward 0) at (prompt index, sample index)."""

    def __init__(self, marks: dict[tuple[int, int], RewardStatus]):
        super().__init__()
        self.marks = marks

    def verify_many(self, jobs):
        out = []
        for job, v in zip(jobs, super().verify_many(jobs)):
            if v.status == VerdictStatus.accepted:
                comps = job.submission.completions
                status = [self.marks.get((c.prompt_index, c.sample_index), RewardStatus.ok) for c in comps]
                rewards = [0.0 if s is not RewardStatus.ok else float(c.sample_index % 2) for c, s in zip(comps,
                    status)]
                v = v.model_copy(update={"rewards": rewards, "reward_status": status})
            out.append(v)
        return out


UNSCORED = [RewardStatus.timed_out, RewardStatus.skipped, RewardStatus.crashed, RewardStatus.error]


@pytest.mark.parametrize("status", UNSCORED)
def test_an_unscored_reward_drops_its_group_without_a_strike(tmp_path, status):
    """error: the reward raised or gave no number, a TRL reward's None ("no reward") included."""
    orch = make_orchestrator(run_config(tmp_path, strikes_to_ban=1), StatusVerifier({(0, 1): status}))
    wid = register(orch)
    leased = lease(orch, wid)
    sub = make_submission(leased, np.random.default_rng(0))
    v = submit_and_drain(orch, wid, sub)
    assert v.status == VerdictStatus.accepted and v.reward_status[1] == status
    w = orch.workers.get(wid)
    assert w.strikes == 0 and not w.banned and w.accepted == 1 and w.rejected == 0
    assert w.verified_tokens == sub.num_tokens
    # the lease's prompts earned its token's record
    assert orch.leases.shares.credit(orch.workers.token_of(wid), time.time()) > 1
    assert kept_prompts(orch, v.submission_id) == {1}  # prompt 0's group is never trained; prompt 1's is
    assert orch.db.get_int("groups_dropped_unscored") == 1 and orch.db.get_int("groups_dropped_zero_signal") == 0
    assert orch.db.get_int("reward_count") == 7  # the made-up 0 is not in the run's reward totals
    assert orch.buffer.depth() == 4 and untrained_matches_rows(orch)
    orch.db.close()


def test_a_submission_whose_every_group_is_unscored_is_still_accepted(tmp_path):
    marks = {(0, 0): RewardStatus.timed_out, (0, 2): RewardStatus.timed_out, (1, 0): RewardStatus.skipped}
    orch = make_orchestrator(run_config(tmp_path, strikes_to_ban=1), StatusVerifier(marks))
    wid = register(orch)
    v = submit_and_drain(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(1)))
    assert v.status == VerdictStatus.accepted
    assert orch.workers.get(wid).strikes == 0 and orch.workers.get(wid).accepted == 1
    assert orch.buffer.depth() == 0 and orch.db.get_int("groups_dropped_unscored") == 2 and untrained_matches_rows(orch)
    assert orch.status().reward_failures == {"toy": {"timed_out": 2, "skipped": 1}}
    orch.db.close()


def test_reward_failures_are_shown_in_status_metrics_live_view_and_summary_and_survive_a_restart(tmp_path):
    cfg = run_config(tmp_path)
    marks = {(0, 1): RewardStatus.timed_out, (1, 3): RewardStatus.crashed, (1, 0): RewardStatus.error}
    orch = make_orchestrator(cfg, StatusVerifier(marks))
    wid = register(orch)
    for seed in range(2):
        submit_and_drain(orch, wid, make_submission(lease(orch, wid), np.random.default_rng(seed)))

    def check(o):
        st = o.status()
        assert st.reward_failures == {"toy": {"timed_out": 2, "crashed": 2, "error": 2}}
        assert st.groups_dropped_unscored == 4
        text = generate_latest(o.metrics.registry).decode()  # what GET /metrics serves
        assert 'swarmrl_reward_failures_total{kind="timed_out",reward="toy"} 2.0' in text
        assert 'swarmrl_reward_failures_total{kind="crashed",reward="toy"} 2.0' in text
        assert 'swarmrl_reward_failures_total{kind="error",reward="toy"} 2.0' in text
        assert "swarmrl_groups_dropped_unscored_total 4.0" in text
        return st

    st = check(orch)
    orch.db.close()
    st = check(make_orchestrator(cfg))  # a restart: the counts are durable

    from rich.console import Console

    from swarmrl.config import RunConfig
    from swarmrl.live_view import render
    from swarmrl.memory_peaks import MemoryPeaks
    from swarmrl.run_dir import RunDir
    from swarmrl.run_record import Progress, RunRecord

    run = SimpleNamespace(progress=Progress(status=st), cfg=RunConfig(), url="http://127.0.0.1:1")
    console = Console(record=True, width=200)
    console.print(render(run))
    assert "toy: 2 crashed, 2 error, 2 timed_out; 4 groups dropped" in console.export_text()
    finished = RunRecord(RunConfig(), RunDir(tmp_path / "run"))
    finished.progress.status = st
    finished.summary(MemoryPeaks())
    assert "toy: 2 crashed, 2 error, 2 timed_out; 4 groups dropped" in (tmp_path / "run" / "summary.md").read_text()


# ------------------------------------------------------------------------------------------------
# strikes decay with accepted work


def decay_orch(tmp_path):
    return make_orchestrator(run_config(tmp_path, strikes_to_ban=3, strike_decay_accepted=3, lease_cooldown_s=0))


def accept(orch, wid, rng):  # zero-signal groups: accepted, and the buffer never fills the async bound
    assert submit_and_drain(orch, wid, make_submission(lease(orch, wid), rng,
        same_tokens=True)).status == VerdictStatus.accepted


def reject(orch, wid, rng):  # a bad proof: a rejection that strikes
    assert submit_and_drain(orch, wid, make_submission(lease(orch, wid), rng,
        bad=True)).status == VerdictStatus.rejected


def test_strikes_decay_with_accepted_work_never_below_zero(tmp_path):
    orch = decay_orch(tmp_path)
    wid, rng = register(orch), np.random.default_rng(0)
    reject(orch, wid, rng)
    reject(orch, wid, rng)
    strikes = []
    for _ in range(9):
        accept(orch, wid, rng)
        strikes.append(orch.workers.get(wid).strikes)
    assert strikes == [2, 2, 1, 1, 1, 0, 0, 0, 0]
    # clean work banks nothing
    assert orch.operators.worker_list().workers[0].strikes == 0 and orch.workers.get(wid).decay_progress == 0
    reject(orch, wid, rng)
    assert orch.workers.get(wid).strikes == 1 and not orch.workers.get(wid).banned
    orch.db.close()


def test_rejections_within_the_decay_rate_never_ban_and_a_cheater_above_it_is_banned(tmp_path):
    # One striking rejection per 3 accepted submissions (the decay rate): never banned.
    orch = decay_orch(tmp_path / "a")
    wid, rng = register(orch), np.random.default_rng(1)
    for _ in range(5):
        reject(orch, wid, rng)
        for _ in range(3):
            accept(orch, wid, rng)
    assert orch.workers.get(wid).strikes == 0 and not orch.workers.get(wid).banned
    orch.db.close()
    # A cheater interleaving one rejection per 2 accepted submissions: banned at the third strike.
    orch = decay_orch(tmp_path / "b")
    wid, rng = register(orch), np.random.default_rng(2)
    for _ in range(3):
        for _ in range(2):
            accept(orch, wid, rng)
        reject(orch, wid, rng)
    w = orch.workers.get(wid)
    assert w.banned and w.strikes == 3 and w.accepted == 6
    # Accepted work verified after the ban never lifts it.
    with orch.db.tx() as db:
        for _ in range(6):
            orch.workers.record_verdict(db, wid, True, 10, 3)
    assert orch.workers.get(wid).banned and orch.workers.get(wid).strikes == 3
    orch.db.close()


# ------------------------------------------------------------------------------------------------
# the real reward pool: a reward that hangs on some of the policy's texts

SLOW_PLUGIN = '''
from environments.tasks import get_task
import hashlib, time

TOY = get_task("toy")

def slow_on_some(text, item):
    """The toy reward, that hangs on 1 text in 8, chosen by a hash of the text (as a third-party scorer might)."""
    if hashlib.sha256(text.encode()).digest()[0] % 8 == 0:
        time.sleep(60)
    return TOY.reward(item, text)
'''
SLOW_REWARD = "swarmrl_slow_reward:slow_on_some"


def is_slow(text: str) -> bool:
    return hashlib.sha256(text.encode()).digest()[0] % 8 == 0


class PoolVerifier(FakeVerifier):
    """Accepts like FakeVerifier, then builds the verdicts with the real verifier's code
    (verifier.service.Verifier._verdicts) and the real sandboxed reward pool."""

    def __init__(self, pool):
        super().__init__()
        from verifier.service import Verifier

        decode = lambda ids: self.tok.decode([int(t) for t in ids], skip_special_tokens=True)  # noqa: E731
        self.real = SimpleNamespace(rewards=pool, decode=decode)
        self.real._reward_request = lambda job, c: Verifier._reward_request(self.real, job, c)
        self._verdicts = Verifier._verdicts

    checked = True  # spot-checked: the verdicts carry our logprobs (the text is shown to be the policy's draw)

    def verify_many(self, jobs):
        from verifier.service import Replayed

        checked = super().verify_many(jobs)
        replayed = [Replayed([trusted_logprobs(c) for c in job.submission.completions]) if self.checked else None
            for job in jobs]
        self.real.tolerances = SimpleNamespace(deviation_rate=0.0)
        return self._verdicts(self.real, jobs, [list(v.rejections) for v in checked], replayed)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_reward_that_times_out_in_the_real_pool_drops_its_group_without_a_strike(tmp_path, checked):
    """Checked, the text is the policy's draw: no strike. Not spot-checked, the worker chose it: a strike."""
    from verifier.reward_pool import RewardPool, RewardPoolConfig

    (tmp_path / "swarmrl_slow_reward.py").write_text(SLOW_PLUGIN)
    cfg = run_config(tmp_path, strikes_to_ban=2)
    with RewardPool(RewardPoolConfig(processes=2, time_limit_s=0.5, import_paths=[str(tmp_path)])) as pool:
        verifier = PoolVerifier(pool)
        verifier.checked = checked
        orch = Orchestrator(cfg.orchestrator, Database(cfg.orchestrator.db_path), make_prompts(cfg), verifier,
                            shape=cfg.step_shape(), task_name=SLOW_REWARD, run_name=cfg.name,
                            make_job=default_make_job, verify_batch=8)
        orch.versions.announce({0: "0" * 64})
        wid = register(orch)
        leased = lease(orch, wid)
        items = [orch.prompts.prompts[i].item for i in orch.leases.get(leased.lease_id).prompt_indices]
        # Deterministic: the first seed whose submission has one hanging text, in prompt 0's group, and a signal in
        # prompt 1's.
        for seed in range(500):
            sub = make_submission(leased, np.random.default_rng(seed))
            texts = [verifier.real.decode(c.token_ids) for c in sub.completions]
            slow = [i for i, t in enumerate(texts) if is_slow(t)]
            rewards1 = {verifier.task.reward(items[1], t) for c, t in zip(sub.completions, texts)
                if c.prompt_index == 1}
            if len(slow) == 1 and sub.completions[slow[0]].prompt_index == 0 and len(rewards1) > 1:
                break
        else:
            pytest.fail("no seed gives one hanging text")
        v = submit_and_drain(orch, wid, sub)
        assert v.status == VerdictStatus.accepted
        assert v.reward_status == [RewardStatus.timed_out if i in slow else RewardStatus.ok for i in range(len(texts))]
        w = orch.workers.get(wid)
        assert w.strikes == (0 if checked else 1) and not w.banned and w.accepted == 1
        assert kept_prompts(orch, v.submission_id) == {1} and orch.db.get_int("groups_dropped_unscored") == 1
        assert orch.status().reward_failures == {SLOW_REWARD: {"timed_out": 1}} and untrained_matches_rows(orch)
        orch.db.close()
