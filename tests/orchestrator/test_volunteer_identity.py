"""A volunteer's identity on the run's side: its credit (its join token's record, carried across
re-registrations), its clean leave (a `stopped` heartbeat frees its slot and revokes its secret), and the base
model files a worker without a model of its own takes from the run (orchestrator/model_files.py, over HTTP)."""

from __future__ import annotations

import contextlib
import hashlib

import httpx
import numpy as np
import pytest
from orch_fakes import encode, make_orchestrator, make_submission, run_config

from orchestrator.errors import ApiError
from orchestrator.server import OrchestratorServer
from protocol import api
from protocol.models import (
    ErrorCode,
    Heartbeat,
    LeaseRequest,
    ModelFiles,
    WorkerRegistered,
    WorkerRegistration,
    WorkerState,
)
from protocol.operator_models import WorkerList
from swarmrl.status_view import credit_by_identity, render_credit
from trainer.tiny_model import init_model

ADMIN, ALICE, BOB = "test-admin-token", "alice-join-token", "bob-join-token"


def accepted_work(orch, worker_id: str, rng, bad: bool = False) -> int:
    """Lease, submit and verify one task of `worker_id`; the submission's tokens."""
    lease = orch.lease(worker_id, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
    sub = make_submission(lease, rng, bad=bad)
    orch.admission.submit(worker_id, encode(sub), None)
    while orch.verification.verify_pending():
        pass
    return sub.num_tokens


def test_a_worker_registered_again_under_its_token_carries_its_credit(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, join_tokens=[ALICE, BOB]))
    rng = np.random.default_rng(0)
    first = orch.register(WorkerRegistration(name="alice-cpu"), ALICE)
    assert first.credit.accepted == first.credit.verified_tokens == 0
    worker = orch.authenticate(first.secret)
    tokens = accepted_work(orch, worker, rng) + accepted_work(orch, worker, rng)
    accepted_work(orch, worker, rng, bad=True)  # a rejection: a strike, below the ban at two
    # A restart registers again (a new worker id) under the same token: the credit carries over ...
    again = orch.register(WorkerRegistration(name="alice-cpu"), ALICE)
    assert again.worker_id != first.worker_id
    assert (again.credit.accepted, again.credit.rejected, again.credit.verified_tokens) == (2, 1, tokens)
    # ... and adds up over the token's workers; another token's identity starts from nothing.
    tokens += accepted_work(orch, orch.authenticate(again.secret), rng)
    assert orch.register(WorkerRegistration(name="alice-2"), ALICE).credit.verified_tokens == tokens
    assert orch.register(WorkerRegistration(name="bob"), BOB).credit.accepted == 0
    # `swarmrl status` sums by join token: alice's three workers are one line.
    credits = credit_by_identity(orch.operators.worker_list())
    assert [(c.workers, c.accepted, c.rejected, c.verified_tokens) for c in credits][0] == (3, 3, 1, tokens)
    assert credits[0].names == {"alice-cpu", "alice-2"} and credits[1].accepted == 0
    orch.db.close()


def test_a_worker_that_leaves_frees_its_identity_and_its_secret_stops_working(tmp_path):
    orch = make_orchestrator(run_config(tmp_path, join_tokens=[ALICE], max_identities_per_token=1,
                                        registrations_per_min_per_token=1e9))  # its rate is not under test
    first = orch.register(WorkerRegistration(name="alice-cpu"), ALICE)
    worker = orch.authenticate(first.secret)
    orch.heartbeat(worker, worker, Heartbeat(state=WorkerState.idle, loaded_policy_version=0))
    with pytest.raises(ApiError) as refused:  # one live identity per token: a second start must wait ...
        orch.register(WorkerRegistration(name="alice-cpu"), ALICE)
    assert refused.value.code is ErrorCode.too_many_identities
    orch.heartbeat(worker, worker, Heartbeat(state=WorkerState.stopped, loaded_policy_version=0))
    # ... unless the first one left: then the restart registers at once, and the old secret is dead.
    again = orch.register(WorkerRegistration(name="alice-cpu"), ALICE)
    with pytest.raises(ApiError) as dead:
        orch.authenticate(first.secret)
    assert dead.value.code is ErrorCode.unauthorized
    assert orch.authenticate(again.secret) == again.worker_id
    records = {w.worker_id: w for w in orch.operators.worker_list().workers}
    assert records[worker].state is WorkerState.stopped and not records[worker].online
    assert records[again.worker_id].online
    orch.db.close()
    # A restarted orchestrator does not count the one that left as live either.
    orch = make_orchestrator(run_config(tmp_path, join_tokens=[ALICE], max_identities_per_token=1))
    assert orch.workers.live_identities(orch.workers.token_of(worker), 1e18) == 0
    with pytest.raises(ApiError):
        orch.authenticate(first.secret)
    orch.db.close()


