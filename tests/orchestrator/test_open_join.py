"""Open join: a join token for a solved proof-of-work puzzle, over real HTTP (uvicorn on 127.0.0.1) where the
endpoints are concerned, and on the orchestrator's objects for shares and bans. Off by default; a puzzle is
claimed once, before it expires, only if solved and issued here; claims are rate-limited per address and in
total; a claimed token holds one identity, is on probation until its work is accepted, and is banned alone."""

from __future__ import annotations

import contextlib
import time
import types

import httpx
import numpy as np
import pytest
from orch_fakes import encode, make_orchestrator, make_submission, run_config

import orchestrator.open_join as open_join_module
from orchestrator.errors import ApiError
from orchestrator.server import OrchestratorServer
from protocol import api
from protocol.join_puzzle import meets_difficulty, solve
from protocol.models import (
    ErrorBody,
    ErrorCode,
    JoinChallenge,
    JoinClaim,
    JoinTokenClaimed,
    LeaseRequest,
    WorkerRegistration,
)
from protocol.operator_models import BanScope, JoinTokenRequest

ADMIN = "test-admin-token"
OPEN = {"enabled": True, "difficulty_bits": 8, "requests_per_min_per_address": 1000.0}


def bearer(t: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {t}"}


@contextlib.contextmanager
def serving(tmp_path, open_join: dict | None = None, **orch):
    if open_join:
        orch["open_join"] = open_join
    cfg = run_config(tmp_path, admin_token=ADMIN, refusal_delay_s=0.0, **orch)
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            yield srv, http
    finally:
        srv.stop()


def refused(r: httpx.Response, status: int, code: str) -> ErrorBody:
    assert r.status_code == status, r.text
    body = ErrorBody.model_validate_json(r.content)
    assert body.error.value == code and body.detail
    return body


def puzzle(http) -> JoinChallenge:
    r = http.post(api.JOIN_CHALLENGE.path)
    assert r.status_code == 200, r.text
    return JoinChallenge.model_validate_json(r.content)


def solved(http) -> dict[str, str]:
    p = puzzle(http)
    return {"challenge": p.challenge, "solution": solve(p.challenge, p.difficulty_bits)[0]}


def claim(http) -> JoinTokenClaimed:
    r = http.post(api.JOIN_CLAIM.path, json=solved(http))
    assert r.status_code == 200, r.text
    return JoinTokenClaimed.model_validate_json(r.content)


def test_the_puzzle_is_hashcash():
    found, hashes = solve("abc.", 12)
    assert meets_difficulty("abc.", found, 12) and hashes >= 1
    assert meets_difficulty("abc.", "anything", 0)
    wrong = next(s for s in map(str, range(100)) if not meets_difficulty("abc.", s, 12))
    assert not meets_difficulty("abc.", wrong, 12)


def test_open_join_is_off_by_default(tmp_path):
    with serving(tmp_path) as (srv, http):
        assert not srv.orch.cfg.open_join.enabled
        assert "open join is off" in refused(http.post(api.JOIN_CHALLENGE.path), 403, "forbidden").detail
        body = {"challenge": "1.8.00.00", "solution": "1"}
        assert "open join is off" in refused(http.post(api.JOIN_CLAIM.path, json=body), 403, "forbidden").detail
        assert not any(t.token_id.startswith("oj-") for t in srv.orch.tokens.all())


def test_a_solved_puzzle_buys_a_token_of_one_identity(tmp_path):
    with serving(tmp_path, OPEN) as (srv, http):
        p = puzzle(http)
        assert p.difficulty_bits == 8 and p.expires_in_s == srv.orch.cfg.open_join.challenge_ttl_s
        got = claim(http)
        assert got.token_id.startswith("oj-")
        r = http.post(api.REGISTER.path, json={"name": "volunteer"}, headers=bearer(got.token))
        assert r.status_code == 200, r.text
        # One live identity per claimed token: a second is refused while the first is live.
        second = http.post(api.REGISTER.path, json={"name": "second"}, headers=bearer(got.token))
        refused(second, 429, "too_many_identities")
        # Two claims are two tokens.
        assert claim(http).token_id != got.token_id


def test_wrong_replayed_forged_and_expired_claims_are_refused(tmp_path, monkeypatch):
    with serving(tmp_path, OPEN | {"difficulty_bits": 16}) as (srv, http):
        p = puzzle(http)
        wrong = next(s for s in map(str, range(1000)) if not meets_difficulty(p.challenge, s, 16))
        r = http.post(api.JOIN_CLAIM.path, json={"challenge": p.challenge, "solution": wrong})
        body = refused(r, 403, "forbidden")
        assert "zero bits" in body.detail
        good = {"challenge": p.challenge, "solution": solve(p.challenge, 16)[0]}
        assert http.post(api.JOIN_CLAIM.path, json=good).status_code == 200
        assert "claimed already" in refused(http.post(api.JOIN_CLAIM.path, json=good), 403, "forbidden").detail
        # Made easier (the difficulty in the challenge lowered) or made up: the mac does not match.
        expires, bits, nonce, mac = puzzle(http).challenge.split(".")
        easier = f"{expires}.0.{nonce}.{mac}"
        body = refused(http.post(api.JOIN_CLAIM.path, json={"challenge": easier, "solution": "1"}), 403, "forbidden")
        assert "not a challenge of this orchestrator" in body.detail
        made_up = {"challenge": f"{expires}.{bits}.{nonce}.{'0' * 32}", "solution": "1"}
        assert "not a challenge" in refused(http.post(api.JOIN_CLAIM.path, json=made_up), 403, "forbidden").detail
        # Solved, but claimed after it expired (the orchestrator's clock an hour on).
        late = solved(http)
        real = open_join_module.time
        monkeypatch.setattr(open_join_module, "time", types.SimpleNamespace(time=lambda: real.time() + 3600))
        assert "expired" in refused(http.post(api.JOIN_CLAIM.path, json=late), 403, "forbidden").detail
        monkeypatch.setattr(open_join_module, "time", real)
        assert len([t for t in srv.orch.tokens.all() if t.token_id.startswith("oj-")]) == 1


@pytest.mark.parametrize("content, headers, status", [
    (b'{"challenge": "1.8.ab.cd", "solution": 7}', {}, 422),  # a number, not a string
    (b'{"challenge": "1.8.ab.cd"}', {}, 422),  # no solution
    (b'{"challenge": "1.8.AB.cd", "solution": "1"}', {}, 422),  # outside the challenge's alphabet
    (b'{"challenge": "1.8.ab.cd", "solution": "1 2"}', {}, 422),
    (b'{"challenge": "' + b"a" * 200 + b'", "solution": "1"}', {}, 422),  # too long
    (b'{"challenge": "1.8.ab.cd", "solution": "1", "admin": true}', {}, 422),  # unknown field
    (b"[1, 2", {}, 422),  # not JSON
    (b'{"challenge": "1.8.ab.cd", "solution": "1"}', {"content-type": "text/plain"}, 422),
    (b"x" * (100 << 10), {}, 413),  # over the small-body cap, refused before it is parsed
])
def test_bad_claims_get_4xx_with_a_reason(tmp_path, content, headers, status):
    with serving(tmp_path, OPEN) as (_, http):
        r = http.post(api.JOIN_CLAIM.path, content=content, headers={"content-type": "application/json"} | headers)
        refused(r, status, {422: "invalid_request", 413: "payload_too_large"}[status])
        bad_challenge = http.post(api.JOIN_CHALLENGE.path, content=b'{"difficulty_bits": 0}',
                                  headers={"content-type": "application/json"})
        refused(bad_challenge, 422, "invalid_request")  # the request has no fields: none may be set


def test_claims_are_rate_limited_per_address(tmp_path):
    with serving(tmp_path, OPEN | {"claims_per_hour_per_address": 2}) as (_, http):
        claim(http), claim(http)
        held_back = solved(http)
        r = http.post(api.JOIN_CLAIM.path, json=held_back)
        assert "from this address" in refused(r, 429, "rate_limited").detail
        assert int(r.headers["retry-after"]) > 60  # a claim comes back every half hour


def test_claims_are_rate_limited_in_total(tmp_path):
    with serving(tmp_path, OPEN | {"claims_per_hour_total": 2, "claims_per_hour_per_address": 100}) as (srv, http):
        claim(http), claim(http)
        r = http.post(api.JOIN_CLAIM.path, json=solved(http))
        assert "from everyone" in refused(r, 429, "rate_limited").detail and "retry-after" in r.headers
    # Across addresses too (the module, as the server calls it with each client's address).
    with serving(tmp_path / "b", OPEN | {"difficulty_bits": 0, "claims_per_hour_total": 3}) as (srv, _):
        oj = srv.orch.open_join
        for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
            oj.claim(address, JoinClaim(challenge=oj.challenge(address).challenge, solution="0"))
        with pytest.raises(ApiError) as e:
            oj.claim("10.0.0.4", JoinClaim(challenge=oj.challenge("10.0.0.4").challenge, solution="0"))
        assert e.value.code is ErrorCode.rate_limited and e.value.retry_after_s > 0


def test_a_forwarded_for_header_does_not_make_another_address(tmp_path):
    """The address is the connection's: uvicorn would take X-Forwarded-For from a loopback peer (the default host,
    and whatever proxy or tunnel forwards to it), and a client could then name a new address per request."""
    with serving(tmp_path, OPEN | {"claims_per_hour_per_address": 1}) as (_, http):
        codes = [http.post(api.JOIN_CLAIM.path, json=solved(http), headers={"X-Forwarded-For": f"10.9.0.{i}"})
                 .status_code for i in range(3)]
        assert codes == [200, 429, 429], codes



def test_behind_a_trusted_proxy_claims_are_limited_per_forwarded_address(tmp_path):
    with serving(tmp_path, OPEN | {"claims_per_hour_per_address": 1}, trusted_proxies=["127.0.0.1"]) as (_, http):
        codes = [http.post(api.JOIN_CLAIM.path, json=solved(http), headers={"X-Forwarded-For": f"10.9.0.{i}"})
                 .status_code for i in (1, 2, 1)]
        assert codes == [200, 200, 429], codes


def test_trusted_proxies_must_be_addresses_or_networks(tmp_path):
    with pytest.raises(ValueError, match="not an IP address or network"):
        run_config(tmp_path, trusted_proxies=["ingress-nginx"])

def test_open_join_requests_are_rate_limited_per_address(tmp_path):
    with serving(tmp_path, OPEN | {"requests_per_min_per_address": 3}) as (_, http):
        codes = [http.post(api.JOIN_CHALLENGE.path).status_code for _ in range(5)]
        assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
        assert "open-join requests" in refused(http.post(api.JOIN_CHALLENGE.path), 429, "rate_limited").detail


def test_credentials_are_still_checked_where_they_were(tmp_path):
    """Open join opens two endpoints and nothing else: a claimed token registers and does nothing more."""
    with serving(tmp_path, OPEN) as (_, http):
        token = claim(http).token
        refused(http.post(api.REGISTER.path, json={"name": "w"}), 401, "unauthorized")
        lease = {"loaded_policy_version": 0}
        refused(http.post(api.LEASE.path, json=lease), 401, "unauthorized")
        refused(http.post(api.LEASE.path, json=lease, headers=bearer(token)), 401, "unauthorized")
        refused(http.get(api.STATUS.path), 401, "unauthorized")
        refused(http.get(api.STATUS.path, headers=bearer(token)), 401, "unauthorized")
        refused(http.post(api.MINT_TOKEN.path, json={"label": "x"}, headers=bearer(token)), 401, "unauthorized")


def open_identity(orch, name: str) -> str:
    """The worker id of a new identity under a token claimed by open join (difficulty 0: any solution)."""
    puzzle = orch.open_join.challenge("10.1.1.1")
    got = orch.open_join.claim("10.1.1.1", JoinClaim(challenge=puzzle.challenge, solution="0"))
    return orch.authenticate(orch.register(WorkerRegistration(name=name), got.token).secret)


def bound_of_16(tmp_path, **orch):
    cfg = run_config(tmp_path, async_level=7, max_open_leases_per_worker=10, prompts_per_lease=2,
                     open_join={"enabled": True, "difficulty_bits": 0, "claims_per_hour_per_address": 1000}, **orch)
    # (1 + 7) x 8 samples / 4 per prompt = 16 prompts; the probation pool is 10% of it, rounded up: 2.
    return make_orchestrator(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 8})}))


