"""Adversarial workers for the hostile-swarm soak test (tests/e2e/test_hostile_swarm.py) and benchmark
(bench/hostile_swarm_bench.py): each holds a join token of its own (minted through the admin API), talks
HTTP to a running `swarmrl run`, and records every status it gets.

- Hoarder: leases all it can and lets the leases go, unsubmitted, just before their deadlines.
- Flooder: junk submissions at the body cap and forged credentials, as fast as it can, over several
  connections at once.
- SlowReward: honest-shaped submissions whose text ('zzzz...') makes tests/e2e/soak_reward.py run forever.
- Cheater: gets itself banned (wrong model hashes), then tries to come back with its token and old secret.
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from protocol import api, limits
from protocol.models import (
    Completion,
    FinishReason,
    LeaseResponse,
    RolloutSubmission,
    SubmissionReceipt,
    WorkerRegistered,
)
from trainer.tiny_model import vocab


def db(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True, timeout=30)


class Adversary(threading.Thread):
    """A worker of its own join token; records every HTTP status it gets."""

    def __init__(self, name: str, url: str, run_dir: Path, stop: threading.Event, admin_token: str):
        super().__init__(name=name, daemon=True)
        self.url, self.run_dir, self.stop = url, run_dir, stop
        self.http = httpx.Client(base_url=url, timeout=15)
        self.statuses: Counter[int] = Counter()
        self.token = self.post(api.MINT_TOKEN.path, {"label": name}, admin_token).json()["token"]
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
        r = self.post(api.LEASE.path, {"loaded_policy_version": self.version(), "max_prompts": prompts},
            self.reg.secret)
        return LeaseResponse.model_validate_json(r.content).lease if r.status_code == 200 else None

    def version(self) -> int:
        with db(self.run_dir) as con:
            return int(float(con.execute("SELECT value FROM meta WHERE key='policy_version'").fetchone()[0]))

    def model_hash(self, version: int) -> str:
        with db(self.run_dir) as con:
            return con.execute("SELECT model_hash FROM versions WHERE version=?", (version,)).fetchone()[0]

    # On one shared machine the attack is paid from the run's own cores; a benchmark may lower the
    # adversaries' priority (Linux: setpriority on a thread changes that thread only) to stand in for an
    # attacker with a machine of its own.
    nice = 0

    def run(self) -> None:
        try:
            if self.nice:
                os.setpriority(os.PRIO_PROCESS, 0, self.nice)
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
    cap = limits.submission_bytes_cap(1, 1)  # set to the run's submission cap before starting
    connections = 8  # in parallel, each ignoring Retry-After (one connection is what a naive script does)

    def attack(self) -> None:
        lock = threading.Lock()
        others = [threading.Thread(target=self.flood, args=(c, lock), daemon=True) for c in range(1, self.connections)]
        for t in others:
            t.start()
        self.flood(0, lock)
        for t in others:
            t.join()

    def flood(self, connection: int, lock: threading.Lock) -> None:
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, 0, self.nice)
        junk = np.random.default_rng(connection).bytes(self.cap - 64)
        forged = [f"w-{connection:04x}{i:012x}.forged-secret" for i in range(1000)]
        headers = {"Authorization": f"Bearer {self.reg.secret}", "content-type": "application/json"}
        statuses: Counter[int] = Counter()
        with httpx.Client(base_url=self.url, timeout=15) as http:
            i = 0
            while not self.stop.is_set():
                statuses[http.post(api.SUBMIT.path, content=junk, headers=headers).status_code] += 1
                lease = {"loaded_policy_version": 0}
                statuses[http.post(api.LEASE.path, json=lease,
                    headers={"Authorization": f"Bearer {forged[i % len(forged)]}"}).status_code] += 1
                i += 1
        with lock:
            self.statuses.update(statuses)


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
            n, version = lease.sampling.max_tokens, lease.generation_version
            comps = [Completion(prompt_index=p, sample_index=s, token_ids=np.full(n, z, np.int32), logprobs=np.full(n,
                -1.0, np.float32),
                                finish_reason=FinishReason.length,
                                proofs=[b"\x01" * limits.MAX_PROOF_BYTES] * math.ceil(n / limits.PROOF_CHUNK_TOKENS))
                     for p in range(len(lease.prompts)) for s in range(lease.samples_per_prompt)]
            sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=version,
                model_hash=self.model_hash(version), completions=comps)
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
                                finish_reason=FinishReason.length, proofs=[rng.bytes(8)])
                                for s in range(lease.samples_per_prompt)]
            sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=lease.generation_version,
                model_hash="f" * 64, completions=comps)
            self.post(api.SUBMIT.path, None, self.reg.secret, content=sub.model_dump_json().encode())
            self.stop.wait(0.5)
        self.comeback = [self.post(api.REGISTER.path, {"name": f"{self.name}-{i}"}, self.token).status_code
            for i in range(3)]
        self.old_secret = [
            self.post(api.HEARTBEAT.url("", worker_id=self.reg.worker_id), {"state": "idle"},
            self.reg.secret).status_code,
            self.post(api.LEASE.path, {"loaded_policy_version": 0}, self.reg.secret).status_code,
        ]
