"""The verifier service: checks submissions against a trusted prefill and computes their rewards.

Pure Python (no Ray): the orchestrator wraps `Verifier` in Ray actors. For each submission:

1. structural checks: the lease id, the prompt / sample indices, the claimed model hash and version;
2. spot check: a submission from a worker of trust level L is verified with probability
   `spot_check_rate[L]` (default 1: everything); the draw is seeded by the submission id;
3. one batched transformers prefill per policy version over every completion of every job;
4. per completion: termination, TOPLOC-style proofs, reported logprobs, and the replay of every seeded
   draw (each token must be what the leased seed draws on our logits, up to a calibrated near tie);
   Multi-turn episodes (a lease with an environment, verifier/episodes.py): the prefill runs over prompt
   + whole episode, the seed replay, proofs and logprob checks cover the model positions only (a model
   token's draw position is its index in the episode), and the environment is replayed from the trusted
   item: every environment position must be its reply, every turn must end as the rules say. Its tool
   calls run in the sandboxed reward pool (time limit per call), batched for all jobs before the checks;
5. accepted submissions get trusted rewards from the decoded completion text, computed in a pool of
   sandboxed processes with a time limit per completion (verifier/reward_pool.py), and the trusted
   behaviour logprobs (ours, tempered) that the trainer learns from.

Every rejection names its reason and carries the statistics behind it.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from environments.tasks import TaskItem
from protocol import limits, memory
from protocol.models import (
    RolloutSubmission,
    TaskLease,
)
from protocol.verdicts import (
    Rejection,
    RejectionCode,
    RewardStatus,
    Verdict,
    VerdictStatus,
)
from verifier import checks, episodes, proofs
from verifier.config import VerifierConfig
from verifier.reference import eos_token_ids, load_reference_model, prefill
from verifier.reward_pool import RewardPool
from verifier.reward_requests import RewardRequest, RewardResult

log = logging.getLogger(__name__)

MAX_REJECTIONS_PER_COMPLETION = 4


@dataclass
class VerifyJob:
    submission_id: str
    submission: RolloutSubmission
    lease: TaskLease
    items: list[TaskItem]  # one per lease prompt, for rewards
    task_name: str
    expected_model_hash: str
    task_params: dict[str, Any] = field(default_factory=dict)
    trust_level: str = "new"


# The trusted side's tool runs: {(submission id, completion index): {model turn: the pool's result}}.
ToolRuns = dict[tuple[str, int], dict[int, RewardResult]]


@dataclass
class Replayed:
    """A spot-checked submission's trusted numbers: per completion (submission order) our tempered
    logprobs of its tokens, and its near ties."""

    logprobs: list[np.ndarray | None]
    near_ties: int = 0
    max_margin: float = 0.0
    choices: int = 0  # positions where more than one token would pass



def decode_completion(tokenizer: Any, eos_ids: set[int], token_ids: np.ndarray) -> str:
    """The text a completion's reward is computed on (also `swarmrl eval`'s): without its final EOS."""
    ids = [int(t) for t in token_ids]
    if ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    vocab = len(tokenizer)
    ids = [t for t in ids if t < vocab]  # padded-vocabulary ids decode to nothing
    return tokenizer.decode(ids, skip_special_tokens=True)

class Verifier:
    def __init__(self, config: VerifierConfig, weights_for_version: Callable[[int], Path], tokenizer_dir: Path):
        from transformers import AutoTokenizer

        self.config = config
        self.tolerances = config.tolerances()
        self.weights_for_version = weights_for_version
        self.tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self.eos_ids = eos_token_ids(self.tokenizer_dir)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self._models: OrderedDict[int, Any] = OrderedDict()
        self.rewards = RewardPool(config.rewards)
        self.vocab_size: int | None = None
        self._environments: dict[str, Any] = {}
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    # ------------------------------------------------------------------------------------------
    def model(self, version: int):
        """The reference model of a policy version, loaded on first use; the last K stay loaded."""
        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version]
        started = time.perf_counter()
        model = load_reference_model(self.tokenizer_dir, self.weights_for_version(version), self.config.dtype,
            self.config.device)
        self.vocab_size = int(model.config.vocab_size)
        self._models[version] = model
        while len(self._models) > self.config.keep_versions:
            evicted, _ = self._models.popitem(last=False)
            log.info("evicted policy version %d", evicted)
        memory.trim()  # the float32 build and the evicted version, freed
        log.info("loaded policy version %d in %.2fs", version, time.perf_counter() - started)
        return model

    def loaded_versions(self) -> list[int]:
        return list(self._models)

    def decode(self, token_ids: np.ndarray) -> str:
        return decode_completion(self.tokenizer, self.eos_ids, token_ids)

    # ------------------------------------------------------------------------------------------
    def verify(self, job: VerifyJob) -> Verdict:
        return self.verify_many([job])[0]

    def verify_many(self, jobs: Sequence[VerifyJob]) -> list[Verdict]:
        rejections: list[list[Rejection]] = [self._structural(job) for job in jobs]
        replayed: list[Replayed | None] = [None] * len(jobs)
        tools = self._run_tools([job for i, job in enumerate(jobs) if not rejections[i]])
        deep = [i for i, job in enumerate(jobs) if not rejections[i] and self._spot_checked(job)]
        for i in set(range(len(jobs))) - set(deep):
            if not rejections[i]:  # not spot-checked: only the checks that need no model
                rejections[i].extend(self._termination(jobs[i], tools))
        by_version: dict[int, list[int]] = {}
        for i in deep:
            by_version.setdefault(jobs[i].submission.policy_version, []).append(i)
        for version, idx in by_version.items():
            try:
                model = self.model(version)
            except (FileNotFoundError, KeyError, ValueError) as exc:
                for i in idx:
                    rejections[i].append(Rejection(code=RejectionCode.lease_mismatch,
                        message=f"policy version {version} unavailable: {exc}"[: limits.MAX_MESSAGE_CHARS]))
                continue
            for i, r in zip(idx, self._deep_check(model, [jobs[i] for i in idx], [rejections[i] for i in idx], tools)):
                replayed[i] = r
        return self._verdicts(jobs, rejections, replayed)

    # ------------------------------------------------------------------------------------------
    def _structural(self, job: VerifyJob) -> list[Rejection]:
        sub, lease = job.submission, job.lease
        out: list[Rejection] = []
        if sub.lease_id != lease.lease_id:
            out.append(Rejection(code=RejectionCode.lease_mismatch,
                message=f"submission is for lease {sub.lease_id}, not {lease.lease_id}"))
        if len(job.items) != len(lease.prompts):
            out.append(Rejection(code=RejectionCode.lease_mismatch,
                message=f"{len(job.items)} task items for {len(lease.prompts)} lease prompts"))
        if sub.policy_version < lease.min_policy_version:
            out.append(Rejection(code=RejectionCode.lease_mismatch,
                message=f"policy version {sub.policy_version} is below the lease minimum {lease.min_policy_version}"))
        if lease.generation_version is not None and sub.policy_version != lease.generation_version:
            out.append(Rejection(code=RejectionCode.lease_mismatch,
                                 message=f"generated with version {sub.policy_version}; the lease was issued for "
                                 f"version {lease.generation_version}"))
        if sub.model_hash != job.expected_model_hash:
            out.append(Rejection(code=RejectionCode.wrong_model_hash,
                message=f"model hash {sub.model_hash[:12]}... is not the hash of version {sub.policy_version}"))
        for ci, c in enumerate(sub.completions):
            if c.prompt_index >= len(lease.prompts) or c.sample_index >= lease.samples_per_prompt:
                out.append(Rejection(code=RejectionCode.lease_mismatch, completion_index=ci,
                                     message=f"prompt {c.prompt_index} / sample {c.sample_index} is not in the lease"))
            elif (c.env_mask is None) != (lease.environment is None):
                out.append(Rejection(code=RejectionCode.lease_mismatch, completion_index=ci,
                                     message="a multi-turn episode for a single-turn lease"
                                     if lease.environment is None else
                                     f"a single-turn completion for a lease of environment {lease.environment!r}"))
        if lease.environment is not None and not out:
            try:
                self.environment(lease.environment)
            except ValueError as exc:
                out.append(Rejection(code=RejectionCode.lease_mismatch, message=str(exc)[: limits.MAX_MESSAGE_CHARS]))
        return out

    def environment(self, name: str):
        """The trusted copy of an environment, made once (with this verifier's tokenizer)."""
        from environments.registry import environment_for

        if name not in self._environments:
            self._environments[name] = environment_for(name, self.tokenizer, sorted(self.eos_ids))
        return self._environments[name]

    def _run_tools(self, jobs: Sequence[VerifyJob]) -> "ToolRuns":
        """Every tool call of every episode in `jobs`, run in the sandboxed pool in one batch (a time limit
        per call, a failure budget per submission): {(submission id, completion index): {turn: result}}."""
        from environments.registry import TOOL_ENTRY, tool_text

        requests, owners = [], []
        for job in jobs:
            if job.lease.environment is None:
                continue
            env = self.environment(job.lease.environment)
            params = {"environment": job.lease.environment}
            for ci, c in enumerate(job.submission.completions):
                seed = job.lease.prompts[c.prompt_index].seeds[c.sample_index]
                for turn, call in episodes.tool_calls(env, c):
                    requests.append(RewardRequest(TOOL_ENTRY, job.items[c.prompt_index], tool_text(call, seed), params,
                        job.submission_id, returns="text"))
                    owners.append((job.submission_id, ci, turn))
        runs: ToolRuns = {}
        for (sid, ci, turn), result in zip(owners, self.rewards.score_many(requests) if requests else []):
            runs.setdefault((sid, ci), {})[turn] = result
        return runs

    def _end_check(self, job: VerifyJob, c, ci: int, tools: "ToolRuns") -> checks.Finding | None:
        """A completion's termination; for an episode, every turn's and the environment's replay."""
        if c.env_mask is None:
            return checks.check_termination(c.token_ids, c.finish_reason, job.lease.sampling, self.eos_ids)
        seed = job.lease.prompts[c.prompt_index].seeds[c.sample_index]
        return episodes.check_episode(self.environment(job.lease.environment), job.items[c.prompt_index], seed, c,
                                      job.lease.sampling, self.eos_ids, tools.get((job.submission_id, ci), {}))

    def _termination(self, job: VerifyJob, tools: "ToolRuns") -> list[Rejection]:
        out = []
        for ci, c in enumerate(job.submission.completions):
            f = self._end_check(job, c, ci, tools)
            if f:
                out.append(Rejection(code=RejectionCode(f.code), message=f.message, stats=f.stats, completion_index=ci))
        return out

    def _spot_checked(self, job: VerifyJob) -> bool:
        rate = self.config.spot_check_rate.get(job.trust_level, 1.0)
        if rate >= 1.0:
            return True
        seed = int.from_bytes(hashlib.sha256(job.submission_id.encode()).digest()[:8], "little")
        return random.Random(seed).random() < rate

    def _deep_check(self, model, jobs: list[VerifyJob], rejections: list[list[Rejection]],
        tools: "ToolRuns") -> list["Replayed"]:
        tol = self.tolerances
        sequences, sampling, seeds, where = [], [], [], []
        for j, job in enumerate(jobs):
            for ci, c in enumerate(job.submission.completions):
                if c.token_ids.size and int(c.token_ids.max()) >= self.vocab_size:
                    rejections[j].append(Rejection(code=RejectionCode.lease_mismatch, completion_index=ci,
                                                   message=f"token id {int(c.token_ids.max())} outside the vocabulary "
                                                   f"of {self.vocab_size}"))
                    continue
                prompt = job.lease.prompts[c.prompt_index]
                sequences.append((prompt.token_ids, c.token_ids))
                sampling.append(job.lease.sampling)
                seeds.append(prompt.seeds[c.sample_index])
                where.append((j, ci))
        results = prefill(model, sequences, sampling, self.config.max_batch_tokens, self.pad_id,
                          seeds=seeds, draw_slack=(tol.draw_top_p_slack, tol.draw_logit_slack, tol.draw_margin_rel),
                          draw_margin=(tol.draw_margin, tol.draw_margin_rel))
        out = [Replayed([None] * len(job.submission.completions)) for job in jobs]
        diff_sums, diff_tokens = [0.0] * len(jobs), [0] * len(jobs)
        for (j, ci), ref in zip(where, results):
            c = jobs[j].submission.completions[ci]
            found, diff, drawn = self._check_completion(c, ci, ref, jobs[j], tools)
            for r in found[:MAX_REJECTIONS_PER_COMPLETION]:
                rejections[j].append(r.model_copy(update={"completion_index": ci}))
            if diff is not None:
                diff_sums[j] += float(diff.sum())
                diff_tokens[j] += int(diff.size)
            out[j].near_ties += drawn.near_ties
            out[j].choices += drawn.choices
            out[j].max_margin = max(out[j].max_margin, drawn.max_margin)
            out[j].logprobs[ci] = ref.stats.tempered_logprob.astype(np.float32)
        for j in range(len(jobs)):
            if diff_tokens[j]:
                f = checks.check_logprob_mean(diff_sums[j], diff_tokens[j], tol.logprob_max_mean_diff)
                if f:
                    rejections[j].append(Rejection(code=RejectionCode(f.code), message=f.message, stats=f.stats))
        return out

    def _check_completion(self, c, ci: int, ref, job: VerifyJob, tools: "ToolRuns") -> tuple[list[Rejection],
        np.ndarray | None, checks.DrawReport]:
        """The completion's own findings, its per-token |logprob diff| for the submission's mean, and
        what the replay of its draws found. An episode's prefill covers all its positions; the proofs,
        logprobs and draws are checked on the model's positions only."""
        tol = self.tolerances
        out: list[Rejection] = []
        term = self._end_check(job, c, ci, tools)
        if term:
            out.append(Rejection(code=RejectionCode(term.code), message=term.message, stats=term.stats))
        token_ids = c.token_ids
        if c.env_mask is not None:
            pos = c.model_positions
            token_ids = np.asarray(c.token_ids)[pos]
            ref = type(ref)(hidden=ref.hidden[torch.from_numpy(pos)],
                            stats=checks.TokenStats(ref.stats.logprob[pos], ref.stats.tempered_logprob[pos]),
                            draw=ref.draw.take(pos))
        chunk_checks = proofs.check_proofs(c.proofs, ref.hidden, tol.proof)
        for cc in chunk_checks:
            if not cc.ok:
                code = RejectionCode.proof_malformed if cc.reason.startswith(("malformed", "proof missing",
                    "proof for")) else RejectionCode.proof_mismatch
                out.append(Rejection(code=code, chunk_index=cc.chunk_index,
                    message=f"chunk {cc.chunk_index}: {cc.reason}", stats=cc.stats()))
                break  # one failing chunk is enough; its stats say why
        diff = checks.logprob_diffs(c.logprobs, ref.stats)
        lp = diff if isinstance(diff, checks.Finding) else checks.check_logprob_max(diff, tol.logprob_max_abs_diff)
        if lp:
            out.append(Rejection(code=RejectionCode(lp.code), message=lp.message, stats=lp.stats))
        drawn = checks.check_draws(ref.draw, token_ids, tol.draw_margin, tol.draw_margin_rel)
        if drawn.finding:
            out.append(Rejection(code=RejectionCode(drawn.finding.code), message=drawn.finding.message,
                stats=drawn.finding.stats))
        return out, None if isinstance(diff, checks.Finding) else diff, drawn

    def _verdicts(self, jobs: Sequence[VerifyJob], rejections: list[list[Rejection]],
        replayed: list["Replayed | None"]) -> list[Verdict]:
        """Rejected jobs keep their reasons; the others get trusted rewards, every completion of every
        job scored in one call to the sandboxed reward pool (a time limit per completion), and, when
        spot-checked, our behaviour logprobs and near ties."""
        requests, owners = [], []
        for j, job in enumerate(jobs):
            if rejections[j]:
                continue
            for c in job.submission.completions:
                requests.append(self._reward_request(job, c))
                owners.append(j)
        results = self.rewards.score_many(requests) if requests else []
        per_job: dict[int, list[RewardResult]] = {}
        for j, r in zip(owners, results):
            per_job.setdefault(j, []).append(r)
        out = []
        for j, job in enumerate(jobs):
            if rejections[j]:
                out.append(Verdict(submission_id=job.submission_id, status=VerdictStatus.rejected,
                    rejections=rejections[j][:1024], verified_tokens=0))
                continue
            scored = per_job.get(j, [])
            status = [RewardStatus(r.status.value) for r in scored]
            rep = replayed[j]
            out.append(Verdict(
                submission_id=job.submission_id, status=VerdictStatus.accepted, rewards=[r.reward for r in scored],
                reward_status=None if all(s is RewardStatus.ok for s in status) else status,
                verified_tokens=job.submission.model_tokens, near_ties=rep.near_ties if rep else 0,
                max_draw_margin=rep.max_margin if rep else 0.0,
                near_tie_allowance=self.tolerances.deviation_rate * rep.choices if rep else 0.0,
                behaviour_logprobs=rep.logprobs if rep else None,
            ))
        return out

    def _reward_request(self, job: VerifyJob, c) -> RewardRequest:
        item = job.items[c.prompt_index]
        if c.env_mask is None:
            ids = list(map(int, c.token_ids)) if self.rewards.config.style == "trl" else None  # TRL's completion_ids
            return RewardRequest(job.task_name, item, self.decode(c.token_ids), job.task_params, job.submission_id,
                                 completion_ids=ids)
        # An episode: the environment's reward from the replayed final state (its answer turn and a summary
        # of the episode), run in the sandboxed pool like any task's.
        from environments.registry import REWARD_ENTRY, reward_text

        env = self.environment(job.lease.environment)
        ids, mask = np.asarray(c.token_ids), np.asarray(c.env_mask)
        a, b = env.answer_span(mask)
        text = reward_text(self.decode(ids[a:b]), env.final_state(ids, mask))
        return RewardRequest(REWARD_ENTRY, item, text, {"environment": job.lease.environment}, job.submission_id)

    def close(self) -> None:
        """Stop the reward processes (also done when the verifier is garbage-collected)."""
        self.rewards.close()
