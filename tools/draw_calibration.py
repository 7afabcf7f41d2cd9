"""Calibration of the seeded-draw tolerances on honest output of real vLLM.

For each setting (model x dtype x vLLM batch size x sampling) the worker's own engine
(`inference_worker.engine.RolloutEngine`, seeded sampler and proofs on, exactly as `swarmrl worker`
runs it) generates leases; the real `Verifier` with the shipped tolerances judges every submission
(a rejected honest completion is a false rejection), and the replay is repeated here to measure the
noise behind the tolerances:

- strict: the replay on the verifier's logits with no slack: tokens that are not the replayed winner,
  tokens outside the replayed support, the largest margin (logits);
- as shipped (the dtype's slacks): near ties (accepted tokens that lost the replayed draw by a margin
  within the tolerance), their share, the largest margin and the largest margin / tolerance;
- attacker's freedom with the shipped tolerances: the share of positions where the verifier would accept
  more than one token (a second token within `draw_margin` of the winner, or one of the boundary band
  the slacks admit that beats it), i.e. where a dishonest worker could choose and still pass.

Used by `python -m tools.calibrate --part draws` (bench/results/verifier_draw_calibration.{md,json}) and by
bench/realsize_draws.py on any model folder (bench/results/realsize_draws.{md,json}).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from environments.tasks import get_task
from inference_worker.config import EngineConfig
from inference_worker.engine import RolloutEngine
from protocol import prf
from protocol import sampling as S
from protocol.models import RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from protocol.verdicts import VerdictStatus
from tools.verifier_calibration import encode_prompts, version_hash
from verifier.config import VerifierConfig
from verifier.service import Verifier, VerifyJob

SAMPLINGS = {
    "T=1": dict(temperature=1.0),
    "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "T=1,top_k=20": dict(temperature=1.0, top_k=20),
}


@dataclass
class Setting:
    model: str
    dtype: str
    batch: int  # completions vLLM generates at once (one lease)
    sampling: str

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} batch {self.batch} {self.sampling}"


def calibrate_draws(
    models: dict[str, Path],
    completions: int = 2000,
    max_tokens: int = 48,
    batches: tuple[int, ...] = (1, 32),
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    samplings: tuple[str, ...] = tuple(SAMPLINGS),
    seed: int = 0,
    progress=print,
) -> list[dict]:
    """One row per setting; see the module docstring for what each row holds."""
    rng = random.Random(seed)
    task = get_task("toy")
    rows = []
    for model_name, model_dir in models.items():
        for dtype in dtypes:
            # KV cache derived from the model
            engine = RolloutEngine(model_dir, EngineConfig(dtype=dtype, max_model_len=512))
            verifier = Verifier(VerifierConfig(dtype=dtype, keep_versions=1), lambda v: model_dir, model_dir)
            try:
                for batch in batches:
                    for name in samplings:
                        setting = Setting(model_name, dtype, batch, name)
                        sampling = SamplingParams(max_tokens=max_tokens, **SAMPLINGS[name])
                        started = time.perf_counter()
                        row = _run_setting(setting, engine, verifier, task, model_dir, sampling, completions, rng)
                        row["seconds"] = round(time.perf_counter() - started, 1)
                        rows.append(row)
                        progress(f"{setting.label}: {row['completions']} completions, {row['false_rejections']} "
                            f"rejected, "
                                 f"near ties {row['near_tie_tokens']}, max margin {row['max_margin_accepted']:.3g} "
                                 f"(strict {row['strict_max_margin']:.3g}), {row['seconds']} s")
            finally:
                engine.close()
                verifier.close()
    return rows


def _run_setting(setting: Setting, engine: RolloutEngine, verifier: Verifier, task, model_dir: Path,
                 sampling: SamplingParams, n: int, rng: random.Random) -> dict:
    tol = verifier.tolerances
    row = {"model": setting.model, "dtype": setting.dtype, "batch": setting.batch, "sampling": setting.sampling,
           "max_tokens": sampling.max_tokens, "completions": 0, "tokens": 0, "false_rejections": 0,
           "rejection_codes": {}, "rejection_examples": [], "near_tie_tokens": 0, "max_margin_accepted": 0.0,
           "strict_not_winner": 0, "strict_outside": 0, "strict_max_margin": 0.0, "slack_outside": 0,
           "free_positions": 0, "band_positions": 0, "max_abs_logit": 0.0, "max_margin_over_tolerance": 0.0,
           "deviations": 0, "outside_logit_gap": 0.0, "outside_mass_gap": 0.0, "draw_margin": tol.draw_margin,
           "draw_margin_rel": tol.draw_margin_rel, "draw_logit_slack": tol.draw_logit_slack,
           "draw_top_p_slack": tol.draw_top_p_slack, "max_logprob_diff": 0.0, "max_mean_logprob_diff": 0.0,
           "logprob_max_abs_diff": tol.logprob_max_abs_diff, "logprob_max_mean_diff": tol.logprob_max_mean_diff}
    model = verifier.model(0)
    done = 0
    while done < n:
        # Generated `batch` completions at a time (what vLLM sees at once), verified 32 or more at a time:
        # the verifier batches its prefill across submissions however they were generated.
        generated = []
        while done < n and sum(len(c) for _, _, c in generated) < max(32, setting.batch):
            k = min(setting.batch, n - done)
            items = task.make_prompts(k, rng.randrange(1 << 30))
            lease = TaskLease(
                lease_id=f"cal{done}", samples_per_prompt=1, sampling=sampling, policy_version=0, min_policy_version=0,
                generation_version=0, deadline=time.time() + 3600,
                prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=p, seeds=[rng.randrange(1 << 63)]) for i,
                p in enumerate(encode_prompts(model_dir, items))],
            )
            generated.append((lease, items, engine.generate(lease)))
            done += k
        jobs = [VerifyJob(f"s{lease.lease_id}", RolloutSubmission(lease_id=lease.lease_id, policy_version=0,
            model_hash=version_hash(0), completions=comps),
                          lease, items, "toy", version_hash(0)) for lease, items, comps in generated]
        for (lease, _, comps), verdict in zip(generated, verifier.verify_many(jobs)):
            if verdict.status != VerdictStatus.accepted:
                bad = {r.completion_index for r in verdict.rejections}
                row["false_rejections"] += len(bad - {None}) or len(comps)
                for r in verdict.rejections:
                    row["rejection_codes"][r.code.value] = row["rejection_codes"].get(r.code.value, 0) + 1
                row["rejection_examples"] = (row["rejection_examples"] + [r.message for r in verdict.rejections])[:4]
            else:
                row["near_tie_tokens"] += verdict.near_ties
                row["max_margin_accepted"] = max(row["max_margin_accepted"], verdict.max_draw_margin)
            _replay_noise(row, model, lease, comps, tol)
            row["completions"] += len(comps)
            row["tokens"] += sum(c.token_ids.size for c in comps)
    row["near_tie_share"] = row["near_tie_tokens"] / max(row["tokens"], 1)
    row["free_share"] = row["free_positions"] / max(row["tokens"], 1)
    row["band_share"] = row["band_positions"] / max(row["tokens"], 1)
    row["deviation_share"] = row["deviations"] / max(row["tokens"], 1)
    return row


@torch.inference_mode()
def _replay_noise(row: dict, model, lease: TaskLease, comps, tol) -> None:
    """Strict replay margins and the attacker's freedom, on the verifier's own logits."""
    sampling = lease.sampling
    to_logits = sampling.temperature if sampling.temperature > 0 else 1.0
    # One forward for the lease's completions: right padding leaves a causal model's logits at the real
    # positions as they are (at 0.6B, 32 one-row forwards cost several times one batched forward).
    rows = [np.concatenate([lease.prompts[c.prompt_index].token_ids, c.token_ids[:-1]]).astype(np.int64) for c in comps]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.from_numpy(r), 1
    batch_logits = model(ids, attention_mask=mask).logits
    for i, c in enumerate(comps):
        p = lease.prompts[c.prompt_index]
        n = c.token_ids.size
        logits = batch_logits[i, len(p.token_ids) - 1 : len(p.token_ids) - 1 + n].float()
        seed, positions, tokens = p.seeds[c.sample_index], torch.arange(n), torch.from_numpy(c.token_ids.astype(
            np.int64))
        strict = S.replay(logits, seed, positions, tokens, sampling)
        not_winner = strict.winner != tokens
        row["strict_not_winner"] += int(not_winner.sum())
        row["strict_outside"] += int((~strict.inside).sum())
        if not bool(strict.inside.all()):
            logit_gap, mass_gap = _outside_gaps(logits, tokens, ~strict.inside, sampling)
            row["outside_logit_gap"] = max(row["outside_logit_gap"], logit_gap)
            row["outside_mass_gap"] = max(row["outside_mass_gap"], mass_gap)
        if not_winner.any():
            row["strict_max_margin"] = max(row["strict_max_margin"], float(strict.margin[not_winner].max()) * to_logits)
        slack = S.replay(logits, seed, positions, tokens, sampling, tol.draw_top_p_slack, tol.draw_logit_slack,
            tol.draw_margin_rel)
        row["slack_outside"] += int((~slack.inside).sum())
        row["max_abs_logit"] = max(row["max_abs_logit"], float(logits.abs().max()))
        if c.logprobs is not None:  # the verifier's logprob check, measured: reported raw logprob against ours
            ours = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0].double().numpy()
            diff = np.abs(np.asarray(c.logprobs, dtype=np.float64) - ours)
            row["max_logprob_diff"] = max(row["max_logprob_diff"], float(diff.max()))
            row["max_mean_logprob_diff"] = max(row["max_mean_logprob_diff"], float(diff.mean()))
        lost = (slack.winner != tokens) & (slack.margin > 0)
        if lost.any():
            scale = torch.maximum(logits.gather(1, slack.winner[:, None]).abs(), logits.gather(1, tokens[:,
                None]).abs())[:, 0]
            ratio = slack.margin * to_logits / (tol.draw_margin + tol.draw_margin_rel * scale)
            row["max_margin_over_tolerance"] = max(row["max_margin_over_tolerance"], float(ratio[lost].max()))
        row["deviations"] += int((slack.exact != tokens).sum())
        choices, band = _choices(logits, seed, positions, sampling, tol)
        row["free_positions"] += int((choices >= 2).sum())
        row["band_positions"] += int(band.sum())


def _outside_gaps(logits: torch.Tensor, tokens: torch.Tensor, outside: torch.Tensor,
    sampling: SamplingParams) -> tuple[float, float]:
    """How far outside the verifier's own support the honest tokens `outside` fell: the largest gap in
    raw logits below the support's smallest kept logit, and (top-p) the largest probability mass by which
    the mass before the token exceeded top-p. What the slacks must cover, measured."""
    rows = outside.nonzero().view(-1)
    lg, tok = logits[rows], tokens[rows]
    params = S.DrawParams.build([sampling.temperature] * len(rows), [sampling.top_k] * len(rows),
        [sampling.top_p] * len(rows), lg.shape[1])
    z = S.tempered(lg, params)
    thr = S.support_threshold(z, params)
    zc = z.gather(1, tok[:, None])
    to_logits = sampling.temperature if sampling.temperature > 0 else 1.0
    logit_gap = float(((thr - zc) * to_logits).max()) if thr is not None else 0.0
    mass_gap = 0.0
    if 0.0 < sampling.top_p < 1.0:
        zk = z if params.k_index is None else z.masked_fill(z < torch.topk(z, params.k_max, -1).values.gather(-1,
            params.k_index), float("-inf"))
        probs = torch.softmax(zk, -1)
        before = (probs * (zk > zc)).sum(-1)
        mass_gap = float((before - sampling.top_p).max())
    return logit_gap, mass_gap


def _choices(logits: torch.Tensor, seed: int, positions: torch.Tensor, sampling: SamplingParams,
    tol) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, how many tokens the verifier would accept there (`acceptable_tokens`), and whether
    one of those is in the boundary band (inside the widened support but not the tightened one)."""
    acceptable, band = acceptable_tokens(logits, seed, positions, sampling, tol)
    return acceptable.sum(-1), band.any(-1)


