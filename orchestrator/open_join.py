"""Open join: a worker with no join token claims one of its own by solving a proof-of-work puzzle.

- A challenge is `<expires>.<bits>.<nonce>.<mac>`, the mac an HMAC-SHA256 under a key made when this process
  started: no state per challenge, none can be forged or made easier, and none outlives a restart. A claimed
  challenge is remembered until it expires, so each one buys one token.
- The puzzle is hashcash's (protocol/join_puzzle.py): 2**difficulty_bits hashes on average to solve, one to check.
- Claims are rate-limited per client address and in total (token buckets, bursts of an hour's worth), and
  every request to these endpoints per address: a 429 says why and when to come back.
- A claimed token holds one identity and has no record, so it is in the probation pool (lease_shares.py): it
  holds a share of the generation budget only once its verified work has been accepted. A ban takes the token
  with its one identity (workers.py), so coming back costs another puzzle and another claim.

So an identity costs an attacker the puzzle's CPU and a claim, and it gets nothing beyond the probation pool,
which all identities without a record share.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time

from orchestrator.admission import RateLimiter
from orchestrator.config import OpenJoinConfig
from orchestrator.errors import ApiError
from orchestrator.tokens import OPEN_JOIN_PREFIX, JoinTokens
from protocol.join_puzzle import meets_difficulty
from protocol.models import ErrorCode, JoinChallenge, JoinClaim, JoinTokenClaimed

log = logging.getLogger(__name__)

HOUR_S = 3600.0


class OpenJoin:
    def __init__(self, config: OpenJoinConfig, tokens: JoinTokens):
        self.cfg, self.tokens = config, tokens
        self._key = secrets.token_bytes(32)
        self._claimed: dict[str, float] = {}  # nonce of a claimed challenge -> when it expires
        per_min = config.requests_per_min_per_address
        self._requests = RateLimiter(per_min / 60.0, burst=per_min)
        per_address, total = config.claims_per_hour_per_address, config.claims_per_hour_total
        self._per_address = RateLimiter(per_address / HOUR_S, burst=per_address)
        self._total = RateLimiter(total / HOUR_S, burst=total)

    def challenge(self, address: str) -> JoinChallenge:
        self._admit(address)
        expires = int(time.time() + self.cfg.challenge_ttl_s)
        body = f"{expires}.{self.cfg.difficulty_bits}.{secrets.token_hex(16)}"
        return JoinChallenge(challenge=f"{body}.{self._mac(body)}", difficulty_bits=self.cfg.difficulty_bits,
                             expires_in_s=self.cfg.challenge_ttl_s)

    def claim(self, address: str, claim: JoinClaim) -> JoinTokenClaimed:
        """Called on the API's event loop only (api.py runs these handlers inline): checking a challenge and
        spending it cannot interleave with another claim."""
        self._admit(address)
        expires, bits, nonce = self._check(claim.challenge)
        if not meets_difficulty(claim.challenge, claim.solution, bits):
            raise ApiError(ErrorCode.forbidden, f"sha256(challenge || solution) does not start with {bits} zero bits")
        # Checked before either is taken, and before the challenge is spent: refused here, the same solution
        # may be claimed again after Retry-After while the challenge lasts.
        _refuse_if_empty(self._per_address, address, "too many tokens claimed from this address")
        _refuse_if_empty(self._total, "", "too many tokens claimed from everyone: try later")
        self._per_address.take(address)
        self._total.take("")
        now = time.time()
        self._claimed = {n: e for n, e in self._claimed.items() if e >= now}
        self._claimed[nonce] = expires
        row, token = self.tokens.mint(f"open join from {address}"[:64], max_identities=1, prefix=OPEN_JOIN_PREFIX)
        log.info("open-join token claimed", extra={"token_id": row.token_id, "client": address})
        return JoinTokenClaimed(token=token, token_id=row.token_id)

    def _admit(self, address: str) -> None:
        if not self.cfg.enabled:
            raise ApiError(ErrorCode.forbidden, "open join is off on this run: ask its operator for a join token")
        try:
            self._requests.check(address)
        except ApiError as exc:
            raise ApiError(ErrorCode.rate_limited, "too many open-join requests from this address",
                           retry_after_s=exc.retry_after_s) from None

    def _check(self, challenge: str) -> tuple[float, int, str]:
        """(expiry, difficulty, nonce) of a challenge this process issued, unexpired and not claimed yet."""
        body, _, mac = challenge.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or not hmac.compare_digest(mac, self._mac(body)):
            raise ApiError(ErrorCode.forbidden, "not a challenge of this orchestrator (or it restarted)")
        expires, bits, nonce = float(parts[0]), int(parts[1]), parts[2]  # ours, so well-formed
        if expires < time.time():
            raise ApiError(ErrorCode.forbidden, "the challenge expired: ask for a new one")
        if nonce in self._claimed:
            raise ApiError(ErrorCode.forbidden, "the challenge was claimed already: ask for a new one")
        return expires, bits, nonce

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:32]


def _refuse_if_empty(bucket: RateLimiter, key: str, why: str) -> None:
    if not bucket.has(key):
        try:
            bucket.check(key)  # raises, with how long until there is a claim again
        except ApiError as exc:
            raise ApiError(ErrorCode.rate_limited, why, retry_after_s=exc.retry_after_s) from None
