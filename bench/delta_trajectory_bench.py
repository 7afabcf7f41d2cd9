"""Bytes on the wire per policy version, on a real trajectory: `swarmrl run` on the demo config.

For each setting (publishing dtype x learning rate), runs the whole loop (`swarmrl run --config
configs/demo.toml`: the `small` model, real rollouts from the vLLM worker, verified, trained with the
staleness-aware PPO step) for `--steps` optimizer steps with the origin keeping every version, then reads
what the origin published (the signed manifests: per version, its delta against the previous version and
the full size) and what the run's worker pulled (its log: bytes downloaded per pull, and the path taken).
It then replays the chain offline: every version rebuilt from the first anchor through the published deltas
(apply speed, each step checked against the signed model hash) and every delta encoded again from the two
rebuilt versions (encode speed, and the bytes must be the published ones).

    python bench/delta_trajectory_bench.py [--steps 20] [--settings bf16:1e-6,bf16:1e-5,fp32:1e-6,fp32:1e-5]
Results: bench/results/delta_trajectory.{json,md}. The run folders (under bench/.work) are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WORK = REPO / "bench" / ".work"
RESULTS = REPO / "bench" / "results"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def make_base_model(work: Path) -> Path:
    """The demo's base model (small, tied, 60 echo-pretraining steps), made once: every setting starts from it."""
    out = work / "base_model"
    subprocess.run([sys.executable, "-m", "swarmrl", "init-model", "--out", str(out), "--size", "small",
        "--pretrain-steps", "60"],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


def run_loop(work: Path, base: Path, tag: str, dtype: str, lr: str, steps: int, minutes: float) -> tuple[Path, float]:
    cmd = [
        sys.executable, "-m", "swarmrl", "run", "--config", "configs/demo.toml", "--output_dir", str(work), "--name",
        tag, "--model.path", str(base), "--trainer.lr", lr, "--trainer.publish_dtype", DTYPES[dtype],
        "--trainer.max_steps", str(steps), "--shardcast.keep_versions", "1000", "--shardcast.delete_grace_s", "100000",
        "--max_minutes", str(minutes),
        "--stop_reward", "2",  # never reached: the run goes on for every step
    ]
    t = time.time()
    with open(work / f"{tag}.log", "wb") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True, env={**os.environ,
            "PYTHONPATH": str(REPO)})
    return work / tag, time.time() - t


def published(run_dir: Path) -> dict[int, dict]:
    from protocol.manifests import PolicyManifest

    out = {}
    for p in sorted((run_dir / "weights" / "origin").glob("v*/manifest.json")):
        m = PolicyManifest.model_validate_json(p.read_bytes())
        out[m.version] = {"manifest": m, "folder": p.parent}
    return out