def acceptable_tokens(logits: torch.Tensor, seed: int, positions: torch.Tensor, sampling: SamplingParams,
    tol) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, V] masks: the tokens the verifier would accept at each position (the replayed winner of the
    tightened support, any token of the widened support that beats it, and any that loses to it by no more
    than the draw tolerance, as verifier/checks.check_draws), and those of them in the boundary band. More
    than one acceptable token means a dishonest worker could choose there (each choice off the exact draw
    is counted against it)."""
    n, vocab = logits.shape
    params = S.DrawParams.build([sampling.temperature] * n, [sampling.top_k] * n, [sampling.top_p] * n, vocab)
    states = prf.row_state(prf.seed_state(torch.full((n,), seed, dtype=torch.int64)), positions)
    z, _, score = S.scores(logits, states, prf.token_words(torch.arange(vocab)), params)
    z_slack = tol.draw_logit_slack / (sampling.temperature if sampling.temperature > 0 else 1.0)
    tight = S.support_threshold(z, params, -tol.draw_top_p_slack, z_slack, tol.draw_margin_rel)
    wide = S.support_threshold(z, params, tol.draw_top_p_slack, -z_slack, tol.draw_margin_rel)
    best, winner = (score if tight is None else score.masked_fill(z < tight, float("-inf"))).max(-1, keepdim=True)
    scale = torch.maximum(logits.gather(1, winner).abs(), logits.abs())  # per (position, token), as check_draws
    # score units
    margin = (tol.draw_margin + tol.draw_margin_rel * scale) / (sampling.temperature if sampling.temperature > 0
        else 1.0)
    acceptable = score >= best - margin
    if wide is not None:
        acceptable &= z >= wide
    band = acceptable & (z < tight) if tight is not None else torch.zeros_like(acceptable)
    return acceptable, band


SETTING_KEYS = ("model", "dtype", "batch", "sampling", "max_tokens")
TOLERANCE_KEYS = ("draw_margin", "draw_margin_rel", "draw_logit_slack", "draw_top_p_slack")
SUMMED = ("completions", "tokens", "false_rejections", "near_tie_tokens", "strict_not_winner", "strict_outside",
          "slack_outside", "free_positions", "band_positions", "deviations", "seconds")
MAXED = ("max_margin_accepted", "strict_max_margin", "max_abs_logit", "max_margin_over_tolerance", "outside_logit_gap",
         "outside_mass_gap", "max_logprob_diff", "max_mean_logprob_diff")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of several runs (different seeds, so different prompts and draws) as one: counts add up, maxima
    are the largest. A setting's runs must have used the same tolerances, or their counts would not mean
    the same thing."""
    merged = {tuple(r[k] for k in SETTING_KEYS): dict(r) for r in old}
    for r in new:
        key = tuple(r[k] for k in SETTING_KEYS)
        if key not in merged:
            merged[key] = dict(r)
            continue
        m = merged[key]
        if any(m[k] != r[k] for k in TOLERANCE_KEYS):
            raise ValueError(f"setting {key}: the runs used different tolerances; recalibrate from scratch")
        for k in SUMMED:
            m[k] = round(m[k] + r[k], 1) if k == "seconds" else m[k] + r[k]
        for k in MAXED:
            m[k] = max(m.get(k, 0.0), r.get(k, 0.0))
        m["rejection_codes"] = {c: m["rejection_codes"].get(c, 0) + r["rejection_codes"].get(c, 0)
            for c in {**m["rejection_codes"], **r["rejection_codes"]}}
        m["rejection_examples"] = (m["rejection_examples"] + r["rejection_examples"])[:4]
        m["near_tie_share"] = m["near_tie_tokens"] / max(m["tokens"], 1)
        for share, count in (("free_share", "free_positions"), ("band_share", "band_positions"), ("deviation_share",
            "deviations")):
            m[share] = m[count] / max(m["tokens"], 1)
    return list(merged.values())


