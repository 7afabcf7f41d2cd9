"""The Verifier service end to end on a tiny model: verdicts, rewards, LRU, spot checks, bad input.

Rollouts here come from transformers (sampling) with proofs from the reference prefill, which is what
an honest worker on a transformers engine would send; the vLLM path is covered by the attack matrix.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from protocol.models import Completion, FinishReason, RejectionCode, RewardStatus, RolloutSubmission, SamplingParams, TaskLease, TaskPrompt, VerdictStatus
from verifier import proofs
from verifier.config import VerifierConfig
from verifier.reference import load_reference_model, prefill
from verifier.service import Verifier, VerifyJob
from verifier.tasks import get_task

HASH0, HASH1 = "a" * 64, "b" * 64
SAMPLING = SamplingParams(temperature=1.0, max_tokens=40)


@pytest.fixture(scope="module")
def versions(tiny_model_dir, tmp_path_factory):
    from trainer.tiny_model import init_model

    return {0: tiny_model_dir, 1: init_model(tmp_path_factory.mktemp("v1"), "tiny", seed=7)}


@pytest.fixture(scope="module")
def honest(tiny_model_dir):
    """Four prompts x two samples of honest rollouts from version 0, as a worker would submit them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_reference_model(tiny_model_dir, None, "float32")
    items = get_task("toy").make_prompts(4, seed=1)
    prompts = [np.array([tok.bos_token_id] + tok.encode(i.prompt, add_special_tokens=False), dtype=np.int32) for i in items]
    torch.manual_seed(0)
    # Toy prompts have equal lengths, so all samples are generated in one batch; cut at the first EOS.
    batch = torch.tensor([p.tolist() for p in prompts for _ in range(2)])
    out = model.generate(batch, do_sample=True, max_new_tokens=SAMPLING.max_tokens, pad_token_id=0, eos_token_id=2,
                         top_k=None, top_p=None)[:, batch.shape[1]:].numpy().astype(np.int32)
    seqs = []
    for row in out:
        end = np.flatnonzero(row == 2)
        seqs.append(row[: end[0] + 1] if end.size else row)
    refs = prefill(model, [(prompts[i // 2], c) for i, c in enumerate(seqs)], [SAMPLING] * len(seqs), 0.0)
    completions = []
    for i, (c, ref) in enumerate(zip(seqs, refs)):
        reason = FinishReason.stop if c[-1] == 2 else FinishReason.length
        completions.append(Completion(prompt_index=i // 2, sample_index=i % 2, token_ids=c, logprobs=ref.stats.logprob.astype(np.float32),
                                      finish_reason=reason, proofs=proofs.build_proofs(ref.hidden)))
    lease = TaskLease(lease_id="L1", prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=p, seeds=[1, 2]) for i, p in enumerate(prompts)],
                      samples_per_prompt=2, sampling=SAMPLING, policy_version=0, min_policy_version=0, deadline=time.time() + 60)
    return lease, items, completions


def job(honest, *, completions=None, version=0, model_hash=HASH0, lease=None, sid="s1", trust="new", items=None):
    lease0, items0, comps = honest
    sub = RolloutSubmission(lease_id=(lease or lease0).lease_id, policy_version=version, model_hash=model_hash,
                            completions=completions if completions is not None else comps)
    return VerifyJob(submission_id=sid, submission=sub, lease=lease or lease0, items=items if items is not None else items0,
                     task_name="toy", expected_model_hash={0: HASH0, 1: HASH1}[version], trust_level=trust)


@pytest.fixture(scope="module")
def verifier(versions, tiny_model_dir):
    return Verifier(VerifierConfig(keep_versions=1), lambda v: versions[v], tiny_model_dir)


def test_honest_submission_is_accepted_with_trusted_rewards(verifier, honest):
    verdict = verifier.verify(job(honest))
    assert verdict.status == VerdictStatus.accepted, verdict.rejections
    _, items, comps = honest
    task = get_task("toy")
    expected = [task.reward(items[c.prompt_index], verifier.decode(c.token_ids)) for c in comps]
    assert verdict.rewards == pytest.approx(expected)
    assert verdict.verified_tokens == sum(c.token_ids.size for c in comps)
    assert set(verifier.decode(comps[0].token_ids)) <= set(verifier.tokenizer.convert_ids_to_tokens(list(range(3, 54))))


def test_claimed_version_is_the_one_checked_and_lru_keeps_k(verifier, honest):
    verdict = verifier.verify(job(honest, version=1, model_hash=HASH1))
    assert verdict.status == VerdictStatus.rejected
    assert {r.code for r in verdict.rejections} >= {RejectionCode.proof_mismatch, RejectionCode.logprob_mismatch}
    assert verifier.loaded_versions() == [1]  # keep_versions=1 evicted version 0
    mism = next(r for r in verdict.rejections if r.code == RejectionCode.proof_mismatch)
    assert mism.chunk_index == 0 and mism.stats["exponent_mismatches"] > 4


def test_structural_rejections(verifier, honest):
    lease, items, comps = honest
    v = verifier.verify(job(honest, model_hash="c" * 64))
    assert [r.code for r in v.rejections] == [RejectionCode.wrong_model_hash]
    other_lease = lease.model_copy(update={"lease_id": "L2"})
    sub_job = job(honest)
    sub_job.lease = other_lease
    assert verifier.verify(sub_job).rejections[0].code == RejectionCode.lease_mismatch
    bad = comps[0].model_copy(update={"prompt_index": 9})
    v = verifier.verify(job(honest, completions=[bad]))
    assert v.status == VerdictStatus.rejected and v.rejections[0].completion_index == 0
    high = lease.model_copy(update={"min_policy_version": 1, "policy_version": 1})
    v = verifier.verify(job(honest, lease=high))
    assert "below the lease minimum" in v.rejections[0].message
    v = verifier.verify(job(honest, items=items[:2]))
    assert v.status == VerdictStatus.rejected and v.rewards is None


def test_batch_of_jobs_judged_independently(verifier, honest):
    _, _, comps = honest
    forged = comps[1].model_copy(update={"logprobs": comps[1].logprobs * np.float32(0.5)})
    lie = comps[2].model_copy(update={"finish_reason": FinishReason.length if comps[2].finish_reason == FinishReason.stop else FinishReason.stop})
    verdicts = verifier.verify_many([job(honest, sid="a"), job(honest, completions=[comps[0], forged], sid="b"),
                                     job(honest, completions=[lie], sid="c")])
    assert [v.submission_id for v in verdicts] == ["a", "b", "c"]
    assert [v.status for v in verdicts] == [VerdictStatus.accepted, VerdictStatus.rejected, VerdictStatus.rejected]
    # The forged completion fails per token, and drags the submission's mean over its limit too.
    assert {(r.code, r.completion_index) for r in verdicts[1].rejections} == {(RejectionCode.logprob_mismatch, 1), (RejectionCode.logprob_mismatch, None)}
    assert verdicts[2].rejections[0].code == RejectionCode.bad_termination


def test_spot_check_rate_per_trust_level(versions, tiny_model_dir, honest):
    _, _, comps = honest
    forged = comps[0].model_copy(update={"logprobs": comps[0].logprobs * np.float32(0.5)})
    ver = Verifier(VerifierConfig(spot_check_rate={"new": 1.0, "trusted": 0.0}), lambda v: versions[v], tiny_model_dir)
    assert ver.verify(job(honest, completions=[forged], trust="new")).status == VerdictStatus.rejected
    # Not spot-checked: accepted without a prefill (the documented risk of rate < 1) ...
    assert ver.verify(job(honest, completions=[forged], trust="trusted")).status == VerdictStatus.accepted
    assert ver.loaded_versions() == [0]
    # ... but termination, which needs no model, is still checked.
    lie = comps[0].model_copy(update={"finish_reason": FinishReason.length if comps[0].finish_reason == FinishReason.stop else FinishReason.stop})
    assert ver.verify(job(honest, completions=[lie], trust="trusted")).status == VerdictStatus.rejected
    half = Verifier(VerifierConfig(spot_check_rate={"trusted": 0.5}), lambda v: versions[v], tiny_model_dir)
    checked = sum(half._spot_checked(job(honest, sid=f"s{i}", trust="trusted")) for i in range(200))
    assert 60 < checked < 140
    assert all(half._spot_checked(job(honest, sid=f"s{i}", trust="unknown-level")) for i in range(20))


def test_missing_version_is_a_clear_rejection(tiny_model_dir, honest, tmp_path):
    ver = Verifier(VerifierConfig(), lambda v: tmp_path / "nothing-here", tiny_model_dir)
    v = ver.verify(job(honest))
    assert v.status == VerdictStatus.rejected and "unavailable" in v.rejections[0].message


def test_cli_check_verifies_a_saved_bundle(tiny_model_dir, honest, tmp_path):
    import json

    from typer.testing import CliRunner

    from swarmrl.verifier_cli import app

    lease, items, comps = honest
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash=HASH0, completions=comps)
    bundle = {"lease": json.loads(lease.model_dump_json()), "submission": json.loads(sub.model_dump_json()),
              "items": [{"prompt": i.prompt, "answer": i.answer} for i in items], "task": "toy"}
    good = tmp_path / "good.json"
    good.write_text(json.dumps(bundle))
    runner = CliRunner()
    res = runner.invoke(app, ["check", str(good), "--model-dir", str(tiny_model_dir)])
    assert res.exit_code == 0, res.output
    assert '"accepted"' in res.output
    forged = json.loads(json.dumps(bundle))
    forged["submission"]["completions"][0]["finish_reason"] = "length" if comps[0].finish_reason == FinishReason.stop else "stop"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(forged))
    res = runner.invoke(app, ["check", str(bad), "--model-dir", str(tiny_model_dir)])
    assert res.exit_code == 1 and "bad_termination" in res.output
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    res = runner.invoke(app, ["check", str(broken), "--model-dir", str(tiny_model_dir)])
    assert res.exit_code == 2 and "cannot read" in res.output


