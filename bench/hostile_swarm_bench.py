"""Honest throughput with and without a hostile swarm, side by side in one invocation.

Each run is the demo loop (`swarmrl run`, small model, one honest local vLLM worker, real verifier and
trainer), measured over the same window after the same warm-up. "attacked" runs add the four adversaries
of tools/adversaries.py (hoarder, flooder, slow-reward, cheater) for the whole window. Runs alternate
clean / attacked, so slow drift of the machine hits both alike. Both modes use the same settings: the
soak reward plug-in and deep checks off for new workers (see tests/e2e/test_hostile_swarm.py for why).

Reported per run: honest accepted submissions per minute (the local worker's, from the run's SQLite),
trainer steps per minute (metrics.jsonl), the orchestrator process's peak RSS; and the attacked / clean
ratios. Goal: >= 0.8 of the attack-free throughput.

    python bench/hostile_swarm_bench.py --repeats 2 --window-s 120
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ADMIN = "demo-admin-token"


def start(out: Path, port: int) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "demo.toml"), "--output_dir",
        str(out), "--name", "bench", "--stop_reward", "null", "--max_minutes", "0", "--trainer.max_steps", "100000",
        "--orchestrator.port", str(port), "--data.reward", "soak_reward:reward", "--verifier.rewards.import_paths",
        json.dumps([str(REPO / "tests" / "e2e")]), "--verifier.spot_check_rate", '{"new": 0.0, "trusted": 1.0}',
    ]
    log = (out / "driver.log").open("ab")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))


def steps(run_dir: Path) -> list[dict]:
    from swarmrl.run_dir import RunDir

    return list(RunDir(run_dir).read_metrics())


def listener_pid(port: int) -> int | None:
    import psutil

    for c in psutil.net_connections("tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN:
            return c.pid
    return None


def cpu_seconds(pid: int | None) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times() if pid is not None else None
    except psutil.Error:
        return 0.0
    return 0.0 if t is None else t.user + t.system


class CpuBurner(threading.Thread):
    """The "cpu_only" control: no request at all, only a thread of this process spinning about `cores` of
    a CPU (a duty cycle per 10 ms), as the adversaries' client threads do in "attacked" runs. On one
    2-core machine the attack's own CPU comes out of the run's; this run shows how much of the attacked
    runs' loss is that, and not the server's defence."""

    def __init__(self, cores: float, stop: threading.Event):
        super().__init__(name="cpu_burner", daemon=True)
        self.cores, self.stop = min(1.0, max(0.0, cores)), stop
        self.statuses: dict[int, int] = {}

    def run(self) -> None:
        period = 0.01
        while not self.stop.is_set():
            end = time.perf_counter() + period * self.cores
            while time.perf_counter() < end:
                pass
            time.sleep(period * (1.0 - self.cores))


WATCHED = ("swarmrl_leases_issued_total", "swarmrl_leases_refused_async_bound_total",
           "swarmrl_leases_refused_budget_total", "swarmrl_groups_dropped_zero_signal_total",
           "swarmrl_verify_seconds_sum", "swarmrl_verify_seconds_count")


def counters(http) -> dict[str, float]:
    """The orchestrator's Prometheus counters that say where the honest worker's time went."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples if s.name in WATCHED}