def read_results(out_dir: Path, stem: str = "verifier_draw_calibration") -> tuple[list[dict], dict]:
    """The rows and meta of an earlier run in `out_dir` (none: [], {})."""
    path = Path(out_dir) / f"{stem}.json"
    if not path.is_file():
        return [], {}
    data = json.loads(path.read_text())
    return data["rows"], data["meta"]


def table_markdown(rows: list[dict]) -> str:
    lines = [
        "| model | dtype | batch | sampling | completions | tokens | false rejections | near ties (share) | largest "
        "near-tie margin | "
        "largest margin / tolerance | largest abs logit | strict: not winner / outside | strict: largest margin | "
        "outside by (logits / mass) | "
        "free positions | of which boundary band | largest logprob diff / limit | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['sampling']} | {r['completions']} | {r['tokens']:,} | "
            f"{r['false_rejections']} | "
            f"{r['near_tie_tokens']} ({r['near_tie_share']:.2e}) | {r['max_margin_accepted']:.2g} | "
            f"{r['max_margin_over_tolerance']:.3f} | {r['max_abs_logit']:.2f} | "
            f"{r['strict_not_winner']} / {r['strict_outside']} | {r['strict_max_margin']:.2g} | "
            f"{r.get('outside_logit_gap', 0.0):.2g} / {r.get('outside_mass_gap', 0.0):.2g} | {r['free_share']:.2e} | "
            f"{r.get('band_share', 0.0):.2e} | "
            f"{_logprob_cell(r)} | {r['seconds']} |"
        )
    return "\n".join(lines)


