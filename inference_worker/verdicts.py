"""What became of the worker's submissions: their verdicts, asked for with each heartbeat, and the credit they add
to the join token's record (the log, the live panel; the operator sees it in `swarmrl status`)."""

from __future__ import annotations

import logging
import threading
import time

from inference_worker import client as c
from inference_worker.display import WorkerStats, credit_line
from protocol.verdicts import VerdictStatus

log = logging.getLogger(__name__)

# A worker that stops waits this long for the verdicts of what it submitted, so its log ends with its credit
# (a CPU demo run verifies a submission in about a second; a second Ctrl-C skips the wait). Unanswered
# submissions are not lost: they are verified and credited all the same.
VERDICTS_AT_EXIT_S = 15.0


class Verdicts:
    def __init__(self, stats: WorkerStats):
        self.stats = stats
        self._pending: list[str] = []
        self._lock = threading.Lock()

    def submitted(self, submission_id: str) -> None:
        with self._lock:
            self._pending.append(submission_id)

    def forget(self) -> None:
        """A new identity (registered again): the old one's submissions are not ours to ask about."""
        with self._lock:
            self._pending.clear()

    def poll(self, client: c.OrchestratorClient) -> None:
        with self._lock:
            pending = list(self._pending)
        for sid in pending:
            try:
                v = client.verdict(sid)
            except c.NotFound:
                v = None  # the orchestrator forgot it (restart)
            except (c.OrchestratorUnavailable, c.OrchestratorError):
                return
            if v is not None and v.status is VerdictStatus.pending:
                continue
            with self._lock:
                if sid in self._pending:
                    self._pending.remove(sid)
            if v is None:
                continue
            credit = self.stats.credit
            if v.status is VerdictStatus.accepted:
                self.stats.accepted += 1
                self.stats.credit = credit.model_copy(update={"accepted": credit.accepted + 1,
                    "verified_tokens": credit.verified_tokens + v.verified_tokens})
                log.info("submission %s accepted: %d tokens verified; credit: %s", sid, v.verified_tokens,
                    credit_line(self.stats.credit))
            else:
                self.stats.rejected += 1
                self.stats.credit = credit.model_copy(update={"rejected": credit.rejected + 1})
                reasons = "; ".join(f"{r.code.value}: {r.message}" for r in v.rejections[:3])
                self.stats.event(f"submission {sid} rejected: {reasons}")
                log.warning("submission %s rejected: %s", sid, reasons)

    def settle(self, client: c.OrchestratorClient, wait_s: float = VERDICTS_AT_EXIT_S) -> None:
        """Poll until every submission has its verdict, or `wait_s` has passed."""
        deadline = time.monotonic() + wait_s
        self.poll(client)
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.5)
            self.poll(client)
        if self._pending:
            log.info("%d submissions still being verified: they count for the join token all the same",
                     len(self._pending))
