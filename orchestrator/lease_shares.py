"""How much of the generation budget each join token may hold: a share of the async bound, weighted by
the work the token delivered.

The async bound (generation at most async_level steps ahead of the trainer) is the run's generation
budget. Among the join tokens with demand (holding a lease, or registered / asked within DEMAND_WINDOW_S),
a token may hold

    share = max(1, ceil(bound * w_token / sum of w over those tokens)),  w = 1 + credit

prompts, where credit counts the prompts of its recently accepted leases (halving every
CREDIT_HALF_LIFE_S; a submission accepted with a strike earns none) and halves again whenever the token
lets a lease go unsubmitted. Equal records give equal shares, the plain fair share.

Probation. A token whose credit is below PROVEN_CREDIT has no record. While tokens with a record want
leases, the tokens without one share a pool of `probation_share` of the bound between them (at least one
prompt), and the tokens with a record share the rest: however many identities an attacker makes, they
hold the pool together, and a new honest volunteer still gets work from the pool to earn its record. With
no token on record (the start of a run, or after a restart: only the weights live in memory) everyone
shares the whole bound, except tokens claimed by open join (orchestrator/open_join.py): without a record
they hold only the pool, always, so a crowd of claimed identities never holds more of the bound.

A token that gives back too many leases after it could have scored them (orchestrator/release_costs.py)
is capped at one prompt, like a token on probation alone, until its release ratio falls.
"""

from __future__ import annotations

import math
import sqlite3

from orchestrator.tokens import is_open_join

# How long a registration or a lease request counts as demand for a share of the bound: longer than an
# honest worker's pause between leases (a reload, a submission), shorter than a cooldown.
DEMAND_WINDOW_S = 10.0
# How fast a token's record fades: a worker that stopped delivering a minute ago still weighs half.
CREDIT_HALF_LIFE_S = 60.0
# Credit (accepted prompts, decayed) that takes a token off probation.
PROVEN_CREDIT = 1.0


class NoLeaseNow(Exception):
    """This worker's join token has used its share of the generation budget, or is cooling down."""

    def __init__(self, why: str, retry_after_s: float):
        super().__init__(why)
        self.retry_after_s = retry_after_s


class LeaseShares:
    def __init__(self, probation_share: float = 0.1) -> None:
        self.probation_share = probation_share
        self._demand: dict[str, float] = {}  # join token -> when it last registered a worker or asked for a lease
        self._credit: dict[str, tuple[float, float]] = {}  # join token -> (credit, when it was last updated)
        # (computed at, join tokens holding open training leases), refreshed each second
        self._holding = (0.0, frozenset())

    def note_demand(self, token_id: str, now: float) -> None:
        """The token registered a worker or asked for a lease: it counts in the shares for a while."""
        self._demand[token_id] = now

    def credit(self, token_id: str, now: float) -> float:
        value, at = self._credit.get(token_id, (0.0, now))
        return value * 0.5 ** (max(0.0, now - at) / CREDIT_HALF_LIFE_S)

    def note_accepted(self, token_id: str, prompts: int, now: float) -> None:
        """A lease of the token's was verified and accepted: delivered work raises its weight."""
        self._credit[token_id] = (self.credit(token_id, now) + prompts, now)

    def note_forfeit(self, token_id: str, now: float) -> None:
        """The token let a lease go unsubmitted: its record halves (a crash costs half, hoarding all of it)."""
        self._credit[token_id] = (self.credit(token_id, now) / 2, now)

    def room(self, db: sqlite3.Connection, token_id: str, bound_prompts: int, now: float,
        cap: int | None = None) -> int:
        """Prompts this token may still lease: its share of the bound (of the probation pool, or of the
        rest, when some tokens have a record), at most `cap`, less what its workers hold."""
        at, holding = self._holding
        if now - at > 1.0:
            holding = frozenset(r[0]
                for r in db.execute("SELECT DISTINCT token_id FROM leases WHERE status='open' AND eval_version IS "
                "NULL AND token_id IS NOT NULL"))
            self._holding = (now, holding)
            self._demand = {t: t_at for t, t_at in self._demand.items() if now - t_at <= DEMAND_WINDOW_S}
            self._credit = {t: (v, t_at) for t, (v, t_at) in self._credit.items() if self.credit(t, now) > 0.01}
        wanting = {t for t, t_at in self._demand.items() if now - t_at <= DEMAND_WINDOW_S} | holding | {token_id}
        proven = {t for t in wanting if self.credit(t, now) >= PROVEN_CREDIT}
        on_probation = wanting - proven
        pooled = on_probation if proven else {t for t in on_probation if is_open_join(t)}
        pool = 0
        if pooled:  # the tokens without a record share a pool; the others, the rest
            pool = max(1, math.ceil(self.probation_share * bound_prompts - 1e-9))
            peers = pooled if token_id in pooled else wanting - pooled
            bound_prompts = pool if token_id in pooled else bound_prompts - pool
        else:
            peers = wanting
        weight = 1.0 + self.credit(token_id, now)
        total = sum(1.0 + self.credit(t, now) for t in peers)
        share = max(1, math.ceil(bound_prompts * weight / total - 1e-3))  # - 1e-3: credit decays while we compute
        if cap is not None:
            share = min(share, cap)
        on_pool = token_id in pooled  # then what every token in the pool holds counts too
        which, args = ("token_id IS NOT NULL", ()) if on_pool else ("token_id=?", (token_id,))
        held_by = {t: int(n) for t, n in db.execute(
            f"SELECT token_id, SUM(json_array_length(prompt_indices)) FROM leases WHERE status='open' AND "
            f"eval_version IS NULL AND {which} GROUP BY token_id", args
        )}
        held = held_by.get(token_id, 0)
        if held >= share:
            raise NoLeaseNow(f"join token {token_id} holds its share of the generation budget ({share} prompts)", 1.0)
        room = share - held
        if on_pool:
            used = sum(n for t, n in held_by.items() if t in pooled)
            if used >= pool:
                raise NoLeaseNow(f"join token {token_id} has no record of accepted work yet, and the pool for such "
                    f"tokens is in use ({pool} prompts)", 1.0)
            room = min(room, pool - used)
        return room
