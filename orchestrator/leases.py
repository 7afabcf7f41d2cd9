"""Task leases: which prompts a worker gets (seeded, never chosen by the worker), with which sampling
seeds, until when, and what happens when the deadline passes (the prompts are handed out again and a
late submission is refused).
"""

from __future__ import annotations

import json
import secrets

import numpy as np

from orchestrator.config import OrchestratorConfig
from orchestrator.data import PromptSet
from orchestrator.errors import ApiError
from orchestrator.state import LeaseRow, State
from protocol.models import ErrorCode, TaskLease, TaskPrompt


def min_policy_version(current: int, async_level: int) -> int:
    """Generation for step N may use any version >= N - async_level (0: fully synchronous)."""
    return max(0, current - async_level)


class GenerationBoundReached(Exception):
    """Generation is async_level versions ahead of the trainer; wait for it to consume a batch."""


class LeaseBook:
    def __init__(self, state: State, prompts: PromptSet, config: OrchestratorConfig):
        self.state = state
        self.prompts = prompts
        self.config = config
        # Open leases, parsed, so a submission does not re-parse its lease (a cache: SQLite is the truth).
        self._open: dict[str, TaskLease] = {}
        # Prompt index -> (prompt_id, token ids) as validated by the first lease that carried the prompt.
        # The token array is shared, read-only, by every later lease of that prompt.
        self._checked_prompts: dict[int, tuple[str, np.ndarray]] = {}

    def _task_prompt(self, index: int, seeds: list[int]) -> TaskPrompt:
        checked = self._checked_prompts.get(index)
        if checked is None:
            p = self.prompts.prompts[index]
            prompt = TaskPrompt(prompt_id=p.prompt_id, token_ids=p.token_ids, seeds=seeds)
            prompt.token_ids.flags.writeable = False
            self._checked_prompts[index] = (prompt.prompt_id, prompt.token_ids)
            return prompt
        return TaskPrompt.model_construct(prompt_id=checked[0], token_ids=checked[1], seeds=seeds)

    def issue(
        self,
        worker_id: str,
        max_prompts: int,
        current_version: int,
        now: float,
        max_untrained_samples: int | None = None,
        *,
        samples_per_step: int | None = None,
        max_staleness: int | None = None,
        loaded_version: int | None = None,
        request_id: str | None = None,
    ) -> TaskLease:
        """A new lease. `max_untrained_samples` bounds how far generation may run ahead of the trainer
        (AReaL's staleness bound): a lease that would exceed it raises GenerationBoundReached.

        With `samples_per_step` and `max_staleness`, the lease also says which version it must be
        generated with: its samples queue behind the untrained ones, so they will be trained `slot`
        steps from now, and a behaviour version below current + slot - max_staleness would be dropped
        as stale when it gets there. A worker holding an older version is told to pull first.
        """
        cfg = self.config
        n = min(max_prompts, cfg.prompts_per_lease)
        min_version = min_policy_version(current_version, cfg.async_level)
        with self.state.tx() as db:
            if request_id is not None:
                earlier = self.state.open_lease_for_request(db, worker_id, request_id, now)
                if earlier is not None:  # a retry of a request whose answer was lost: the same lease again
                    return TaskLease.model_validate_json(earlier)
            if max_untrained_samples is not None:
                untrained = self.state.untrained_samples(db, cfg.samples_per_prompt)
                room = (max_untrained_samples - untrained) // cfg.samples_per_prompt
                if room <= 0:
                    raise GenerationBoundReached()
                n = min(n, room)
                if samples_per_step and max_staleness is not None:
                    slot = (untrained + n * cfg.samples_per_prompt - 1) // samples_per_step
                    min_version = max(min_version, min(current_version, current_version + slot - max_staleness))
                    if loaded_version is not None and loaded_version < min_version:
                        raise ApiError(
                            ErrorCode.version_too_old,
                            f"loaded policy version {loaded_version} would be stale by the time these samples are trained; pull version {min_version}",
                            min_policy_version=min_version,
                        )
            # Counted inside the transaction: two concurrent requests cannot both pass the cap.
            if self.state.open_leases(worker_id, now) >= cfg.max_open_leases_per_worker:
                raise ApiError(
                    ErrorCode.too_many_leases,
                    f"worker already holds {cfg.max_open_leases_per_worker} open leases; submit or release one first",
                    retry_after_s=1.0,
                )
            seq = self.state.next_lease_seq(db)
            indices = self.state.take_reissue(db, n)
            if len(indices) < n:
                start = self.state.take_prompt_cursor(db, n - len(indices))
                indices += [self.prompts.order(start + i) for i in range(n - len(indices))]
            seeds = self.prompts.sample_seeds(seq, n * cfg.samples_per_prompt)
            k = cfg.samples_per_prompt
            # Built without re-validation: every field is ours (each prompt was validated by the first
            # lease that carried it; ids, seeds, versions and deadline are made right here).
            lease = TaskLease.model_construct(
                lease_id=f"L{seq:08d}-{secrets.token_hex(4)}",
                prompts=[self._task_prompt(i, seeds[j * k : (j + 1) * k]) for j, i in enumerate(indices)],
                samples_per_prompt=k,
                sampling=cfg.sampling,
                policy_version=current_version,
                min_policy_version=min_version,
                deadline=now + cfg.lease_timeout_s,
            )
            self.state.insert_lease(
                db,
                LeaseRow(lease.lease_id, seq, worker_id, indices, lease.model_dump_json(), now, lease.deadline, "open", request_id),
            )
        self._open[lease.lease_id] = lease
        return lease

    def for_submission(self, lease_id: str, worker_id: str, now: float) -> tuple[LeaseRow, TaskLease]:
        """The open lease a submission is for, or the reason it cannot be submitted."""
        row = self.state.lease(lease_id)
        if row is None:
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        if row.worker_id != worker_id:
            # Not yours: indistinguishable from a lease that does not exist, so ids cannot be probed.
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        if row.status in ("submitted", "done", "rejected"):
            raise ApiError(ErrorCode.duplicate, f"lease {lease_id} already has a submission")
        if row.status in ("expired", "released") or row.deadline < now:
            raise ApiError(ErrorCode.lease_expired, f"lease {lease_id} is {row.status if row.status != 'open' else 'past its deadline'}")
        lease = self._open.pop(lease_id, None) or TaskLease.model_validate_json(row.body)
        return row, lease

    def release(self, lease_id: str, worker_id: str) -> bool:
        row = self.state.lease(lease_id)
        if row is None or row.worker_id != worker_id:
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        self._open.pop(lease_id, None)
        return self.state.release_lease(lease_id)

    def expire(self, now: float) -> list[str]:
        expired = self.state.expire_leases(now)
        for lease_id in expired:
            self._open.pop(lease_id, None)
        return expired

    @staticmethod
    def prompt_indices(row: LeaseRow) -> list[int]:
        return list(row.prompt_indices) if isinstance(row.prompt_indices, list) else json.loads(row.prompt_indices)
