"""The operator's endpoints (admin token): the workers with their records, bans, and join tokens. A ban,
or a revoked token's bans, sends the banned workers' open leases back at once.
"""

from __future__ import annotations

import time

from orchestrator.db import Database
from orchestrator.draw_deviations import DeviationLedger
from orchestrator.leases import LeaseBook
from orchestrator.tokens import JoinTokens
from orchestrator.workers import Workers
from protocol.operator_models import (
    BanScope,
    JoinTokenList,
    JoinTokenMinted,
    JoinTokenRecord,
    JoinTokenRequest,
    WorkerList,
    WorkerRecord,
)


class Operators:
    def __init__(self, db: Database, workers: Workers, tokens: JoinTokens, leases: LeaseBook,
        deviations: DeviationLedger):
        self.db, self.workers, self.tokens, self.leases, self.deviations = db, workers, tokens, leases, deviations

    def worker_list(self) -> WorkerList:
        now, released, costs = time.time(), self.leases.costs.by_worker(self.db), self.leases.costs
        deviations = self.deviations.of()
        return WorkerList(workers=[
            self.workers.record(w, now).model_copy(update={
                "leases_released": released.get(w.worker_id, (0, 0))[0], "releases_charged": released.get(w.worker_id,
                (0, 0))[1],
                "token_release_ratio": costs.ratio(w.token_id),
                "draw_deviations": deviations.get(w.worker_id, (0, 0.0))[0],
                "deviation_allowance": deviations.get(w.worker_id, (0, 0.0))[1],
            })
            for w in self.workers.all()
        ])

    def set_ban(self, worker_id: str, banned: bool, reason: str, scope: BanScope | None = None) -> WorkerRecord:
        row = self.workers.set_ban(worker_id, banned, reason, scope)
        if banned:
            self._release_banned()
        return self.workers.record(row, time.time())

    def mint_token(self, req: JoinTokenRequest) -> JoinTokenMinted:
        row, token = self.tokens.mint(req.label, req.max_identities)
        return JoinTokenMinted(token=token, **self.tokens.record(row, 0).model_dump())

    def token_list(self) -> JoinTokenList:
        now = time.time()
        return JoinTokenList(tokens=[self.tokens.record(t, self.workers.live_identities(t.token_id, now))
            for t in self.tokens.all()])

    def revoke_token(self, token_id: str, reason: str) -> JoinTokenRecord:
        """No registration with the token any more, and every worker it registered is banned."""
        row = self.tokens.revoke(token_id, reason)
        with self.db.tx() as db:
            self.workers.ban_token_identities(db, token_id, f"join token revoked: {row.ban_reason}")
        self._release_banned()
        return self.tokens.record(row, 0)

    def _release_banned(self) -> None:
        with self.db.tx() as db:
            self.leases.release_banned(db)