def one_run(mode: str, warmup_steps: int, window_s: float, port: int, attacker_nice: int = 0, burn_cores: float = 0.6,
    keep: bool = False) -> dict:
    import httpx
    import psutil

    from protocol import limits
    from swarmrl.config import load_run_config
    from tools.adversaries import Adversary, Cheater, Flooder, Hoarder, SlowReward, db

    out = Path(tempfile.mkdtemp(prefix=f"swarmrl-hostile-{mode}-"))
    proc = start(out, port)
    run_dir = out / "bench"
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    adversaries = []
    try:
        deadline = time.time() + 600
        while len(steps(run_dir)) < warmup_steps:
            if proc.poll() is not None or time.time() > deadline:
                log = (out / "driver.log").read_text(errors="replace")[-3000:] if (
                    out / "driver.log").exists() else "(no driver.log)"
                raise RuntimeError(f"{mode}: the run did not warm up (exit code {proc.poll()}); the end of its "
                    f"driver.log:\n{log}")
            time.sleep(1)
        pid = listener_pid(port)
        cfg = load_run_config(REPO / "configs" / "demo.toml", environ={}).orchestrator
        Flooder.cap = limits.submission_bytes_cap(cfg.prompts_per_lease * cfg.samples_per_prompt,
            cfg.sampling.max_tokens)
        kinds = {"hoarder": Hoarder, "flooder": Flooder, "slow": SlowReward, "cheater": Cheater}
        if mode == "attacked" or mode in kinds:  # all four, or the one named (what each costs alone)
            Adversary.nice = attacker_nice
            adversaries = [kind(name, url, run_dir, stop, ADMIN) for name, kind in kinds.items()
                if mode in ("attacked", name)]
        elif mode == "cpu_only":
            adversaries = [CpuBurner(burn_cores, stop)]
        with db(run_dir) as con:
            honest = con.execute("SELECT worker_id FROM workers WHERE name='local-0'").fetchone()[0]
        t0, steps0, load0 = time.time(), len(steps(run_dir)), round(os.getloadavg()[0], 2)
        # CPU seconds over the window: this process (the adversaries' threads: on this one machine the attack
        # is paid from the same two cores as the run) and the orchestrator's process (what refusing it costs).
        cpu0, orch_cpu0 = time.process_time(), cpu_seconds(pid)
        watch = httpx.Client(base_url=url, timeout=30)
        metrics0 = counters(watch)
        for a in adversaries:
            a.start()
        peak_rss, status_ms = 0, []
        while time.time() < t0 + window_s:
            if pid is not None:
                try:
                    peak_rss = max(peak_rss, psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass
            s = time.perf_counter()
            watch.get("/v1/status", headers={"Authorization": f"Bearer {ADMIN}"})
            status_ms.append(1e3 * (time.perf_counter() - s))
            time.sleep(1)
        t1, steps1 = time.time(), len(steps(run_dir))
        metrics1 = counters(watch)
        delta = {k.removeprefix("swarmrl_").removesuffix("_total"): round(metrics1.get(k, 0) - metrics0.get(k, 0), 2)
            for k in WATCHED}
        batches = delta.pop("verify_seconds_count")
        delta["verify_batch_mean_s"] = round(delta.pop("verify_seconds_sum") / batches, 3) if batches else None
        attacker_cpu, orch_cpu = time.process_time() - cpu0, cpu_seconds(pid) - orch_cpu0
        stop.set()
        for a in adversaries:  # their statuses are complete once they have stopped
            a.join(timeout=30)
        with db(run_dir) as con:
            accepted, tokens = con.execute("SELECT COUNT(*), COALESCE(SUM(num_tokens), 0) FROM submissions WHERE "
                "worker_id=? AND status='accepted' "
                                           "AND received_at BETWEEN ? AND ?", (honest, t0, t1)).fetchone()
            # Where the honest worker's time goes: lease -> submission (generation), submission -> next lease.
            leases = con.execute("SELECT l.issued_at, s.received_at, json_array_length(l.prompt_indices) FROM leases "
                "l JOIN submissions s "
                                 "ON s.lease_id = l.lease_id WHERE l.worker_id=? AND l.issued_at BETWEEN ? AND ? "
                                 "ORDER BY l.issued_at",
                                 (honest, t0, t1)).fetchall()
        gen_s = [r - i for i, r, _ in leases]
        wait_s = [b[0] - a[1] for a, b in zip(leases, leases[1:]) if b[0] >= a[1]]
        five_xx = sum(n for a in adversaries for code, n in a.statuses.items() if code >= 500)
        minutes = (t1 - t0) / 60
        return {
            "mode": mode, "load_avg_1m_before_after": [load0, round(os.getloadavg()[0], 2)],
            "bench_process_cpu_per_s": round(attacker_cpu / (t1 - t0), 3),
            "orchestrator_cpu_per_s": round(orch_cpu / (t1 - t0), 3), "window_s": round(t1 - t0, 1),
            "honest_accepted_per_min": round(accepted / minutes, 1), "honest_tokens_per_min": round(tokens / minutes),
            "trainer_steps_per_min": round((steps1 - steps0) / minutes, 1),
            "orchestrator_peak_rss_mib": round(peak_rss / 2**20, 1),
            "status_p50_ms": round(statistics.median(status_ms), 1), "status_max_ms": round(max(status_ms), 1),
            "adversary_5xx": five_xx, "honest_prompts_per_lease": round(statistics.mean(n for *_, n in leases), 2)
            if leases else None, "honest_lease_to_submit_p50_s": round(statistics.median(gen_s), 3) if gen_s else None,
            "honest_submit_to_next_lease_p50_s": round(statistics.median(wait_s), 3) if wait_s else None,
            "honest_overlapping_leases": len(leases) - 1 - len(wait_s) if leases else 0,
            "orchestrator_counters": delta, "adversary_requests": {a.name: sum(a.statuses.values())
            for a in adversaries},
        }
    finally:
        stop.set()
        for a in adversaries:
            a.join(timeout=30)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        else:
            print(f"kept {out}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=120.0)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--port", type=int, default=0, help="the orchestrator's port (0: a free one for each run)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--attacker-nice", type=int, default=0,
        help="the adversaries' threads' nice value (19: they run on what the run leaves idle, "
                    "standing in for an attacker's own machine)")
    ap.add_argument("--tag", default="", help="results go to hostile_swarm_bench<_tag>.{json,md}")
    ap.add_argument("--modes", default="clean,attacked",
        help="per repeat, in order; the first is the baseline of the ratios. "
                    "attacked: all four adversaries; hoarder, flooder, slow or cheater: that one alone; "
                    "cpu_only: no adversary, a thread spinning --burn-cores (the control for the attackers' own CPU)")
    ap.add_argument("--burn-cores", type=float, default=0.6,
        help="cpu_only: the CPU to spin (the attacked runs' bench_process_cpu_per_s)")
    ap.add_argument("--keep", action="store_true", help="keep each run's folder (logs, SQLite) and print where")
    args = ap.parse_args()
    modes = args.modes.split(",")
    runs = []
    for r in range(args.repeats):
        for mode in modes:
            from swarmrl.processes import free_port

            result = one_run(mode, args.warmup_steps, args.window_s, args.port or free_port("127.0.0.1"),
                args.attacker_nice, args.burn_cores, args.keep)
            result["attacker_nice"] = args.attacker_nice if mode not in ("clean", "cpu_only") else None
            result["repeat"] = r
            print(json.dumps(result), flush=True)
            runs.append(result)
    metrics = ("honest_accepted_per_min", "honest_tokens_per_min", "trainer_steps_per_min")
    by = {(x["repeat"], x["mode"]): x for x in runs}
    ratio = {m: {k: [round(by[r, m][k] / by[r, modes[0]][k], 3) if by[r, modes[0]][k] else None
        for r in range(args.repeats)] for k in metrics}
             for m in modes[1:]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"hostile_swarm_bench{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps({"args": {
        k: str(v) for k, v in vars(args).items()}, "runs": runs, "ratio": ratio}, indent=1))
    print(json.dumps({"ratio_attacked_over_clean": ratio}, indent=1))
    write_markdown(args, runs, ratio)


