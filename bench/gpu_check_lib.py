"""Helpers of bench/gpu_check.py: the wheels, the import trace, training samples, the honest worker's
generation loop, and the Verifier that also keeps its per-completion numbers.

Only the standard library at import time: pydantic may not be installed yet (`ensure_wheels` does that).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS_TXT, WHEELS = REPO / "bench" / "gpu_wheels.txt", REPO / "bench" / "gpu_wheels"
PROJECT = {"__main__", "__mp_main__", "gpu_check_lib", *(d.name for d in REPO.iterdir()
    if (d / "__init__.py").is_file())}
IMPORTS: set[str] = set()  # top-level modules that an import statement of the project's code named


def trace_imports() -> None:
    """Record what the project's own import statements ask for (tests/bench/test_gpu_check.py holds it to the
    GPU image and the wheels); what torch or transformers import on their own is their business."""
    import builtins

    real = builtins.__import__

    def traced(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (globals or {}).get("__name__", "").partition(".")[0] in PROJECT:
            IMPORTS.add(name.partition(".")[0])
        return real(name, globals, locals, fromlist, level)

    builtins.__import__ = traced


def ensure_wheels() -> str:
    """pydantic and its kin (protocol's models, every config): the GPU image lacks them."""
    try:
        import pydantic  # noqa: F401
        return "present"
    except ImportError:
        pass
    site = Path(tempfile.gettempdir()) / "gpu_check_site"
    if not any(WHEELS.glob("*.whl")):
        sys.exit(f"pydantic is missing and {WHEELS} holds no wheels: fetch them with the command at the top of "
            f"{WHEELS_TXT}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--find-links", str(WHEELS), "--target", str(site), "-r", str(WHEELS_TXT)], check=True)
    sys.path.insert(0, str(site))
    # the reward pool's children
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    return f"installed into {site}"


def train_samples(n: int, lo: int, hi: int, vocab: int, version: int, seed: int) -> list:
    """Random verified samples (prompt and completion of lo..hi tokens): a step's cost needs only their shape."""
    import numpy as np

    from trainer.samples import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c = int(rng.integers(lo, hi))
        out.append(TrainSample(rng.integers(0, vocab, int(rng.integers(lo, hi))), rng.integers(0, vocab, c),
                               -rng.uniform(11.0, 12.5, c), float(rng.normal()), float(rng.uniform()), version,
                               f"s{seed}-{i}"))
    return out


