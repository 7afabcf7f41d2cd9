"""Orchestrator throughput: simulated workers on loopback lease tasks and submit realistic rollouts.

The orchestrator runs in its own process (real uvicorn, real SQLite file, the real admission path:
auth, size caps, zstd, schema with vocab check, lease, version, shape, replay fingerprint, durable
insert). Verification is STUBBED for this benchmark only (accept, random rewards), so accepted
submissions still become buffer samples in SQLite; a stub trainer thread in the server takes and
commits batches through the real `take_batch` / `commit_batches` (without publishing versions), so the
buffer stays bounded as in a real run and the async-generation bound does not stall the workers.

Clients run in separate processes: raw HTTP/1.1 keep-alive connections on asyncio (+ uvloop if installed; one per
simulated worker), so the client costs far less CPU per request than the server. With
`--server-cpus 0 --client-cpus 1` (the default on a machine with >= 2 cores) the server and the
clients are pinned to different cores, standing in for separate machines.

Two modes. Closed loop (the default): each worker leases again as soon as its submit returns, which
measures saturation throughput (its latency is only workers in flight / throughput). Paced (`--rates`,
open loop): each worker starts a cycle at the times of its own Poisson process (rate / workers; the
gaps stand in for generation), which measures latency at a given offered rate; "scheduled" latency is
from the scheduled start to the submit response, so a stall makes the cycles behind it late instead
of postponing them (no coordinated omission).

Reported per point: accepted submissions/s, submit / lease latency p50, p99 and max, the server's
CPU-seconds per accepted submission (from the kernel's accounting of the server process: independent
of other load on the machine, unlike wall-clock throughput) and the implied capacity of one core, RSS.
`--compare-head` also runs the code of git HEAD's `orchestrator/`, `protocol/` and `trainer/` side by side (the
"before"); `--compare-ref REF` the code of any commit.
Then, unless `--no-steps`: the server's CPU per step of a cycle measured in-process (no HTTP, no
threads; thread CPU time), to show where the time goes.

    python bench/orchestrator_bench.py                          # 64 and 256 workers, 15 s each
    python bench/orchestrator_bench.py --workers 64 --seconds 10 --compare-head
    python bench/orchestrator_bench.py --steps --compare-head   # only the per-step table
    python bench/orchestrator_bench.py --workers 64 --rates 300 400 500 600 --seconds 8   # paced
    python bench/orchestrator_bench.py --workers 64 --rates 500 --closed-loop --compare-ref 8a83d27
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LEASE_MARK = "LEASEMARK"
PROOF_MARK = "PROOFMARK"
ADMIN, JOIN = "bench-admin", "bench-join"
HEAD_DIR = REPO / "bench" / ".work" / "orchestrator_head"
BEFORE_LABEL = "git HEAD (before)"  # the rows of the code being compared against (--compare-head / --compare-ref)
# The packages whose code is on the server's path: the "before" runs git HEAD's copy of all of them.
HEAD_PACKAGES = ("orchestrator", "protocol", "trainer")


# --------------------------------------------------------------------------------------------------
# server side


class StubVerifier:
    """Accepts everything with random rewards (BENCHMARK ONLY: no proof checks, no model)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def verify_many(self, jobs):
        from protocol.verdicts import Verdict, VerdictStatus

        return [
            Verdict(submission_id=j.submission_id, status=VerdictStatus.accepted,
                    rewards=self.rng.random(len(j.submission.completions)).tolist(),
                    verified_tokens=j.submission.num_tokens)
            for j in jobs
        ]


# The harness also runs older commits (--compare-ref) whose orchestrator had another shape: these helpers
# build and drive either (orchestrator.db: the current one; orchestrator.state: before the split).


def make_orchestrator(cfg, prompts, verifier):
    from orchestrator.service import Orchestrator

    try:
        from orchestrator.db import Database
    except ImportError:
        from orchestrator.state import State

        return Orchestrator(cfg, State(cfg.orchestrator.db_path), prompts, verifier, verify_batch=64)
    return Orchestrator(cfg.orchestrator, Database(cfg.orchestrator.db_path), prompts, verifier, shape=cfg.step_shape(),
                        task_name=cfg.data.task, run_name=cfg.name, verify_batch=64)


def register(orch, reg):
    return orch.register(reg, JOIN) if hasattr(orch, "tokens") else orch.register(reg)


def commit(orch, batch_id: str) -> None:
    """Commit without publishing a new version."""
    if hasattr(orch, "commit_batches"):
        orch.commit_batches({batch_id: 0}, {})
    else:  # an older ref's orchestrator
        orch.commit_batch(batch_id, 0)


def announce_v0(orch) -> None:
    """Version 0 (the trainer's first reconciliation announces it in a run)."""
    if hasattr(orch, "versions"):
        orch.versions.announce({0: "0" * 64})
    else:  # an older ref's orchestrator
        orch.publish_version(0, "0" * 64)


def verify_pending(orch) -> int:
    return orch.verification.verify_pending() if hasattr(orch, "verification") else orch.verify_pending()