def write_markdown(args, runs: list[dict], ratio: dict) -> None:
    cols = ("repeat", "mode", "window_s", "honest_accepted_per_min", "honest_tokens_per_min", "trainer_steps_per_min",
            "honest_prompts_per_lease", "honest_lease_to_submit_p50_s", "honest_submit_to_next_lease_p50_s",
            "honest_overlapping_leases", "orchestrator_peak_rss_mib", "status_p50_ms", "status_max_ms",
            "adversary_5xx", "bench_process_cpu_per_s", "orchestrator_cpu_per_s", "attacker_nice",
            "load_avg_1m_before_after")
    lines = [
        "# Honest throughput with and without a hostile swarm", "",
        f"Command: `python bench/hostile_swarm_bench.py --repeats {args.repeats} --window-s {args.window_s:g} --modes "
        f"{args.modes}"
        + (f" --burn-cores {args.burn_cores:g}" if "cpu_only" in args.modes else "")
        + (f" --attacker-nice {args.attacker_nice}" if args.attacker_nice else "") + (f" --tag {args.tag}" if args.tag
        else "") + "` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). The demo loop (small model, one honest local vLLM "
        f"worker, real "
        "verifier and trainer) on this 2-core machine; runs alternate clean / attacked; 'attacked' adds a hoarder, a "
        "flooder, a "
        "slow-reward worker and a banned cheater coming back (tools/adversaries.py) for the whole window. Every run "
        "is listed. "
        "bench_process_cpu_per_s: cores used by this benchmark's process, i.e. by the adversaries' threads, taken "
        "from the same two "
        "cores the run has (an attacker's own machine in a real swarm); orchestrator_cpu_per_s: cores the "
        "orchestrator's process used. "
        "cpu_only (when in --modes): no adversary, one thread of this process spinning about --burn-cores, the "
        "control for that "
        "share of the attacked runs' loss.", "",
        "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in runs), "",
        *(f"{m} / {args.modes.split(',')[0]}, per repeat: honest accepted submissions/min "
        f"{q['honest_accepted_per_min']}; "
          f"honest accepted tokens/min {q['honest_tokens_per_min']}; trainer steps/min {q['trainer_steps_per_min']} "
          f"(goal >= 0.8 for attacked)."
          for m, q in ratio.items()), "",
    ]
    (args.out / f"hostile_swarm_bench{'_' + args.tag if args.tag else ''}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
