"""Orchestrator throughput: simulated workers on loopback lease tasks and submit realistic rollouts.

The orchestrator runs in its own process (real uvicorn, real SQLite file, the real admission path:
size caps, zstd, schema, lease, version, shape, replay fingerprint, durable insert). Verification is
STUBBED for this benchmark only (accept, random rewards), so accepted submissions still become
buffer samples in SQLite. Clients run in separate processes (asyncio + httpx), one lease + one zstd
submission per cycle, each submission unique (fresh proofs), so replay detection does real work.

Reports, per worker count: accepted submissions/s, submit latency p50/p99, lease latency p50/p99,
the orchestrator's peak RSS, and the ratio between worker counts measured side by side in one run.

    python bench/orchestrator_bench.py                      # 64 and 256 workers, 20 s each, demo shape
    python bench/orchestrator_bench.py --workers 64 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LEASE_MARK = "LEASEMARK"
PROOF_MARK = "PROOFMARK"
ADMIN, JOIN = "bench-admin", "bench-join"


# --------------------------------------------------------------------------------------------------
# server side


class StubVerifier:
    """Accepts everything with random rewards (BENCHMARK ONLY: no proof checks, no model)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def verify_many(self, jobs):
        from protocol.models import Verdict, VerdictStatus

        return [
            Verdict(submission_id=j.submission_id, status=VerdictStatus.accepted,
                    rewards=self.rng.random(len(j.submission.completions)).tolist(), verified_tokens=j.submission.num_tokens)
            for j in jobs
        ]


def bench_config(run_dir: Path, port: int, args):
    from orchestrator.config import RunConfig

    return RunConfig.model_validate({
        "name": "bench", "output_dir": str(run_dir), "seed": 0,
        "data": {"task": "toy", "num_prompts": 4096},
        "orchestrator": {"port": port, "samples_per_prompt": args.samples_per_prompt, "prompts_per_lease": args.prompts_per_lease,
                         "sampling": {"max_tokens": args.max_tokens}, "max_open_leases_per_worker": 2,
                         "rate_limit_per_s": 1000.0, "lease_timeout_s": 120.0, "admin_token": ADMIN, "join_tokens": [JOIN],
                         "db_path": str(run_dir / "orchestrator.sqlite")},
    })


def serve_main(args) -> None:
    import logging

    from orchestrator.data import PromptSet
    from orchestrator.serve import OrchestratorServer
    from orchestrator.service import Orchestrator
    from orchestrator.state import State
    from trainer.tiny_model import make_tokenizer, padded_vocab_size
    from verifier.tasks import get_task

    logging.basicConfig(level=logging.WARNING)
    cfg = bench_config(Path(args.dir), args.port, args)
    items = get_task("toy", digits=6).make_prompts(cfg.data.num_prompts, 0)
    prompts = PromptSet.from_items(items, make_tokenizer(), 0, padded_vocab_size())
    orch = Orchestrator(cfg, State(cfg.orchestrator.db_path), prompts, StubVerifier(), verify_batch=64)
    orch.publish_version(0, "0" * 64)
    server = OrchestratorServer(orch).start()
    print(server.url, flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.1)
    server.stop()


# --------------------------------------------------------------------------------------------------
# client side


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
            comps.append(Completion(prompt_index=p, sample_index=s, token_ids=rng.integers(3, 50, n), logprobs=-rng.random(n).astype(np.float32),
                                    finish_reason=FinishReason.length, proofs=[rng.bytes(limits.MAX_PROOF_BYTES) for _ in range(k)]))
    sub = RolloutSubmission(lease_id="L0", policy_version=0, model_hash="0" * 64, completions=comps)
    doc = json.loads(sub.model_dump_json())
    doc["lease_id"] = LEASE_MARK
    doc["completions"][0]["proofs"][0] = PROOF_MARK
    return json.dumps(doc, separators=(",", ":"))


async def ceiling_loop(client, tmpl: str, stop_at: float, measure_from: float, out: dict, rng: np.random.Generator) -> None:
    """The HTTP ceiling on this machine: the same two requests per cycle, to an endpoint that does nothing."""
    from protocol import api

    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        await client.get(api.HEALTH.path)
        r = await client.get(api.HEALTH.path)
        t1 = time.perf_counter()
        if measure_from <= t1 <= stop_at and r.status_code == 200:
            out["accepted"] += 1
            out["submit_ms"].append((t1 - t0) * 1e3 / 2)
            out["lease_ms"].append((t1 - t0) * 1e3 / 2)


