"""The attack matrix of multi-turn episodes: honest episodes from the real vLLM turn loop must all be
accepted, each episode attack (tools/episode_attacks.py) rejected in every trial.

    python -m tools.calibrate --part episodes --trials 100     (or: python -m tools.episode_calibration)

Each trial is its own one-completion submission: one forged episode, verified alone. Honest episodes are
verified in submissions of 8. Environment "lookup" on a tiny model taught the tool format (40 pretraining
steps: about a third of its episodes call the tool, so several hundred episodes give the multi-turn ones the
attacks need).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import typer

from environments.registry import item_to_wire
from environments.tasks import get_task
from protocol.models import RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from protocol.verdicts import VerdictStatus
from tools.episode_attacks import ATTACKS, multi_turn
from verifier.config import VerifierConfig
from verifier.service import Verifier, VerifyJob

HASH = "a" * 64


def honest_episodes(model_dir: Path, n_prompts: int, samples: int, seed: int = 0, dtype: str = "float32"):
    """(lease, items, completions, hidden) of `n_prompts` x `samples` lookup episodes from the worker's engine."""
    from transformers import AutoTokenizer

    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    items = get_task("lookup").make_prompts(n_prompts, seed=seed)
    prompts = [TaskPrompt(prompt_id=f"p{i}", token_ids=np.array([tok.bos_token_id] + tok.encode(it.prompt,
        add_special_tokens=False), dtype=np.int32),
                          seeds=[(seed << 32) + 1000 * i + s for s in range(samples)], env_item=item_to_wire(it))
                          for i, it in enumerate(items)]
    lease = TaskLease(lease_id="E", prompts=prompts, samples_per_prompt=samples,
                      sampling=SamplingParams(temperature=1.0, max_tokens=24), policy_version=0, min_policy_version=0,
                      deadline=time.time() + 3600, generation_version=0, environment="lookup")
    engine = RolloutEngine(model_dir, EngineConfig(dtype=dtype, max_model_len=128, kv_cache_bytes=64 << 20))
    try:
        completions, hidden = engine.generate_with_hidden(lease)
    finally:
        engine.close()
    return lease, items, completions, hidden


def verify(verifier: Verifier, lease, items, completions, sid: str):
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash=HASH, completions=completions)
    return verifier.verify(VerifyJob(submission_id=sid, submission=sub, lease=lease, items=items, task_name="lookup",
        expected_model_hash=HASH))


def run(model_dir: Path, trials: int, n_prompts: int = 40, samples: int = 16, seed: int = 0) -> dict:
    started = time.perf_counter()
    lease, items, comps, hidden = honest_episodes(model_dir, n_prompts, samples, seed)
    generated_s = time.perf_counter() - started
    verifier = Verifier(VerifierConfig(keep_versions=1), lambda v: model_dir, model_dir)
    rows = []
    try:
        honest = Counter()
        for start in range(0, len(comps), 8):
            part = comps[start : start + 8]
            v = verify(verifier, lease, items, part, f"honest-{start}")
            honest[v.status.value] += 1
            honest["episodes"] += len(part)
            honest["multi_turn"] += sum(multi_turn(c) for c in part)
            for r in v.rejections:
                honest[f"code:{r.code.value}"] += 1
        rows.append({"scenario": "honest episodes (submissions of 8)", "expect": "accept",
                     "trials": honest["accepted"] + honest["rejected"], "accepted": honest["accepted"],
                     "rejected": honest["rejected"],
                     "detail": f"{honest['episodes']} episodes, {honest['multi_turn']} with a tool call",
                     "codes": {k[5:]: v for k, v in honest.items() if k.startswith("code:")}})
        multi = [(c, h) for c, h in zip(comps, hidden) if multi_turn(c)]
        rng = np.random.default_rng(seed)
        for name, attack in ATTACKS.items():
            codes: Counter = Counter()
            accepted = rejected = 0
            made = 0
            for i in range(10 * trials):  # some attacks do not apply to every episode: go on until `trials` were made
                if made == trials:
                    break
                c, h = multi[i % len(multi)]
                try:
                    forged = attack(c, h, rng)
                except ValueError:
                    continue
                made += 1
                v = verify(verifier, lease, items, [forged], f"{name}-{i}")
                if v.status == VerdictStatus.accepted:
                    accepted += 1
                else:
                    rejected += 1
                    codes[v.rejections[0].code.value] += 1
            rows.append({"scenario": name, "expect": "reject", "trials": made, "accepted": accepted,
                         "rejected": rejected, "detail": f"from {len(multi)} honest episodes with a tool call",
                         "codes": dict(codes)})
    finally:
        verifier.close()
    return {"rows": rows, "prompts": n_prompts, "samples": samples, "generate_s": generated_s,
        "total_s": time.perf_counter() - started}


def markdown(result: dict, meta: dict) -> str:
    lines = ["# verifier attack matrix: multi-turn episodes", "", "```", json.dumps(meta, indent=1), "```", "",
             "| scenario | expect | trials | accepted | rejected | first rejection code | detail |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
        lines.append(f"| {r['scenario']} | {r['expect']} | {r['trials']} | {r['accepted']} | {r['rejected']} | "
            f"{codes} | {r['detail']} |")
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """Each attack trial is a one-completion submission verified alone; the proofs of a forged episode are rebuilt
over the model rows it keeps (tools/episode_attacks.py), so the rejection comes from the episode checks. The
environment's tool ran in the verifier's sandboxed reward pool, as in a run. "first rejection code" is the
first reason of each rejected verdict: `extra_turn` exceeds lookup's two model turns, which the turn count
catches before the replay would (`env_mismatch`). "seconds" is wall time on the shared 2-core machine, not a
benchmark. The single-turn attack matrix is `--part attacks` (bench/results/verifier_attacks_calibration.md)."""


def make_tool_model(workdir: Path) -> Path:
    from trainer.tiny_model import init_model

    return init_model(Path(workdir) / "tool-model", "tiny", seed=0, pretrain_steps=40, tool_format=True)


def write_results(result: dict, out: Path, trials: int) -> Path:
    meta = {"trials": trials, "environment": "lookup", "model": "tiny, 40 steps of the tool corpus",
            "episodes": result["prompts"] * result["samples"],
            "command": f"python -m tools.calibrate --part episodes --trials {trials}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(result["total_s"], 1)}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "verifier_episode_attacks.md"
    path.write_text(markdown(result, meta))
    (out / "verifier_episode_attacks.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    return path


def main(model_dir: Path = typer.Option(None, help="a tiny model taught the tool format; default: make one"),
         trials: int = typer.Option(100), out: Path = typer.Option(Path("bench/results")), prompts: int = 40,
         samples: int = 16) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="swarmrl-episodes-") as tmp:
        result = run(model_dir or make_tool_model(Path(tmp)), trials, prompts, samples)
    print(write_results(result, out, trials).read_text())


if __name__ == "__main__":
    typer.run(main)
