"""Honest-noise calibration and the attack matrix, on real vLLM output from a locally made tiny model.

A developer tool (not installed): used by `python -m tools.calibrate` (writes bench/results/verifier_*),
by the attack-matrix tests and by the benchmark. Everything here runs real engines: the worker's own
vLLM engine (CPU, in-process; tools/vllm_rollouts.py) generates and captures hidden states like an honest
worker; attacks tamper with those rollouts, or generate with other weights, another prompt or a lower
precision; the real `Verifier` judges every submission.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from environments.tasks import TaskItem, get_task
from inference_worker.engine import RolloutEngine
from protocol.models import (
    Completion,
    FinishReason,
    RolloutSubmission,
    SamplingParams,
    TaskLease,
    TaskPrompt,
)
from protocol.verdicts import VerdictStatus
from tools.vllm_rollouts import Rollout, generate, make_engine
from verifier import proofs
from verifier.config import ProofThresholds, VerifierConfig
from verifier.reference import load_reference_model, prefill
from verifier.service import Verifier, VerifyJob

log = logging.getLogger(__name__)

LOOSE = ProofThresholds(max_exponent_mismatches=128, max_mantissa_mean=1e9, max_mantissa_median=1e9)


def version_hash(v: int) -> str:
    return f"{v:064x}"


# --------------------------------------------------------------------------------------------------
# Models


def make_models(root: Path, base: Path, stale_lrs: tuple[float, ...] = (1e-4, 1e-3)) -> dict[str, Path]:
    """base (v0, given), other (the same architecture, freshly initialised from another seed), and one
    "v1" per stale lr: v0 after one AdamW step on a GRPO-like loss over v0's own samples (what a worker
    that skipped a download still holds)."""
    root = Path(root)
    dirs = {"base": Path(base), "other": _other_init(Path(base), root / "other", seed=1)}
    for lr in stale_lrs:
        dirs[f"stale_{lr:g}"] = _one_step(dirs["base"], root / f"stale_{lr:g}", lr)
    return dirs


def _other_init(base: Path, out: Path, seed: int) -> Path:
    """A model with the base's architecture and tokenizer but independently initialised weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def _one_step(base: Path, out: Path, lr: float, seed: int = 0) -> Path:
    """One AdamW step of lr on -sum_i A_i log pi(y_i) with group-normalized toy-task rewards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base)
    task = get_task("toy")
    items = task.make_prompts(8, seed)
    ids, rewards, plen = [], [], []
    with torch.no_grad():  # toy prompts have equal lengths: one batched generate for all 8 x 4 samples
        prompts = [[1] + tok.encode(item.prompt, add_special_tokens=False) for item in items]
        batch = torch.tensor([p for p in prompts for _ in range(4)])
        generated = model.generate(batch, do_sample=True, max_new_tokens=8, pad_token_id=0, eos_token_id=2, top_k=None,
            top_p=None)
    for row, out_ids in enumerate(generated):
        comp = out_ids[batch.shape[1]:].tolist()
        if 2 in comp:
            comp = comp[: comp.index(2) + 1]
        rewards.append(task.reward(items[row // 4], tok.decode([t for t in comp if 2 < t < len(tok)],
            skip_special_tokens=True)))
        ids.append(torch.tensor(prompts[row // 4] + comp))
        plen.append(batch.shape[1])
    r = torch.tensor(rewards).view(-1, 4)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = 0.0
    for seq, a, n in zip(ids, adv, plen):
        logits = model(seq[None]).logits[0, n - 1 : -1]
        lp = torch.log_softmax(logits, -1).gather(1, seq[n:, None]).sum()
        loss = loss - a * lp
    (loss / len(ids)).backward()
    opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for f in ("swarmrl_model.json",):
        if (base / f).exists():
            shutil.copy(base / f, out / f)
    return out


# --------------------------------------------------------------------------------------------------
# Rollouts and submissions


@dataclass
class Trial:
    """One submission (one completion) and what the verifier should say about it."""

    name: str
    rollout: Rollout  # what the worker claims
    lease: TaskLease
    item: TaskItem
    policy_version: int = 0
    expect_accept: bool = False
    logprobs: np.ndarray | None = None  # override the rollout's (forgery)
    proofs: list[bytes] | None = None  # override (copied proofs)
    finish_reason: FinishReason | None = None
    sample_index: int = 0  # which of the lease's samples (and seeds) the completion claims to be
    # The tokens an honest worker would have sent for this lease (claimed version and dtype, leased
    # prompt and seed), where the matrix generated them: an accepted attack that sent exactly these
    # gained nothing, since the trainer's logprobs come from the verifier, not from the worker.
    honest_tokens: np.ndarray | None = None


def encode_prompts(tokenizer_dir: Path, items: list[TaskItem]) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    bos = tok.bos_token_id
    return [np.asarray(([bos] if bos is not None else []) + tok.encode(i.prompt, add_special_tokens=False),
        dtype=np.int32) for i in items]


def lease_for(prompt_ids: np.ndarray, sampling: SamplingParams, seed: int | list[int], lease_id: str,
    version: int = 0) -> TaskLease:
    seeds = seed if isinstance(seed, list) else [seed]
    return TaskLease(
        lease_id=lease_id,
        prompts=[TaskPrompt(prompt_id=f"p-{lease_id}", token_ids=prompt_ids, seeds=seeds)],
        samples_per_prompt=len(seeds),
        sampling=sampling,
        policy_version=version,
        min_policy_version=0,
        deadline=time.time() + 3600,
    )


def to_job(trial: Trial, index: int) -> VerifyJob:
    r = trial.rollout
    proofs_ = trial.proofs if trial.proofs is not None else proofs.build_proofs(r.hidden)
    completion = Completion(
        prompt_index=0,
        sample_index=trial.sample_index,
        token_ids=r.token_ids,
        logprobs=trial.logprobs if trial.logprobs is not None else r.logprobs,
        finish_reason=trial.finish_reason or r.finish_reason,
        proofs=proofs_,
    )
    sub = RolloutSubmission(lease_id=trial.lease.lease_id, policy_version=trial.policy_version,
                            model_hash=version_hash(trial.policy_version), completions=[completion])
    return VerifyJob(submission_id=f"s{index}", submission=sub, lease=trial.lease, items=[trial.item],
                     task_name="toy", expected_model_hash=version_hash(trial.policy_version))


def honest_jobs(model_dir: Path, n: int, sampling: SamplingParams, seed: int = 0, task: str = "toy") -> list[VerifyJob]:
    """n honest one-completion submissions of version 0 (the real vLLM worker engine, seeded draws), as
    verifier jobs: what the verifier-pool tests and benchmark verify."""
    items = get_task(task).make_prompts(n, seed)
    prompts = encode_prompts(model_dir, items)
    engine = make_engine(model_dir, "float32", max_model_len=int(max(p.size
        for p in prompts)) + sampling.max_tokens + 16)
    try:
        rolls = generate(engine, prompts, sampling, list(range(seed * n, (seed + 1) * n)), batch=min(n, 32))
    finally:
        engine.close()
    trials = [Trial("honest", r, lease_for(r.prompt_ids, sampling, seed * n + k, f"h{seed}-{k}"), it,
        expect_accept=True) for k, (r, it) in enumerate(zip(rolls, items))]
    return [to_job(t, k) for k, t in enumerate(trials)]


# Honest settings: (label, sampling, batch size). Short and long completions, batch 1 and 32.
HONEST_SETTINGS: list[tuple[str, SamplingParams, int]] = [
    ("long_t1_b32", SamplingParams(temperature=1.0, max_tokens=256), 32),
    ("long_t0.7_p0.9_k20_b32", SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=200), 32),
    ("short_t1_b32", SamplingParams(temperature=1.0, max_tokens=16), 32),
    ("mixed_b1", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=100), 1),
    ("greedy_b1", SamplingParams(temperature=0.0, max_tokens=64), 1),
]


@dataclass
class MatrixResult:
    rows: list[dict] = field(default_factory=list)  # one per scenario
    honest_stats: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> max honest noise
    timings: dict[str, float] = field(default_factory=dict)


def run_matrix(
    workdir: Path,
    base_model: Path,
    trials: int = 32,
    honest_counts: dict[str, int] | None = None,
    stale_lrs: tuple[float, ...] = (1e-4, 1e-3),
    seed: int = 0,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
) -> MatrixResult:
    """Generate honest rollouts (fp32 and bf16) and every attack, verify all, and tabulate."""
    workdir = Path(workdir)
    rng = random.Random(seed)
    models = make_models(workdir / "models", base_model, stale_lrs)
    base = models["base"]
    versions = {0: base}
    for i, lr in enumerate(stale_lrs):
        versions[1 + i] = models[f"stale_{lr:g}"]
    task = get_task("toy")
    result = MatrixResult()
    honest_counts = honest_counts or {"long_t1_b32": 32, "long_t0.7_p0.9_k20_b32": 32, "short_t1_b32": 32,
        "mixed_b1": 6, "greedy_b1": 2}

    engines: dict[str, RolloutEngine] = {}

    def engine(key: str, model: Path, dtype: str, seeded_sampler: bool = True) -> RolloutEngine:
        if key not in engines:
            t = time.perf_counter()
            engines[key] = make_engine(model, dtype, seeded_sampler=seeded_sampler)
            result.timings[f"engine_start_{key}"] = time.perf_counter() - t
        return engines[key]

    def verifier(dtype: str) -> Verifier:
        return Verifier(VerifierConfig(dtype=dtype, keep_versions=4), lambda v: versions[v], base)

    def sample_items(n: int) -> tuple[list[TaskItem], list[np.ndarray], list[int]]:
        items = task.make_prompts(n, rng.randrange(1 << 30))
        return items, encode_prompts(base, items), [rng.randrange(1 << 31) for _ in range(n)]

    scenarios: list[tuple[str, str, list[Trial], bool]] = []  # (name, claimed dtype, trials, outcome asserted)
    honest_by_dtype: dict[str, list[Rollout]] = {}
    for dtype in dtypes:
        eng = engine(f"base_{dtype}", base, dtype)
        trials_d: list[Trial] = []
        for label, sampling, batch in HONEST_SETTINGS:
            n = honest_counts.get(label, 0)
            if not n:
                continue
            items, prompts, seeds = sample_items(n)
            t = time.perf_counter()
            rolls = generate(eng, prompts, sampling, seeds, batch)
            result.timings[f"generate_{dtype}_{label}"] = time.perf_counter() - t
            for k, (it, r, sd) in enumerate(zip(items, rolls, seeds)):
                trials_d.append(Trial(f"honest_{dtype}_{label}", r, lease_for(r.prompt_ids, sampling, sd,
                    f"h{dtype[:4]}{label[:6]}{k}".replace(".", "")), it, expect_accept=True))
        honest_by_dtype[dtype] = [t.rollout for t in trials_d]
        scenarios.append((f"honest {dtype}", dtype, trials_d, True))

    # ---- attacks (claimed fp32, version 0 unless stated) -------------------------------------
    base32 = engine("base_float32", base, "float32")
    samp = SamplingParams(temperature=1.0, max_tokens=64)

    def fresh(n: int, eng: RolloutEngine, sampling: SamplingParams = samp, prompt_edit: Callable | None = None,
              honest: RolloutEngine | None = None) -> list[Trial]:
        """n one-completion trials generated by `eng` (on edited prompts if given); with `honest`, also the
        rollouts an honest worker would have sent for the same leases, kept as each trial's honest_tokens."""
        items, prompts, seeds = sample_items(n)
        gen_prompts = [prompt_edit(p) for p in prompts] if prompt_edit else prompts
        rolls = generate(eng, gen_prompts, sampling, seeds, 32)
        reference = generate(honest, prompts, sampling, seeds, 32) if honest is not None else [None] * n
        out = []
        for k, (it, p, r, sd, ref) in enumerate(zip(items, prompts, rolls, seeds, reference)):
            r.prompt_ids = p  # the worker claims the leased prompt
            t = Trial("", r, lease_for(p, sampling, sd, f"a{rng.randrange(1 << 40):x}"), it)
            t.honest_tokens = ref.token_ids if ref is not None else None
            out.append(t)
        return out

    def named(name: str, ts: list[Trial], dtype: str = "float32", asserted: bool = True, **kw) -> tuple[str, str,
        list[Trial], bool]:
        for t in ts:
            t.name = name
            for k, v in kw.items():
                setattr(t, k, v)
        return (name, dtype, ts, asserted)

    other = engine("other_float32", models["other"], "float32")
    scenarios.append(named("other weights", fresh(trials, other, honest=base32)))

    def change_one(p: np.ndarray) -> np.ndarray:
        q = p.copy()
        i = rng.randrange(1, len(q))  # keep BOS
        q[i] = (q[i] - 3 + rng.randrange(1, 40)) % 51 + 3  # another character token
        return q

    scenarios.append(named("prompt: one token changed", fresh(trials, base32, prompt_edit=change_one, honest=base32)))

    # Tampered completions start from honest fp32 rollouts with enough tokens.
    pool = fresh(trials * 6, base32, SamplingParams(temperature=1.0, max_tokens=64))
    pool = [t for t in pool if t.rollout.token_ids.size >= 3]
    source: dict[int, Trial] = {}  # id(copied rollout) -> the pool trial it was copied from

    def tampered(edit: Callable[[Trial], Trial]) -> list[Trial]:
        out = []
        for _ in range(trials):
            original = pool[rng.randrange(len(pool))]
            copy = _copy_trial(original)
            source[id(copy.rollout)] = original
            out.append(edit(copy))
        return out

    def edit_token(t: Trial) -> Trial:
        r = t.rollout
        ids = r.token_ids.copy()
        last_is_end = ids[-1] == 2
        i = rng.randrange(len(ids) - (1 if last_is_end else 0))
        ids[i] = _other_token(int(ids[i]), rng)
        r.token_ids = ids
        return t

    def append_token(t: Trial) -> Trial:
        r = t.rollout
        r.token_ids = np.append(r.token_ids, np.int32(_other_token(2, rng)))
        r.logprobs = np.append(r.logprobs, np.float32(-4.0))
        r.hidden = torch.cat([r.hidden, r.hidden[-1:]])  # proofs as if that row existed
        return t

    def truncate(t: Trial) -> Trial:
        r = t.rollout
        cut = rng.randrange(1, min(8, len(r.token_ids)))
        r.token_ids, r.logprobs, r.hidden = r.token_ids[:-cut], r.logprobs[:-cut], r.hidden[:-cut]
        return t

    def copy_proof(t: Trial) -> Trial:
        n = len(proofs.chunk_sizes(len(t.rollout.token_ids)))
        own = source[id(t.rollout)]
        donors = [d for d in pool if d is not own and len(d.rollout.token_ids) >= len(t.rollout.token_ids)
                  and not (np.array_equal(d.rollout.prompt_ids, own.rollout.prompt_ids)
                           and np.array_equal(d.rollout.token_ids[: len(own.rollout.token_ids)],
                           own.rollout.token_ids))]
        donor = donors[rng.randrange(len(donors))]
        t.proofs = proofs.build_proofs(donor.rollout.hidden)[:n]
        return t

    def forge(t: Trial) -> Trial:
        lp = t.rollout.logprobs.astype(np.float64).copy()
        kind = rng.randrange(3)
        if kind == 0:  # one token made more likely
            i = rng.randrange(len(lp))
            lp[i] = min(0.0, lp[i] + rng.choice([0.01, 0.1, 1.0]))
        elif kind == 1:  # every token scaled toward 0 (inflates every importance weight)
            lp *= rng.choice([0.99, 0.9, 0.5])
        else:  # constant claim
            lp[:] = -1.0
        t.logprobs = lp.astype(np.float32)
        return t

    def lie_finish(t: Trial) -> Trial:
        t.finish_reason = FinishReason.length if t.rollout.finish_reason == FinishReason.stop else FinishReason.stop
        return t

    scenarios.append(named("completion: one token changed", tampered(edit_token)))
    scenarios.append(named("completion: token appended", tampered(append_token)))
    scenarios.append(named("completion: truncated", tampered(truncate)))
    scenarios.append(named("proof copied from another completion", tampered(copy_proof)))
    scenarios.append(named("forged logprobs", tampered(forge)))
    scenarios.append(named("finish-reason lie", tampered(lie_finish)))
    # Sampling outside the lease's support: the lease says top_k=3, the worker sampled freely.
    free = fresh(trials, base32, SamplingParams(temperature=1.0, max_tokens=32))
    for t in free:
        t.lease = t.lease.model_copy(update={"sampling": SamplingParams(temperature=1.0, top_k=3, max_tokens=32)})
    scenarios.append(named("sampling outside top-k", free))
    # Replay: a completion generated for one prompt, submitted for another lease.
    replay = fresh(trials, base32)
    others = fresh(trials, base32)
    for t, o in zip(replay, others):
        t.lease, t.item = o.lease, o.item
        t.rollout.prompt_ids = o.rollout.prompt_ids
    scenarios.append(named("replay for another prompt", replay))
    scenarios.extend(_draw_attacks(trials, rng, base, base32, engine, fresh, named, task))
    if "bfloat16" in dtypes:
        scenarios.append(named("precision: bf16 claimed as fp32", fresh(trials, engine("base_bfloat16", base,
            "bfloat16"), honest=base32)))
    scenarios.append(named("precision: fp16 claimed as fp32", fresh(trials, engine("base_float16", base, "float16"),
        honest=base32)))
    for i, lr in enumerate(stale_lrs):
        scenarios.append(named(f"stale weights (one AdamW step, lr {lr:g})", fresh(trials, base32), asserted=False,
            policy_version=1 + i))
    if "bfloat16" in dtypes:  # the same attacks against a bf16 run (looser, calibrated tolerances)
        base16 = engine("base_bfloat16", base, "bfloat16")
        for i, lr in enumerate(stale_lrs):
            scenarios.append(named(f"bf16 run: stale weights (lr {lr:g})", fresh(trials, base16), "bfloat16", False,
                policy_version=1 + i))
        for delta in (0.05, 0.2, 1.0):
            ts = fresh(trials, base16)
            for t in ts:
                lp = t.rollout.logprobs.astype(np.float64)
                room = np.flatnonzero(lp < -delta) if (lp < -delta).any() else np.arange(len(lp))
                i = int(room[rng.randrange(len(room))])
                lp[i] = min(0.0, lp[i] + delta)
                t.logprobs = lp.astype(np.float32)
            scenarios.append(named(f"bf16 run: one logprob raised by {delta:g}", ts, "bfloat16", delta >= 0.2))
        scenarios.append(named("bf16 run: other weights", fresh(trials, engine("other_bfloat16", models["other"],
            "bfloat16"), honest=base16), "bfloat16"))
        scenarios.append(named("bf16 run: prompt one token changed", fresh(trials, base16, prompt_edit=change_one,
            honest=base16), "bfloat16"))

    for eng in engines.values():
        eng.close()
    engines.clear()

    # ---- verify ------------------------------------------------------------------------------
    verifiers = {d: verifier(d) for d in set(sc[1] for sc in scenarios)}
    for name, dtype, ts, asserted in scenarios:
        jobs = [to_job(t, k) for k, t in enumerate(ts)]
        t0 = time.perf_counter()
        verdicts = verifiers[dtype].verify_many(jobs)
        dt = time.perf_counter() - t0
        accepted = sum(v.status == VerdictStatus.accepted for v in verdicts)
        compared = [(t, v) for t, v in zip(ts, verdicts) if t.honest_tokens is not None]
        # Accepted attacks that sent other tokens than an honest worker would have (near ties only,
        # or the draw check would have rejected them): the attacks that changed what the trainer sees.
        accepted_changed = sum(v.status == VerdictStatus.accepted and not np.array_equal(t.rollout.token_ids,
            t.honest_tokens)
                               for t, v in compared)
        codes: dict[str, int] = {}
        for v in verdicts:
            for c in {r.code.value for r in v.rejections}:
                codes[c] = codes.get(c, 0) + 1
        expect_accept = all(t.expect_accept for t in ts)
        result.rows.append({
            "scenario": name,
            "claimed_dtype": dtype,
            "trials": len(ts),
            "tokens": int(sum(t.rollout.token_ids.size for t in ts)),
            "expect": ("accept" if expect_accept else "reject") if asserted else "measured",
            "accepted": accepted,
            "rejected": len(ts) - accepted,
            "rate": (accepted if expect_accept else len(ts) - accepted) / len(ts),
            "mean_tokens": float(np.mean([t.rollout.token_ids.size for t in ts])),
            "codes": codes,
            "compared_with_honest": len(compared),
            "accepted_other_tokens": accepted_changed if compared else None,
            "verify_s": dt,
            "examples": [r.message for v in verdicts for r in v.rejections][:2],
        })
    for dtype, rolls in honest_by_dtype.items():
        result.honest_stats[dtype] = honest_noise(base, rolls, dtype)
    return result