async def worker_loop(client, tmpl: str, stop_at: float, measure_from: float, out: dict, rng: np.random.Generator) -> None:
    import httpx
    import zstandard

    from protocol import api, limits

    r = await client.post(api.REGISTER.path, json={"name": "bench"}, headers={"Authorization": f"Bearer {JOIN}"})
    r.raise_for_status()
    h = {"Authorization": f"Bearer {r.json()['secret']}"}
    hz = h | {"Content-Encoding": "zstd", "Content-Type": "application/json"}
    cctx = zstandard.ZstdCompressor(level=3)
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        r = await client.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 64}, headers=h)
        t1 = time.perf_counter()
        if r.status_code != 200:
            out["errors"][f"lease {r.status_code}"] = out["errors"].get(f"lease {r.status_code}", 0) + 1
            await asyncio.sleep(0.05)
            continue
        lease_id = r.json()["lease"]["lease_id"]
        proof = base64.b64encode(rng.bytes(limits.MAX_PROOF_BYTES)).decode()
        body = cctx.compress(tmpl.replace(LEASE_MARK, lease_id).replace(PROOF_MARK, proof).encode())
        t2 = time.perf_counter()
        try:
            r = await client.post(api.SUBMIT.path, content=body, headers=hz)
        except httpx.HTTPError as exc:
            out["errors"][type(exc).__name__] = out["errors"].get(type(exc).__name__, 0) + 1
            continue
        t3 = time.perf_counter()
        if measure_from <= t3 <= stop_at:  # counted by completion time
            out["lease_ms"].append((t1 - t0) * 1e3)
            if r.status_code == 200:
                out["submit_ms"].append((t3 - t2) * 1e3)
                out["accepted"] += 1
            else:
                out["errors"][f"submit {r.status_code}"] = out["errors"].get(f"submit {r.status_code}", 0) + 1


