"""What a verdict changes, worked out before its transaction (CPU work only, no state): for an accepted
training submission the rewards the run counts and its GRPO groups (orchestrator/buffer.py), for an
accepted eval submission its per-prompt results (orchestrator/evaluation.py), and the rewards the trusted
side could not compute (orchestrator/reward_failures.py). An accepted verdict with unusable rewards is
turned into a rejection (no strike), so that no submission stays pending forever.
orchestrator/verification.py records the result.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from orchestrator import reward_failures
from orchestrator.admission import Pending
from orchestrator.buffer import Groups, build_groups
from orchestrator.evaluation import per_prompt_results
from protocol.verdicts import Rejection, RejectionCode, Verdict, VerdictStatus

log = logging.getLogger(__name__)


@dataclass
class Applied:
    submission_id: str
    worker_id: str
    verdict: Verdict
    accepted: bool
    rewards: list[float]
    groups: Groups | None
    num_tokens: int = 0  # the submission's generated tokens (what the verifier's throughput counts)
    # an accepted eval submission: (version, held-out prompt index -> (rewards, completion lengths))
    evaluation: tuple[int, dict[int, tuple[list[float], list[int]]]] | None = None
    failures: tuple[str, dict[str, int]] = ("", {})  # rewards not computed: (reward, kind -> completions)
    scored_prompts: tuple[int, ...] = ()  # training: the prompt index of each of `rewards` (a curriculum's input)


def prepare(submission_id: str, p: Pending, v: Verdict, *, task_name: str, advantage_std: bool) -> Applied:
    v = v.model_copy(update={"submission_id": submission_id})
    if v.status != VerdictStatus.accepted:
        return Applied(submission_id, p.worker_id, v, False, [], None, p.submission.num_tokens)
    rewards = list(v.rewards or [])
    failures = (reward_failures.reward_name(task_name, p.lease), reward_failures.kinds(v))
    if p.eval_version is not None:  # scored for the evaluation; never a training group
        if len(rewards) != len(p.submission.completions) or not all(map(math.isfinite, rewards)):
            v = Verdict(submission_id=submission_id, status=VerdictStatus.rejected,
                        rejections=[Rejection(code=RejectionCode.reward_error,
                        message="unusable rewards for an eval lease")])
            return Applied(submission_id, p.worker_id, v, False, [], None, p.submission.num_tokens)
        per_prompt = per_prompt_results(p.prompt_indices, p.submission.completions, rewards)
        return Applied(submission_id, p.worker_id, v, True, rewards, None, p.submission.num_tokens,
            (p.eval_version, per_prompt), failures)
    unscored = reward_failures.unscored(v)
    try:  # a group with an unscored completion is dropped, like a zero-signal one
        groups = build_groups(submission_id, p.submission, p.lease, rewards, advantage_std,
            v.behaviour_logprobs, unscored)
    except ValueError as exc:  # no reward per completion, or one that is not finite: never pending forever
        log.error("accepted verdict with unusable rewards; recorded as rejected",
            extra={"submission_id": submission_id, "error": str(exc)})
        v = Verdict(submission_id=submission_id, status=VerdictStatus.rejected,
                    rejections=[Rejection(code=RejectionCode.reward_error,
                    message=f"unusable rewards: {exc}"[:2000])])
        return Applied(submission_id, p.worker_id, v, False, [], None, p.submission.num_tokens)
    # the run's reward totals skip made-up 0s
    kept = [i for i in range(len(rewards)) if not (unscored and unscored[i])]
    indices = tuple(p.prompt_indices[p.submission.completions[i].prompt_index] for i in kept)
    return Applied(submission_id, p.worker_id, v, True, [rewards[i] for i in kept], groups, p.submission.num_tokens,
                   failures=failures, scored_prompts=indices)
