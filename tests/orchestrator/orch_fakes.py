"""Test doubles for orchestrator logic tests: a verifier that skips the proof check (but scores with the
real task rewards), and simulated workers' submissions. Never used outside tests/orchestrator."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.service import Orchestrator
from orchestrator.verification import default_make_job as make_job
from protocol import limits
from protocol.models import (
    Completion,
    FinishReason,
    RolloutSubmission,
    TaskLease,
)
from protocol.verdicts import (
    Rejection,
    RejectionCode,
    Verdict,
    VerdictStatus,
)
from swarmrl.config import RunConfig
from trainer.tiny_model import make_tokenizer

HASH0 = "0" * 64
HASH1 = "1" * 64
BAD_PROOF = b"BAD"




class FakeVerifier:
    """Accepts unless the model hash is wrong or a proof starts with BAD_PROOF; rewards are the real
    task's rewards of the decoded completions. Counts what it was asked to verify."""

    def __init__(self, task_name: str = "toy"):
        from environments.tasks import get_task

        self.task = get_task(task_name)
        self.tok = make_tokenizer()
        self.jobs_seen = 0
        self.fail_next = 0
        self._lock = threading.Lock()

    def verify_many(self, jobs: list[Any]) -> list[Verdict]:
        with self._lock:
            self.jobs_seen += len(jobs)
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("verifier actor died (test)")
        out = []
        for job in jobs:
            sub: RolloutSubmission = job.submission
            if sub.model_hash != job.expected_model_hash:
                out.append(Verdict(submission_id=job.submission_id, status=VerdictStatus.rejected,
                                   rejections=[Rejection(code=RejectionCode.wrong_model_hash, message="hash")]))
                continue
            bad = [i for i, c in enumerate(sub.completions) if any(p.startswith(BAD_PROOF) for p in c.proofs)]
            if bad:
                out.append(Verdict(submission_id=job.submission_id, status=VerdictStatus.rejected,
                                   rejections=[Rejection(code=RejectionCode.proof_mismatch, message="proof",
                                   completion_index=bad[0])]))
                continue
            rewards = [self.task.reward(job.items[c.prompt_index], self.tok.decode(c.token_ids.tolist(),
                skip_special_tokens=True))
                       for c in sub.completions]
            # The trusted behaviour logprobs: distinguishable from the worker's, to show which ones are kept.
            out.append(Verdict(submission_id=job.submission_id, status=VerdictStatus.accepted, rewards=rewards,
                               verified_tokens=sub.num_tokens, behaviour_logprobs=[trusted_logprobs(c)
                               for c in sub.completions]))
        return out


def trusted_logprobs(c) -> np.ndarray:
    """What FakeVerifier reports as its own recomputation of a completion's behaviour logprobs."""
    return (c.logprobs - np.float32(0.25)).astype(np.float32)


def make_submission(lease: TaskLease, rng: np.random.Generator, *, policy_version: int | None = None,
                    model_hash: str = HASH0, bad: bool = False, same_tokens: bool = False,
                    lease_id: str | None = None) -> RolloutSubmission:
    """A submission covering the lease: random digit/letter tokens (so rewards vary within a group),
    or the same tokens for every sample when `same_tokens` (a zero-signal group)."""
    if policy_version is None:  # the version the lease was issued for
        policy_version = lease.policy_version if lease.generation_version is None else lease.generation_version
    comps = []
    fixed = rng.integers(3, 13, size=4)
    for p in range(len(lease.prompts)):
        for s in range(lease.samples_per_prompt):
            n = 4 if same_tokens else int(rng.integers(1, lease.sampling.max_tokens + 1))
            ids = fixed if same_tokens else rng.integers(3, 40, size=n)
            proofs = [(BAD_PROOF if bad else b"") + rng.bytes(limits.MAX_PROOF_BYTES - (3 if bad else 0))
                      for _ in range(math.ceil(n / limits.PROOF_CHUNK_TOKENS))]
            comps.append(Completion(prompt_index=p, sample_index=s, token_ids=ids,
                                    logprobs=-rng.random(n).astype(np.float32), finish_reason=FinishReason.length,
                                    proofs=proofs))
    return RolloutSubmission(lease_id=lease_id or lease.lease_id,
                             policy_version=policy_version,
                             model_hash=model_hash, completions=comps)


def run_config(tmp: Path, **orch: Any) -> RunConfig:
    base = dict(samples_per_prompt=4, prompts_per_lease=2, lease_timeout_s=30.0, rate_limit_per_s=1000.0,
                max_open_leases_per_worker=2, strikes_to_ban=2, request_timeout_s=10.0,
                db_path=str(tmp / "orchestrator.sqlite"), port=0,
                new_worker_tokens_per_s=1e9)  # simulated workers are instant: a lease lasts lease_timeout_s
    base.update(orch)
    return RunConfig.model_validate({"name": "test", "output_dir": str(tmp), "seed": 7,
                                     "data": {"task": "toy", "num_prompts": 32},
                                     "orchestrator": {"sampling": {"max_tokens": 8, "temperature": 1.0}, **base}})


def make_prompts(config: RunConfig) -> PromptSet:
    from environments.tasks import get_task

    items = get_task(config.data.task).make_prompts(config.data.num_prompts, config.seed)
    return PromptSet.from_items(items, make_tokenizer(), config.seed, vocab_size=64)


def make_orchestrator(config: RunConfig, verifier: Any = None, base_model_dir: Path | None = None) -> Orchestrator:
    orch = Orchestrator(
        config.orchestrator, Database(config.orchestrator.db_path), make_prompts(config), verifier or FakeVerifier(),
        shape=config.step_shape(), task_name=config.data.task, run_name=config.name, make_job=make_job, verify_batch=8,
        evaluation=config.eval, base_model_dir=base_model_dir,
    )
    orch.versions.announce({0: HASH0})
    return orch


def encode(sub: RolloutSubmission) -> bytes:
    return sub.model_dump_json().encode()
