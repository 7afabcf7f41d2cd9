"""Steering attacks on the seeded draw: a worker with our source code and the weights that chooses, among
the tokens the verifier's tolerances accept, the one that serves the task's reward.

The attacker runs the verifier's own reference model in the claimed dtype, so it knows the verifier's
logits and, at every position, which tokens the verifier would accept
(`tools.draw_calibration.acceptable_tokens`: near ties within the draw margin, tokens of the support's
boundary band). Where more than one is accepted it tries each, finishes the completion with the seed's
exact draws, scores the text with the task's reward, and keeps the best (one step of lookahead; a tie
keeps the exact draw). Two attackers:

- unbounded: steers wherever it gains;
- within allowance: steers only while its deviations stay within the verifier's `deviation_rate` x the
  positions so far that offered a choice, the rate the orchestrator's ledger (orchestrator/draw_deviations.py)
  lets a worker keep up without strikes.

Each steered completion goes to the real `Verifier` with proofs and logprobs the attacker computed
honestly for its own tokens. A row reports the reward gained over the exact draws of the same seeds
(paired: mean and standard error), the share of positions offering a second token, the deviations per
token, how many steered submissions the verifier accepted, and the strikes the orchestrator's ledger gives
the unbounded attacker over those submissions (with the run's default burst).

Used by `python -m tools.calibrate --part steering`; writes bench/results/verifier_steering_attacks.{md,json}.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from environments.tasks import get_task
from protocol import sampling as S
from protocol.models import Completion, FinishReason, RolloutSubmission, SamplingParams
from protocol.verdicts import VerdictStatus
from tools.draw_calibration import SAMPLINGS, acceptable_tokens
from tools.verifier_calibration import encode_prompts, lease_for, version_hash
from verifier import proofs
from verifier.config import VerifierConfig
from verifier.reference import prefill
from verifier.service import Verifier, VerifyJob


@dataclass
class Steered:
    tokens: list[int]
    reward: float
    deviations: int  # positions where it sent another token than the exact draw
    choices: int  # positions where more than one token was acceptable (on the path it took)


class Attacker:
    def __init__(self, verifier: Verifier, task, item, prompt_ids: np.ndarray, seed: int, sampling: SamplingParams):
        self.v, self.task, self.item = verifier, task, item
        self.model = verifier.model(0)
        self.tol = verifier.tolerances
        self.prompt = [int(t) for t in prompt_ids]
        self.seed, self.sampling = seed, sampling

    @torch.inference_mode()
    def _step(self, out: list[int]) -> tuple[int, list[int]]:
        """(the exact draw, the acceptable tokens) at position len(out)."""
        ids = torch.tensor([self.prompt + out], dtype=torch.long)
        logits = self.model(ids).logits[0, -1:].float()
        pos = torch.tensor([len(out)])
        exact = int(S.replay(logits, self.seed, pos, torch.tensor([0]), self.sampling).winner[0])
        acceptable, _ = acceptable_tokens(logits, self.seed, pos, self.sampling, self.tol)
        return exact, acceptable[0].nonzero().view(-1).tolist()

    def _ended(self, out: list[int]) -> bool:
        return len(out) >= self.sampling.max_tokens or (bool(out) and out[-1] in self.v.eos_ids)

    def reward(self, out: list[int]) -> float:
        return float(self.task.reward(self.item, self.v.decode(np.asarray(out, dtype=np.int64))))

    def finish_exact(self, out: list[int]) -> list[int]:
        out = list(out)
        while not self._ended(out):
            out.append(self._step(out)[0])
        return out

    def steer(self, budget: float | None, rate: float = 0.0) -> tuple[Steered, float | None]:
        """`budget`: deviations it may still make (None: unbounded); each position that offers a choice adds
        `rate` to it, as the verifier's allowance does. Returns the completion and the budget left."""
        out: list[int] = []
        deviations = choices = 0
        while not self._ended(out):
            exact, ok = self._step(out)
            pick = exact
            if len(ok) > 1:
                choices += 1
                if budget is not None:
                    budget += rate
                if budget is None or budget >= 1:
                    best = self.reward(self.finish_exact(out + [exact]))
                    for c in ok:
                        if c != exact:
                            r = self.reward(self.finish_exact(out + [c]))
                            if r > best + 1e-9:
                                best, pick = r, c
            if pick != exact:
                deviations += 1
                if budget is not None:
                    budget -= 1
            out.append(pick)
        return Steered(out, self.reward(out), deviations, choices), budget