# --------------------------------------------------------------------------------------------------
# Attacks on the draw: tokens that the leased seeds did not draw, sent with honest proofs and logprobs


def where_different(honest: list, rolls: list) -> list:
    """The trials whose rollout the attack changed, now carrying the attacker's rollout (an attack that
    happened to produce the honest tokens is no attack)."""
    out = []
    for t, r in zip(honest, rolls):
        if not np.array_equal(r.token_ids, t.rollout.token_ids):
            t.rollout = r
            out.append(t)
    return out


def _draw_attacks(trials, rng, base: Path, base32: RolloutEngine, engine, fresh, named, task) -> list:
    """Each trial's completion differs from what the leased seed draws; a trial whose attack happens to
    give exactly the honest completion is not an attack and is regenerated."""
    from transformers import AutoTokenizer

    ref = load_reference_model(base, None, "float32")  # the attacker has the weights: its own honest prefill
    tok = AutoTokenizer.from_pretrained(base)
    samp = SamplingParams(temperature=1.0, max_tokens=32)

    def with_honest_evidence(t: Trial, tokens: np.ndarray, finish: FinishReason) -> Trial:
        """Proofs and logprobs computed honestly for tokens the worker chose."""
        r = prefill(ref, [(t.rollout.prompt_ids, tokens)], [t.lease.sampling])[0]
        t.rollout = Rollout(t.rollout.prompt_ids, tokens.astype(np.int32), r.stats.logprob.astype(np.float32), finish,
            r.hidden)
        return t

    def until(n: int, make: Callable[[int], list[Trial]]) -> list[Trial]:
        out: list[Trial] = []
        while len(out) < n:
            out += make(n - len(out))
        return out[:n]

    # 1. The right answer written by the worker (the toy task's reward 1), with honest proofs and logprobs.
    def written(n):
        out = []
        for t in fresh(n, base32, samp):
            answer = np.asarray(tok.encode(t.item.answer, add_special_tokens=False) + [2], dtype=np.int32)
            if not np.array_equal(answer, t.rollout.token_ids):
                out.append(with_honest_evidence(t, answer, FinishReason.stop))
        return out

    # 2. One token of an honest rollout changed (not the final EOS), proofs and logprobs recomputed for it.
    def one_changed(n):
        out = []
        for t in fresh(n, base32, samp):
            ids = t.rollout.token_ids.copy()
            i = rng.randrange(len(ids) - (1 if ids[-1] == 2 else 0) or 1)
            ids[i] = _other_token(int(ids[i]), rng)
            out.append(with_honest_evidence(t, ids, t.rollout.finish_reason))
        return out

    # 3. (ours) Stopped early: EOS written in at a position the worker chose.
    def stopped_early(n):
        out = []
        for t in fresh(n, base32, samp):
            ids = t.rollout.token_ids
            if ids.size >= 2:
                k = rng.randrange(ids.size - 1)
                out.append(with_honest_evidence(t, np.append(ids[:k], np.int32(2)), FinishReason.stop))
        return out

    # 4. Greedy decoding under a temperature-1 lease.
    def greedy(n):
        honest = fresh(n, base32, samp)
        items_prompts = [t.rollout.prompt_ids for t in honest]
        rolls = generate(base32, items_prompts, SamplingParams(temperature=0.0, max_tokens=samp.max_tokens), [0] * n,
            32)
        return where_different(honest, rolls)

    # 5. Best of 4 samples drawn with the worker's own seeds (highest reward, then longest).
    def best_of_n(n, k=4):
        honest = fresh(n, base32, samp)
        prompts = [t.rollout.prompt_ids for t in honest for _ in range(k)]
        rolls = generate(base32, prompts, samp, [rng.randrange(1 << 62) for _ in prompts], 32)
        out = []
        for j, t in enumerate(honest):
            cands = rolls[j * k : (j + 1) * k]
            best = max(cands, key=lambda r: (task.reward(t.item, tok.decode([int(x) for x in r.token_ids
                if 2 < x < len(tok)])), r.token_ids.size))
            if not np.array_equal(best.token_ids, t.rollout.token_ids):
                t.rollout = best
                out.append(t)
        return out

    # 6. The lease's own seeds, but each completion claims the other sample's index (indices permuted).
    def permuted(n):
        out = []
        pairs = fresh(n, base32, samp)
        for t in pairs:
            other_seed = rng.randrange(1 << 62)
            r = generate(base32, [t.rollout.prompt_ids], samp, [other_seed], 1)[0]
            if np.array_equal(r.token_ids, t.rollout.token_ids):
                continue
            # Lease seeds [other, own]: the completion of seed `other` claims to be sample 1 (seed `own`).
            own = t.lease.prompts[0].seeds[0]
            t.lease = lease_for(t.rollout.prompt_ids, samp, [other_seed, own], t.lease.lease_id)
            t.rollout, t.sample_index = r, 1
            out.append(t)
        return out

    # 7. A rollout accepted under one lease, submitted again under a later lease of the same prompt.
    def replayed(n):
        out = []
        for t in fresh(n, base32, samp):
            later = lease_for(t.rollout.prompt_ids, samp, rng.randrange(1 << 62), f"later{rng.randrange(1 << 40):x}")
            if not np.array_equal(generate(base32, [t.rollout.prompt_ids], samp, [later.prompts[0].seeds[0]],
                1)[0].token_ids, t.rollout.token_ids):
                t.lease = later
                out.append(t)
        return out

    # 8. Top-k / top-p honoured, but drawn by vLLM's own sampler, not from the seed.
    bounded = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=32)
    own_sampler = engine("own_sampler_float32", base, "float32", seeded_sampler=False)

    def unseeded(n):
        honest = fresh(n, base32, bounded)
        rolls = generate(own_sampler, [t.rollout.prompt_ids for t in honest], bounded, [t.lease.prompts[0].seeds[0]
            for t in honest], 32)
        return where_different(honest, rolls)

    return [
        named("draw: right answer written, honest proofs and logprobs", until(trials, written)),
        named("draw: one token changed, honest proofs and logprobs", until(trials, one_changed)),
        named("draw: EOS written in early, honest proofs and logprobs", until(trials, stopped_early)),
        named("draw: greedy under a temperature-1 lease", until(trials, greedy)),
        named("draw: best of 4 with the worker's own seeds", until(trials, best_of_n)),
        named("draw: another sample's seed (indices permuted)", until(trials, permuted)),
        named("draw: accepted rollout replayed under a later lease", until(trials, replayed)),
        named("draw: top-k/top-p honoured, vLLM's own sampler", until(trials, unseeded)),
    ]


