"""Open join: what an identity costs an attacker, how soon an honest volunteer with no token does accepted
work, and the honest worker's accepted work beside 50 claimed attacker identities against a run without them.

    nice -n 19 python bench/open_join_bench.py --pow-only             # attacker CPU per identity only (~25 s)
    python bench/open_join_bench.py --repeats 2 --window-s 180        # the whole benchmark (~30-40 min)

--pow-only solves puzzles like the orchestrator's (protocol/join_puzzle.py) at the default difficulty
(orchestrator.open_join.difficulty_bits) in this process for --pow-budget-s, and reports the CPU seconds per
identity (each solve's, and 2**bits over the measured hash rate, the mean the few solves estimate).

Otherwise each run is the demo loop (`swarmrl run`, configs/demo.toml: small model, real verifier and trainer) with
open join on and no local worker. The honest worker is `swarmrl worker` with no join token: it claims a token at the
default difficulty, then pulls weights, starts vLLM and leases like any worker. Runs alternate, per repeat:
- both: once the honest worker has an accepted submission, this process claims --sybils identities (solving the
  run's own puzzles: the CPU of each claim is measured), so that both windows start at the same point of the run;
- clean: the claimed tokens are never used: the honest worker alone;
- sybils: this process registers one worker per claimed token, and each hoards for the
  whole window: it leases all it may and gives its leases back unsubmitted just before their deadlines, asking
  again every --sybil-poll-s. The claim limits are raised for these runs (one address stands in for an attacker
  with many: the limits per address are what such an attacker gets past).
Measured per run: the honest worker's seconds from its start to its first accepted submission (received; and to
its registration, and the puzzle's part, from its log), and over the window after --warmup-steps trainer steps:
honest accepted submissions and tokens per minute, trainer steps per minute, the reward at the window's ends, CPU
seconds per process in the window; the CPU seconds per claimed identity; for sybil runs the prompts they held at
once and how many were banned. Goal: sybils / clean >= 0.8 of honest
accepted submissions per minute. Results: bench/results/open_join_bench[_pow].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"
# The claim limits of sybil runs: one client address stands in for an attacker with many.
OPEN_JOIN = {"enabled": "true", "claims_per_hour_per_address": "100000", "claims_per_hour_total": "100000",
             "requests_per_min_per_address": "100000"}
CLAIM_LOG = re.compile(r"claimed a join token by open join in ([\d.]+) s \((\d+) hashes, ([\d.]+) CPU s\)")


def default_bits() -> int:
    from orchestrator.config import OpenJoinConfig

    return OpenJoinConfig().difficulty_bits


def pow_only(budget_s: float) -> dict:
    """Solve puzzles shaped like the orchestrator's until the budget's CPU time is spent (this thread's CPU)."""
    from protocol.join_puzzle import solve

    bits, solves = default_bits(), []
    end = time.monotonic() + budget_s
    while time.monotonic() < end:
        challenge = f"{int(time.time()) + 600}.{bits}.{secrets.token_hex(16)}.{secrets.token_hex(16)}"
        cpu = time.thread_time()
        found = solve(challenge, bits, deadline=end)
        if found is None:
            break
        solves.append((time.thread_time() - cpu, found[1]))
    cpu_s, hashes = sum(c for c, _ in solves), sum(h for _, h in solves)
    rate = hashes / cpu_s if cpu_s else None
    return {
        "difficulty_bits": bits, "identities_solved": len(solves),
        "cpu_s_per_identity": [round(c, 3) for c, _ in solves],
        "cpu_s_per_identity_median": round(statistics.median(c for c, _ in solves), 3) if solves else None,
        "hashes_per_cpu_s": round(rate) if rate else None,
        "expected_cpu_s_per_identity": round(2**bits / rate, 3) if rate else None,
    }


def db(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True, timeout=30)


def one_value(run_dir: Path, sql: str, args: tuple = ()):
    if not (run_dir / "orchestrator.sqlite").exists():
        return None
    with db(run_dir) as con:
        try:
            return con.execute(sql, args).fetchone()[0]
        except sqlite3.OperationalError:  # a table not made yet
            return None


def start_run(out: Path, port: int) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "swarmrl", "run", "--config", str(REPO / "configs" / "demo.toml"),
        "--output_dir", str(out), "--name", "bench", "--stop_reward", "null", "--max_minutes", "0",
        "--trainer.max_steps", "100000", "--num_workers", "0", "--orchestrator.port", str(port),
        *(a for k, v in OPEN_JOIN.items() for a in (f"--orchestrator.open_join.{k}", v)),
    ]
    log = (out / "driver.log").open("ab")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def start_honest(url: str, run_dir: Path, out: Path) -> subprocess.Popen:
    """`swarmrl worker` as `swarmrl run` starts its local ones, but named "honest" and with no join token."""
    from swarmrl.config import load_run_config
    from swarmrl.processes import child_env, worker_command
    from swarmrl.run_dir import RunDir

    cfg = load_run_config(REPO / "configs" / "demo.toml", environ={})
    cmd = worker_command(url, RunDir(run_dir).model_dir, out / "honest-work", 0, cfg)
    cmd[cmd.index("--name") + 1] = "honest"
    env = child_env(max(1, cfg.worker.num_threads))
    env.pop("SWARMRL_JOIN_TOKEN", None)
    log = (out / "honest-worker.log").open("ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


class Sybil(threading.Thread):
    """One claimed identity hoarding leases: all it may hold, given back unsubmitted just before the deadline."""

    def __init__(self, name: str, url: str, run_dir: Path, stop: threading.Event, token: str, poll_s: float,
                 nice: int = 0):
        import httpx

        from protocol import api
        from protocol.models import WorkerRegistered

        super().__init__(name=name, daemon=True)
        self.api, self.run_dir, self.stop, self.poll_s, self.nice = api, run_dir, stop, poll_s, nice
        self.http = httpx.Client(base_url=url, timeout=15)
        self.statuses: Counter[int] = Counter()
        self.held = 0
        r = self.http.post(api.REGISTER.path, json={"name": name}, headers={"Authorization": f"Bearer {token}"})
        r.raise_for_status()
        self.secret = WorkerRegistered.model_validate_json(r.content).secret

    def post(self, path: str, body: dict):
        r = self.http.post(path, json=body, headers={"Authorization": f"Bearer {self.secret}"})
        self.statuses[r.status_code] += 1
        return r

    def run(self) -> None:
        from protocol.models import LeaseResponse

        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)  # this thread only (Linux)
        held = []
        while not self.stop.is_set():
            version = int(float(one_value(self.run_dir, "SELECT value FROM meta WHERE key='policy_version'") or 0))
            r = self.post(self.api.LEASE.path, {"loaded_policy_version": version, "max_prompts": 64})
            if r.status_code == 403:  # banned: this identity is spent
                break
            lease = LeaseResponse.model_validate_json(r.content).lease if r.status_code == 200 else None
            if lease is not None:
                held.append(lease)
            self.held = sum(len(lease.prompts) for lease in held)
            now = time.time()
            for lease in held:
                if lease.deadline - 1.0 <= now:
                    self.post(self.api.RELEASE.url("", lease_id=lease.lease_id), {"reason": "hoarded"})
            held = [lease for lease in held if lease.deadline - 1.0 > now]
            self.stop.wait(self.poll_s)