def test_rewards_run_sandboxed_and_their_failures_are_reported_per_completion(versions, tiny_model_dir, honest, tmp_path):
    """A reward that returns NaN, raises, or runs forever never reaches the trainer as anything but 0, and
    never leaves a submission without a verdict: each completion's reward status says what happened
    (error: the run's reward code is at fault; timed_out: counted against the worker by the orchestrator)."""
    from verifier.reward_config import RewardPoolConfig

    (tmp_path / "user_rewards.py").write_text(
        "import math, time\n"
        "def nan(text, item):\n    return math.nan\n"
        "import os\n"
        f"MARK = {str(tmp_path / 'slept')!r}\n"
        "def slow_once(text, item):\n"
        "    if item.prompt_id == 'q0' and not os.path.exists(MARK):\n"
        "        open(MARK, 'w').close()\n"
        "        time.sleep(60)\n"
        "    return 1.0\n"
    )
    cfg = VerifierConfig(keep_versions=1, rewards=RewardPoolConfig(processes=1, time_limit_s=1.0, import_paths=[str(tmp_path)]))
    v = Verifier(cfg, lambda ver: versions[ver], tiny_model_dir)
    try:
        lease, items, comps = honest
        items = [dataclasses.replace(it, prompt_id=f"q{i}") for i, it in enumerate(items)]
        nan = v.verify(dataclasses.replace(job(honest, sid="nan", items=items), task_name="user_rewards:nan"))
        assert nan.status == VerdictStatus.accepted and nan.rewards == [0.0] * len(comps)
        assert nan.reward_status == [RewardStatus.error] * len(comps)
        slow = v.verify(dataclasses.replace(job(honest, sid="slow", items=items), task_name="user_rewards:slow_once"))
        assert slow.status == VerdictStatus.accepted
        assert slow.reward_status.count(RewardStatus.timed_out) == 1  # the one slow completion, killed at the limit
        timed_out = slow.reward_status.index(RewardStatus.timed_out)
        assert comps[timed_out].prompt_index == 0 and slow.rewards[timed_out] == 0.0
        assert all(r == 1.0 and st == RewardStatus.ok for i, (r, st) in enumerate(zip(slow.rewards, slow.reward_status)) if i != timed_out)
    finally:
        v.close()