def _logprob_cell(r: dict) -> str:
    if "logprob_max_abs_diff" not in r:  # rows of runs before this was measured
        return "-"
    return f"{r['max_logprob_diff']:.2g} / {r['logprob_max_abs_diff']:.2g}"


def write_results(rows: list[dict], out_dir: Path, meta: dict, stem: str = "verifier_draw_calibration") -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join([
        "# Seeded-draw calibration: honest vLLM output against the verifier's replay", "",
        "```", json.dumps(meta, indent=1), "```", "", table_markdown(rows), "",
        "- false rejections: honest completions the real Verifier (shipped tolerances for the dtype) rejected, any "
        "reason.",
        "- near ties: accepted tokens that lost the seed's draw on the verifier's logits by a margin within the "
        "tolerance,",
        "  draw_margin + draw_margin_rel * |logit| (logits); 'largest margin / tolerance' is the headroom left (1 "
        "would reject).",
        "- strict: the replay with no slack (support exactly the verifier's own), to show the raw noise the slacks "
        "absorb.",
        "- free positions: where the verifier would accept more than one token (a rival within draw_margin of the "
        "winner, or a",
        "  token of the boundary band the slacks admit that beats it), i.e. where a dishonest worker could choose and "
        "still pass:",
        "  the price of the tolerances. 'of which boundary band': positions where one of those tokens is inside the "
        "support",
        "  widened by the slacks but not the tightened one. Every accepted token that is not the exact draw on the "
        "verifier's",
        "  logits is counted as a near tie (a deviation), and a worker's deviations are held to what noise explains.",
        "- outside by: how far outside the verifier's own support the honest tokens that fell outside it were (raw "
        "logits",
        "  below its smallest kept logit; probability mass past top-p): what the slacks must cover.",
        "",
    ]))
    return path
