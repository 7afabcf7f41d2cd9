"""Bytes per published version, full fine-tuning against LoRA, side by side on the demo config.

The demo's model (configs/demo.toml: the small model, its echo pretraining) and its trainer and shardcast
settings. Two runs of the same trajectory (the same batches of synthetic samples, seed fixed): the
trainer as in the demo (full fine-tuning; the origin publishes deltas between anchors) and the trainer
with `trainer.lora` on (rank 8 by default; the origin publishes whole adapters, no deltas, as the trainer
actor does in a LoRA run). Per version: the bytes of its files on the origin (manifest sizes, the manifest
itself left out), split into full shards and delta, and what a worker that holds the previous version
downloads (the delta if there is one, else the shards).
Bytes do not depend on the machine's load; the load is recorded anyway.

    python bench/lora_bytes_bench.py [--versions 6] [--rank 8]
Results: bench/results/lora.{json,md}. Work folders are temporary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"


def samples(n: int, seed: int, version: int):
    import numpy as np

    from trainer.samples import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c = int(rng.integers(2, 9))  # the demo's max_tokens is 8
        out.append(TrainSample(rng.integers(3, 53, size=int(rng.integers(4, 10))), rng.integers(3, 53, size=c),
                               -rng.uniform(3.5, 4.5, size=c), float(rng.normal()), float(rng.uniform()), version,
                               f"s{seed}-{i}"))
    return out


def run(mode: str, cfg, model_dir: Path, work: Path, versions: int, rank: int) -> list[dict]:
    import torch

    from shardcast.keys import generate_signing_key
    from shardcast.origin import Origin
    from trainer.train import Trainer

    trainer_cfg, shardcast_cfg = cfg.trainer, cfg.shardcast
    if mode == "lora":
        trainer_cfg = trainer_cfg.model_copy(update={"lora": trainer_cfg.lora.model_copy(update={"enabled": True,
            "rank": rank})})
        shardcast_cfg = shardcast_cfg.model_copy(update={"deltas": False})  # as swarmrl/trainer_actor.py
    origin = Origin.from_config(work / f"{mode}-origin", generate_signing_key(work / f"{mode}.pem"),
        shardcast_cfg.model_copy(update={"keep_versions": versions + 1, "run_id": f"lora-bytes-{mode}"}))
    torch.manual_seed(0)
    trainer = Trainer(trainer_cfg, model_dir, work / f"{mode}-run", publish=lambda v, s: origin.publish(v,
        s).model_hash)
    for step in range(versions - 1):
        trainer.step(samples(trainer_cfg.samples_per_step, seed=step, version=trainer.version))
    rows = []
    for v in origin.versions():
        m = origin.manifest(v)
        full = sum(s.size for s in m.full_shards)
        # A worker that holds the previous version downloads the delta when there is one, else the shards.
        rows.append({"version": v, "bytes_on_origin": m.total_bytes, "full_shard_bytes": full,
                     "delta_bytes": m.total_bytes - full, "follower_download_bytes": (m.total_bytes - full) if m.deltas
                     else full, "anchor": m.anchor_version == v, "files": [s.name for s in m.shards]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    import torch

    from swarmrl.config import load_run_config
    from trainer.tiny_model import init_model

    torch.set_num_threads(1)
    cfg = load_run_config(REPO / "configs" / "demo.toml")
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="lora-bytes-") as tmp:
        work = Path(tmp)
        model_dir = init_model(work / "base", cfg.model.init_size, cfg.model.init_seed, cfg.model.tie_embeddings,
                               cfg.model.init_pretrain_steps, cfg.model.init_pretrain_target,
                               cfg.model.init_pretrain_max_steps)
        model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        result = {mode: run(mode, cfg, model_dir, work, args.versions, args.rank) for mode in ("full", "lora")}
    result.update(model=cfg.model.init_size, model_bytes=model_bytes, rank=args.rank,
                  target_modules=cfg.trainer.lora.target_modules, publish_dtype=cfg.trainer.publish_dtype,
                  load_avg_before=load_before, load_avg_after=os.getloadavg(), seconds=time.time() - started,
                  command=f"python bench/lora_bytes_bench.py --versions {args.versions} --rank {args.rank}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(result, indent=2))
    for mode in ("full", "lora"):
        for r in result[mode]:
            print(mode, r["version"], r["bytes_on_origin"], r["full_shard_bytes"], r["delta_bytes"], "anchor"
                if r["anchor"] else "delta")


if __name__ == "__main__":
    main()