def honest_noise(model_dir: Path, rollouts: list[Rollout], dtype: str) -> dict[str, float]:
    """The largest proof and logprob deviations of honest rollouts against the reference."""
    model = load_reference_model(model_dir, None, dtype)
    refs = prefill(model, [(r.prompt_ids, r.token_ids) for r in rollouts], [SamplingParams()] * len(rollouts))
    worst = {"exponent_mismatches": 0.0, "mantissa_mean": 0.0, "mantissa_median": 0.0, "logprob_max_abs_diff": 0.0,
             "logprob_mean_abs_diff": 0.0, "hidden_max_abs_diff": 0.0, "chunks": 0.0,
             "completions": float(len(rollouts))}
    for r, ref in zip(rollouts, refs):
        for c in proofs.check_proofs(proofs.build_proofs(r.hidden), ref.hidden, LOOSE):
            worst["exponent_mismatches"] = max(worst["exponent_mismatches"], c.exponent_mismatches)
            worst["mantissa_mean"] = max(worst["mantissa_mean"], c.mantissa_mean)
            worst["mantissa_median"] = max(worst["mantissa_median"], c.mantissa_median)
            worst["chunks"] += 1
        d = np.abs(r.logprobs.astype(np.float64) - ref.stats.logprob)
        worst["logprob_max_abs_diff"] = max(worst["logprob_max_abs_diff"], float(d.max()))
        worst["logprob_mean_abs_diff"] = max(worst["logprob_mean_abs_diff"], float(d.mean()))
        worst["hidden_max_abs_diff"] = max(worst["hidden_max_abs_diff"],
            float((r.hidden.float() - ref.hidden.float()).abs().max()))
    return worst