def claim_identity(http) -> tuple[str, float]:
    """A token for a solved puzzle of the run, and the CPU seconds the solving took."""
    from protocol import api
    from protocol.join_puzzle import solve
    from protocol.models import JoinChallenge, JoinTokenClaimed

    puzzle = JoinChallenge.model_validate_json(http.post(api.JOIN_CHALLENGE.path).content)
    cpu = time.thread_time()
    solution, _ = solve(puzzle.challenge, puzzle.difficulty_bits)
    cpu = time.thread_time() - cpu
    r = http.post(api.JOIN_CLAIM.path, json={"challenge": puzzle.challenge, "solution": solution})
    r.raise_for_status()
    return JoinTokenClaimed.model_validate_json(r.content).token, cpu


def last_reward(run_dir: Path) -> float | None:
    from swarmrl.run_dir import RunDir

    rows = list(RunDir(run_dir, create=False).read_metrics())
    return round(rows[-1]["reward_mean"], 3) if rows and rows[-1].get("reward_mean") is not None else None


def cpu_seconds(run_dir: Path, honest_pid: int) -> dict[str, float]:
    """CPU seconds so far of the run's processes (pids.json: driver, orchestrator, trainer, verifiers, relays) and
    of this process (the sybils' threads: an attacker's clients, here on the same cores)."""
    import resource

    try:
        pids = {k: v for k, v in json.loads((run_dir / "pids.json").read_text()).items() if isinstance(v, int)}
    except (OSError, ValueError):
        pids = {}
    pids["honest worker"] = honest_pid
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    me = resource.getrusage(resource.RUSAGE_SELF)
    out["attacker (this process)"] = me.ru_utime + me.ru_stime
    return out