def held(orch, worker_id: str, asks: int = 8) -> int:
    leases = (orch.lease(worker_id, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease for _ in range(asks))
    return sum(len(lease.prompts) for lease in leases if lease is not None)


def test_an_open_join_identity_is_on_probation_until_its_work_is_accepted(tmp_path):
    orch = bound_of_16(tmp_path)
    newcomer = open_identity(orch, "newcomer")
    token = orch.workers.token_of(newcomer)
    # Alone, and with no token on record anywhere, it still holds only the probation pool (a minted token
    # alone would hold the whole bound).
    first = orch.lease(newcomer, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
    assert len(first.prompts) == 2 and held(orch, newcomer) == 0
    assert orch.leases.shares.credit(token, time.time()) == 0
    orch.admission.submit(newcomer, encode(make_submission(first, np.random.default_rng(0))), None)
    while orch.verification.verify_pending():
        pass
    assert orch.workers.get(newcomer).accepted == 1
    # Its work was accepted: it has a record, and a share of the bound beyond the pool.
    assert held(orch, newcomer) > 2
    orch.db.close()


def test_a_crowd_of_claimed_identities_holds_the_pool_together(tmp_path):
    orch = bound_of_16(tmp_path)
    crowd = [open_identity(orch, f"sybil{i}") for i in range(12)]
    assert sum(held(orch, w, asks=2) for w in crowd) == 2  # the pool, for all twelve
    honest = orch.authenticate(orch.register(WorkerRegistration(name="operator-worker"),
                                             orch.operators.mint_token(JoinTokenRequest(label="op")).token).secret)
    assert held(orch, honest) == 16 - 2  # an operator's token without a record shares the rest
    orch.db.close()


@pytest.mark.parametrize("scope", ["token", "identity"])
def test_banning_one_open_join_identity_leaves_the_others(tmp_path, scope):
    orch = bound_of_16(tmp_path, ban_scope=scope, strikes_to_ban=1)
    cheater, honest, other = (open_identity(orch, name) for name in ("cheater", "honest", "other"))
    with orch.db.tx() as db:
        assert orch.workers.strike(db, cheater, "rejected submissions", strikes_to_ban=1)
    assert orch.workers.get(cheater).banned
    assert not orch.workers.get(honest).banned and not orch.workers.get(other).banned
    # Banned with its token whatever the run's ban scope: coming back takes a new puzzle and claim.
    assert orch.tokens.get(orch.workers.token_of(cheater)).banned
    with pytest.raises(ApiError) as e:
        orch.register(WorkerRegistration(name="again"), orch.tokens.get(orch.workers.token_of(cheater)))
    assert e.value.code is ErrorCode.banned
    assert orch.lease(honest, LeaseRequest(loaded_policy_version=0)).lease is not None
    # An operator's ban of one identity takes that one only.
    orch.operators.set_ban(honest, True, "operator", BanScope.identity)
    assert orch.tokens.get(orch.workers.token_of(honest)).banned and not orch.workers.get(other).banned
    assert not orch.tokens.get(orch.workers.token_of(other)).banned
    orch.db.close()