def close(orch) -> None:
    (orch.db if hasattr(orch, "db") else orch.state).close()


def bench_config(run_dir: Path, port: int, args):
    try:
        from orchestrator.config import RunConfig
    except ImportError:
        from swarmrl.config import RunConfig

    orch_fields = RunConfig.model_fields["orchestrator"].annotation.model_fields
    # 64-256 simulated workers under one join token (newer configs cap identities per token).
    many = {"max_identities_per_token": 100_000,
        "registrations_per_min_per_token": 1e9} if "max_identities_per_token" in orch_fields else {}
    return RunConfig.model_validate({
        "name": "bench", "output_dir": str(run_dir), "seed": 0,
        "data": {"task": "toy", "num_prompts": 4096},
        # Big steps: the async bound ((async_level + 1) * samples_per_step) leaves room for every worker's lease.
        "trainer": {"samples_per_step": args.samples_per_step},
        "orchestrator": {"port": port, "samples_per_prompt": args.samples_per_prompt,
                         "prompts_per_lease": args.prompts_per_lease, "sampling": {"max_tokens": args.max_tokens},
                         "max_open_leases_per_worker": 2, "rate_limit_per_s": 1000.0, "lease_timeout_s": 120.0,
                         "admin_token": ADMIN, "join_tokens": [JOIN], "db_path": str(run_dir / "orchestrator.sqlite"),
                         **many},
    })


def stub_trainer(orch, n: int, stop: threading.Event, events: list) -> None:
    """Consumes the buffer like the trainer does (take + commit), without publishing new versions."""
    while not stop.is_set():
        c0 = time.thread_time()
        batch = orch.take_batch(n, wait_s=0.5)
        # The real trainer decodes batch.samples in its own process (older code decoded them in take_batch).
        if batch.num_samples if hasattr(batch, "num_samples") else batch.samples:
            commit(orch, batch.batch_id)
            # (end time, CPU ms of take + commit): each pull competes with the HTTP thread for the one core
            events.append(("trainer pull", time.perf_counter(), 1e3 * (time.thread_time() - c0)))
        else:
            orch.give_back_batch(batch.batch_id)


def record_gc(events: list) -> None:
    """Records collections of generation >= 1 (end time, wall ms): they stop every thread."""
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] >= 1:
            now = time.perf_counter()
            events.append((f"gc gen {info['generation']}", now, 1e3 * (now - started[0])))

    gc.callbacks.append(on_gc)


def serve_main(args) -> None:
    import logging

    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.src:  # run another copy of orchestrator/, protocol/, trainer/ (e.g. git HEAD's) against the same harness
        sys.path.insert(0, args.src)
    from environments.tasks import get_task
    from orchestrator.data import PromptSet
    from orchestrator.server import OrchestratorServer
    from trainer.tiny_model import make_tokenizer, padded_vocab_size

    logging.basicConfig(level=logging.WARNING)
    cfg = bench_config(Path(args.dir), args.port, args)
    items = get_task("toy", digits=6).make_prompts(cfg.data.num_prompts, 0)
    prompts = PromptSet.from_items(items, make_tokenizer(), 0, padded_vocab_size())
    orch = make_orchestrator(cfg, prompts, StubVerifier())
    announce_v0(orch)
    server = OrchestratorServer(orch).start()
    stop, events = threading.Event(), []
    record_gc(events)
    trainer = threading.Thread(target=stub_trainer, args=(orch, args.samples_per_step, stop, events),
        name="stub-trainer", daemon=True)
    trainer.start()
    # Native thread ids -> names, so the harness can split the server's CPU by thread from /proc.
    (Path(args.dir) / "threads.json").write_text(json.dumps({t.native_id: t.name for t in threading.enumerate()}))
    print(server.url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.1):
        pass
    trainer.join(timeout=10)
    server.stop()
    # Times are perf_counter (CLOCK_MONOTONIC: the same clock in every process), to line up with the clients' cycles.
    (Path(args.dir) / "server_events.json").write_text(json.dumps(events))


STEPS = ("lease", "submit", "verify", "take", "commit")