def _copy_trial(t: Trial) -> Trial:
    r = t.rollout
    return Trial(t.name, Rollout(r.prompt_ids.copy(), r.token_ids.copy(), r.logprobs.copy(), r.finish_reason,
        r.hidden.clone()),
                 t.lease, t.item, t.policy_version)


def _other_token(tok: int, rng: random.Random) -> int:
    """A different ordinary character token (never EOS / PAD / BOS)."""
    while True:
        new = rng.randrange(3, 54)
        if new != tok:
            return new


def table_markdown(result: MatrixResult) -> str:
    lines = ["| scenario | claimed dtype | trials | tokens | expected | accepted | rejected | detected (attacks) / "
        "accepted (honest) "
             "| accepted with other tokens than the honest draw | rejection codes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.rows:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
        other = "" if r.get("accepted_other_tokens") is None else f"{r['accepted_other_tokens']} of {r['accepted']}"
        lines.append(f"| {r['scenario']} | {r['claimed_dtype']} | {r['trials']} | {r['tokens']} | {r['expect']} | "
            f"{r['accepted']} | "
                     f"{r['rejected']} | {100 * r['rate']:.0f}% | {other} | {codes} |")
    return "\n".join(lines)


def write_results(result: MatrixResult, out_dir: Path, tag: str, meta: dict) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = [f"# verifier attack matrix ({tag})", "", "```", json.dumps(meta, indent=1), "```", "",
          table_markdown(result), "", "## Largest honest deviation (vLLM CPU vs transformers, same dtype)", "", "```",
          json.dumps(result.honest_stats, indent=1), "```", ""]
    path = out_dir / f"verifier_attacks_{tag}.md"
    path.write_text("\n".join(md))
    (out_dir / f"verifier_attacks_{tag}.json").write_text(json.dumps({"meta": meta, "rows": result.rows,
                                                                        "honest_stats": result.honest_stats,
                                                                        "timings": result.timings}, indent=1,
                                                                        default=str))
    return path
