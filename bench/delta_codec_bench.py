"""Delta codec: bytes on the wire per policy version, and encode/decode speed, side by side in one run.

1. Sizes. The `small` model of trainer.tiny_model (seed 0, tied embeddings) is the fp32 master. AdamW
   (torch defaults, weight decay 0.01) takes `--versions` steps of next-token loss on the tiny model's
   pretraining corpus, at lr 1e-6 and at 1e-5. After each step a version is published twice: as bf16
   (cast from the fp32 master, shardcast.precision) and as fp32 (the master itself). Per version:
   delta bytes / full bytes, where full = the safetensors bytes of that version. For reference, the
   same full version compressed by zstd (level 3), and two variants the codec does not implement: the
   integer difference of the bit patterns (mod 2^bits, zigzag) instead of XOR, and sparse sections
   holding the new values instead of the XOR.
   Every chain v0 + deltas is checked to equal the last full version bit for bit.
2. Speed. Encode and apply MB/s (MB of the full version per second of wall time) on the small model's
   deltas, and on a synthetic state of `--synthetic-mb` MB (bf16) made of 2048x2048 tensors, one
   Adam-like step (each weight moves by lr * U(0.5, 1.5) in a random direction) at lr 1e-6 and 1e-5.
   Encode is given both hashes (the origin has them from publishing); apply is given the base's hash
   (the client verified it with the base) and always hashes the result.
3. zstd level 1 / 3 / 9: sizes and encode speed, the default's evidence. On the synthetic state also:
   the encoding chosen on a sample (the codec) vs both encodings compressed whole, 2 zstd threads per
   frame, and 2 tensors at once (`workers`) for encode and apply.
Every timing is repeated `--repeats` times; the report lists every run. The machine is 2 cores shared
with other jobs: its load average is recorded, and spreads are wide.

    python bench/delta_codec_bench.py [--versions 10] [--repeats 5] [--synthetic-mb 200]
Results: bench/results/delta_codec.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"

from shardcast import delta as codec  # noqa: E402
from shardcast.delta import apply_delta, delta_stats, encode_delta, read_header  # noqa: E402
from shardcast.precision import cast_for_publishing  # noqa: E402
from shardcast.weights import model_hash, serialize_shard, split_aliases  # noqa: E402

SAMPLE = codec.CHOICE_SAMPLE_ELEMENTS


def full_bytes(state) -> bytes:
    tensors, aliases = split_aliases(state)
    return serialize_shard(tensors, aliases)


def bits_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].contiguous().view(-1).view(torch.uint8),
        b[k].contiguous().view(-1).view(torch.uint8)) for k in a
    )


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4g} [{min(xs):.4g}–{max(xs):.4g}]"


# --- 1. the small model under AdamW ------------------------------------------------------------------


def copy_state(sd: dict) -> dict:
    """A copy that keeps the tying (lm_head is embed_tokens), as the trainer's state_dict has it."""
    tensors, aliases = split_aliases(sd)
    copies = {k: v.detach().clone() for k, v in tensors.items()}
    return {k: copies[aliases.get(k, k)] for k in sd}


