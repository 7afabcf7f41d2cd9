"""Registration: a new worker identity under a join token, and what the worker is told to start with.

A token registers while it is not banned or revoked (orchestrator/tokens.py), under its cap on live
identities and its registration rate: its whole quota of identities at once, then again at the per-minute
rate. The new worker gets its bearer secret, the current policy version and its model hash, the relays to
pull weights from (the origin as their fallback) and the key that signs this run's manifests, with the run
id it signs them for.
"""

from __future__ import annotations

import time

from orchestrator.admission import RateLimiter
from orchestrator.config import OrchestratorConfig
from orchestrator.errors import ApiError
from orchestrator.lease_shares import LeaseShares
from orchestrator.tokens import JoinTokens, TokenRow
from orchestrator.versions import PolicyVersions
from orchestrator.workers import Workers
from protocol.models import ErrorCode, WorkerRegistered, WorkerRegistration


class Registration:
    def __init__(
        self, config: OrchestratorConfig, *, tokens: JoinTokens, workers: Workers, shares: LeaseShares,
        versions: PolicyVersions, relay_urls: list[str], manifest_public_key: str, run_id: str, origin_url: str,
    ):
        self.cfg, self.tokens, self.workers, self.shares, self.versions = config, tokens, workers, shares, versions
        self.relay_urls = list(relay_urls)
        self.manifest_public_key = manifest_public_key
        self.run_id = run_id  # workers accept only manifests signed for this run
        self.origin_url = origin_url  # the workers' fallback when relays fail
        # A token may register its whole quota of identities at once, then re-register at the per-minute rate.
        self.rate = RateLimiter(config.registrations_per_min_per_token / 60.0,
                                burst=float(config.max_identities_per_token))

    def register(self, reg: WorkerRegistration, join_token: str | TokenRow) -> WorkerRegistered:
        """A new identity under a join token that may still register (the secret, or the row the HTTP gate
        already authenticated): not banned or revoked, under its registration rate and its cap on live
        identities."""
        token = self.tokens.authenticate(join_token) if isinstance(join_token, str) else self.tokens.current(join_token)
        if self.workers.live_identities(token.token_id, time.time()) >= token.max_identities:
            raise ApiError(
                ErrorCode.too_many_identities,
                f"join token {token.token_id} already has {token.max_identities} live workers",
                retry_after_s=self.cfg.worker_dead_after_s,
            )
        self.rate.check(token.token_id)
        credit = self.workers.credit(token.token_id)
        worker_id, secret = self.workers.register(reg.name, reg.device, reg.client_version, token.token_id)
        self.shares.note_demand(token.token_id, time.time())  # a new worker asks for its first lease next
        return WorkerRegistered(
            worker_id=worker_id, secret=secret, heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            async_level=self.cfg.async_level, policy_version=self.versions.current, relay_urls=self.relay_urls,
            manifest_public_key=self.manifest_public_key, run_id=self.run_id, origin_url=self.origin_url,
            policy_model_hash=self.versions.model_hash(self.versions.current) or None, credit=credit,
        )
