"""A hostile swarm cannot stall the run: the real loop (`swarmrl run`: Ray, verifier, trainer, an honest
vLLM worker) with one adversary of each kind at once, each with a join token of its own, talking HTTP:

- a hoarder that leases all it can and lets the leases go just before their deadlines;
- a flooder that sends junk submissions at the cap and forged credentials, as fast as it can;
- a slow-reward adversary whose completions' text makes the run's reward run forever;
- a cheater that gets itself banned, then tries to come back with its join token and its old secret.

The slow-reward adversary needs texts of its choosing to be scored. With full verification no worker can
choose its text (the verifier checks every token against the seeded draw), so this run turns deep checks
off for new workers (`verifier.spot_check_rate.new = 0`), what an operator trading verification for
throughput would do: the reward's time limit must contain it then.

Asserted: no 5xx to anyone, no hang, the run keeps advancing versions, the honest worker is never
struck, and every adversary is refused or contained.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import zstandard

from e2e_helpers import db, metrics, pids, start_run, stop_run, wait_for
from protocol import api, limits
from protocol.models import Completion, FinishReason, LeaseResponse, RolloutSubmission, SubmissionReceipt, WorkerRegistered
from trainer.tiny_model import vocab

pytestmark = pytest.mark.e2e

ADMIN = "demo-admin-token"
HERE = Path(__file__).resolve().parent


class Adversary(threading.Thread):
    """A worker of its own join token; records every HTTP status it gets."""

    def __init__(self, name: str, url: str, run_dir: Path, stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self.url, self.run_dir, self.stop = url, run_dir, stop
        self.http = httpx.Client(base_url=url, timeout=15)
        self.statuses: Counter[int] = Counter()
        self.token = self.post(api.MINT_TOKEN.path, {"label": name}, ADMIN).json()["token"]
        self.reg = self.register()
        self.error: BaseException | None = None

    def post(self, path: str, body, token: str, content: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        if content is None:
            r = self.http.post(path, json=body, headers=headers)
        else:
            r = self.http.post(path, content=content, headers=headers | {"content-type": "application/json"})
        self.statuses[r.status_code] += 1
        return r

    def register(self) -> WorkerRegistered:
        r = self.post(api.REGISTER.path, {"name": self.name}, self.token)
        assert r.status_code == 200, r.text
        return WorkerRegistered.model_validate_json(r.content)

    def lease(self, prompts: int = 64):
        r = self.post(api.LEASE.path, {"loaded_policy_version": self.version(), "max_prompts": prompts}, self.reg.secret)
        return LeaseResponse.model_validate_json(r.content).lease if r.status_code == 200 else None

    def version(self) -> int:
        with db(self.run_dir) as con:
            return int(float(con.execute("SELECT value FROM meta WHERE key='policy_version'").fetchone()[0]))

    def model_hash(self, version: int) -> str:
        with db(self.run_dir) as con:
            return con.execute("SELECT model_hash FROM versions WHERE version=?", (version,)).fetchone()[0]

    def run(self) -> None:
        try:
            self.attack()
        except BaseException as exc:  # surfaced by the test
            self.error = exc


class Hoarder(Adversary):
    def attack(self) -> None:
        self.held_max, self.refused = 0, 0
        held = []
        while not self.stop.is_set():
            lease = self.lease()
            if lease is None:
                self.refused += 1
            else:
                held.append(lease)
            self.held_max = max(self.held_max, sum(len(lease.prompts) for lease in held))
            soonest = min((lease.deadline for lease in held), default=time.time() + 1)
            if time.time() > soonest - 1.0:  # give them back just before the deadline, unsubmitted
                for lease in held:
                    self.post(api.RELEASE.url("", lease_id=lease.lease_id), {"reason": "hoarded"}, self.reg.secret)
                held = []
            self.stop.wait(0.2)


class Flooder(Adversary):
    def attack(self) -> None:
        junk = np.random.default_rng(0).bytes(self.cap - 64)
        forged = [f"w-{i:016x}.forged-secret" for i in range(1000)]
        i = 0
        while not self.stop.is_set():
            self.post(api.SUBMIT.path, None, self.reg.secret, content=junk)
            self.post(api.LEASE.path, {"loaded_policy_version": 0}, forged[i % len(forged)])
            i += 1


class SlowReward(Adversary):
    """Honest-looking submissions (right shape, version, hash and termination) whose text is all 'z'."""

    def attack(self) -> None:
        self.verdicts = []
        z = vocab()["z"]
        while not self.stop.is_set() and self.statuses[403] == 0:
            lease = self.lease(2)
            if lease is None:
                self.stop.wait(0.5)
                continue
            n, version = lease.sampling.max_tokens, lease.policy_version
            comps = [Completion(prompt_index=p, sample_index=s, token_ids=np.full(n, z, np.int32), logprobs=np.full(n, -1.0, np.float32),
                                finish_reason=FinishReason.length, proofs=[b"\x01" * limits.MAX_PROOF_BYTES] * math.ceil(n / limits.PROOF_CHUNK_TOKENS))
                     for p in range(len(lease.prompts)) for s in range(lease.samples_per_prompt)]
            sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=version, model_hash=self.model_hash(version), completions=comps)
            r = self.post(api.SUBMIT.path, None, self.reg.secret, content=sub.model_dump_json().encode())
            if r.status_code == 200:
                self.verdicts.append(SubmissionReceipt.model_validate_json(r.content).submission_id)
            self.stop.wait(1.0)


class Cheater(Adversary):
    """Gets banned (wrong model hashes), then tries to come back: new registrations, the old secret."""

    def attack(self) -> None:
        while not self.stop.is_set() and self.statuses[403] == 0:
            lease = self.lease(1)
            if lease is None:
                self.stop.wait(0.3)
                continue
            rng = np.random.default_rng(len(self.statuses) + self.statuses.total())  # distinct content: not a replay
            comps = [Completion(prompt_index=0, sample_index=s, token_ids=rng.integers(5, 30, size=1), logprobs=[-1.0],
                                finish_reason=FinishReason.length, proofs=[rng.bytes(8)]) for s in range(lease.samples_per_prompt)]
            sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=lease.policy_version, model_hash="f" * 64, completions=comps)
            self.post(api.SUBMIT.path, None, self.reg.secret, content=sub.model_dump_json().encode())
            self.stop.wait(0.5)
        self.comeback = [self.post(api.REGISTER.path, {"name": f"{self.name}-{i}"}, self.token).status_code for i in range(3)]
        self.old_secret = [
            self.post(api.HEARTBEAT.url("", worker_id=self.reg.worker_id), {"state": "idle"}, self.reg.secret).status_code,
            self.post(api.LEASE.path, {"loaded_policy_version": 0}, self.reg.secret).status_code,
        ]


def test_a_hostile_swarm_cannot_stall_the_run(tmp_path):
    proc = start_run(
        tmp_path, "--name", "soak", "--trainer.max_steps", "1000", "--num_workers", "1",
        "--data.reward", "soak_reward:reward", "--verifier.rewards.import_paths", json.dumps([str(HERE)]),
        "--verifier.spot_check_rate", '{"new": 0.0, "trusted": 1.0}', "--orchestrator.strikes_to_ban", "3",
    )
    run_dir = tmp_path / "soak"
    stop = threading.Event()
    adversaries: list[Adversary] = []
    try:
        url = wait_for(lambda: pids(run_dir).get("url"), 240, "the orchestrator's URL", proc)
        wait_for(lambda: len(metrics(run_dir)) >= 2, 240, "two trainer steps before the attack", proc)
        cap = limits.submission_bytes_cap(2 * 4, 8)
        Flooder.cap = cap
        adversaries = [Hoarder("hoarder", url, run_dir, stop), Flooder("flooder", url, run_dir, stop),
                       SlowReward("slow", url, run_dir, stop), Cheater("cheater", url, run_dir, stop)]
        start_version = metrics(run_dir)[-1]["version"]
        for a in adversaries:
            a.start()
        # The operator keeps watching through it all: no hang, never a 5xx.
        watch = httpx.Client(base_url=url, timeout=10)
        deadline = time.time() + 90
        while time.time() < deadline:
            st = watch.get(api.STATUS.path, headers={"Authorization": f"Bearer {ADMIN}"})
            assert st.status_code == 200, st.text
            assert proc.poll() is None, "the run died under attack"
            time.sleep(1.0)
        stop.set()
        for a in adversaries:
            a.join(timeout=30)
        end_version = metrics(run_dir)[-1]["version"]
        workers = {w["name"]: w for w in watch.get(api.WORKERS.path, headers={"Authorization": f"Bearer {ADMIN}"}).json()["workers"]}
    finally:
        stop.set()
        stop_run(proc)
    hoarder, flooder, slow, cheater = adversaries
    for a in adversaries:
        assert a.error is None, f"{a.name}: {a.error!r}"
        assert not [s for s in a.statuses if s >= 500], f"{a.name} got {a.statuses}"
    # The run kept advancing.
    assert end_version - start_version >= 3, (start_version, end_version)
    honest = workers["local-0"]
    assert not honest["banned"] and honest["strikes"] == 0 and honest["submissions_accepted"] > 0
    # The hoarder never held more than its fair share of the bound of 12 prompts: 12 / (live join tokens),
    # which grows as the other adversaries get banned but never passes half (the honest token is live too).
    assert hoarder.held_max <= 12 // 2 and hoarder.refused > 0
    # The flooder got nothing but refusals (4xx), never a 2xx for its junk.
    assert set(flooder.statuses) <= {200, 401, 413, 422, 429} and flooder.statuses[200] == 2  # its token minting and registration
    # The slow rewards were cut off at their time limit and struck the worker until it was banned.
    assert slow.verdicts and workers["slow"]["strikes"] >= 1
    with db(run_dir) as con:
        statuses = [json.loads(v).get("reward_status") for (v,) in con.execute(
            "SELECT verdict FROM submissions WHERE worker_id=? AND verdict IS NOT NULL", (slow.reg.worker_id,))]
    assert any(s and "timed_out" in s for s in statuses)
    # The cheater was banned, and came back neither with its join token nor with its old secret.
    assert workers["cheater"]["banned"], (cheater.statuses, workers["cheater"])
    assert cheater.comeback == [403, 403, 403] and cheater.old_secret == [403, 403]
