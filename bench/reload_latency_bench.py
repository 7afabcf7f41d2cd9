"""Publish -> worker generating with the new version, full versions against deltas, side by side.

Two origins publish the same trajectory of bfloat16 versions (a float32 master taking Adam-like steps), one
with deltas off (every version full) and one with deltas on (anchor every 10). Each has its own relay (the
`swarmrl shardcast relay` command) and its own worker process: the worker's shardcast client (relay first,
the origin as fallback) and an in-process vLLM `RolloutEngine`, polling the relay's listing every 20 ms.
Per version, in alternation (full, then delta): t0 = the origin's `publish` returned; the worker pulls,
hot-reloads (from the weights in memory when the pull applied deltas; from the version folder otherwise),
generates one token, and reports the time. Loopback links: the bytes saved by deltas cost ~nothing here
(see bench/results/delta_trajectory.md for the bytes); what this measures is the rest of the path.

    python bench/reload_latency_bench.py [--versions 12] [--models small,medium]
Results: bench/results/reload_latency.{json,md}. Work folders under bench/.work are removed.
"""

from __future__ import annotations

import argparse
import json
import os
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
RUN_ID = "reload-latency-bench"
MEDIUM = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4)


# -------------------------------------------------------------------------------------------------
# The worker process


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--relay")
    p.add_argument("--origin")
    p.add_argument("--pub")
    p.add_argument("--model")
    p.add_argument("--dest")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(a.dest) / "vllm-cache"))
    import numpy as np

    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine
    from protocol.models import SamplingParams, TaskLease, TaskPrompt
    from shardcast.client import ShardcastClient

    engine = RolloutEngine(a.model, EngineConfig(max_model_len=128, kv_cache_bytes=64 << 20))
    # as the worker's keeper
    client = ShardcastClient([a.relay], a.pub, Path(a.dest), run_id=RUN_ID, fallback_urls=[a.origin], keep_versions=2,
        write_behind=True)
    held = -1
    print("@@ready", flush=True)
    while True:
        latest = client.latest_version()
        if latest is None or latest <= held:
            time.sleep(0.02)
            continue
        t_seen = time.time()
        pulled = client.pull(latest)
        t_pulled = time.time()
        engine.reload(pulled.path, pulled.version, pulled.manifest.model_hash, state=pulled.state)
        t_reloaded = time.time()
        lease = TaskLease(
            lease_id="l", prompts=[TaskPrompt(prompt_id="p0", token_ids=np.array([1, 10, 11, 12], dtype=np.int32),
            seeds=[0])], samples_per_prompt=1,
            sampling=SamplingParams(temperature=0.0, max_tokens=1), policy_version=pulled.version,
            min_policy_version=0, deadline=time.time() + 60,
        )
        engine.generate(lease)
        held = pulled.version
        print("@@" + json.dumps({
            "version": held, "t_seen": t_seen, "t_pulled": t_pulled, "t_reloaded": t_reloaded,
            "t_generated": time.time(), "wire_bytes": pulled.wire_bytes, "steps": pulled.steps,
            "from_memory": pulled.state is not None,
        }), flush=True)


# -------------------------------------------------------------------------------------------------
# The driver


def make_model(work: Path, size: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.tiny_model import init_model

    small = init_model(work / "small", "small", seed=0, tie_embeddings=True)
    if size == "small":
        return small
    base = AutoConfig.from_pretrained(small).to_dict()
    for k in ("layer_types", "head_dim", "architectures", "transformers_version", "model_type"):
        base.pop(k, None)
    cfg = type(AutoConfig.from_pretrained(small))(**{**base, **MEDIUM})
    out = work / "medium"
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    for f in small.iterdir():  # the tokenizer
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def start(args: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log, "wb") if log
                            else subprocess.DEVNULL, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                            **(env or {})})


