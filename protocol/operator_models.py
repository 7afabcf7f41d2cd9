"""The operator API's wire models: run status, worker and join-token records, bans, evaluations, health.

Served to the operator (admin token) by the orchestrator (`protocol.api.OPERATOR_ENDPOINTS`), and
read by `swarmrl status`, the dashboard and the driver. Wire rules as in `protocol.models`.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import Field

from protocol.models import Id, Message, SafeName, Version, WireModel, WorkerState


class WorkerRecord(WireModel):
    worker_id: Id
    name: str
    device: str = "cpu"
    online: bool
    banned: bool
    strikes: int
    loaded_policy_version: Version | None = None
    state: WorkerState | None = None
    last_seen: float | None = None
    submissions_accepted: int = 0
    submissions_rejected: int = 0
    verified_tokens: int = 0  # contribution ledger
    tokens_per_s: float = 0.0
    token_id: str | None = None  # the join token it registered with
    # Leases it gave back unsubmitted; of those, charged: after their free window (orchestrator/release_costs.py).
    leases_released: int = 0
    releases_charged: int = 0
    token_release_ratio: float = 0.0  # its token's charged releases over the token's last ended leases
    # Accepted tokens off the seed's exact draw, and how many of those noise explains (orchestrator/draw_deviations.py).
    draw_deviations: int = 0
    deviation_allowance: float = 0.0


class WorkerList(WireModel):
    workers: list[WorkerRecord]


class BanScope(str, Enum):
    identity = "identity"  # this worker only; its join token may register new workers
    token = "token"  # every worker of its join token, and no new registration with that token


class BanRequest(WireModel):
    reason: Message = ""
    scope: BanScope | None = None  # None: the run's default (orchestrator.ban_scope)


class JoinTokenRequest(WireModel):
    label: SafeName
    max_identities: Annotated[int, Field(ge=1, le=10_000)] | None = None  # None: the run's default


class JoinTokenRecord(WireModel):
    token_id: Id
    label: str
    created_at: float
    revoked: bool
    banned: bool
    max_identities: int
    live_identities: int = 0
    registrations: int = 0
    lease_debt: float = 0.0  # leases held and given back unsubmitted, in leases (see orchestrator/tokens.py)
    cooldown_until: float = 0.0


class JoinTokenMinted(JoinTokenRecord):
    token: Annotated[str, Field(min_length=16, max_length=256)]  # the secret: shown once, stored hashed


class JoinTokenList(WireModel):
    tokens: list[JoinTokenRecord]


class RestartCount(WireModel):
    count: int  # restarts of one component over the run
    seconds_lost: float  # from its death (as last seen alive) to its answering again, summed


class EvalResult(WireModel):
    """One evaluation of a policy version on held-out prompts (never trained on), from verified rollouts."""

    policy_version: Version  # the version every eval lease of this round was pinned to
    prompts: int  # held-out prompts whose samples were all verified
    prompts_planned: int
    samples_per_prompt: int  # k
    avg_reward: float | None  # avg@k: mean trusted reward over all samples
    pass_at: dict[str, float] = {}  # "k" -> pass@k, the unbiased estimator (Chen et al. 2021), mean over prompts
    mean_completion_tokens: float | None = None
    complete: bool  # False: the version was left behind before every prompt was verified
    finished_at: float | None = None  # unix seconds; None while the round is open


class CurriculumStatus(WireModel):
    """The difficulty level of a task with levels (environments/curriculum.py)."""

    level: int  # new prompts are made at this level
    levels: int
    pass_rate: float | None = None  # over the verified completions seen at this level (None before any)
    moving: bool = False  # the run moves the level by the pass rate (data.curriculum.enabled)


class RunStatus(WireModel):
    run_name: str
    step: int  # optimizer steps done
    policy_version: Version
    async_level: int
    buffer_depth: int  # verified samples waiting for the trainer
    workers_online: int
    acceptance_rate: float  # accepted / verified submissions, over the run
    submissions_accepted: int
    submissions_rejected: int
    groups_dropped_zero_signal: int
    samples_dropped_stale: int
    # Rewards the trusted side could not compute, over the run: reward -> kind (timed_out, crashed,
    # skipped) -> completions; and the GRPO groups dropped for them (never trained, no strike).
    reward_failures: dict[str, dict[str, int]] = {}
    groups_dropped_unscored: int = 0
    verified_tokens: int = 0  # tokens of accepted submissions, over the run
    near_tie_tokens: int = 0  # of those, accepted but not the seed's exact draw (near ties, boundary picks)
    rollout_tokens_per_s: float
    trained_samples_per_s: float
    mean_reward: float | None = None
    staleness_histogram: dict[str, int] = {}  # version gap -> trained samples
    # Seconds workers were refused leases because generation was async_level versions ahead: high
    # means the trainer is the bottleneck (the driver's time/wait_for_rollouts high means the workers are).
    wait_for_trainer_s: float = 0.0
    # The verifier pool over the last minute: submissions waiting, queued per second (in) and verified
    # per second (out); in above out, with a queue, means verification is the bottleneck.
    verify_queue: int = 0
    verify_in_per_s: float = 0.0
    verify_out_per_s: float = 0.0
    verify_tokens_per_s: float = 0.0  # tokens of the submissions verified, accepted or not
    verifier_actors: int = 0  # live: verifying
    verifier_actors_pending: int = 0  # requested, waiting for a place (on KubeRay, for a node)
    # Restarts per component (orchestrator, trainer, verifier-0, relay-0, worker-1, driver, ...).
    restarts: dict[str, RestartCount] = {}
    finished: bool = False
    error: str | None = None
    eval_latest: EvalResult | None = None  # the newest finished evaluation on held-out prompts
    evals_open: int = 0  # evaluations whose eval leases are still going out or being verified
    # Leases given back unsubmitted over the run: free (before they could have been generated) and charged
    # (after); and the highest share of charged releases among the join tokens' recent leases.
    releases_free: int = 0
    releases_charged: int = 0
    max_token_release_ratio: float = 0.0
    curriculum: CurriculumStatus | None = None  # a task with difficulty levels: the level new prompts are made at


class HealthStatus(WireModel):
    ok: bool
    detail: Message = ""