def steps_main(args) -> None:
    """In-process CPU per step of one cycle, no HTTP and no threads: where the server's time goes,
    step by step (thread CPU time, so less sensitive to other load than wall-clock numbers). One cycle:
    lease (+ its JSON response) and submit (+ receipt) for one of 64 workers; every 16 cycles the
    verification of the queued submissions (stub verifier) and one trainer pull (take + commit)."""
    import gc
    import shutil
    import tempfile

    if args.src:
        sys.path.insert(0, args.src)
    import zstandard

    from environments.tasks import get_task
    from orchestrator.data import PromptSet
    from protocol.models import LeaseRequest, WorkerRegistration
    from trainer.tiny_model import make_tokenizer, padded_vocab_size

    run_dir = Path(tempfile.mkdtemp(prefix="swarmrl-orch-steps-"))
    cfg = bench_config(run_dir, 0, args)
    items = get_task("toy", digits=6).make_prompts(cfg.data.num_prompts, 0)
    orch = make_orchestrator(cfg, PromptSet.from_items(items, make_tokenizer(), 0, padded_vocab_size()), StubVerifier())
    announce_v0(orch)
    workers = [orch.authenticate(register(orch, WorkerRegistration(name="bench")).secret) for _ in range(64)]
    tmpl, cctx, rng = template(args), zstandard.ZstdCompressor(level=1), np.random.default_rng(0)
    spent = dict.fromkeys(STEPS, 0.0)
    clock = time.thread_time

    def cycle(i: int) -> None:
        wid = workers[i % len(workers)]
        t0 = clock()
        resp = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=64))
        resp.model_dump_json()
        t1 = clock()
        body = cctx.compress(tmpl.replace(LEASE_MARK, resp.lease.lease_id).replace(PROOF_MARK,
            base64.b64encode(rng.bytes(258)).decode()).encode())
        t2 = clock()
        (orch.admission.submit if hasattr(orch, "admission") else orch.submit)(wid, body, "zstd").model_dump_json()
        t3 = clock()
        spent["lease"] += t1 - t0
        spent["submit"] += t3 - t2
        if i % 16 == 15:
            verify_pending(orch)
            t4 = clock()
            batch = orch.take_batch(512)
            t5 = clock()
            commit(orch, batch.batch_id)
            spent["verify"] += t4 - t3
            spent["take"] += t5 - t4
            spent["commit"] += clock() - t5

    for i in range(200):  # warm-up
        cycle(i)
    gc.collect()
    # as the server now does at start; HEAD's server did not: its full-collection stalls show in the wall-clock points
    gc.freeze()
    spent = dict.fromkeys(STEPS, 0.0)
    process0 = time.process_time()
    for i in range(args.steps_cycles):
        cycle(200 + i)
    process = time.process_time() - process0
    out = {k: round(1e3 * v / args.steps_cycles, 3) for k, v in spent.items()}
    out["total"] = round(sum(out.values()), 3)
    # All threads (e.g. a background WAL checkpointer) and the harness's own compression: an upper bound.
    out["process"] = round(1e3 * process / args.steps_cycles, 3)
    print(json.dumps(out), flush=True)
    close(orch)
    shutil.rmtree(run_dir, ignore_errors=True)


def run_steps(args, src: str = "") -> dict:
    cmd = [sys.executable, __file__, "--steps-worker", "--steps-cycles", str(args.steps_cycles), "--src", src,
           "--cpus", args.server_cpus, "--samples-per-prompt", str(args.samples_per_prompt), "--prompts-per-lease",
           str(args.prompts_per_lease), "--max-tokens", str(args.max_tokens), "--samples-per-step",
           str(args.samples_per_step)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ,
        PYTHONPATH=str(REPO))).stdout
    return {"code": BEFORE_LABEL if src else "working tree (after)", **json.loads(out.strip().splitlines()[-1])}


# --------------------------------------------------------------------------------------------------
# client side: raw HTTP/1.1 keep-alive (one connection per simulated worker)


