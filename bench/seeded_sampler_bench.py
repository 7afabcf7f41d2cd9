"""Seeded sampler benchmark: honest replay margins, generation overhead, replay cost, measured in one run.

1. Margins. The real vLLM engine (tiny model, float32 and bfloat16) generates leases with the seeded
   sampler; the verifier's side replays every draw on transformers' logits (reference in the engine's
   dtype, and float32 for the bfloat16 engine). Counts tokens that are not exactly the replayed winner,
   tokens outside the replayed support, and the largest margin (score units).
2. Overhead. One engine on the `small` model generates the same leases with the seeded sampler and
   with vLLM's own seeded sampling (EngineConfig.seeded_sampler toggled per call; the processor stays
   loaded and idles in the baseline), interleaved so that machine noise hits both alike. Reports the
   time-per-token ratio (goal <= 1.03), the CPU-time ratio, and vLLM's `Sampler.forward` seconds in each
   mode (the sampler is the only thing that differs).
3. Replay cost. On the completions of 2, the verifier's prefill
   (`verifier.reference.prefill`) against `protocol.sampling.replay` over the same rows, given the logits
   (goal <= 0.10). Also a synthetic Qwen-sized vocabulary (151,936), where the replay's elementwise work
   is compared with the LM-head matmul alone (a lower bound of a prefill's cost).

    python bench/seeded_sampler_bench.py [--rounds 6] [--overhead-rounds 10] [--prompts 8] [--samples 8] [--max-tokens
    128]

Writes bench/results/seeded_sampler.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from protocol import sampling as S  # noqa: E402
from protocol.models import SamplingParams, TaskLease, TaskPrompt  # noqa: E402

SETTINGS = {"T=1": dict(temperature=1.0), "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "T=1,top_k=20": dict(temperature=1.0, top_k=20)}


def make_lease(n_prompts: int, n_samples: int, max_tokens: int, seed: int, **sampling) -> TaskLease:
    rng = np.random.default_rng(seed)
    return TaskLease(
        lease_id=f"bench-{seed}",
        prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=np.concatenate([[1], rng.integers(3, 54,
        size=15)]).astype(np.int32), seeds=[int(s) for s in rng.integers(0, 2**63, size=n_samples)])
        for i in range(n_prompts)],
        samples_per_prompt=n_samples,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        policy_version=0,
        min_policy_version=0,
        deadline=time.time() + 3600,
    )


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def sequences(lease: TaskLease, completions) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(lease.prompts[c.prompt_index].token_ids, c.token_ids) for c in completions]


@torch.inference_mode()
def replay_inputs(model, lease: TaskLease, completions):
    """Logits, seeds, positions and tokens of every completion row, concatenated (not timed)."""
    logits, seeds, positions, tokens = [], [], [], []
    for c in completions:
        p = lease.prompts[c.prompt_index]
        ids = torch.from_numpy(np.concatenate([p.token_ids, c.token_ids[:-1]]).astype(np.int64))[None]
        logits.append(model(ids).logits[0, len(p.token_ids) - 1 :].float())
        n = c.token_ids.size
        seeds.append(torch.full((n,), p.seeds[c.sample_index], dtype=torch.int64))
        positions.append(torch.arange(n))
        tokens.append(torch.from_numpy(c.token_ids.astype(np.int64)))
    return torch.cat(logits), torch.cat(seeds), torch.cat(positions), torch.cat(tokens)


def replay_rows(logits, seeds, positions, tokens, sampling, rows: int = 2048, **slack):
    """The replay as a verifier would run it: slices of rows (verifier.reference uses 2048)."""
    parts = [S.replay(logits[s : s + rows], seeds[s : s + rows], positions[s : s + rows], tokens[s : s + rows],
        sampling, **slack) for s in range(0, logits.shape[0], rows)]
    return S.Replay(*(torch.cat([getattr(p, f) for p in parts]) for f in ("winner", "margin", "inside")))


def bench_margins(model_dir: Path, args) -> list[dict]:
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine
    from verifier.reference import load_reference_model

    rows = []
    for engine_dtype, ref_dtypes in (("float32", ["float32"]), ("bfloat16", ["bfloat16", "float32"])):
        engine = RolloutEngine(model_dir, EngineConfig(dtype=engine_dtype, max_model_len=512, kv_cache_bytes=128 << 20,
            proofs=False))
        try:
            generated = {name: [] for name in SETTINGS}
            for r in range(args.rounds):
                for name, kw in SETTINGS.items():
                    lease = make_lease(args.prompts, args.samples, args.max_tokens, seed=1000 + r, **kw)
                    generated[name].append((lease, engine.generate(lease)))
        finally:
            engine.close()
        for ref_dtype in ref_dtypes:
            model = load_reference_model(model_dir, None, ref_dtype)
            for name, runs in generated.items():
                row = {"engine": engine_dtype, "reference": ref_dtype, "sampling": name, "tokens": 0,
                    "max_logprob_diff": 0.0}
                slacks = {"strict": {}, "slack": dict(top_p_slack=args.top_p_slack, logit_slack=args.logit_slack)}
                for key in slacks:
                    row[key] = {"not_exact": 0, "positive_margin": 0, "outside_support": 0, "max_margin": []}
                for lease, completions in runs:
                    logits, seeds, positions, tokens = replay_inputs(model, lease, completions)
                    row["tokens"] += tokens.numel()
                    raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
                    reported = torch.from_numpy(np.concatenate([c.logprobs for c in completions]))
                    row["max_logprob_diff"] = max(row["max_logprob_diff"], float((raw - reported).abs().max()))
                    for key, slack in slacks.items():
                        rep = replay_rows(logits, seeds, positions, tokens, lease.sampling, **slack)
                        row[key]["not_exact"] += int((rep.winner != tokens).sum())
                        row[key]["positive_margin"] += int((rep.margin > 0).sum())
                        row[key]["outside_support"] += int((~rep.inside).sum())
                        row[key]["max_margin"].append(float(rep.margin.max()))  # > 0: the claimed token lost
                for key in slacks:
                    row[key]["max_margin"] = spread(row[key]["max_margin"])
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    return rows


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def matched_stats(steps: dict[str, list[tuple[int, float]]], q: float) -> dict[int, tuple[int, dict[str, float]]]:
    """Per batch size seen in both modes: (number of steps, q-quantile of the time per mode). The
    forward pass costs the same at the same size, so only the sampler differs; a median or a low
    quantile shrugs off other jobs' bursts (the low quantile is the undisturbed cost)."""
    sizes = sorted(set(b for b, _ in steps["seeded"]) & set(b for b, _ in steps["vllm"]))
    return {b: (sum(1 for m in steps for bb, _ in steps[m] if bb == b), {m: quantile([t for bb, t in steps[m]
        if bb == b], q) for m in steps}) for b in sizes}


