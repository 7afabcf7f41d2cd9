"""Evaluation during training: the pass@k estimator, the held-out split, and how eval rounds are
scheduled, verified and recorded (orchestrator logic with the test verifier; then over real HTTP)."""

from __future__ import annotations

import itertools
import time

import httpx
import numpy as np
import pytest
from orch_fakes import HASH0, encode, make_orchestrator, make_prompts, make_submission, run_config

from orchestrator.config import DataConfig, EvalConfig
from orchestrator.data import DataError, PromptSet
from orchestrator.evaluation import HeldOutPrompts, held_out_data, hold_out, pass_at_k, summarize
from orchestrator.leases import GenerationBoundReached
from orchestrator.server import OrchestratorServer
from protocol import api
from protocol.models import LeaseRequest, LeaseResponse, WorkerRegistered, WorkerRegistration
from protocol.operator_models import RunStatus


def test_pass_at_k_is_the_unbiased_estimator():
    # Chen et al. 2021: the chance that a random k-subset of the n samples holds at least one pass.
    for n in range(1, 8):
        for c in range(n + 1):
            passes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(passes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_summary_averages_over_prompts():
    r = summarize(3, [([1.0, 0.0, 1.0, 0.5], [2, 3, 4, 5]), ([0.0, 0.0, 0.0, 0.0], [1, 1, 1, 1])], planned=3, k=4,
                  pass_ks=[1, 2, 4], threshold=1.0, complete=False)
    assert r.policy_version == 3 and r.prompts == 2 and r.prompts_planned == 3
    assert r.avg_reward == pytest.approx(2.5 / 8)
    assert r.pass_at["1"] == pytest.approx((2 / 4 + 0) / 2)
    assert r.pass_at["2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # C(2,2)/C(4,2) of the first prompt fail
    assert r.pass_at["4"] == pytest.approx(0.5)
    assert r.mean_completion_tokens == pytest.approx(18 / 8)


def eval_config(tmp_path, every=2, num=4, **orch):
    cfg = run_config(tmp_path, **orch)
    cfg.eval = EvalConfig(every_steps=every, num_prompts=num, pass_at=[1, 2])
    return cfg


def register(orch, name="w"):
    reg = orch.register(WorkerRegistration(name=name), orch.cfg.join_tokens[0].get_secret_value())
    return orch.authenticate(reg.secret)


def lease(orch, wid, version=0, max_prompts=64):
    return orch.lease(wid, LeaseRequest(loaded_policy_version=version, max_prompts=max_prompts)).lease


def drain(orch):
    while orch.verification.verify_pending():
        pass


def test_held_out_prompts_are_never_in_the_training_order(tmp_path):
    cfg = eval_config(tmp_path)
    orch = make_orchestrator(cfg)
    prompts = orch.prompts
    held = {prompts.prompts[i].prompt_id for i in prompts.held_out}
    n = len(make_prompts(cfg))
    assert len(held) == 4 and prompts.num_train == n - 4
    trained = {prompts.prompts[prompts.order(pos)].prompt_id for pos in range(3 * prompts.num_train)}
    assert trained.isdisjoint(held) and len(trained) == n - 4
    # The same run holds out the same prompts (a restarted orchestrator agrees with the one before).
    again = hold_out(make_prompts(cfg), 4, cfg.seed)
    assert {again.prompts[i].prompt_id for i in again.held_out} == held
    orch.db.close()


def test_a_held_out_split_of_a_dataset(tmp_path, tiny_model_dir):
    import datasets

    rows = [{"prompt": f"copy:{i:03d}=", "answer": f"{i:03d}"} for i in range(12)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:9]),
        "test": datasets.Dataset.from_list(rows[9:])}).save_to_disk(str(tmp_path / "dd"))
    data = DataConfig(task="toy", path=str(tmp_path / "dd"))
    assert held_out_data(data, EvalConfig(every_steps=1)) is None  # no split or path of its own: a slice
    with pytest.raises(DataError, match="data.path or eval.path"):
        held_out_data(DataConfig(task="toy"), EvalConfig(every_steps=1, split="test"))
    source = held_out_data(data, EvalConfig(every_steps=1, split="test"))
    assert source.path == data.path and source.split == "test"
    prompts = HeldOutPrompts(PromptSet.from_config(data, tiny_model_dir, 0), PromptSet.from_config(source,
        tiny_model_dir, 0).prompts)
    assert prompts.num_train == 9 and [prompts.prompts[i].item.prompt for i in prompts.held_out] == [r["prompt"]
        for r in rows[9:]]
    assert {prompts.order(pos) for pos in range(30)} == set(range(9))
    with pytest.raises(DataError, match="no training prompts left"):  # the same split for both: nothing to train on
        HeldOutPrompts(PromptSet.from_config(data, tiny_model_dir, 0), PromptSet.from_config(data, tiny_model_dir,
            0).prompts)