def template(args) -> str:
    """A submission body for any lease of the benchmark's shape, with marks for the lease id and one proof."""
    from protocol import limits
    from protocol.models import Completion, FinishReason, RolloutSubmission

    rng = np.random.default_rng(1)
    comps = []
    for p in range(args.prompts_per_lease):
        for s in range(args.samples_per_prompt):
            n = int(rng.integers(args.max_tokens // 2, args.max_tokens + 1))
            k = -(-n // limits.PROOF_CHUNK_TOKENS)
            comps.append(Completion(prompt_index=p, sample_index=s, token_ids=rng.integers(3, 50, n),
                                    logprobs=-rng.random(n).astype(np.float32), finish_reason=FinishReason.length,
                                    proofs=[rng.bytes(limits.MAX_PROOF_BYTES) for _ in range(k)]))
    sub = RolloutSubmission(lease_id="L0", policy_version=0, model_hash="0" * 64, completions=comps)
    doc = json.loads(sub.model_dump_json())
    doc["lease_id"] = LEASE_MARK
    doc["completions"][0]["proofs"][0] = PROOF_MARK
    return json.dumps(doc, separators=(",", ":"))


class Conn:
    """One keep-alive HTTP/1.1 connection; just enough of the protocol for this benchmark."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    async def open(self) -> "Conn":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, method: str, path: str, body: bytes = b"", headers: str = "") -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode()
        self.writer.write(head + body)
        resp = await self.reader.readuntil(b"\r\n\r\n")
        status = int(resp[9:12])
        i = resp.lower().find(b"\r\ncontent-length:")
        n = int(resp[i + 17 : resp.find(b"\r\n", i + 2)]) if i >= 0 else 0
        return status, await self.reader.readexactly(n) if n else b""


async def ceiling_loop(conn: Conn, tmpl: str, stop_at: float, measure_from: float, out: dict, rng) -> None:
    """The HTTP ceiling: the same two requests per cycle, to an endpoint that does nothing."""
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        await conn.request("GET", "/healthz")
        t1 = time.perf_counter()
        status, _ = await conn.request("GET", "/healthz")
        t2 = time.perf_counter()
        if measure_from <= t2 <= stop_at and status == 200:
            out["accepted"] += 1
            out["lease_ms"].append((t1 - t0) * 1e3)
            out["submit_ms"].append((t2 - t1) * 1e3)


class SimWorker:
    """One simulated worker's requests: register, lease, submit (the same bodies in both modes)."""

    def __init__(self, conn: Conn, tmpl: str, rng) -> None:
        import zstandard

        self.conn, self.tmpl, self.rng = conn, tmpl, rng
        self.cctx = zstandard.ZstdCompressor(level=1)
        self.lease_body = b'{"loaded_policy_version":0,"max_prompts":64}'

    async def register(self) -> "SimWorker":
        from protocol import api

        status, data = await self.conn.request("POST", api.REGISTER.path, b'{"name":"bench"}',
                                               f"Authorization: Bearer {JOIN}\r\nContent-Type: application/json\r\n")
        assert status == 200, data
        self.auth = f"Authorization: Bearer {json.loads(data)['secret']}\r\nContent-Type: application/json\r\n"
        self.authz = self.auth + "Content-Encoding: zstd\r\n"
        return self

    async def lease(self) -> tuple[int, dict | None, float, float]:
        """(status, parsed response if 200, send time, response time)."""
        from protocol import api

        t0 = time.perf_counter()
        status, data = await self.conn.request("POST", api.LEASE.path, self.lease_body, self.auth)
        t1 = time.perf_counter()
        return status, json.loads(data) if status == 200 else None, t0, t1

    async def submit(self, lease_id: str) -> tuple[int, float, float]:
        """Builds the body (client work, not timed) and submits it: (status, send time, response time)."""
        from protocol import api, limits

        proof = base64.b64encode(self.rng.bytes(limits.MAX_PROOF_BYTES)).decode()
        body = self.cctx.compress(self.tmpl.replace(LEASE_MARK, lease_id).replace(PROOF_MARK, proof).encode())
        t2 = time.perf_counter()
        status, _ = await self.conn.request("POST", api.SUBMIT.path, body, self.authz)
        return status, t2, time.perf_counter()


def count(errors: dict, key: str) -> None:
    errors[key] = errors.get(key, 0) + 1


async def worker_loop(conn: Conn, tmpl: str, stop_at: float, measure_from: float, out: dict, rng) -> None:
    """Closed loop: lease -> submit -> lease ... with zero think time."""
    w = await SimWorker(conn, tmpl, rng).register()
    errors = out["errors"]
    while time.perf_counter() < stop_at:
        status, resp, t0, t1 = await w.lease()
        if status != 200:
            count(errors, f"lease {status}")
            await asyncio.sleep(0.05)
            continue
        if resp["lease"] is None:  # backpressure (verifier backlog or async bound): wait as told
            count(errors, "lease: none, retry")
            await asyncio.sleep(resp["retry_after_s"])
            continue
        status, t2, t3 = await w.submit(resp["lease"]["lease_id"])
        if measure_from <= t3 <= stop_at:  # counted by completion time
            out["lease_ms"].append((t1 - t0) * 1e3)
            if status == 200:
                out["submit_ms"].append((t3 - t2) * 1e3)
                out["accepted"] += 1
            else:
                count(errors, f"submit {status}")


def poisson_schedule(rng, rate: float, start: float, stop_at: float) -> list[float]:
    """Start times of a Poisson process of `rate` per second on [start, stop_at): exponential gaps stand in for
    generation."""
    times: list[float] = []
    t = start
    while True:
        gaps = np.cumsum(rng.exponential(1.0 / rate, size=max(16, int(rate * (stop_at - t)) + 16)))
        times += (t + gaps[t + gaps < stop_at]).tolist()
        if t + gaps[-1] >= stop_at:
            return times
        t += gaps[-1]


async def paced_loop(conn: Conn, tmpl: str, schedule: list[float], stop_at: float, measure_from: float, out: dict,
    rng) -> None:
    """Open loop: one cycle (lease, then submit) at each scheduled time; a cycle that starts late (its predecessor ran
    past its time) starts at once, never skipped. Latencies of the cycles SCHEDULED in the window, whenever they end."""
    w = await SimWorker(conn, tmpl, rng).register()
    errors = out["errors"]
    i, prev_end = 0, 0.0
    try:
        for i, t_sched in enumerate(schedule):
            now = time.perf_counter()
            if t_sched > now:
                await asyncio.sleep(t_sched - now)
            # Client lag: how much later than it could have, the cycle starts (the sleep's overshoot or a busy client
            # loop).
            lag = time.perf_counter() - max(t_sched, prev_end)
            while True:  # lease until granted: a refused lease makes this cycle, and the schedule behind it, late
                status, resp, t0, t1 = await w.lease()
                if status != 200:
                    count(errors, f"lease {status}")
                    await asyncio.sleep(0.05)
                elif resp["lease"] is None:  # backpressure: wait as told
                    count(errors, "lease: none, retry")
                    await asyncio.sleep(resp["retry_after_s"])
                else:
                    break
            status, t2, t3 = await w.submit(resp["lease"]["lease_id"])
            prev_end = t3
            # throughput: counted by completion time, as the closed loop
            if measure_from <= t3 <= stop_at and status == 200:
                out["accepted"] += 1
            if measure_from <= t_sched < stop_at:  # latencies: counted by scheduled time
                out["client_lag_ms"].append(lag * 1e3)
                out["lease_ms"].append((t1 - t0) * 1e3)
                if status == 200:
                    out["submit_ms"].append((t3 - t2) * 1e3)
                    out["sched_ms"].append((t3 - t_sched) * 1e3)
                    out["sched_at"].append(t_sched)
                else:
                    count(errors, f"submit {status}")
    except asyncio.CancelledError:  # drain deadline: cycles still owed count with their lateness so far (a lower bound)
        now = time.perf_counter()
        for t_sched in schedule[i:]:
            if measure_from <= t_sched < stop_at:
                out["sched_ms"].append((now - t_sched) * 1e3)
                out["sched_at"].append(t_sched)
                count(errors, "unfinished at drain end (latency so far counted)")


def client_proc(url: str, n_workers: int, start_at: float, seconds: float, warmup: float, tmpl: str, seed: int, q,
                ceiling: bool, cpus: str, worker_rate: float = 0.0, drain: float = 10.0) -> None:
    """`worker_rate` > 0: paced mode, each worker on its own Poisson schedule of that rate (cycles/s)."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def main():
        conns = [await Conn(host, int(port)).open() for _ in range(n_workers)]
        out = {"lease_ms": [], "submit_ms": [], "sched_ms": [], "sched_at": [], "client_lag_ms": [], "accepted": 0,
            "errors": {}, "scheduled": 0}
        await asyncio.sleep(max(0.0, start_at - time.time()))  # all client processes start together
        now = time.perf_counter()
        measure_from, stop_at = now + warmup, now + warmup + seconds
        out["measure_from"] = measure_from
        rngs = [np.random.default_rng([seed, i]) for i in range(n_workers)]
        if not worker_rate:
            loop_fn = ceiling_loop if ceiling else worker_loop
            await asyncio.gather(*(loop_fn(c, tmpl, stop_at, measure_from, out, rng) for c, rng in zip(conns, rngs)))
            return out
        schedules = [poisson_schedule(np.random.default_rng([seed, i, 1]), worker_rate, now, stop_at)
            for i in range(n_workers)]
        out["scheduled"] = sum(measure_from <= t < stop_at for s in schedules for t in s)
        tasks = [asyncio.create_task(paced_loop(c, tmpl, s, stop_at, measure_from, out, rng)) for c, s,
            rng in zip(conns, schedules, rngs)]
        _, pending = await asyncio.wait(tasks, timeout=stop_at + drain - time.perf_counter())
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return out

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    q.put(asyncio.run(main()))


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a /proc stat file (a process's, or one of its threads')."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def thread_cpu_s(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of a process, by native thread id, from /proc."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = stat_cpu_s(task / "stat")
        except FileNotFoundError:  # the thread ended
            continue
    return out


def cores_busy_s(cpus: str) -> float:
    """Busy (non-idle) CPU seconds of these cores since boot, all processes, from /proc/stat."""
    wanted, busy = {f"cpu{c}" for c in cpus.split(",")}, 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *ticks = line.split()
        if name in wanted:
            ticks = [int(t) for t in ticks]
            busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_point(args, n_workers: int, tmpl: str, ceiling: bool = False, src: str = "", rate: float = 0.0) -> dict:
    """One point: closed loop (rate 0) or paced at `rate` offered submissions/s summed over the workers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="swarmrl-orch-bench-"))
    cmd = [sys.executable, __file__, "--serve", "--dir", str(run_dir), "--port", str(port), "--samples-per-prompt",
           str(args.samples_per_prompt), "--prompts-per-lease", str(args.prompts_per_lease), "--max-tokens",
           str(args.max_tokens), "--samples-per-step", str(args.samples_per_step), "--cpus", args.server_cpus, "--src",
           src]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://"), url
        rss_idle = rss_mb(server.pid)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        per = [n_workers // args.client_procs + (i < n_workers % args.client_procs) for i in range(args.client_procs)]
        start_at = time.time() + 3.0
        procs = [ctx.Process(target=client_proc, args=(url, k, start_at, args.seconds, args.warmup, tmpl, i, q,
                                                       ceiling, args.client_cpus, rate / n_workers, args.drain))
                 for i, k in enumerate(per)]
        for p in procs:
            p.start()
        time.sleep(max(0.0, start_at + args.warmup - time.time()))
        cpu0, load0, peak = cpu_s(server.pid), os.getloadavg()[0], rss_idle
        threads0 = thread_cpu_s(server.pid)
        client_cpu0 = sum(cpu_s(p.pid) for p in procs)
        core0 = cores_busy_s(args.server_cpus) if args.server_cpus else 0.0
        end = time.time() + args.seconds
        while time.time() < end:
            time.sleep(0.25)
            peak = max(peak, rss_mb(server.pid))
        server_cpu = cpu_s(server.pid) - cpu0
        threads1 = thread_cpu_s(server.pid)
        # Other processes on the server's core(s) (e.g. other people's jobs on a shared machine): they slow the server.
        others_on_server_cores = cores_busy_s(args.server_cpus) - core0 - server_cpu if args.server_cpus else None
        client_cpu = sum(cpu_s(p.pid) for p in procs) - client_cpu0  # all client processes (they share --client-cpus)
        results = [q.get(timeout=120 + args.drain) for _ in procs]
        for p in procs:
            p.join(timeout=10)
        import httpx

        st = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        import shutil

        names_file = run_dir / "threads.json"
        names = {int(k): v for k, v in json.loads(names_file.read_text()).items()} if names_file.exists() else {}
        events_file = run_dir / "server_events.json"
        events = json.loads(events_file.read_text()) if events_file.exists() else []
        shutil.rmtree(run_dir, ignore_errors=True)
    submit, lease, sched, lag = (np.array(sum((r[k] for r in results), [])) for k in ("submit_ms", "lease_ms",
        "sched_ms", "client_lag_ms"))
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    accepted = sum(r["accepted"] for r in results)
    t_from = min(r["measure_from"] for r in results)
    events = [(kind, t - t_from, ms) for kind, t, ms in events if t_from <= t <= t_from + args.seconds]
    cpu_ms = 1e3 * server_cpu / max(accepted, 1)
    pct = lambda a, q: round(float(np.percentile(a, q)), 2) if a.size else None  # noqa: E731
    return {
        "code": BEFORE_LABEL if src else "working tree (after)",
        "mode": "ceiling: 2x GET /healthz per cycle" if ceiling else "paced: lease + submit" if rate
        else "closed loop: lease + submit", "workers": n_workers,
        "offered_submissions_per_s": rate or None,
        "scheduled_per_s": round(sum(r["scheduled"] for r in results) / args.seconds, 1) if rate else None,
        "seconds": args.seconds,
        "accepted_submissions": accepted,
        "accepted_submissions_per_s": round(accepted / args.seconds, 1),
        "completions_per_s": round(accepted * args.prompts_per_lease * args.samples_per_prompt / args.seconds, 1),
        "submit_p50_ms": pct(submit, 50), "submit_p99_ms": pct(submit, 99), "submit_max_ms": pct(submit, 100),
        "lease_p50_ms": pct(lease, 50), "lease_p99_ms": pct(lease, 99), "lease_max_ms": pct(lease, 100),
        # paced only: submit response - scheduled start of the cycle (includes waiting behind a late schedule)
        "scheduled_p50_ms": pct(sched, 50), "scheduled_p99_ms": pct(sched, 99), "scheduled_max_ms": pct(sched, 100),
        "client_lag_p50_ms": pct(lag, 50), "client_lag_p99_ms": pct(lag, 99),
        "server_cpu_ms_per_submission": round(cpu_ms, 3),
        "one_core_capacity_per_s": round(1e3 / cpu_ms, 0),
        "server_cpu_share": round(server_cpu / args.seconds, 3),
        # Share of a core per server thread over the window (the HTTP thread serves every request).
        "server_cpu_share_by_thread": {names.get(tid, "other"): round((threads1[tid] - threads0.get(tid,
        0.0)) / args.seconds, 3)
                                       for tid in sorted(threads1, key=lambda t: threads0.get(t, 0.0) - threads1[t])
                                       if threads1[tid] - threads0.get(tid, 0.0) > 0},
        "client_cpu_share": round(client_cpu / args.seconds, 3),
        "server_events": {kind: {"n": len(ms), "median_ms": round(float(np.median(ms)), 1), "max_ms": round(max(ms), 1)}
                          for kind in sorted({e[0] for e in events}) for ms in [[e[2] for e in events
                          if e[0] == kind]]},
        "timeline": timeline(results, events, t_from, args.seconds) if rate else None,
        "others_cpu_share_on_server_cores": round(others_on_server_cores / args.seconds, 3) if args.server_cpus
        else None, "orchestrator_rss_idle_mb": round(rss_idle, 1), "orchestrator_rss_peak_mb": round(peak, 1),
        "load_average_at_start": load0,
        "verified_by_end": st.get("submissions_accepted"),
        "buffer_depth_at_end": st.get("buffer_depth"),
        "errors": errors,
        "body_json_kb": round(len(tmpl) / 1024, 1),
    }


def timeline(results: list[dict], events: list, t_from: float, seconds: float, step: float = 0.25) -> list[dict]:
    """Per `step` s of the window (by scheduled time): cycles, their worst scheduled latency, and the server's events
    (trainer pulls, GC) ending in it, to see whether latency spikes follow them."""
    at = np.array(sum((r["sched_at"] for r in results), [])) - t_from
    ms = np.array(sum((r["sched_ms"] for r in results), []))
    rows = []
    for b in range(int(np.ceil(seconds / step))):
        sel = (at >= b * step) & (at < (b + 1) * step)
        rows.append({"t": round(b * step, 2), "cycles": int(sel.sum()), "scheduled_max_ms": round(float(ms[sel].max()),
            1) if sel.any() else None,
                     "events": [f"{kind} {e_ms:.0f} ms" for kind, t, e_ms in events if b * step <= t < (b + 1) * step]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir")
    ap.add_argument("--port", type=int)
    ap.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    ap.add_argument("--src", default="", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--client-procs", type=int, default=2)
    two = (os.cpu_count() or 1) >= 2
    ap.add_argument("--server-cpus", default="0" if two else "", help="pin the server to these cores ('' = no pinning)")
    ap.add_argument("--client-cpus", default="1" if two else "", help="pin the client processes to these cores")
    ap.add_argument("--compare-head", action="store_true",
        help="also run git HEAD's orchestrator/, protocol/ and trainer/ (the 'before'), side by side")
    ap.add_argument("--compare-ref", default="",
        help="like --compare-head, with the code of this git commit as the 'before'")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the GET /healthz ceiling points (closed loop only)")
    ap.add_argument("--rates", type=float, nargs="+", default=[],
                    help="paced (open-loop) mode: offered submissions/s summed over the workers, one point per rate "
                    "and worker count")
    ap.add_argument("--closed-loop", action="store_true",
        help="with --rates: also run the closed-loop points (and ceiling)")
    ap.add_argument("--drain", type=float, default=10.0,
                    help="paced: seconds after the window for cycles scheduled in it to finish (later: counted with "
                    "their lateness so far)")
    ap.add_argument("--prompts-per-lease", type=int, default=4)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16, help="16: the demo config")
    ap.add_argument("--samples-per-step", type=int, default=4096)
    ap.add_argument("--steps", action="store_true", help="only the in-process CPU per step (no HTTP points)")
    ap.add_argument("--no-steps", action="store_true",
        help="skip the in-process CPU per step (skipped anyway with --rates)")
    ap.add_argument("--steps-cycles", type=int, default=1500)
    ap.add_argument("--steps-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "orchestrator_bench"))
    args = ap.parse_args()
    if args.serve:
        serve_main(args)
        return
    if args.steps_worker:
        if args.cpus:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        steps_main(args)
        return
    tmpl = template(args)
    head_rev = ""
    if args.compare_head and not args.compare_ref:
        args.compare_ref = "HEAD"
    args.compare_head = bool(args.compare_ref)
    if args.compare_head:
        import shutil

        shutil.rmtree(HEAD_DIR, ignore_errors=True)
        HEAD_DIR.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.compare_ref, *HEAD_PACKAGES], check=True,
            capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(HEAD_DIR)], input=archive, check=True)
        head_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.compare_ref],
            capture_output=True, text=True).stdout.strip()
        global BEFORE_LABEL
        BEFORE_LABEL = f"git {head_rev} (before)"
    rows = []
    closed = not args.rates or args.closed_loop
    for n in [] if args.steps else args.workers:  # side by side, interleaved per point: (ceiling,) before, after
        points = ([dict(ceiling=True)] if closed and not args.no_ceiling else []) + ([{}] if closed
            else []) + [dict(rate=r) for r in args.rates]
        for kw in points:
            for src in [str(HEAD_DIR)] if args.compare_head and not kw.get("ceiling") else []:
                rows.append(run_point(args, n, tmpl, src=src, **kw))
                print(json.dumps(rows[-1]), flush=True)
            rows.append(run_point(args, n, tmpl, **kw))
            print(json.dumps(rows[-1]), flush=True)
    steps = []
    if args.steps or not (args.no_steps or args.rates):  # 3 interleaved runs per code version; the median of each step
        runs: dict[str, list[dict]] = {}
        for _ in range(3):
            for src in ([str(HEAD_DIR)] if args.compare_head else []) + [""]:
                r = run_steps(args, src)
                runs.setdefault(r.pop("code"), []).append(r)
                print(json.dumps(r), flush=True)
        steps = [{"code": code, **{k: float(np.median([r[k] for r in rs])) for k in rs[0]}} for code,
            rs in runs.items()]
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "pinning": {"server_cpus": args.server_cpus, "client_cpus": args.client_cpus,
        "client_procs": args.client_procs},
        "head": head_rev,
        "shape": {"prompts_per_lease": args.prompts_per_lease, "samples_per_prompt": args.samples_per_prompt,
        "max_tokens": args.max_tokens},
        "verification": "stubbed (benchmark only); stub trainer consumes the buffer",
        "rows": rows,
        "steps_ms_per_cycle": steps,
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Orchestrator benchmark",
        "",
        f"`{result['command']}` on {os.cpu_count()} shared cores; server pinned to cpu {args.server_cpus or '-'}, "
        f"{args.client_procs} client processes pinned to cpu {args.client_cpus or '-'} (standing in for separate "
        f"machines).",
        f"Each cycle: lease + one zstd submission of {args.prompts_per_lease}x{args.samples_per_prompt} completions of "
        f"{args.max_tokens // 2}-{args.max_tokens} tokens with proofs ({len(tmpl) / 1024:.1f} KiB JSON). Verification "
        f"stubbed (benchmark only).",
        "Server CPU ms per submission is the server process's user+system CPU over the measured window divided by "
        "accepted "
        "submissions (lease + submit + admission + verdict bookkeeping + buffer + stub trainer pulls): it does not "
        "depend on other "
        "load on the machine the way wall-clock throughput does; 1000 / it = what one dedicated core sustains.",
        "",
        "Two modes. **Closed loop**: each worker leases again as soon as its submit returns (zero think time), so the "
        "server is "
        "always saturated: it measures saturation throughput and CPU per submission, but its latency is just workers "
        "in flight / "
        "throughput, a property of the client count, not of the server. **Paced** (open loop, `--rates`): each worker "
        "starts a "
        "cycle (lease, then submit) at the times of its own Poisson process of rate offered / workers (the gaps stand "
        "in for "
        "generation), so the offered load does not depend on how fast the server answers: this is the latency measure "
        "at a given "
        "throughput. Its *scheduled* latency runs from a cycle's scheduled start to its submit response: a cycle that "
        "starts late "
        "because its worker's previous one ran long (or the server stalled) counts its wait, instead of being "
        "silently postponed "
        "(no coordinated omission); above capacity it grows with the run's length. Paced latencies are of the cycles "
        "scheduled in "
        f"the {args.seconds:g} s window (after {args.warmup:g} s warm-up), which may finish up to {args.drain:g} s "
        f"after it; "
        "accepted/s counts completions inside the window in both modes.",
        "Server CPU share by thread: CPU of each server thread over the window (`http` serves every request; `verify` "
        "applies the "
        "verdicts: advantages, buffer rows, ledger; `stub-trainer` pulls batches; `checkpoint` checkpoints the WAL). "
        "Others' CPU on server core: busy time of the server's pinned core(s) not spent by the server, over the "
        "window (other "
        "people's jobs on a shared machine; +-0.02 from 10 ms clock ticks). Server events: the stub trainer's pulls "
        "(CPU ms of take + commit) and garbage "
        "collections of generation >= 1 (wall ms, they stop every thread); the json has a 250 ms timeline of them "
        "next to the "
        "worst scheduled latency. Client CPU share: CPU of all client processes over the window / window (they share "
        "one core when pinned); client lag p99 "
        "(paced): how much later than it could have a cycle started (sleep overshoot or a busy client loop): the "
        "client is not the "
        "bottleneck while both stay small.",
        "",
        "| code | mode | workers | offered/s | accepted/s | submit p50 / p99 / max ms | lease p50 / p99 / max ms | "
        "scheduled p50 / p99 ms "
        "| server CPU ms / submission | one-core capacity /s | server CPU share | server CPU share by thread | "
        "others' CPU on server core "
        "| client CPU share | client lag p99 ms | RSS peak MiB | load avg | server events in window: n x median / max "
        "ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rows:
        paced = p["offered_submissions_per_s"] is not None
        sched = f"{p['scheduled_p50_ms']} / {p['scheduled_p99_ms']}" if paced else "-"
        events = "; ".join(f"{k}: {v['n']} x {v['median_ms']} / {v['max_ms']}" for k,
            v in p["server_events"].items()) or "-"
        by_thread = ", ".join(f"{k.removeprefix('orchestrator-')} {v:.2f}" for k,
            v in p["server_cpu_share_by_thread"].items() if v >= 0.01) or "-"
        lines.append(
            f"| {'-' if 'ceiling' in p['mode'] else p['code']} | {p['mode']} | {p['workers']} | "
            f"{p['offered_submissions_per_s'] if paced else '-'} | "
            f"{p['accepted_submissions_per_s']:.0f} | {p['submit_p50_ms']} / {p['submit_p99_ms']} / "
            f"{p['submit_max_ms']} | "
            f"{p['lease_p50_ms']} / {p['lease_p99_ms']} / {p['lease_max_ms']} | "
            f"{sched} | {p['server_cpu_ms_per_submission']:.2f} | "
            f"{p['one_core_capacity_per_s']:.0f} | {p['server_cpu_share']:.2f} | {by_thread} | "
            f"{p['others_cpu_share_on_server_cores']} | {p['client_cpu_share']:.2f} | "
            f"{p['client_lag_p99_ms'] if paced else '-'} | {p['orchestrator_rss_peak_mb']:.0f} | "
            f"{p['load_average_at_start']:.1f} | {events} | {p['errors'] or '-'} |"
        )
    if steps:
        lines += [
            "",
            f"In-process server CPU per step (ms per cycle; no HTTP, no threads; median of 3 runs of "
            f"{args.steps_cycles} cycles; "
            "`verify` = stub verification + verdict bookkeeping, `take`/`commit` = the trainer's pulls):",
            "",
            "| code | " + " | ".join(STEPS) + " | total | process CPU (all threads, incl. the harness's zstd) |",
            "|---|" + "---|" * (len(STEPS) + 2),
        ]
        lines += [f"| {r['code']} | " + " | ".join(f"{r[k]:.3f}" for k in (*STEPS, "total", "process")) + " |"
            for r in steps]
    lines.append("")
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