def worker_pulls(run_dir: Path) -> list[dict]:
    """The run's worker log lines `pulled version N via ...: X MB on the wire (full Y MB)`."""
    pulls = []
    pat = re.compile(r"pulled version (\d+) via (.*?): ([\d.]+) MB on the wire \(full ([\d.]+) MB\)")
    for log in sorted((run_dir / "logs").glob("worker-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = pat.search(line)
            if m:
                pulls.append({"version": int(m.group(1)), "path": m.group(2), "wire_MB": float(m.group(3)),
                    "full_MB": float(m.group(4))})
    return pulls


def replay(versions: dict[int, dict], repeats: int) -> dict:
    """Rebuild every version from the first anchor through the published deltas; encode every delta again."""
    from shardcast.delta import apply_delta, encode_delta
    from shardcast.weights import load_version_dir

    first = min(versions)
    state = load_version_dir(versions[first]["folder"])
    states = {first: state}
    apply_s: list[float] = []
    for v in sorted(versions)[1:]:
        m = versions[v]["manifest"]
        ref = next(d for d in m.deltas if d.base_version == v - 1)
        blob = (versions[v]["folder"] / ref.file).read_bytes()
        t = time.perf_counter()
        state = apply_delta(states[v - 1], blob, base_hash=versions[v - 1]["manifest"].model_hash,
            expected_hash=m.model_hash)
        apply_s.append(time.perf_counter() - t)
        states[v] = state
    encode_s: list[float] = []
    same_bytes = True
    for _ in range(repeats):
        for v in sorted(versions)[1:]:
            m = versions[v]["manifest"]
            ref = next(d for d in m.deltas if d.base_version == v - 1)
            t = time.perf_counter()
            blob = encode_delta(states[v - 1], states[v], base_hash=versions[v - 1]["manifest"].model_hash,
                new_hash=m.model_hash)
            encode_s.append(time.perf_counter() - t)
            same_bytes &= blob == (versions[v]["folder"] / ref.file).read_bytes()
    full = versions[first]["manifest"].full_bytes
    return {
        "apply_MBps": [round(full / s / 1e6, 1) for s in apply_s],
        "encode_MBps": [round(full / s / 1e6, 1) for s in encode_s],
        "reencoded_bytes_identical": same_bytes,
    }


def spread(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.4g} [{min(values):.4g}–{max(values):.4g}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--settings", default="bf16:1e-6,bf16:1e-5,fp32:1e-6,fp32:1e-5")
    p.add_argument("--minutes", type=float, default=20.0, help="time limit of each run")
    p.add_argument("--repeats", type=int, default=3, help="encode passes over the chain")
    p.add_argument("--out", default=str(RESULTS / "delta_trajectory"))
    a = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="delta-trajectory-", dir=WORK))
    meta = {"command": "python " + " ".join(["bench/delta_trajectory_bench.py"] + sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_before": [round(x, 2)
            for x in os.getloadavg()]}
    rows = []
    try:
        base = make_base_model(work)
        for setting in a.settings.split(","):
            dtype, lr = setting.split(":")
            tag = f"{dtype}-lr{lr}"
            run_dir, seconds = run_loop(work, base, tag, dtype, lr, a.steps, a.minutes)
            versions = published(run_dir)
            deltas = {}
            for v, d in sorted(versions.items()):
                m = d["manifest"]
                ref = next((r for r in m.deltas if r.base_version == v - 1), None)
                if ref is not None:
                    deltas[v] = m.file(ref.file).size / m.full_bytes
            row = {
                "setting": tag, "run_seconds": round(seconds, 1), "versions": len(versions),
                "full_bytes": versions[min(versions)]["manifest"].full_bytes, "anchors": [v for v,
                d in versions.items() if d["manifest"].anchor_version == v],
                "delta_over_full": {v: round(f, 5) for v, f in deltas.items()},
                "worker_pulls": worker_pulls(run_dir),
                **replay(versions, a.repeats),
            }
            summary = {k: row[k] for k in ("setting", "versions", "anchors", "reencoded_bytes_identical")}
            print(json.dumps({**summary, "delta_over_full": spread(list(deltas.values()))}), flush=True)
            rows.append(row)
            shutil.rmtree(run_dir, ignore_errors=True)
        meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        write(a.out, rows, meta)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write(out: str, rows: list[dict], meta: dict) -> None:
    Path(out + ".json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    lines = [
        "# Delta broadcast on a real trajectory",
        "",
        f"`{meta['command']}` — {meta['when']}, 2 cores shared with other jobs (load before {meta['loadavg_before']}, "
        f"after {meta.get('loadavg_after')}).",
        "Each setting is one `swarmrl run --config configs/demo.toml` (the `small` model, 3.95M parameters; real "
        "rollouts from the",
        "vLLM worker, verified, trained) with the origin keeping every version. *delta / full* = the bytes of version "
        "v's delta",
        "from v-1 over the bytes of v's full safetensors shards, one value per version 1..N. Speeds are MB of the "
        "full version",
        "per second of one thread: *apply* rebuilds each version from the previous one (checked against its signed "
        "hash),",
        "*encode* makes each delta again (the same bytes as published).",
        "",
        "| setting | full MB | delta / full, median [min–max] | mean | anchors | encode MB/s | apply MB/s | "
        "re-encoded = published | run s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fr = list(r["delta_over_full"].values())
        lines.append(
            f"| {r['setting']} | {r['full_bytes'] / 1e6:.2f} | {spread(fr)} | {statistics.mean(fr):.4g} | "
            f"{r['anchors']} | {spread(r['encode_MBps'])} | "
            f"{spread(r['apply_MBps'])} | {r['reencoded_bytes_identical']} | {r['run_seconds']} |"
        )
    lines += ["", "Per version, delta / full:", ""]
    for r in rows:
        lines.append(f"- {r['setting']}: " + ", ".join(f"{v}: {f:.4f}" for v, f in r["delta_over_full"].items()))
    lines += ["",
        "What the run's worker actually pulled (it pulls the newest version it is told of, so it may skip versions):",
        ""]
    for r in rows:
        pulls = r["worker_pulls"]
        cells = [f"v{q['version']} {q['wire_MB']:.3f}/{q['full_MB']:.2f} MB ({q['path']})" for q in pulls]
        lines.append(f"- {r['setting']}: " + ("; ".join(cells) if cells else "no pull lines found"))
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