def test_eval_leases_go_first_pinned_to_the_version_and_outside_the_async_bound(tmp_path):
    # prompts_per_lease 2, k 4, samples_per_step 64, async level 2 -> a bound of 3*64/4 = 48 prompts
    orch = make_orchestrator(eval_config(tmp_path))
    evals = orch.leases.evals
    wid = register(orch)
    assert orch.status().evals_open == 1  # version 0 was published: its round is open
    first, second = lease(orch, wid), lease(orch, wid)
    held = set(orch.prompts.held_out)
    for ls in (first, second):
        assert ls.generation_version == 0 and ls.samples_per_prompt == 4 and len(ls.prompts) == 2
        rows = orch.leases.get(ls.lease_id)
        assert rows.eval_version == 0 and set(rows.prompt_indices) <= held
        for p, i in zip(ls.prompts, rows.prompt_indices):
            assert p.seeds == evals.seeds(0, i)
    # The round is all leased: the next lease is a training one, and eval leases took no room in the bound.
    orch.cfg.max_open_leases_per_worker = 100
    training = []
    while (t := lease(orch, wid)) is not None:
        training.append(t)
    assert len(training) == 24  # the whole bound, though 4 eval prompts are out
    assert all(orch.leases.get(t.lease_id).eval_version is None for t in training)
    assert not set(i for t in training for i in orch.leases.get(t.lease_id).prompt_indices) & held
    with pytest.raises(GenerationBoundReached):
        orch.leases.issue(wid, 2, 0, time.time(), loaded_version=0)
    # Version 2 is announced while generation is at the bound: its eval prompts still go out, but only
    # to a worker that says it holds version 2 (the pin is exactly the version evaluated).
    orch.versions.announce({1: HASH0})
    orch.versions.announce({2: HASH0})
    assert orch.status().evals_open == 2
    other = register(orch, "w2")
    assert lease(orch, other, version=1) is None  # version 1 has no round; the bound holds
    ev = lease(orch, other, version=2)
    assert ev.generation_version == 2 and orch.leases.get(ev.lease_id).eval_version == 2
    orch.db.close()


def test_eval_results_are_recorded_never_buffered_and_a_released_lease_comes_back_with_the_same_seeds(tmp_path):
    orch = make_orchestrator(eval_config(tmp_path))
    wid = register(orch)
    rng = np.random.default_rng(0)
    first = lease(orch, wid)
    released = orch.release(wid, first.lease_id)
    assert released.released
    again = lease(orch, wid)
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in first.prompts]
    assert [p.seeds for p in again.prompts] == [p.seeds for p in first.prompts]  # no re-roll by letting a lease go
    # A rejected eval submission is a strike like any other, and its prompts wait again.
    orch.admission.submit(wid, encode(make_submission(again, rng, bad=True)), None)
    drain(orch)
    assert orch.workers.get(wid).strikes == 1
    subs = []
    while (ls := lease(orch, wid)) is not None and orch.leases.get(ls.lease_id).eval_version is not None:
        sub = make_submission(ls, rng)
        orch.admission.submit(wid, encode(sub), None)
        subs.append((ls, sub))
        drain(orch)
    assert len(subs) == 2
    assert orch.buffer.depth() == 0 and orch.reward_totals() == (0.0, 0)  # never trained on, not in the training reward
    [result] = orch.eval_results()
    assert result.complete and result.policy_version == 0 and result.prompts == 4 and result.samples_per_prompt == 4
    task, tok = orch.verification.verifier.task, orch.verification.verifier.tok
    rewards, lengths = [], []
    for ls, sub in subs:
        items = [orch.prompts.prompts[i].item for i in orch.leases.get(ls.lease_id).prompt_indices]
        for c in sub.completions:
            rewards.append(task.reward(items[c.prompt_index], tok.decode(c.token_ids.tolist(),
                skip_special_tokens=True)))
            lengths.append(c.token_ids.size)
    assert result.avg_reward == pytest.approx(np.mean(rewards))
    assert result.mean_completion_tokens == pytest.approx(np.mean(lengths))
    assert set(result.pass_at) == {"1", "2",
        "4"} and 0.0 <= result.pass_at["1"] <= result.pass_at["2"] <= result.pass_at["4"] <= 1.0
    st = orch.status()
    assert st.eval_latest == result and st.evals_open == 0
    orch.housekeeping()
    assert orch.metrics.eval_avg_reward._value.get() == pytest.approx(result.avg_reward)
    orch.db.close()