def _job(verifier: Verifier, lease, item, prompt_ids: np.ndarray, tokens: list[int], index: int) -> VerifyJob:
    """The attacker's submission: its tokens with proofs and logprobs computed honestly for them."""
    ids = np.asarray(tokens, dtype=np.int64)
    ref = prefill(verifier.model(0), [(prompt_ids, ids)], [lease.sampling])[0]
    finish = FinishReason.stop if int(ids[-1]) in verifier.eos_ids else FinishReason.length
    c = Completion(prompt_index=0, sample_index=0, token_ids=ids.astype(np.int32),
                   logprobs=ref.stats.logprob.astype(np.float32), finish_reason=finish,
                   proofs=proofs.build_proofs(ref.hidden))
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash=version_hash(0), completions=[c])
    return VerifyJob(f"steer{index}", sub, lease, [item], "toy", version_hash(0))


def _ledger(per_submission: list[tuple[int, float]], burst: float, ban_at: float) -> tuple[int, int | None]:
    """What the orchestrator's DeviationLedger does over these (deviations, allowance), in order: the
    strikes, and after how many of these submissions it bans (None: never)."""
    from orchestrator.db import Database
    from orchestrator.draw_deviations import DeviationLedger

    db = Database(":memory:")
    ledger, strikes = DeviationLedger(db, burst, ban_at), 0
    try:
        with db.tx() as conn:
            for i, (deviations, allowance) in enumerate(per_submission):
                due, ban = ledger.record(conn, "steerer", deviations, allowance)
                strikes += due
                if ban:
                    return strikes, i + 1
        return strikes, None
    finally:
        db.close()


def paired(gains: list[float]) -> tuple[float, float]:
    g = np.asarray(gains, dtype=np.float64)
    return float(g.mean()), float(g.std(ddof=1) / math.sqrt(len(g))) if len(g) > 1 else 0.0


def run_steering(model_dir: Path, dtypes: tuple[str, ...], samplings: tuple[str, ...], n: int, max_tokens: int,
                 seed: int, burst: float, progress=print) -> list[dict]:
    rng = random.Random(seed)
    task = get_task("toy")
    rows = []
    for dtype in dtypes:
        verifier = Verifier(VerifierConfig(dtype=dtype, keep_versions=1), lambda v: model_dir, model_dir)
        rate = getattr(verifier.tolerances, "deviation_rate", 0.0)  # 0 before the rate existed (a run of the old code)
        try:
            for name in samplings:
                sampling = SamplingParams(max_tokens=max_tokens, **SAMPLINGS[name])
                items = task.make_prompts(n, rng.randrange(1 << 30))
                prompt_ids = encode_prompts(model_dir, items)
                row = {"dtype": dtype, "sampling": name, "samples": n, "tokens": 0, "choice_positions": 0,
                    "deviation_rate": rate, "burst": burst}
                gains = {"unbounded": [], "within_allowance": []}
                stats = {k: {"deviations": 0, "tokens": 0, "accepted": 0, "counted": 0, "per_submission": []}
                    for k in gains}
                allowance_left = 0.0
                jobs = {k: [] for k in gains}
                for i, (item, p) in enumerate(zip(items, prompt_ids)):
                    lease = lease_for(p, sampling, rng.randrange(1 << 63), f"steer-{dtype}-{len(rows)}-{i}")
                    attacker = Attacker(verifier, task, item, p, lease.prompts[0].seeds[0], sampling)
                    honest = attacker.finish_exact([])
                    honest_reward = attacker.reward(honest)
                    row["tokens"] += len(honest)
                    free, _ = attacker.steer(None)
                    row["choice_positions"] += free.choices
                    bounded, allowance_left = attacker.steer(allowance_left, rate)
                    for kind, s in (("unbounded", free), ("within_allowance", bounded)):
                        gains[kind].append(s.reward - honest_reward)
                        st = stats[kind]
                        st["deviations"] += s.deviations
                        st["tokens"] += len(s.tokens)
                        if s.deviations:
                            jobs[kind].append(_job(verifier, lease, item, p, s.tokens, i))
                for kind, js in jobs.items():
                    st = stats[kind]
                    for v in verifier.verify_many(js) if js else []:
                        st["accepted"] += v.status == VerdictStatus.accepted
                        st["counted"] += v.near_ties
                        st["per_submission"].append((v.near_ties, v.near_tie_allowance))
                    st["submitted"] = len(js)
                    mean, se = paired(gains[kind])
                    row[kind] = {"reward_gain": mean, "reward_gain_se": se, "deviations": st["deviations"],
                                 "tokens": st["tokens"], "deviation_share": st["deviations"] / max(st["tokens"], 1),
                                 "steered_submissions": len(js), "accepted": st["accepted"],
                                 "counted_by_verifier": st["counted"], **dict(zip(("ledger_strikes", "banned_after"),
                                 _ledger(st["per_submission"], burst, 3 * burst)))}
                row["choice_share"] = row["choice_positions"] / max(row["tokens"], 1)
                rows.append(row)
                u, b = row["unbounded"], row["within_allowance"]
                progress(f"{dtype} {name}: choices {row['choice_share']:.2%}; unbounded gain {u['reward_gain']:+.4f} "
                    f"± {u['reward_gain_se']:.4f}, "
                         f"{u['accepted']}/{u['steered_submissions']} accepted, {u['ledger_strikes']} strikes, banned "
                         f"after {u['banned_after']}; "
                         f"within allowance gain {b['reward_gain']:+.4f} ± {b['reward_gain_se']:.4f}")
        finally:
            verifier.close()
    return rows