def client_proc(url: str, n_workers: int, seconds: float, warmup: float, tmpl: str, seed: int, q, ceiling: bool = False) -> None:
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=n_workers + 8, max_keepalive_connections=n_workers + 8)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            now = time.perf_counter()
            out = {"lease_ms": [], "submit_ms": [], "accepted": 0, "errors": {}}
            loop_fn = ceiling_loop if ceiling else worker_loop
            await asyncio.gather(*(loop_fn(client, tmpl, now + warmup + seconds, now + warmup, out, np.random.default_rng([seed, i]))
                                   for i in range(n_workers)))
            return out

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    q.put(asyncio.run(main()))


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def run_point(args, n_workers: int, tmpl: str, ceiling: bool = False) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="swarmrl-orch-bench-"))
    cmd = [sys.executable, __file__, "--serve", "--dir", str(run_dir), "--port", str(port), "--samples-per-prompt", str(args.samples_per_prompt),
           "--prompts-per-lease", str(args.prompts_per_lease), "--max-tokens", str(args.max_tokens)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://"), url
        rss_idle = rss_mb(server.pid)
        import psutil

        sproc = psutil.Process(server.pid)
        cpu0 = sum(sproc.cpu_times()[:2])
        load0 = os.getloadavg()[0]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        per = [n_workers // args.client_procs + (i < n_workers % args.client_procs) for i in range(args.client_procs)]
        procs = [ctx.Process(target=client_proc, args=(url, k, args.seconds, args.warmup, tmpl, i, q, ceiling)) for i, k in enumerate(per)]
        for p in procs:
            p.start()
        peak = rss_idle
        deadline = time.time() + args.warmup + args.seconds + 60
        results = []
        while len(results) < len(procs) and time.time() < deadline:
            try:
                results.append(q.get(timeout=0.5))
            except Exception:
                pass
            peak = max(peak, rss_mb(server.pid))
        for p in procs:
            p.join(timeout=10)
        server_cpu_s = sum(sproc.cpu_times()[:2]) - cpu0
        import httpx

        st = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    submit = np.array(sum((r["submit_ms"] for r in results), []))
    lease = np.array(sum((r["lease_ms"] for r in results), []))
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    accepted = sum(r["accepted"] for r in results)
    body_kb = len(tmpl) / 1024
    return {
        "mode": "ceiling: 2x GET /healthz per cycle" if ceiling else "lease + submit",
        "workers": n_workers,
        "seconds": args.seconds,
        "accepted_submissions": accepted,
        "accepted_submissions_per_s": accepted / args.seconds,
        "completions_per_s": accepted * args.prompts_per_lease * args.samples_per_prompt / args.seconds,
        "submit_p50_ms": float(np.percentile(submit, 50)) if submit.size else None,
        "submit_p99_ms": float(np.percentile(submit, 99)) if submit.size else None,
        "lease_p50_ms": float(np.percentile(lease, 50)) if lease.size else None,
        "lease_p99_ms": float(np.percentile(lease, 99)) if lease.size else None,
        "orchestrator_rss_idle_mb": rss_idle,
        "orchestrator_rss_peak_mb": peak,
        "server_cpu_ms_per_submission": 1e3 * server_cpu_s / max(accepted, 1),
        "server_cpu_share": server_cpu_s / (args.warmup + args.seconds),
        "load_average_at_start": load0,
        "verified_by_end": st.get("submissions_accepted"),
        "buffer_depth_at_end": st.get("buffer_depth"),
        "errors": errors,
        "body_json_kb": round(body_kb, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir")
    ap.add_argument("--port", type=int)
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--prompts-per-lease", type=int, default=4)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16, help="16: the demo config")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "orchestrator_bench"))
    args = ap.parse_args()
    if args.serve:
        serve_main(args)
        return
    tmpl = template(args)
    points, ceilings = [], []
    for n in args.workers:  # side by side: the HTTP ceiling right before each measured point
        ceilings.append(run_point(args, n, tmpl, ceiling=True))
        points.append(run_point(args, n, tmpl))
        print(json.dumps(ceilings[-1]))
        print(json.dumps(points[-1]))
    base = points[0]
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "shape": {"prompts_per_lease": args.prompts_per_lease, "samples_per_prompt": args.samples_per_prompt, "max_tokens": args.max_tokens,
                  "client_procs": args.client_procs},
        "verification": "stubbed (benchmark only)",
        "points": points,
        "http_ceiling": ceilings,
        "fraction_of_http_ceiling": {str(p["workers"]): round(p["accepted_submissions_per_s"] / max(c["accepted_submissions_per_s"], 1e-9), 3)
                                     for p, c in zip(points, ceilings)},
        "ratios_vs_first": {str(p["workers"]): round(p["accepted_submissions_per_s"] / max(base["accepted_submissions_per_s"], 1e-9), 3) for p in points},
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Orchestrator benchmark",
        "",
        f"`{result['command']}` on {os.cpu_count()} cores (shared; clients and server on the same machine).",
        f"Each cycle: lease + one zstd submission of {args.prompts_per_lease}x{args.samples_per_prompt} completions of "
        f"{args.max_tokens // 2}-{args.max_tokens} tokens with proofs ({points[0]['body_json_kb']} KiB JSON). Verification stubbed (benchmark only).",
        "",
        "| workers | accepted submissions/s | completions/s | submit p50 ms | submit p99 ms | lease p50 ms | lease p99 ms | RSS idle MiB | RSS peak MiB | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p['workers']} | {p['accepted_submissions_per_s']:.0f} | {p['completions_per_s']:.0f} | {p['submit_p50_ms']:.1f} | {p['submit_p99_ms']:.1f} | "
            f"{p['lease_p50_ms']:.1f} | {p['lease_p99_ms']:.1f} | {p['orchestrator_rss_idle_mb']:.0f} | {p['orchestrator_rss_peak_mb']:.0f} | {p['errors'] or '-'} |"
        )
    lines += ["", "Side by side, the same client against GET /healthz twice per cycle (the HTTP ceiling of this machine at that moment):", ""]
    for c, p in zip(ceilings, points):
        lines.append(f"- {c['workers']} workers: ceiling {c['accepted_submissions_per_s']:.0f} cycles/s; the orchestrator reached "
                     f"{p['accepted_submissions_per_s'] / max(c['accepted_submissions_per_s'], 1e-9):.0%} of it; server CPU "
                     f"{p['server_cpu_ms_per_submission']:.2f} ms per lease+submit+verdict (ceiling: {c['server_cpu_ms_per_submission']:.2f} ms per 2 requests); "
                     f"load average at start {p['load_average_at_start']:.1f} on {os.cpu_count()} cores")
    cap = 1000.0 / max(points[0]["server_cpu_ms_per_submission"], 1e-9)
    lines += ["", f"Goal: >= 500 accepted submissions/s with submit p99 < 100 ms at 64 workers. When the HTTP ceiling is far below "
              f"that, the machine (shared cores) is the limit, not the orchestrator; the less load-dependent figure is the server's CPU "
              f"per cycle (itself inflated by contention): at {points[0]['server_cpu_ms_per_submission']:.2f} ms, one dedicated core sustains about {cap:.0f} cycles/s."]
    lines += ["", "Throughput ratio vs the first row: " + ", ".join(f"{k} workers: {v}x" for k, v in result["ratios_vs_first"].items()), ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
