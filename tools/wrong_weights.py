"""Wrong weights on short completions: what the verifier catches, and what the ones it accepts carry.

A worker whose weights differ slightly from the policy's (the last decoder layer, or an untied head,
scaled by 1 + eps * N(0, 1)) generates with the real vLLM worker engine and the lease's seeds; the real
Verifier judges its submissions against the true policy. On the demo's base model the completions are
2-3 tokens, where the logprob checks have little to average over, so some such workers pass. Each row also
says how many of the accepted submissions carry other tokens than the true policy's exact draws of the
same seeds (generated beside them): a submission that carries exactly those tokens gives the trainer the
same data as an honest one, since the trainer learns from the verifier's logprobs, never the worker's.

Used by `python -m tools.calibrate --part weights`; writes bench/results/verifier_wrong_weights.{md,json}.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from environments.tasks import get_task
from protocol.models import SamplingParams
from protocol.verdicts import VerdictStatus
from tools.verifier_calibration import Trial, encode_prompts, lease_for, to_job
from tools.vllm_rollouts import generate, make_engine
from verifier.config import VerifierConfig
from verifier.service import Verifier


def perturbed(base: Path, out: Path, part: str, eps: float, seed: int = 0) -> Path:
    """A copy of `base` with `part` ("last_layer" or "head") scaled elementwise by 1 + eps * N(0, 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if part == "head" and model.config.tie_word_embeddings:
        raise ValueError("perturbing the head of a tied model changes the embeddings too; use an untied base")
    params = model.lm_head.parameters() if part == "head" else model.model.layers[-1].parameters()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.mul_(1.0 + eps * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():  # tokenizer and our model card, unchanged
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def run(bases: dict[str, Path], variants: list[tuple[str, str, float]], work: Path, trials: int,
        sampling: SamplingParams, dtypes: tuple[str, ...], seed: int = 0, progress=print) -> list[dict]:
    """`bases`: name -> model folder; `variants`: (base name, part, eps)."""
    rng = random.Random(seed)
    task = get_task("toy")
    rows = []
    for dtype in dtypes:
        for base_name, part, eps in variants:
            base = bases[base_name]
            wrong = perturbed(base, work / f"{base_name}-{part}-{eps:g}", part, eps, seed)
            items = task.make_prompts(trials, rng.randrange(1 << 30))
            prompts = encode_prompts(base, items)
            seeds = [rng.randrange(1 << 31) for _ in range(trials)]
            honest_engine = make_engine(base, dtype)
            honest = generate(honest_engine, prompts, sampling, seeds)
            honest_engine.close()
            wrong_engine = make_engine(wrong, dtype)
            rolls = generate(wrong_engine, prompts, sampling, seeds)
            wrong_engine.close()
            verifier = Verifier(VerifierConfig(dtype=dtype, keep_versions=1), lambda v: base, base)
            ts = []
            for k, (it, p, r, sd, h) in enumerate(zip(items, prompts, rolls, seeds, honest)):
                t = Trial(f"{part} {eps:g}", r, lease_for(p, sampling, sd, f"w{k}"), it)
                t.honest_tokens = h.token_ids
                ts.append(t)
            verdicts = verifier.verify_many([to_job(t, k) for k, t in enumerate(ts)])
            verifier.close()
            accepted = [t for t, v in zip(ts, verdicts) if v.status == VerdictStatus.accepted]
            codes: dict[str, int] = {}
            for v in verdicts:
                for c in {r.code.value for r in v.rejections}:
                    codes[c] = codes.get(c, 0) + 1
            row = {
                "dtype": dtype, "base": base_name, "part": part, "eps": eps, "trials": trials,
                "tokens": int(sum(t.rollout.token_ids.size for t in ts)),
                "tokens_differ": sum(not np.array_equal(t.rollout.token_ids, t.honest_tokens) for t in ts),
                "accepted": len(accepted),
                "accepted_other_tokens": sum(not np.array_equal(t.rollout.token_ids, t.honest_tokens)
                for t in accepted),
                "near_ties_accepted": int(sum(v.near_ties for v in verdicts if v.status == VerdictStatus.accepted)),
                "codes": codes,
            }
            rows.append(row)
            progress(f"{dtype} {base_name} {part} x(1+{eps:g}N): {row['accepted']}/{trials} accepted, "
                     f"{row['accepted_other_tokens']} of them with other tokens than the exact draw; differ "
                     f"{row['tokens_differ']}")
    return rows


def write_results(rows: list[dict], out_dir: Path, meta: dict) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verifier_wrong_weights.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| dtype | base | perturbed | eps | trials | tokens | completions whose tokens differ from the true "
        "policy's | accepted | "
             "accepted with other tokens than the true policy's draw | near ties in accepted | rejection codes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
        lines.append(f"| {r['dtype']} | {r['base']} | {r['part']} | {r['eps']:g} | {r['trials']} | {r['tokens']} | "
            f"{r['tokens_differ']} | "
                     f"{r['accepted']} | {r['accepted_other_tokens']} | {r['near_ties_accepted']} | {codes} |")
    path = out_dir / "verifier_wrong_weights.md"
    path.write_text("\n".join([
        "# Wrong weights on the demo's short completions", "", "```", json.dumps(meta, indent=1), "```", "", *lines, "",
        "- A worker whose weights are the policy's with one part scaled by 1 + eps * N(0, 1), drawing with the "
        "lease's seeds in",
        "  the real vLLM worker engine, judged by the real Verifier against the true policy.",
        "- 'accepted with other tokens': accepted submissions whose tokens are not what the true policy's engine drew "
        "for the",
        "  same lease seeds. Where this is 0, what passed is token for token an honest submission: the trainer learns "
        "from the",
        "  verifier's logprobs of those tokens, so the wrong weights cannot move it.", "",
    ]))
    return path
