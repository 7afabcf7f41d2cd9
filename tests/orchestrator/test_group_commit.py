"""Group commit: requests of one event-loop iteration share one transaction, each answered only once it
is durable; a failing request undoes only its own writes. (Through the real HTTP API: test_api.py.)"""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import numpy as np
import pytest
from orch_fakes import encode, make_orchestrator, make_submission, run_config

from orchestrator.db import Database
from orchestrator.group_commit import GroupCommit
from orchestrator.server import OrchestratorServer
from protocol import api
from protocol.models import LeaseResponse, SubmissionReceipt, WorkerRegistered


def committed(path) -> dict[str, float]:
    """Counters as another connection (another process) sees them: only what was committed."""
    with sqlite3.connect(path) as db:
        return {k: float(v) for k, v in db.execute("SELECT key, value FROM meta WHERE key LIKE 'test:%'")}


def bump(state: Database, key: str, n: float) -> None:
    """A handler's write: its own transaction, a savepoint inside the shared one."""
    with state.tx() as db:
        Database.add(db, key, n)


async def request(group: GroupCommit, fn, *args):
    """What the middleware does around a handler: join, the handler's database work, wait until durable."""
    group.join()
    result = fn(*args)
    await group.durable()
    return result


def test_concurrent_requests_share_one_commit_and_answer_after_it(tmp_path):
    path = tmp_path / "s.sqlite"
    state = Database(path)
    group = GroupCommit(state)
    seen_before_answer: list[dict[str, float]] = []

    def write(i: int) -> int:
        bump(state, f"test:{i}", 1)  # a database write: a savepoint in the shared transaction
        return i

    async def answer(i: int) -> int:
        result = await request(group, write, i)
        seen_before_answer.append(committed(path))  # answered: must be durable already
        return result

    async def main() -> list[int]:
        return await asyncio.gather(*(answer(i) for i in range(8)))

    assert asyncio.run(main()) == list(range(8))
    assert group.batches == 1 and group.requests == 8
    assert all(seen == {f"test:{i}": 1.0 for i in range(8)} for seen in seen_before_answer)
    state.close()


def test_a_failing_request_undoes_only_its_own_writes(tmp_path):
    path = tmp_path / "s.sqlite"
    state = Database(path)
    group = GroupCommit(state)

    def write(i: int) -> None:
        with state.tx() as db:
            Database.add(db, f"test:{i}", 1)
            if i == 2:
                raise ValueError("bad request")

    async def main() -> list:
        return await asyncio.gather(*(request(group, write, i) for i in range(4)), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[2], ValueError) and results[:2] + results[3:] == [None] * 3
    assert committed(path) == {"test:0": 1.0, "test:1": 1.0, "test:3": 1.0}
    state.close()


def test_requests_in_later_iterations_get_their_own_commit_and_other_threads_are_not_blocked(tmp_path):
    path = tmp_path / "s.sqlite"
    state = Database(path)
    group = GroupCommit(state)

    async def main() -> None:
        for i in range(3):
            await request(group, bump, state, f"test:{i}", 1)
            # Between batches the lock is free: another thread can write at once.
            await asyncio.wait_for(asyncio.to_thread(bump, state, "test:thread", 1), timeout=5)

    asyncio.run(main())
    assert group.batches == 3
    assert committed(path) == {"test:0": 1.0, "test:1": 1.0, "test:2": 1.0, "test:thread": 3.0}
    state.close()


def test_a_failed_commit_fails_every_request_of_the_batch_and_leaves_state_usable(tmp_path):
    path = tmp_path / "s.sqlite"
    state = Database(path)
    group = GroupCommit(state)
    with state.tx() as db:
        db.execute("CREATE TABLE t (x INTEGER PRIMARY KEY, y INTEGER REFERENCES meta(key) DEFERRABLE INITIALLY "
            "DEFERRED)")

    def write(i: int) -> None:
        with state.tx() as db:
            db.execute("INSERT INTO t (x, y) VALUES (?, ?)", (i, "no such key" if i == 1 else None))

    async def main() -> list:
        return await asyncio.gather(*(request(group, write, i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(main())  # the deferred foreign key fails at COMMIT: nothing of the batch lands
    assert all(isinstance(r, sqlite3.IntegrityError) for r in results), results
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0
    bump(state, "test:after", 1)  # no transaction left open
    assert committed(path) == {"test:after": 1.0}
    state.close()


@pytest.mark.parametrize("n", [1, 3])
def test_cancelled_request_does_not_break_the_batch(tmp_path, n):
    state = Database(tmp_path / "s.sqlite")
    group = GroupCommit(state)

    async def main() -> None:
        tasks = [asyncio.ensure_future(request(group, bump, state, f"test:{i}", 1)) for i in range(n + 1)]
        await asyncio.sleep(0)  # every request has run its writes and waits for the commit...
        tasks[0].cancel()  # ...when the first one's client goes away
        await asyncio.gather(*tasks, return_exceptions=True)
        assert tasks[0].cancelled() and all(t.result() is None for t in tasks[1:])

    asyncio.run(main())
    assert committed(tmp_path / "s.sqlite") == {f"test:{i}": 1.0 for i in range(n + 1)}
    state.close()


def test_over_http_every_answer_is_already_durable(tmp_path):
    """Concurrent workers through the real app and uvicorn: each lease and submission is in the
    database file (as another process sees it) by the time its answer arrives, and requests were
    committed in batches counted by the app's GroupCommit."""
    cfg = run_config(tmp_path, admin_token="admin", join_tokens=["join"], max_open_leases_per_worker=4)
    server = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    db_path = cfg.orchestrator.db_path

    def row_exists(sql: str, key: str) -> bool:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
            return db.execute(sql, (key,)).fetchone() is not None

    async def worker(client: httpx.AsyncClient, i: int) -> int:
        r = await client.post(api.REGISTER.path, json={"name": f"w{i}"}, headers={"Authorization": "Bearer join"})
        w = WorkerRegistered.model_validate_json(r.content)
        auth = {"Authorization": f"Bearer {w.secret}"}
        done = 0
        for k in range(3):
            r = await client.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 2}, headers=auth)
            lease = LeaseResponse.model_validate_json(r.content).lease
            assert lease is not None and row_exists("SELECT 1 FROM leases WHERE lease_id=?", lease.lease_id)
            body = encode(make_submission(lease, np.random.default_rng([i, k])))
            r = await client.post(api.SUBMIT.path, content=body, headers=auth)
            assert r.status_code == 200, r.text
            receipt = SubmissionReceipt.model_validate_json(r.content)
            assert row_exists("SELECT 1 FROM submissions WHERE submission_id=?", receipt.submission_id)
            done += 1
        return done

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(*(worker(client, i) for i in range(8)))

    try:
        assert asyncio.run(main()) == [3] * 8
        group = server.app.state.group_commit
        assert group.requests >= 8 * 7  # register + 3 x (lease + submit) per worker, all through the group
        assert 0 < group.batches <= group.requests
    finally:
        server.stop()