def wait_for(what: str, cond, procs: list, out: Path, timeout_s: float = 900.0):
    deadline = time.time() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if any(p.poll() is not None for p in procs) or time.time() > deadline:
            log = (out / "driver.log").read_text(errors="replace")[-3000:] if (out / "driver.log").exists() else ""
            codes = [p.poll() for p in procs]
            raise RuntimeError(f"timed out waiting for {what} (exit codes, run first: {codes}); "
                               f"the end of driver.log:\n{log}")
        time.sleep(0.5)


def one_run(mode: str, args: argparse.Namespace, port: int) -> dict:
    import httpx

    from swarmrl.run_dir import RunDir

    out = Path(tempfile.mkdtemp(prefix=f"swarmrl-open-join-{mode}-"))
    run_dir, url = out / "bench", f"http://127.0.0.1:{port}"
    proc = start_run(out, port)
    honest = None
    stop = threading.Event()
    sybils: list[Sybil] = []
    http = httpx.Client(base_url=url, timeout=30)

    def ready() -> bool:
        try:
            model = RunDir(run_dir, create=False).model_dir / "config.json"
            return model.exists() and http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def steps() -> int:
        return len(list(RunDir(run_dir, create=False).read_metrics())) if (run_dir / "metrics.jsonl").exists() else 0

    try:
        wait_for("the run to serve", ready, [proc], out)
        started = time.time()
        honest = start_honest(url, run_dir, out)
        first = ("SELECT MIN(s.received_at) FROM submissions s JOIN workers w ON w.worker_id = s.worker_id "
                 "WHERE w.name='honest' AND s.status='accepted'")
        first_accepted = wait_for("the honest worker's first accepted submission", lambda: one_value(run_dir, first),
                                  [proc, honest], out)
        registered = one_value(run_dir, "SELECT MIN(created_at) FROM workers WHERE name='honest'")
        claim = CLAIM_LOG.search((out / "honest-worker.log").read_text(errors="replace"))
        # Both modes claim the identities, so that their windows start at the same point of the run's learning (a
        # demo run's reward saturates within minutes, and then most groups carry no signal and the trainer waits)
        # after the same CPU; only sybil runs register them and hoard.
        claim_cpu, tokens = [], []

        def claim_all() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.attacker_nice)
            for _ in range(args.sybils):
                token, cpu = claim_identity(http)
                tokens.append(token)
                claim_cpu.append(cpu)

        claimer = threading.Thread(target=claim_all)
        claimer.start()
        claimer.join()
        assert len(tokens) == args.sybils, "the claims failed (see above)"
        if mode == "sybils":
            sybils = [Sybil(f"sybil-{i}", url, run_dir, stop, t, args.sybil_poll_s, args.attacker_nice)
                      for i, t in enumerate(tokens)]
            for s in sybils:
                s.start()
        wait_for(f"{args.warmup_steps} trainer steps", lambda: steps() >= args.warmup_steps, [proc, honest], out)
        worker_id = one_value(run_dir, "SELECT worker_id FROM workers WHERE name='honest' ORDER BY created_at DESC")
        t0, steps0, held_max, cpu0 = time.time(), steps(), 0, cpu_seconds(run_dir, honest.pid)
        reward0 = last_reward(run_dir)
        while time.time() < t0 + args.window_s:
            held_max = max(held_max, sum(s.held for s in sybils))
            time.sleep(1)
        t1, steps1, cpu1 = time.time(), steps(), cpu_seconds(run_dir, honest.pid)
        with db(run_dir) as con:
            accepted, tokens_out = con.execute(
                "SELECT COUNT(*), COALESCE(SUM(num_tokens), 0) FROM submissions WHERE worker_id=? "
                "AND status='accepted' AND received_at BETWEEN ? AND ?", (worker_id, t0, t1)).fetchone()
            banned = con.execute("SELECT COUNT(*) FROM workers WHERE name LIKE 'sybil-%' AND banned=1").fetchone()[0]
        minutes = (t1 - t0) / 60
        return {
            "mode": mode, "window_s": round(t1 - t0, 1),
            "honest_first_accepted_s": round(first_accepted - started, 1),
            "honest_registered_s": round(registered - started, 1) if registered else None,
            "honest_claim_s": float(claim.group(1)) if claim else None,
            "honest_claim_cpu_s": float(claim.group(3)) if claim else None,
            "honest_accepted_per_min": round(accepted / minutes, 2),
            "honest_tokens_per_min": round(tokens_out / minutes),
            "trainer_steps_per_min": round((steps1 - steps0) / minutes, 2),
            "sybils": len(sybils),
            "claim_cpu_s_median": round(statistics.median(claim_cpu), 3) if claim_cpu else None,
            "claim_cpu_s_total": round(sum(claim_cpu), 1) if claim_cpu else None,
            "sybil_prompts_held_max": held_max if sybils else None, "sybils_banned": banned if sybils else None,
            "sybil_5xx": sum(n for s in sybils for code, n in s.statuses.items() if code >= 500),
            "sybil_requests": sum(sum(s.statuses.values()) for s in sybils),
            "reward_at_window_start": reward0, "reward_at_window_end": last_reward(run_dir),
            "cpu_s_in_window": {k: round(cpu1[k] - cpu0[k], 1) for k in cpu1 if k in cpu0},
            "load_avg_1m_at_end": os.getloadavg()[0],
        }
    finally:
        stop.set()
        for s in sybils:
            s.join(timeout=30)
        http.close()
        for p, sig in ((honest, signal.SIGTERM), (proc, signal.SIGINT)):
            if p is not None and p.poll() is None:
                p.send_signal(sig)
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        if args.keep:
            print(f"kept {out}", file=sys.stderr)
        else:
            shutil.rmtree(out, ignore_errors=True)