def report(proc: subprocess.Popen) -> str:
    """The worker's next report (vLLM writes its own lines to stdout too)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the worker exited")
        if line.startswith("@@"):
            return line[2:].strip()


def bench_model(work: Path, size: str, versions: int, lr: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from shardcast.keys import generate_signing_key, public_key_b64
    from shardcast.origin import Origin
    from shardcast.precision import cast_for_publishing
    from shardcast.server import serve_origin

    model_dir = make_model(work, size)
    master = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir,
        dtype=torch.float32).state_dict().items() if k != "lm_head.weight"}
    key = generate_signing_key(work / f"{size}-key.pem")
    pub = public_key_b64(key)
    modes = {"full": dict(deltas=False), "delta": dict(deltas=True, anchor_every=10)}
    origins, servers, procs, workers = {}, {}, [], {}
    try:
        for mode, kw in modes.items():
            origins[mode] = Origin(work / f"{size}-{mode}-origin", key, run_id=RUN_ID, keep_versions=3,
                shard_bytes=64 << 20, grace_s=0, **kw)
            origins[mode].publish(0, cast_for_publishing(master))
            servers[mode] = serve_origin(origins[mode])
            relay = start([sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", "relay", "--upstream",
                           servers[mode].url, "--root", str(work / f"{size}-{mode}-relay"), "--public-key", pub,
                           "--run-id", RUN_ID, "--poll-interval-s", "0.02", "--log-level", "ERROR"])
            procs.append(relay)
            relay_url = json.loads(relay.stdout.readline())["url"]
            w = start([sys.executable, __file__, "_worker", "--relay", relay_url, "--origin", servers[mode].url,
                       "--pub", pub, "--model", str(model_dir), "--dest", str(work / f"{size}-{mode}-worker")],
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, log=work / f"{size}-{mode}-worker.log")
            procs.append(w)
            assert report(w) == "ready", f"{mode} worker did not start"
            workers[mode] = w
            json.loads(report(w))  # version 0 loaded
        gen = torch.Generator().manual_seed(0)
        rows = []
        for v in range(1, versions + 1):
            for t in master.values():  # an Adam-like step: every weight moves by about lr
                t.add_(torch.sign(torch.randn(t.shape, generator=gen)) * lr)
            state = cast_for_publishing(master)
            for mode in modes:
                os.sync()
                visible: list[float] = []
                add_complete = origins[mode].add_complete

                def timed(*args, _add=add_complete, _visible=visible):
                    out = _add(*args)
                    _visible.append(time.time())  # the version is listed from here on
                    return out

                origins[mode].add_complete = timed
                t0 = time.time()
                m = origins[mode].publish(v, state)
                origins[mode].add_complete = add_complete
                r = json.loads(report(workers[mode]))
                assert r["version"] == v, r
                rows.append({
                    "model": size, "mode": mode, "version": v, "publish_s": round(visible[0] - t0, 3),
                    "latency_s": round(r["t_generated"] - t0, 3), "seen_s": round(r["t_seen"] - visible[0], 3),
                    "pull_s": round(r["t_pulled"] - r["t_seen"], 3), "reload_s": round(r["t_reloaded"] - r["t_pulled"],
                    3), "generate_s": round(r["t_generated"] - r["t_reloaded"], 3), "wire_bytes": r["wire_bytes"],
                    "full_bytes": m.full_bytes, "steps": r["steps"], "from_memory": r["from_memory"],
                })
                print(json.dumps(rows[-1]), flush=True)
        return {"model": size, "params": sum(t.numel() for t in master.values()), "rows": rows}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        for s in servers.values():
            s.stop()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]" if values else "—"


def write(out: str, results: list[dict], meta: dict) -> None:
    Path(out + ".json").write_text(json.dumps({"meta": meta, "models": results}, indent=2) + "\n")
    lines = [
        "# Publish -> worker generating with the new version: full versions and deltas",
        "",
        f"`{meta['command']}` — {meta['when']}, loopback, 2 cores shared with other jobs (load before "
        f"{meta['loadavg_before']}, after {meta.get('loadavg_after')}).",
        f"bfloat16 versions of a float32 master taking Adam-like steps of {meta['lr']} per weight; full and delta "
        f"published alternately, version by",
        "version. latency = the trainer calls the origin's publish -> the worker generated a token with the new "
        "version; its parts: publish",
        "(encode the delta or serialize the shards, hash, fsync, sign, until listed), seen (relay mirrored it + the "
        "worker's 20 ms listing poll),",
        "pull (download, verify, apply deltas, write the folder), reload (vLLM), generate (1 token). Cells: median "
        "[min–max].",
        "",
        "| model | params | mode | latency s, median | max | publish | seen | pull | reload | generate | MB on the "
        "wire | reload from memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for mode in ("full", "delta"):
            rs = [r for r in res["rows"] if r["mode"] == mode]
            lat = [r["latency_s"] for r in rs]
            lines.append(
                f"| {res['model']} | {res['params'] / 1e6:.1f}M | {mode} | {statistics.median(lat):.3f} | "
                f"{max(lat):.3f} | {spread([r['publish_s'] for r in rs])} | {spread([r['seen_s'] for r in rs])} | "
                f"{spread([r['pull_s'] for r in rs])} | {spread([r['reload_s'] for r in rs])} | "
                f"{spread([r['generate_s'] for r in rs])} | "
                f"{spread([r['wire_bytes'] / 1e6 for r in rs])} | {sum(r['from_memory'] for r in rs)}/{len(rs)} |"
            )
    lines += ["", "Every version (latency s, full / delta):", ""]
    for res in results:
        full = [r for r in res["rows"] if r["mode"] == "full"]
        delta = [r for r in res["rows"] if r["mode"] == "delta"]
        lines.append(f"- {res['model']}: " + "; ".join(f"v{f['version']} {f['latency_s']} / {d['latency_s']}" for f,
            d in zip(full, delta)))
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=12)
    p.add_argument("--models", default="small,medium")
    p.add_argument("--lr", type=float, default=2.5e-6,
        help="per-weight step of the master (bf16 deltas of a few percent)")
    p.add_argument("--out", default=str(RESULTS / "reload_latency"))
    a = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="reload-latency-", dir=WORK))
    meta = {"command": "python " + " ".join(["bench/reload_latency_bench.py"] + sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_before": [round(x, 2)
            for x in os.getloadavg()], "lr": a.lr}
    try:
        results = [bench_model(work, size, a.versions, a.lr) for size in a.models.split(",")]
        meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        write(a.out, results, meta)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        main()