def generate(model, prompts, seeds, temperature: float, top_p: float, max_tokens: int, eos: set[int]):
    """One batch of equal-length prompts [B, P] with a KV cache: every token is the seed's draw on the float32
    logits, as inference_worker/seeded_sampler.py draws it; raw logprobs as vLLM reports them; the final-norm
    hidden state that produced each token (row t made token t), as inference_worker/capture.py keeps them.
    Returns tokens and logprobs [B, T] (numpy) and hidden states [B, T, H] (CPU); rows go on past their EOS."""
    import numpy as np
    import torch

    from protocol import prf
    from protocol import sampling as ps

    n, vocab, dev = prompts.shape[0], model.config.vocab_size, prompts.device
    params = ps.DrawParams.build([temperature] * n, [-1] * n, [top_p] * n, vocab, dev)
    words = prf.token_words(torch.arange(vocab, device=dev))
    seed_states = prf.seed_state_np(seeds)
    eos_t = torch.tensor(sorted(eos), device=dev)
    out = model.model(input_ids=prompts, use_cache=True)
    tokens, logprobs, hidden = [], [], []
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    for t in range(max_tokens):
        h = out.last_hidden_state[:, -1]
        logits = model.lm_head(h).float()
        states = torch.from_numpy(prf.row_state_np(seed_states, np.full(n, t,
            dtype=np.uint32)).astype(np.int64)).to(dev)
        tok = ps.draw(logits, states, words, params)
        tokens.append(tok)
        logprobs.append(torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])
        hidden.append(h)
        done |= torch.isin(tok, eos_t)
        if t + 1 == max_tokens or bool(done.all()):
            break
        out = model.model(input_ids=tok[:, None], past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(tokens, 1).cpu().numpy(), torch.stack(logprobs, 1).cpu().numpy(), torch.stack(hidden, 1).cpu()


def recording_verifier(config, model_dir: Path):
    """The real Verifier (verifier/service.py), which also keeps, per completion, the numbers its verdict only
    sums up: logprob differences, choices, near ties, the worst margin against its tolerance, proof statistics.
    `extra_s` is the time spent keeping them, left out of its speed."""
    import numpy as np

    from verifier import proofs
    from verifier.service import Verifier

    class Recording(Verifier):
        def _check_completion(self, c, ci, ref, job, tools):
            found, diff, drawn = super()._check_completion(c, ci, ref, job, tools)
            started, tol, d = time.perf_counter(), self.tolerances, ref.draw
            lost = d.winner != np.asarray(c.token_ids)
            ratio = np.where(lost, d.margin / (tol.draw_margin + tol.draw_margin_rel * d.scale), 0.0)
            chunks = proofs.check_proofs(c.proofs, ref.hidden, tol.proof)
            nan = float("nan")
            self.rows.append({"tokens": int(c.token_ids.size), "max_diff": float(diff.max()) if diff is not None
                              else nan, "diff_sum": float(diff.sum()) if diff is not None else nan,
                              "choices": int(d.choice.sum()), "near_ties": drawn.near_ties,
                              "margin_ratio": float(ratio.max()), "margin": float(d.margin[lost].max()) if lost.any()
                              else 0.0, "exp_mismatch": max(x.exponent_mismatches for x in chunks),
                              "mantissa_mean": max(x.mantissa_mean for x in chunks)})
            self.extra_s += time.perf_counter() - started
            return found, diff, drawn

    v = Recording(config, lambda version: model_dir, model_dir)
    v.rows, v.extra_s = [], 0.0
    return v


def limits(tol) -> dict:
    return {"logprob_max_abs_diff": tol.logprob_max_abs_diff, "logprob_max_mean_diff": tol.logprob_max_mean_diff,
            "draw_margin": tol.draw_margin, "draw_margin_rel": tol.draw_margin_rel,
            "deviation_rate": tol.deviation_rate, "max_exponent_mismatches": tol.proof.max_exponent_mismatches,
            "max_mantissa_mean": tol.proof.max_mantissa_mean}


def summary(rows: list[dict], verdicts: list, seconds: float) -> dict:
    """One setting's verification: every submission is honest, so every rejection is a false one."""
    from protocol.verdicts import VerdictStatus

    tokens, choices, near = sum(x["tokens"] for x in rows), sum(x["choices"] for x in rows), sum(x["near_ties"]
        for x in rows)
    worst = max(rows, key=lambda x: x["margin_ratio"])
    rejections = [(vd.submission_id, x) for vd in verdicts for x in vd.rejections]
    return {
        "submissions": len(verdicts), "completions": len(rows), "tokens": tokens,
        "false_rejections": sum(vd.status == VerdictStatus.rejected for vd in verdicts),  # submissions
        "rejected_completions": len({(sid, x.completion_index) for sid, x in rejections}),
        "rejection_codes": dict(Counter(x.code.value for _, x in rejections)), "rejection_examples": [x.message for _,
        x in rejections][:3],
        "near_ties": near, "near_tie_allowance": round(sum(vd.near_tie_allowance for vd in verdicts), 2),
        "near_tie_share_of_choices": round(near / choices, 4) if choices else 0.0,
        "choice_share": round(choices / max(tokens, 1), 4), "max_draw_margin": max((vd.max_draw_margin
        for vd in verdicts), default=0.0),
        "worst_margin_over_tolerance": round(worst["margin_ratio"], 4), "worst_margin": worst["margin"],
        "max_logprob_diff": max(x["max_diff"] for x in rows), "mean_logprob_diff": sum(x["diff_sum"]
        for x in rows) / max(tokens, 1),
        "max_exponent_mismatches": max(x["exp_mismatch"] for x in rows), "max_mantissa_mean": max(x["mantissa_mean"]
        for x in rows),
        "verify_s": round(seconds, 2), "tokens_per_s": round(tokens / max(seconds, 1e-9)),
    }