def test_status_credit_table_sums_identities_and_folds_the_rest():
    from rich.console import Console

    workers = WorkerList.model_validate({"workers": [
        {"worker_id": f"w-{i}", "name": f"n{i}", "online": i % 2 == 0, "banned": False, "strikes": 0,
         "submissions_accepted": i, "verified_tokens": 10 * i, "token_id": f"tok-{i % 25}"} for i in range(30)]})
    console = Console(record=True, width=140)
    render_credit(workers, console, rows=20)
    text = console.export_text()
    # tok-4 holds w-4 and w-29: 4 + 29 accepted, 330 tokens, the most of all: the first row.
    first = next(line for line in text.splitlines() if "tok-" in line)
    assert "tok-4 " in first and "330" in first and "33" in first, text
    assert "5 more" in text, text


@contextlib.contextmanager
def serving(tmp_path, base_model_dir, **orch):
    cfg = run_config(tmp_path, admin_token=ADMIN, join_tokens=[ALICE], refusal_delay_s=0.0, **orch)
    srv = OrchestratorServer(make_orchestrator(cfg, base_model_dir=base_model_dir), port=0).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            yield http
    finally:
        srv.stop()


def registered(http) -> dict[str, str]:
    r = http.post(api.REGISTER.path, json={"name": "w"}, headers={"Authorization": f"Bearer {ALICE}"})
    return {"Authorization": f"Bearer {WorkerRegistered.model_validate_json(r.content).secret}"}


def test_the_run_serves_its_base_models_config_and_tokenizer_but_no_weights(tmp_path):
    model = init_model(tmp_path / "base")
    (model / "secrets.env").write_text("NOT=served")
    with serving(tmp_path, model) as http:
        # A worker endpoint: no credential, a join token, or the admin token get nothing.
        for headers in ({}, {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {ADMIN}"}):
            assert http.get(api.MODEL_FILES.path, headers=headers).status_code == 401
            assert http.get(api.MODEL_FILE.url("", name="config.json"), headers=headers).status_code == 401
        auth = registered(http)
        listing = ModelFiles.model_validate_json(http.get(api.MODEL_FILES.path, headers=auth).content)
        names = {f.name for f in listing.files}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
        assert not any(n.endswith(".safetensors") or n == "secrets.env" for n in names), names
        for f in listing.files:
            data = http.get(api.MODEL_FILE.url("", name=f.name), headers=auth).content
            assert data == (model / f.name).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f.size, f.sha256)
        for name in ("model.safetensors", "secrets.env", "..%2Fbase%2Fconfig.json", ".config.json"):
            r = http.get(api.MODEL_FILE.url("", name=name), headers=auth)
            assert r.status_code == 404 and r.json()["error"] == "not_found", (name, r.text)
        # A worker that fetches them over and over is stopped at DOWNLOADS_PER_IDENTITY times their total
        # (it fetched them once above); another identity is not.
        tokenizer = api.MODEL_FILE.url("", name="tokenizer.json")
        codes = [http.get(tokenizer, headers=auth).status_code for _ in range(3 * len(listing.files) + 3)]
        assert codes[0] == 200 and codes[-1] == 429, codes
        assert http.get(tokenizer, headers=registered(http)).status_code == 200


def test_a_token_that_registers_again_and_again_gets_no_fresh_download_allowance(tmp_path):
    """Each new identity has its own allowance; a worker that leaves and registers again, over and over, draws on
    its join token's (DOWNLOADS_PER_IDENTITY per identity the token may hold), not a fresh one each time."""
    model = init_model(tmp_path / "base")
    with serving(tmp_path, model, max_identities_per_token=2, registrations_per_min_per_token=1e9) as http:
        tokenizer = api.MODEL_FILE.url("", name="tokenizer.json")
        fetched, last = [], None
        for _ in range(6):
            auth = registered(http)
            n = 0
            while (last := http.get(tokenizer, headers=auth)).status_code == 200:
                n += 1
            assert last.status_code == 429 and last.json()["error"] == "rate_limited", last.text
            fetched.append(n)
            worker_id = auth["Authorization"].removeprefix("Bearer ").partition(".")[0]
            r = http.post(api.HEARTBEAT.url("", worker_id=worker_id), json={"state": "stopped"}, headers=auth)
            assert r.status_code == 200, r.text  # it leaves: its slot is free for the next registration
        assert fetched[0] >= 3 and sum(fetched) <= 2 * fetched[0] + 2, fetched
        assert "join token" in last.json()["detail"]


def test_a_run_without_a_base_model_folder_lists_nothing(tmp_path):
    with serving(tmp_path, None) as http:
        auth = registered(http)
        assert ModelFiles.model_validate_json(http.get(api.MODEL_FILES.path, headers=auth).content).files == []
        assert http.get(api.MODEL_FILE.url("", name="config.json"), headers=auth).status_code == 404