def test_a_left_behind_round_closes_partial_and_rounds_survive_a_restart(tmp_path):
    cfg = eval_config(tmp_path, async_level=1)
    orch = make_orchestrator(cfg)
    wid = register(orch)
    rng = np.random.default_rng(1)
    ls = lease(orch, wid)  # 2 of the 4 held-out prompts of version 0
    orch.admission.submit(wid, encode(make_submission(ls, rng)), None)
    drain(orch)
    orch.stop()
    orch.db.close()
    orch = make_orchestrator(cfg)  # a restarted orchestrator: the round is still open, half done
    wid = register(orch, "w2")
    assert orch.status().evals_open == 1 and orch.eval_results() == []
    orch.versions.announce({1: HASH0})
    open_lease = lease(orch, wid, version=0)  # still generatable at version 0 (async level 1)
    assert orch.leases.get(open_lease.lease_id).eval_version == 0
    orch.versions.announce({2: HASH0})  # version 0 is left behind, but an eval lease of it is still open
    assert orch.status().evals_open == 2
    orch.release(wid, open_lease.lease_id)
    orch.housekeeping()
    [result] = orch.eval_results()
    assert not result.complete and result.prompts == 2 and result.prompts_planned == 4
    assert orch.status().evals_open == 1  # version 2's round
    assert orch.eval_results(after_version=0) == []
    orch.db.close()


def test_eval_over_http(tmp_path):
    """A worker on the real HTTP API: its eval leases look like its training leases, the verdicts come back
    the same way, and /v1/status and /metrics show the evaluation."""
    cfg = eval_config(tmp_path, admin_token="admin", join_tokens=["join"], max_open_leases_per_worker=3)
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    rng = np.random.default_rng(2)
    admin = {"Authorization": "Bearer admin"}
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            r = client.post(api.REGISTER.path, json={"name": "w", "device": "cpu"},
                headers={"Authorization": "Bearer join"})
            w = WorkerRegistered.model_validate_json(r.content)
            auth = {"Authorization": f"Bearer {w.secret}"}
            leases = []
            for _ in range(3):
                r = client.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 64}, headers=auth)
                assert r.status_code == 200, r.text
                leases.append(r.json()["lease"])
            *evals, training = leases
            for ls in evals:  # the same fields and values as a training lease but for ids, prompts and seeds
                assert ls.keys() == training.keys()
                for key in ("samples_per_prompt", "sampling", "policy_version", "min_policy_version",
                    "generation_version"):
                    assert ls[key] == training[key], key
                assert len(ls["prompts"]) == len(training["prompts"])
                sub = make_submission(LeaseResponse.model_validate({"lease": ls}).lease, rng)
                r = client.post(api.SUBMIT.path, content=encode(sub), headers={**auth,
                    "Content-Type": "application/json"})
                assert r.status_code == 200, r.text
            deadline = time.time() + 30
            while True:
                st = RunStatus.model_validate_json(client.get(api.STATUS.path, headers=admin).content)
                metrics = client.get("/metrics", headers=admin).text
                if (st.eval_latest is not None
                    and f"swarmrl_eval_avg_reward {st.eval_latest.avg_reward}" in metrics) or time.time() > deadline:
                    break
                time.sleep(0.2)
            assert st.eval_latest is not None and st.eval_latest.complete and st.eval_latest.prompts == 4
            assert st.submissions_accepted == 2 and st.buffer_depth == 0
            assert f"swarmrl_eval_avg_reward {st.eval_latest.avg_reward}" in metrics
            assert 'swarmrl_eval_pass_at_k{k="4"}' in metrics
    finally:
        srv.stop()