def matched(steps: dict[str, list[tuple[int, float]]], q: float = 0.5) -> dict:
    """seeded / vLLM of the per-size quantiles, weighted by how many steps each size had."""
    st = matched_stats(steps, q)
    num = sum(n * m["seeded"] for n, m in st.values())
    den = sum(n * m["vllm"] for n, m in st.values())
    return {"ratio": num / den, "sizes": len(st), "steps": {m: len(v) for m, v in steps.items()}}


def component_ratio(steps: dict, q: float = 0.5) -> float:
    """1 + (the sampler's extra time per step) / (the step's time with vLLM's sampler), from per-size
    quantiles: the sampler is the only thing the modes change, and it is timed on its own."""
    sampler, step = matched_stats(steps["sampler"], q), matched_stats(steps["step"], q)
    extra = sum(n * (m["seeded"] - m["vllm"]) for n, m in sampler.values())
    return 1 + extra / sum(n * m["vllm"] for n, m in step.values())


def bench_overhead(model_dir: Path, args) -> tuple[dict, list]:
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.sample.sampler import Sampler

    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine
    from inference_worker.seeded_sampler import SeededSampler

    # Per engine step: its batch size (rows the sampler saw), its time, and the sampler's time (our
    # processor runs inside vLLM's Sampler.forward), per mode; wall time and this thread's CPU time.
    # In-process vLLM on CPU runs the whole step in this thread (it sets torch to 1 thread for
    # serving), so the thread's CPU time is the step's work without other jobs' time slices.
    mode, last = ["seeded"], {"batch": None, "sampler": 0.0, "sampler_cpu": 0.0}
    steps = {k: {"seeded": [], "vllm": []} for k in ("step", "sampler", "step_cpu", "sampler_cpu")}
    applies: list[float] = []
    originals = (Sampler.forward, LLMEngine.step, SeededSampler.apply)

    def sampler_forward(self, logits, *a, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = originals[0](self, logits, *a, **kw)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        last["batch"], last["sampler"], last["sampler_cpu"] = logits.shape[0], wall, cpu
        return out

    def engine_step(self):
        last["batch"] = None
        t0, c0 = time.perf_counter(), time.thread_time()
        out = originals[1](self)
        if last["batch"] is not None:
            b, m = last["batch"], mode[0]
            steps["step"][m].append((b, time.perf_counter() - t0))
            steps["step_cpu"][m].append((b, time.thread_time() - c0))
            steps["sampler"][m].append((b, last["sampler"]))
            steps["sampler_cpu"][m].append((b, last["sampler_cpu"]))
        return out

    def processor_apply(self, logits):
        t0 = time.perf_counter()
        out = originals[2](self, logits)
        if self.rows:
            applies.append(time.perf_counter() - t0)
        return out

    Sampler.forward, LLMEngine.step, SeededSampler.apply = sampler_forward, engine_step, processor_apply
    engine = RolloutEngine(model_dir, EngineConfig(max_model_len=512, kv_cache_bytes=256 << 20, proofs=False))
    kept = []
    secs = {"seeded": [], "vllm": []}
    cpu = {"seeded": [], "vllm": []}
    tokens = {"seeded": [], "vllm": []}
    try:
        for seeded in (True, False):  # warm-up
            engine.config.seeded_sampler = seeded
            engine.generate(make_lease(2, 2, 16, seed=999))
        for k in steps:
            steps[k] = {"seeded": [], "vllm": []}
        applies.clear()
        for r in range(args.overhead_rounds):
            lease = make_lease(args.prompts, args.samples, args.max_tokens, seed=r, temperature=1.0)
            for m in (("seeded", "vllm") if r % 2 == 0 else ("vllm", "seeded")):
                mode[0] = m
                engine.config.seeded_sampler = m == "seeded"
                c0 = time.process_time()
                completions = engine.generate(lease)
                cpu[m].append(time.process_time() - c0)
                secs[m].append(engine.last_stats.seconds)
                tokens[m].append(engine.last_stats.tokens)
                if m == "seeded":
                    kept.append((lease, completions))
    finally:
        engine.close()
        Sampler.forward, LLMEngine.step, SeededSampler.apply = originals
    per_tok = {m: [s / t for s, t in zip(secs[m], tokens[m])] for m in secs}
    step_med = {m: statistics.median(t for _, t in steps["step"][m]) for m in secs}
    result = {
        "rounds": args.overhead_rounds,
        "completions_per_lease": args.prompts * args.samples,
        "tokens": {m: sum(v) for m, v in tokens.items()},
        "tok_per_s": {m: sum(tokens[m]) / sum(secs[m]) for m in secs},
        "step_time_ratio_matched": matched(steps["step"]),
        "sampler_time_ratio_matched": matched(steps["sampler"]),
        "component_ratio": component_ratio(steps),
        "step_time_ratio_matched_p10": matched(steps["step"], 0.1),
        "component_ratio_p10": component_ratio(steps, 0.1),
        "step_cpu_ratio_matched": matched(steps["step_cpu"]),
        "component_ratio_cpu": component_ratio({"sampler": steps["sampler_cpu"], "step": steps["step_cpu"]}),
        "torch_threads_in_engine": torch.get_num_threads(),
        "step_ms_median": {m: 1e3 * v for m, v in step_med.items()},
        "sampler_ms_median": {m: 1e3 * statistics.median(t for _, t in steps["sampler"][m]) for m in secs},
        "apply_ms_median": 1e3 * statistics.median(applies),
        "time_per_token_ratio": (sum(secs["seeded"]) / sum(tokens["seeded"])) / (sum(secs["vllm"]) / sum(
        tokens["vllm"])),
        "time_per_token_ratio_per_round": spread([a / b for a, b in zip(per_tok["seeded"], per_tok["vllm"])]),
        "cpu_per_token_ratio": (sum(cpu["seeded"]) / sum(tokens["seeded"])) / (sum(cpu["vllm"]) / sum(tokens["vllm"])),
    }
    print(json.dumps(result), flush=True)
    return result, kept


def bench_replay_cost(model_dir: Path, kept: list, args, label: str) -> dict:
    from verifier.reference import load_reference_model, prefill

    model = load_reference_model(model_dir, None, "float32")
    ratios, prefill_s, replay_s, rows = [], [], [], 0
    for lease, completions in kept:
        seqs = sequences(lease, completions)
        inputs = replay_inputs(model, lease, completions)
        rows = inputs[0].shape[0]
        prefill(model, seqs[:2], [lease.sampling] * 2)  # warm-up
        for _ in range(2):
            t0 = time.perf_counter()
            prefill(model, seqs, [lease.sampling] * len(seqs))  # without seeds: the prefill alone
            t1 = time.perf_counter()
            replay_rows(*inputs, lease.sampling)
            t2 = time.perf_counter()
            prefill_s.append(t1 - t0)
            replay_s.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
    result = {"model": label, "torch_threads": torch.get_num_threads(), "rows_per_lease": rows,
        "replay_over_prefill": spread(ratios), "prefill_ms_per_token": 1e3 * statistics.median(prefill_s) / rows,
        "replay_ms_per_token": 1e3 * statistics.median(replay_s) / rows}
    print(json.dumps(result), flush=True)
    return result


def bench_large_vocab(args) -> dict:
    """Replay over a Qwen-sized vocabulary against the LM-head matmul alone (hidden 896, as Qwen2-0.5B).
    Synthetic logits, flat (std ~0.6: the top 1,024 tokens hold little mass, so top-p sorts whole
    rows) and peaked (std ~3, closer to a trained model's: the top 1,024 usually hold top_p)."""
    vocab, hidden, n = 151936, 896, args.large_vocab_rows
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    out = {}
    for shape, scale in (("flat", 0.02), ("peaked", 0.1)):
        weight = torch.randn(vocab, hidden, generator=gen) * scale
        for name, kw in SETTINGS.items():
            sp = SamplingParams(**kw)
            head, rep = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                logits = h @ weight.t()
                t1 = time.perf_counter()
                S.replay(logits, 7, torch.arange(n), tokens, sp)
                t2 = time.perf_counter()
                head.append(1e3 * (t1 - t0) / n)
                rep.append(1e3 * (t2 - t1) / n)
            key = f"{shape}, {name}"
            out[key] = {"logits_std": float(logits.std()), "lm_head_ms_per_token": spread(head),
                "replay_ms_per_token": spread(rep),
                "replay_over_lm_head": statistics.median(rep) / statistics.median(head)}
            print(key, json.dumps(out[key]), flush=True)
    return {"vocab": vocab, "hidden": hidden, "rows": n, "torch_threads": torch.get_num_threads(), "settings": out}


def write_markdown(res: dict, args, out: Path) -> None:
    m = res["machine"]
    lines = [
        "# Seeded sampler bench",
        "",
        f"`python bench/seeded_sampler_bench.py --rounds {args.rounds} --overhead-rounds {args.overhead_rounds} "
        f"--prompts {args.prompts} --samples {args.samples} --max-tokens {args.max_tokens} --top-p-slack "
        f"{args.top_p_slack} --logit-slack {args.logit_slack}`",
        f"(in-process vLLM CPU {m['vllm']}, torch {m['torch']}, {m['cpus']} cores shared with other jobs; load "
        f"average {m['load_avg_start'][0]:.1f} at start, {m['load_avg_end'][0]:.1f} at end)",
        "",
        "## 1. Honest margins (tiny model, {} leases x {} completions x <= {} tokens per setting)".format(args.rounds,
        args.prompts * args.samples, args.max_tokens),
        "",
        "| engine dtype | reference dtype | sampling | tokens | strict: not the replayed winner / outside support | "
        "strict: largest margin, median [min, max] over leases | with slack: margin > 0 / outside | with slack: "
        "largest margin, median [min, max] | largest logprob diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["margins"]:
        cells = []
        for key, count in (("strict", "not_exact"), ("slack", "positive_margin")):
            e, mm = r[key], r[key]["max_margin"]
            cells += [f"{e[count]} / {e['outside_support']}", f"{mm['median']:.3g} [{mm['min']:.3g}, {mm['max']:.3g}]"]
        lines.append(f"| {r['engine']} | {r['reference']} | {r['sampling']} | {r['tokens']:,} | " + " | ".join(
            cells) + f" | {r['max_logprob_diff']:.2g} |")
    lines += [
        "",
        "- margin: score(replayed winner) - score(claimed token), score units (logits / temperature); 0 when the "
        "claimed token is the winner, < 0 when it beat every token of the (tightened) support.",
        f"- with slack: `replay(..., top_p_slack={res['args']['top_p_slack']}, "
        f"logit_slack={res['args']['logit_slack']})`: tokens within the slack of the top-p / top-k boundary do not "
        f"compete for the winner (so the claimed token is often not 'the winner' there, with a margin <= 0), and the "
        f"claimed token counts as inside if it is inside the widened support.",
    ]
    o = res["overhead"]
    rr = o["time_per_token_ratio_per_round"]
    st, sm = o["step_time_ratio_matched"], o["sampler_time_ratio_matched"]
    lines += [
        "",
        f"## 2. Generation overhead (small model, float32, {o['rounds']} rounds x {o['completions_per_lease']} "
        f"completions x <= {args.max_tokens} tokens, T=1)",
        "",
        "| | seeded sampler | vLLM's own seeded sampling |",
        "|---|---|---|",
        f"| tokens/s | {o['tok_per_s']['seeded']:,.0f} | {o['tok_per_s']['vllm']:,.0f} |",
        f"| engine step, median ms ({st['steps']['seeded']} / {st['steps']['vllm']} steps) | "
        f"{o['step_ms_median']['seeded']:.2f} | {o['step_ms_median']['vllm']:.2f} |",
        f"| vLLM Sampler.forward per step, median ms | {o['sampler_ms_median']['seeded']:.3f} | "
        f"{o['sampler_ms_median']['vllm']:.3f} |",
        f"| of which the seeded processor, median ms | {o['apply_ms_median']:.3f} | - |",
        "",
        f"- **engine step time, seeded / vLLM, matched by batch size (goal <= 1.03): {st['ratio']:.3f}** "
        f"({st['sizes']} batch sizes): the",
        "  forward pass costs the same at the same batch size, so per-size medians compare the samplers and shrug off",
        "  other jobs' bursts; weighted by the number of steps at each size.",
        f"- **from the sampler's own time: 1 + (extra Sampler.forward time per step) / (step time with vLLM's "
        f"sampler) = {o['component_ratio']:.3f}**,",
        "  per-size medians as above: the sampler is timed on its own, so this is the least noisy estimate.",
        f"- the same two from the 10th percentile per batch size (the undisturbed cost): step time "
        f"**{o['step_time_ratio_matched_p10']['ratio']:.3f}**, from the sampler's own time "
        f"**{o['component_ratio_p10']:.3f}**",
        f"- the same two on this thread's CPU time (in-process vLLM runs the step in this thread, torch threads "
        f"{o['torch_threads_in_engine']}),",
        f"  which leaves out other jobs' time slices: step time matched by batch size "
        f"**{o['step_cpu_ratio_matched']['ratio']:.3f}**, from the sampler's own time "
        f"**{o['component_ratio_cpu']:.3f}**",
        f"- sampler time (Sampler.forward, processor included), seeded / vLLM, matched the same way: {sm['ratio']:.3f}",
        "- end to end, time per token (the two modes draw different samples, so lengths and batch shapes differ):",
        f"  {o['time_per_token_ratio']:.3f}; per round median {rr['median']:.3f}, min {rr['min']:.3f}, max "
        f"{rr['max']:.3f}; CPU time per token {o['cpu_per_token_ratio']:.3f}",
        "",
        "## 3. Replay cost against the verifier's prefill (same completions, float32 reference)",
        "",
        "| model (vocab 64) | torch threads | rows per lease | replay / prefill, median [min, max] (goal <= 0.10) | "
        "prefill ms per token | replay ms per token |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["replay_cost"]:
        s = r["replay_over_prefill"]
        lines.append(f"| {r['model']} | {r['torch_threads']} | {r['rows_per_lease']} | {s['median']:.4f} "
            f"[{s['min']:.4f}, {s['max']:.4f}] | {r['prefill_ms_per_token']:.3f} | {r['replay_ms_per_token']:.4f} |")
    lv = res["large_vocab"]
    lines += [
        "",
        f"Qwen-sized vocabulary ({lv['vocab']:,}), {lv['rows']} rows, eager torch on this CPU ({lv['torch_threads']} "
        f"torch thread(s)), against the LM-head matmul alone (hidden {lv['hidden']}):",
        "",
        "| synthetic logits, sampling | logits std | LM head ms per token | replay ms per token, median [min, max] | "
        "replay / LM head |",
        "|---|---|---|---|---|",
    ]
    for name, r in lv["settings"].items():
        lines.append(f"| {name} | {r.get('logits_std', float('nan')):.2f} | {r['lm_head_ms_per_token']['median']:.2f} "
            f"| {r['replay_ms_per_token']['median']:.2f} [{r['replay_ms_per_token']['min']:.2f}, "
            f"{r['replay_ms_per_token']['max']:.2f}] | {r['replay_over_lm_head']:.1f} |")
    lines += ["", *res.get("notes", [])]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6, help="leases per sampling setting and dtype for the margins")
    ap.add_argument("--overhead-rounds", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--large-vocab-rows", type=int, default=256)
    ap.add_argument("--top-p-slack", type=float, default=0.01)
    ap.add_argument("--logit-slack", type=float, default=0.05)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "seeded_sampler"))
    ap.add_argument("--parts", default="margins,overhead,large-vocab",
        help="a subset reruns those parts into the existing .json")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the existing .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.markdown_only:
        write_markdown(json.loads(out.with_suffix(".json").read_text()), args, out)
        return

    import vllm

    from trainer.tiny_model import init_model

    tmp = Path(tempfile.mkdtemp(prefix="seeded-bench-"))
    res: dict = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "vllm": vllm.__version__, "load_avg_start": os.getloadavg()}}
    parts = set(args.parts.split(","))
    if parts != {"margins", "overhead", "large-vocab"} and out.with_suffix(".json").exists():
        # rerun some parts
        res = {**json.loads(out.with_suffix(".json").read_text()), "args": vars(args), "machine": res["machine"]}
    try:
        if "margins" in parts:
            res["margins"] = bench_margins(init_model(tmp / "tiny", "tiny", seed=0), args)
        if "overhead" in parts:
            small = init_model(tmp / "small", "small", seed=0)
            res["overhead"], kept_small = bench_overhead(small, args)
            res["replay_cost"] = [bench_replay_cost(small, kept_small, args, "small")]
        if "large-vocab" in parts:
            res["large_vocab"] = bench_large_vocab(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["machine"]["load_avg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    if all(k in res for k in ("margins", "overhead", "replay_cost", "large_vocab")):
        write_markdown(res, args, out)
    else:
        print(f"not every part in {out.with_suffix('.json')} yet: no markdown")


if __name__ == "__main__":
    main()