def table_markdown(rows: list[dict]) -> str:
    lines = ["| dtype | sampling | samples | tokens | positions offering a second token | attacker | reward gain over "
        "the exact draws "
             "(mean ± s.e.) | deviations (share of tokens) | steered submissions accepted | counted by the verifier | "
             "ledger strikes | "
             "banned after (steered submissions) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for kind in ("unbounded", "within_allowance"):
            a = r[kind]
            lines.append(f"| {r['dtype']} | {r['sampling']} | {r['samples']} | {r['tokens']:,} | "
                f"{r['choice_share']:.3%} | {kind.replace('_', ' ')} | "
                         f"{a['reward_gain']:+.4f} ± {a['reward_gain_se']:.4f} | {a['deviations']} "
                         f"({a['deviation_share']:.3%}) | "
                         f"{a['accepted']} / {a['steered_submissions']} | {a['counted_by_verifier']} | "
                         f"{a['ledger_strikes']} | "
                         f"{a.get('banned_after') or 'not banned'} |")
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir: Path, meta: dict, tag: str = "") -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"verifier_steering_attacks{tag}"
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join([
        "# Steering within the verifier's tolerances, toward the reward", "", "```", json.dumps(meta, indent=1), "```",
        "", table_markdown(rows), "",
        "- The attacker knows the verifier's logits (same weights, same reference model and dtype) and, at every "
        "position, the",
        "  tokens the verifier accepts; where there are several it keeps the one whose completion (finished with the "
        "seed's",
        "  exact draws) scores best. 'within allowance' steers only while its deviations stay within the dtype's",
        "  deviation_rate x the positions that offered a choice, what the orchestrator's ledger lets a worker keep up "
        "without",
        "  strikes.",
        "- reward gain: steered minus exact-draw reward of the same lease seeds, per sample (the toy copy task's "
        "reward).",
        "- ledger strikes / banned after: what orchestrator/draw_deviations.py does over the steered submissions, in "
        "order, with",
        "  this burst and a ban at 3 bursts (the defaults). Submissions without a deviation are not sent here, so "
        "they do not",
        "  drain it: the real ledger would strike somewhat later.",
        "- Logprob limits are not a steering channel: the trainer learns from the verifier's own logprobs, never the "
        "worker's,",
        "  so a reported logprob moved within its limit changes no token and no reward (gain 0 by construction).", "",
    ]))
    return path