def train_versions(lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """fp32 master states v0..v_steps (copies), the model trained by AdamW at `lr`."""
    from transformers import Qwen2ForCausalLM

    from trainer.tiny_model import EOS_ID, PAD_ID, init_model, make_tokenizer, pretrain_corpus

    with tempfile.TemporaryDirectory() as d:
        model = Qwen2ForCausalLM.from_pretrained(init_model(d, "small", seed=0), torch_dtype=torch.float32)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tok, rng = make_tokenizer(), random.Random(0)
    versions = [copy_state(model.state_dict())]
    model.train()
    for _ in range(steps):
        rows = [tok(t)["input_ids"] + [EOS_ID] for t in pretrain_corpus(32, rng)]
        ids = torch.full((len(rows), max(map(len, rows))), PAD_ID)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        loss = model(input_ids=ids, attention_mask=(ids != PAD_ID).long(), labels=ids.masked_fill(ids == PAD_ID,
            -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append(copy_state(model.state_dict()))
    return versions


def whatif_frames(base: dict, new: dict, variant: str) -> int:
    """The codec's frame bytes under a variant it does not implement (same planes, same smaller-of-two):
    "int-diff": (new - base) mod 2^bits, zigzagged, in place of new XOR base, dense and sparse;
    "new values": sparse sections hold the new values at the changed positions instead of the XOR."""
    cctx = zstandard.ZstdCompressor(level=codec.DEFAULT_LEVEL)
    total = 0
    b_t, _ = split_aliases(base)
    n_t, _ = split_aliases(new)
    for name in sorted(b_t):
        w = b_t[name].element_size()
        sint, uint = {2: (np.int16, np.uint16), 4: (np.int32, np.uint32)}[w]
        a, b = codec._bytes(b_t[name]).view(sint), codec._bytes(n_t[name]).view(sint)
        if variant == "int-diff":
            d = b - a  # wraps mod 2^bits
            z = ((d << 1) ^ (d >> (8 * w - 1))).view(uint)
        else:
            z = (a ^ b).view(uint)
        count = int(np.count_nonzero(z))
        if count == 0:
            continue
        best = len(cctx.compress(codec._dense_raw(z, w)))
        if count <= codec.SPARSE_MAX_DENSITY * z.size:
            raw = codec._sparse_raw(z, w)
            if variant == "new values":
                pos = np.flatnonzero(z)
                raw[4 * count :] = codec._planes(b[pos].view(np.uint8), w)
            best = min(best, len(cctx.compress(raw)))
        total += best
    return total


def timed(fn, *args, **kwargs) -> tuple[object, float, float]:
    """(result, wall seconds, CPU seconds of this process, all threads)."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - w0, time.process_time() - c0


def record(runs: dict, label: str, nbytes: int, wall: float, cpu: float) -> None:
    r = runs.setdefault(label, {"wall_MBps": [], "cpu_MBps": []})
    r["wall_MBps"].append(nbytes / wall / 1e6)
    r["cpu_MBps"].append(nbytes / max(cpu, 1e-9) / 1e6)


def bench_model(versions: int, repeats: int) -> dict:
    out = {}
    for lr in (1e-6, 1e-5):
        masters = train_versions(lr, versions)
        for pub in ("bfloat16", "float32"):
            states = [cast_for_publishing(m, getattr(torch, pub)) for m in masters]
            hashes = [model_hash(s) for s in states]
            full = [len(full_bytes(s)) for s in states]
            pairs = [dict(base_hash=hashes[i], new_hash=hashes[i + 1]) for i in range(versions)]
            deltas = [encode_delta(states[i], states[i + 1], **pairs[i]) for i in range(versions)]
            state = states[0]
            for i, d in enumerate(deltas):
                state = apply_delta(state, d, base_hash=hashes[i], expected_hash=hashes[i + 1])
            assert bits_equal(state, states[-1]), "chain != full version"
            runs: dict = {}
            for _ in range(repeats):
                for i in range(versions):
                    _, w, c = timed(encode_delta, states[i], states[i + 1], **pairs[i])
                    record(runs, "encode", full[i + 1], w, c)
                    _, w, c = timed(apply_delta, states[i], deltas[i], base_hash=hashes[i])
                    record(runs, "apply", full[i + 1], w, c)
            levels = {}
            for level in (1, 3, 9):
                for _ in range(repeats):
                    sizes, w, c = timed(lambda: [len(encode_delta(states[i], states[i + 1], level=level, **pairs[i]))
                        for i in range(versions)])
                    record(runs, f"encode, level {level}", sum(full[1:]), w, c)
                levels[level] = sum(sizes) / sum(full[1:])
            changed = []
            for i in range(versions):
                a, _ = split_aliases(states[i])
                b, _ = split_aliases(states[i + 1])
                n = sum(t.numel() for t in a.values())
                changed.append(sum(int((codec._bytes(a[k]) != codec._bytes(b[k])).reshape(-1,
                    a[k].element_size()).any(1).sum()) for k in a) / n)
            whatif: dict[str, list[float]] = {"int-diff": [], "new values": []}
            for i, d in enumerate(deltas):
                frames = sum(t.length for t in read_header(d).tensors)
                for variant, ratios in whatif.items():
                    ratios.append((len(d) - frames + whatif_frames(states[i], states[i + 1], variant)) / full[i + 1])
            key = f"lr={lr:g} {pub}"
            out[key] = {
                "full_bytes": full[1],
                "full_zstd3_ratio": len(zstandard.ZstdCompressor(level=3).compress(full_bytes(states[1]))) / full[1],
                "delta_ratio": [len(d) / full[i + 1] for i, d in enumerate(deltas)],
                "whatif_ratio": whatif,
                "changed_fraction": changed,
                "encodings": [{k: v for k, v in delta_stats(d).items() if k in ("same", "xor", "sparse")}
                for d in deltas],
                "chain_bit_exact": True,
                "level_ratio": levels,
                "runs": runs,
            }
            print(f"{key}: delta/full {spread(out[key]['delta_ratio'])}", flush=True)
    return out


# --- 2. a synthetic state ------------------------------------------------------------------------------


def bench_synthetic(mb: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n_tensors = max(1, mb * (1 << 20) // (2048 * 2048 * 2))
    master = {f"layers.{i}.weight": torch.randn(2048, 2048, generator=g) * 0.02 for i in range(n_tensors)}
    configs = [
        ("level 1", dict(level=1)),
        ("level 1, exact choice", dict(level=1, exact=True)),
        ("level 3", dict(level=3)),
        ("level 1, 2 zstd threads", dict(level=1, threads=2)),
        ("level 1, 2 workers", dict(level=1, workers=2)),
    ]
    out = {}
    for lr in (1e-6, 1e-5):
        stepped = {k: v + lr * torch.sign(torch.randn(v.shape, generator=g)) * (torch.rand(v.shape, generator=g) + 0.5)
            for k, v in master.items()}
        for pub in ("bfloat16", "float32"):
            a, b = cast_for_publishing(master, getattr(torch, pub)), cast_for_publishing(stepped, getattr(torch, pub))
            ha, hb = model_hash(a), model_hash(b)
            nbytes = sum(t.numel() * t.element_size() for t in b.values())
            runs: dict = {}
            sizes = {}
            for _ in range(repeats):  # configs interleaved, so load from other jobs hits all alike
                for label, kw in configs:
                    kw = dict(kw)
                    # both encodings, whole
                    codec.CHOICE_SAMPLE_ELEMENTS = 1 << 62 if kw.pop("exact", False) else SAMPLE
                    d, w, c = timed(encode_delta, a, b, base_hash=ha, new_hash=hb, **kw)
                    codec.CHOICE_SAMPLE_ELEMENTS = SAMPLE
                    record(runs, f"encode, {label}", nbytes, w, c)
                    sizes[label] = len(d) / nbytes
                    if label == "level 1":
                        delta = d
                        for workers in (1, 2):
                            r, w, c = timed(apply_delta, a, d, base_hash=ha, workers=workers)
                            record(runs, f"apply, {workers} worker{'s' * (workers > 1)}", nbytes, w, c)
                            assert model_hash(r) == hb
                            del r
                    del d
                _, w, c = timed(model_hash, b)
                record(runs, "model_hash (part of apply)", nbytes, w, c)
            key = f"lr={lr:g} {pub}"
            out[key] = {"MB": nbytes / 1e6, "ratio": sizes, "runs": runs, "encodings": delta_stats(delta)}
            print(f"synthetic {key}: " + json.dumps({k: spread(v["wall_MBps"]) for k, v in runs.items()}), flush=True)
            del a, b, delta
    return out


# --- report ------------------------------------------------------------------------------------------------


def report(res: dict) -> str:
    m, s = res["model"], res["synthetic"]
    lines = [
        "# Delta codec benchmark",
        "",
        f"`{res['command']}` — {res['when']}, torch {torch.__version__}, zstandard {zstandard.__version__}, "
        f"{os.cpu_count()} cores shared with other jobs (load average before {res['load_before']}, after "
        f"{res['load_after']}).",
        "Cells are median [min–max] over every run; every run is listed in `delta_codec.json`. Speeds are MB of the",
        "full version per second: *wall* (what a caller waits) and *CPU* (per CPU-second of this process, all threads:",
        "less sensitive to the other jobs on this box).",
        "",
        f"## 1. The `small` model ({res['params']:,} parameters), fp32 master, AdamW, {res['versions']} versions",
        "",
        "delta / full = the delta's bytes over the version's safetensors bytes, one value per version v→v+1.",
        "What-ifs, not implemented, same planes and choice: *int-diff* = (new − base) mod 2^bits (zigzag) in place of",
        "XOR; *new values* = sparse sections holding the new values at the changed positions instead of the XOR.",
        "",
        "| run | full MB | full + zstd-3 | delta / full | what-if int-diff | what-if new values | elements changed | "
        "tensors same/xor/sparse (v0→v1) | chain == full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in m.items():
        e = r["encodings"][0]
        lines.append(
            f"| {key} | {r['full_bytes'] / 1e6:.2f} | {r['full_zstd3_ratio']:.3f} | {spread(r['delta_ratio'])} "
            f"| {spread(r['whatif_ratio']['int-diff'])} | {spread(r['whatif_ratio']['new values'])} "
            f"| {spread(r['changed_fraction'])} | {e['same']}/{e['xor']}/{e['sparse']} | {r['chain_bit_exact']} |"
        )
    lines += ["", "Per version, delta / full:", ""]
    for key, r in m.items():
        lines.append(f"- {key}: " + ", ".join(f"{x:.4f}" for x in r["delta_ratio"]))
    lines += ["",
              "Speed and zstd level on the small model (encode/apply: every version × repeat; level rows: all "
              "versions at once):", "", "| run | measure | delta / full | wall MB/s | CPU MB/s |",
              "|---|---|---|---|---|"]
    for key, r in m.items():
        for label, v in r["runs"].items():
            level = int(label.rsplit(" ", 1)[1]) if "level" in label else None
            ratio = f"{r['level_ratio'][level]:.4f}" if level else ""
            lines.append(f"| {key} | {label} | {ratio} | {spread(v['wall_MBps'])} | {spread(v['cpu_MBps'])} |")
    lines += ["", "## 2. Synthetic state of 2048×2048 tensors, one Adam-like step", "",
              "| run | MB | measure | delta / full | wall MB/s | CPU MB/s |", "|---|---|---|---|---|---|"]
    for key, r in s.items():
        for label, v in r["runs"].items():
            cfg = label.split(", ", 1)[1] if label.startswith("encode") else ""
            ratio = f"{r['ratio'][cfg]:.4f}" if cfg in r["ratio"] else ""
            lines.append(f"| {key} | {r['MB']:.0f} | {label} | {ratio} | {spread(v['wall_MBps'])} | "
                f"{spread(v['cpu_MBps'])} |")
    lines += ["", "Every run, wall MB/s:", ""]
    for key, r in s.items():
        for label, v in r["runs"].items():
            lines.append(f"- {key}, {label}: " + ", ".join(f"{x:.0f}" for x in v["wall_MBps"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--versions", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--synthetic-mb", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    res = {
        "command": "python bench/delta_codec_bench.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "versions": a.versions,
    }
    from transformers import Qwen2ForCausalLM

    from trainer.tiny_model import make_config

    res["params"] = sum(p.numel() for p in Qwen2ForCausalLM(make_config("small")).parameters())
    res["model"] = bench_model(a.versions, a.repeats)
    res["synthetic"] = bench_synthetic(a.synthetic_mb, a.repeats)
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "delta_codec.json").write_text(json.dumps(res, indent=1))
    (RESULTS / "delta_codec.md").write_text(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
