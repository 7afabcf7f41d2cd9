"""A worker's lease request, answered: a lease (orchestrator/leases.py), or when to ask again. No lease
while the run is over, while the verifier pool is behind (more rollouts now would only wait, and go stale),
before the trainer's first reconciliation (no published version to check rollouts against), for a loaded
version that is too old, nor while the worker's join token holds its share or cools down
(orchestrator/lease_shares.py). When the async bound is full, `try_lease` raises GenerationBoundReached:
api.py holds the request until there is room (orchestrator/room.py); `lease` answers at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.admission import check_version
from orchestrator.config import OrchestratorConfig
from orchestrator.lease_shares import NoLeaseNow
from orchestrator.leases import GenerationBoundReached, LeaseBook
from orchestrator.status import Metrics, RunWindows
from orchestrator.verification import MAX_VERIFY_BACKLOG, Verification
from orchestrator.versions import PolicyVersions
from orchestrator.workers import Workers
from protocol.models import LeaseRequest, LeaseResponse


class LeaseRequests:
    def __init__(
        self, config: OrchestratorConfig, *, workers: Workers, leases: LeaseBook, versions: PolicyVersions,
        verification: Verification, metrics: Metrics, windows: RunWindows, finished: Callable[[], bool],
    ):
        self.cfg, self.workers, self.leases, self.versions = config, workers, leases, versions
        self.verification, self.metrics, self.windows = verification, metrics, windows
        self.finished = finished  # whether the run is over: no more leases

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        """A lease, or a reason to come back later (api.py holds the request instead while the bound is full)."""
        try:
            return self.try_lease(worker_id, req)
        except GenerationBoundReached:
            return self.bound_reached()

    def bound_reached(self) -> LeaseResponse:
        self.windows.bound_reached(time.time())
        self.metrics.leases_refused_async_bound.inc()
        return LeaseResponse(lease=None, retry_after_s=0.2)

    def try_lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        """A lease, a reason to come back later, or GenerationBoundReached."""
        self.workers.refuse_if_banned(worker_id)
        if self.finished():
            return LeaseResponse(lease=None, retry_after_s=max(self.cfg.heartbeat_interval_s, 5.0))
        if self.verification.backlog() >= MAX_VERIFY_BACKLOG:
            # Backpressure: the verifier pool is behind; more rollouts now would only wait (and go stale).
            return LeaseResponse(lease=None, retry_after_s=1.0)
        current = self.versions.current
        if not self.versions.model_hash(current):  # before the trainer's first reconcile: nothing to check against
            return LeaseResponse(lease=None, retry_after_s=1.0)
        check_version(req.loaded_policy_version, current, self.cfg.async_level, what="loaded policy version")
        now = time.time()
        try:
            lease = self.leases.issue(worker_id, req.max_prompts, current, now,
                                      loaded_version=req.loaded_policy_version, request_id=req.request_id)
        except NoLeaseNow as exc:  # this worker's token: its share is in use, or it is cooling down
            self.metrics.leases_refused_budget.inc()
            return LeaseResponse(lease=None, retry_after_s=round(exc.retry_after_s, 3))
        self.windows.bound_cleared(now)
        self.metrics.leases_issued.inc()
        return LeaseResponse(lease=lease)