def write(name: str, result: dict, lines: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pow-only", action="store_true", help="only the attacker's CPU per identity (no run started)")
    ap.add_argument("--pow-budget-s", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=180.0)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--sybils", type=int, default=50)
    ap.add_argument("--sybil-poll-s", type=float, default=1.0, help="each sybil asks for a lease this often")
    ap.add_argument("--attacker-nice", type=int, default=0,
                    help="run the attacker's threads (claims, sybil clients) at this nice level: 19 stands in for an "
                    "attacker on machines of its own (here its clients share the run's 2 cores)")
    ap.add_argument("--keep", action="store_true", help="keep each run's folder (logs, SQLite) and print where")
    args = ap.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.pow_only:
        r = pow_only(args.pow_budget_s)
        print(json.dumps(r, indent=1))
        write("open_join_bench_pow", r, [
            "# Open join: the attacker's CPU per identity", "",
            f"Command: `nice -n 19 python bench/open_join_bench.py --pow-only --pow-budget-s {args.pow_budget_s:g}` "
            f"({when}); puzzles shaped like the orchestrator's, solved with protocol/join_puzzle.py (Python hashlib, "
            "one core).", "",
            f"- difficulty: {r['difficulty_bits']} bits (the default); identities solved: {r['identities_solved']}",
            f"- CPU seconds per identity: {r['cpu_s_per_identity']} (median {r['cpu_s_per_identity_median']})",
            f"- hash rate: {r['hashes_per_cpu_s']} per CPU second; expected CPU per identity (2**bits / rate): "
            f"{r['expected_cpu_s_per_identity']} s",
        ])
        return
    from swarmrl.processes import free_port

    runs = []
    for rep in range(args.repeats):
        for mode in ("clean", "sybils"):
            result = one_run(mode, args, free_port("127.0.0.1")) | {"repeat": rep}
            print(json.dumps(result), flush=True)
            runs.append(result)
    by = {(r["repeat"], r["mode"]): r for r in runs}
    measures = ("honest_accepted_per_min", "honest_tokens_per_min", "trainer_steps_per_min")
    ratio = {k: [round(by[r, "sybils"][k] / by[r, "clean"][k], 3) if by[r, "clean"][k] else None
                 for r in range(args.repeats)] for k in measures}
    print(json.dumps({"ratio_sybils_over_clean": ratio}, indent=1))
    cols = list(runs[0])
    write("open_join_bench", {"args": vars(args), "runs": runs, "ratio": ratio}, [
        f"# Open join: an honest volunteer with no token, with and without {args.sybils} claimed attacker identities",
        "",
        f"Command: `python bench/open_join_bench.py --repeats {args.repeats} --window-s {args.window_s:g} "
        f"--sybils {args.sybils} --attacker-nice {args.attacker_nice}` ({when}). The demo loop with open join on and "
        "no local worker; the honest worker is `swarmrl worker` with no join token (default difficulty). After the "
        f"honest worker's first accepted submission, this process claims {args.sybils} identities in both modes "
        "(claim limits raised: one address stands in for many); in sybil runs each hoards leases for the window.",
        "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in runs), "",
        f"sybils / clean, per repeat: honest accepted submissions/min {ratio['honest_accepted_per_min']}; honest "
        f"accepted tokens/min {ratio['honest_tokens_per_min']}; trainer steps/min {ratio['trainer_steps_per_min']} "
        "(goal >= 0.8).",
    ])


if __name__ == "__main__":
    main()
