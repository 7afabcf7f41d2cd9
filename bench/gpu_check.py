"""The GPU check: the trainer, a pretrained base, an honest GPU worker and the Verifier on other hardware.

    python3 bench/gpu_check.py --out $OUT                           # a GPU machine: at most ~7.5 min (the budgets)
    python3 bench/gpu_check.py --device cpu --size tiny --out DIR    # CI (tests/bench/test_gpu_check.py): < 1 min idle

Writes DIR/gpu_check.json and DIR/gpu_check.md after every part. The GPU machine has torch, transformers,
safetensors, numpy and peft, not pydantic: the wheels of bench/gpu_wheels.txt (fetched with the command at
its top, carried in bench/gpu_wheels/) are installed with no index into a folder put on sys.path.

Parts, in order, each with its own time budget (--budget part=seconds); one that overruns is recorded as
"ran out of time" and the next one starts:
  setup       the BPE tokenizer (trained from this Python's standard library), the qwen3-0.6b-shaped model
  trainer     Trainer.step with bf16 autocast: tokens/s, peak memory; a tiny model's fp32 step on the device
              equals the CPU's
  pretrain    a short corpus pretraining on the device, so that the sampled distributions are peaked
  worker      an honest worker: a KV-cache generation loop drawing every token with protocol.sampling's seeded
              draw, raw logprobs, proofs from its own final hidden states; T=1 and T=0.7 / top-p 0.9, bf16 and fp32
  verify_cpu  the real Verifier on the CPU in fp32 over the fp32 completions (bf16 ones fail fp32 checks by design)
  verify_gpu  the real Verifier on the device in bf16 over the bf16 completions (with --device cpu: the CPU)
  throughput  verification / generation tokens per second on the device (goal >= 10x)
FSDP2: trainer/distributed.py shards only when WORLD_SIZE > 1, so one GPU trains the plain module (recorded).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

# the project, the helpers
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from gpu_check_lib import (  # noqa: E402
    IMPORTS,
    ensure_wheels,
    generate,
    limits,
    recording_verifier,
    summary,
    trace_imports,
    train_samples,
)

ARCH = "qwen3-0.6b"
# carry: bench/gpu_wheels
DEVICE_COMMAND = "PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log"
SETTINGS = {"t1": (1.0, 1.0), "t07_p09": (0.7, 0.9)}  # name: (temperature, top_p)
SAMPLES, PER_LEASE = 4, 4  # samples per prompt (a GRPO group), prompts per lease (one submission each)
# completions: per setting; cpu_completions: the fp32 set the CPU verifier checks; train: (samples, shortest and longest
# prompt / completion, micro-batch tokens, steps); pretrain: (batch, sequence length, learning rate, most steps)
SIZES = {
    "full": dict(layers=None, hidden=None, completions=1024, cpu_completions=32, prompt=32, max_tokens=64,
                 gen_batch=512, train=(48, 128, 384, 8192, 4), pretrain=(32, 256, 5e-4, 10**9), verify_batch=65536),
    "tiny": dict(layers=2, hidden=64, completions=16, cpu_completions=16, prompt=16, max_tokens=8, gen_batch=16,
                 train=(8, 16, 48, 1024, 2), pretrain=(8, 32, 1e-2, 6), verify_batch=16384),
}
# seconds; full sums to 430 (8 min with start-up). tiny: its few tokens still pay for the real 151,936-id vocabulary
# (every logit row, every top-p sort), so it is kept to a handful: 38 s in one run at load 2.5 (was 64 s at 0.2)
BUDGETS = {
    "full": dict(setup=60, trainer=60, pretrain=90, worker=90, verify_cpu=70, verify_gpu=55, throughput=5),
    "tiny": dict(setup=60, trainer=30, pretrain=30, worker=60, verify_cpu=60, verify_gpu=60, throughput=5),
}
TRAIN_REL_TOL = 1e-4  # see part_trainer


class OutOfTime(BaseException):  # BaseException: no `except Exception` in library code swallows it
    pass


class Ctx:
    """What the parts share: settings, paths, and what earlier parts made."""

    def __init__(self, args):
        import torch

        self.args, self.size, self.dev = args, SIZES[args.size], torch.device(args.device)
        self.out = Path(args.out)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.model_dir, self.tiny_dir, self.base_dir = self.work / "model", self.work / "tiny", self.work / "base"
        self.served = self.model_dir  # the weights the worker serves: the pretrained base once it is written
        self.tok = self.text = None
        self.completions: dict = {}  # (dtype, setting) -> list of (lease, items, [Completion])
        self.report: dict = {}

    def sync(self):
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------- parts


def part_setup(ctx: Ctx, r: dict, deadline: float) -> None:
    from trainer.bpe_tokenizer import build_tokenizer, read_corpus
    from trainer.model_shapes import PRESETS, init_model

    built = build_tokenizer(PRESETS[ARCH].vocab)
    ctx.tok, ctx.text = built.tokenizer, "\n".join(read_corpus().texts)
    s = ctx.size
    init_model(ctx.model_dir, ARCH, seed=0, layers=s["layers"], hidden=s["hidden"], tokenizer=built)
    init_model(ctx.tiny_dir, ARCH, seed=1, layers=2, hidden=64, tokenizer=built)  # the device-vs-CPU equality check's
    for name, d in (("model", ctx.model_dir), ("tiny", ctx.tiny_dir)):
        info = json.loads((d / "swarmrl_model.json").read_text())
        r[name] = {"arch": ARCH, "shapes": info["shapes"], "parameters": info["parameters"],
            "real_shape": info["real_shape"]}
    r["tokenizer"] = {k: built.info[k] for k in ("learned_tokens",
        "vocab_size")} | {"corpus_bytes": built.info["corpus"]["bytes"]}


def part_trainer(ctx: Ctx, r: dict, deadline: float) -> None:
    import numpy as np
    import torch

    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    n, lo, hi, micro, steps = ctx.size["train"]
    cfg = TrainerConfig(device=str(ctx.dev), bf16=True, micro_batch_tokens=micro, checkpoint_every=10_000)
    if ctx.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, ctx.model_dir, ctx.work / "run", resume=False)
    vocab = trainer.model_config.vocab_size
    r["fsdp2"] = ("not engaged: trainer/distributed.py wraps the model only when WORLD_SIZE > 1 (world size 1 trains "
                  "the plain module)")
    r["config"] = {"bf16": True, "attention": cfg.attention, "micro_batch_tokens": micro, "samples": n,
        "tokens_per_sequence": [2 * lo, 2 * hi]}
    r["steps"] = []
    for k in range(steps):
        # room for the equality check
        if k and time.monotonic() + r["steps"][-1]["s"] > deadline - (15 if ctx.args.size == "full" else 5):
            r["status"] = "ran out of time"
            break
        m = trainer.step(train_samples(n, lo, hi, vocab, trainer.version, k))
        r["steps"].append({"tokens": int(m["tokens"]), "s": round(m["time/compute"], 3),
                           "tokens_per_s": round(m["tokens_per_s"]), "loss": m["loss"], "grad_norm": m["grad_norm"]})
    # the first step warms up
    r["tokens_per_s"] = round(float(np.median([s["tokens_per_s"] for s in r["steps"][1:] or r["steps"]])))
    r["peak_memory_gib"] = round((torch.cuda.max_memory_allocated() if ctx.dev.type == "cuda" else
                                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30, 2)
    r["peak_memory_kind"] = "torch.cuda.max_memory_allocated" if ctx.dev.type == "cuda" else "process max RSS"
    del trainer
    free(ctx)
    # The same fp32 step of the tiny model on the device and on the CPU. Both are IEEE fp32 (TF32 is off), so
    # they differ only in reduction order: ~1e-6 relative through two layers and a 151,936-way softmax.
    # 1e-4 leaves 100x room, while a real fault (a wrong mask, a dropped token, bf16 leaking in) moves the
    # loss and the gradient norm by 1e-3 or more.
    same = train_samples(8, 8, 48, vocab, 0, 123)
    got = {}
    for dev in dict.fromkeys([str(ctx.dev), "cpu"]):
        t = Trainer(TrainerConfig(device=dev, bf16=False, micro_batch_tokens=512, checkpoint_every=10_000),
            ctx.tiny_dir, ctx.work / f"run-{dev}", resume=False)
        m = t.step(same)
        got[dev] = {"loss": m["loss"], "grad_norm": m["grad_norm"]}
        del t
    cpu, dev = got["cpu"], got[str(ctx.dev)]
    rel = {k: abs(dev[k] - cpu[k]) / max(abs(cpu[k]), 1e-12) for k in cpu}
    r["tiny_fp32_step"] = {"device": dev, "cpu": cpu, "relative_difference": rel, "tolerance": TRAIN_REL_TOL}
    if max(rel.values()) > TRAIN_REL_TOL:
        raise AssertionError(f"the tiny model's fp32 step differs between {ctx.dev} and the CPU: {rel}")


def part_pretrain(ctx: Ctx, r: dict, deadline: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model_shapes import mean_loss, pretrain

    # full: as many steps as the budget allows; tiny: a fixed number (CI's timing varies)
    batch, seq, lr, steps = ctx.size["pretrain"]
    model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32).to(ctx.dev)
    # seconds for the evaluation and writing 2.4 GB of fp32 weights (full)
    reserve = 30 if ctx.args.size == "full" else 3
    r["eval_loss_before"] = round(mean_loss(model, ctx.tok, ctx.text, 0), 4)
    done = pretrain(model, ctx.tok, ctx.text, steps, 0, batch, seq, lr,
        max_seconds=deadline - time.monotonic() - reserve)
    r["eval_loss_after"] = round(mean_loss(model, ctx.tok, ctx.text, 0), 4)  # ln(151936) = 11.93 is uniform
    losses = done["losses"]
    r.update(steps=len(losses), batch=[batch, seq], lr=lr, tokens=len(losses) * batch * seq, first_losses=losses[:3],
             last_losses=losses[-3:], median_step_s=sorted(done["step_s"])[len(losses) // 2] if losses else None)
    shutil.copytree(ctx.model_dir, ctx.base_dir, ignore=shutil.ignore_patterns("*.safetensors", "swarmrl_model.json"))
    model.save_pretrained(ctx.base_dir)
    ctx.served = ctx.base_dir
    del model
    free(ctx)


def part_worker(ctx: Ctx, r: dict, deadline: float) -> None:
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from environments.tasks import TaskItem
    from protocol.models import Completion, FinishReason, SamplingParams, TaskLease, TaskPrompt
    from trainer.model_shapes import corpus_windows
    from verifier.proofs import build_proofs_many
    from verifier.reference import eos_token_ids

    base = ctx.served
    r["model"] = "pretrained" if base == ctx.base_dir else "random (pretraining did not finish)"
    eos = eos_token_ids(base) | {int(ctx.tok.eos_token_id)}
    s, rng = ctx.size, random.Random("gpu-check-worker")
    for dtype, n in (("bfloat16", s["completions"]), ("float32", s["cpu_completions"])):
        # the verifier's rounding
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(ctx.dev, getattr(torch,
            dtype)).eval()
        for name, (temperature, top_p) in SETTINGS.items():
            sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=s["max_tokens"])
            prompts = corpus_windows(ctx.text, ctx.tok, n // SAMPLES, s["prompt"], rng).numpy()
            rows = [(p, k, rng.getrandbits(63)) for p in range(len(prompts)) for k in range(SAMPLES)]
            made, gen_s, proof_s, logprob_sum = {}, 0.0, 0.0, 0.0
            for b in range(0, len(rows), s["gen_batch"]):
                if time.monotonic() > deadline - 10:
                    r["status"] = "ran out of time"
                    break
                part = rows[b : b + s["gen_batch"]]
                ctx.sync()
                started = time.perf_counter()
                with torch.inference_mode():
                    toks, lps, hid = generate(model, torch.from_numpy(prompts[[p for p, _, _ in part]]).to(ctx.dev),
                                              [sd for _, _, sd in part], temperature, top_p, s["max_tokens"], eos)
                gen_s += time.perf_counter() - started
                started = time.perf_counter()
                ends = [next((t + 1 for t in range(toks.shape[1]) if int(toks[i, t]) in eos), toks.shape[1])
                    for i in range(len(part))]
                built = build_proofs_many([hid[i, :e] for i, e in enumerate(ends)])
                proof_s += time.perf_counter() - started
                for i, ((p, k, _), e) in enumerate(zip(part, ends)):
                    finish = FinishReason.stop if int(toks[i, e - 1]) in eos else FinishReason.length
                    made[(p, k)] = Completion(prompt_index=p % PER_LEASE, sample_index=k, token_ids=toks[i,
                        :e].astype(np.int32),
                                              logprobs=np.minimum(lps[i, :e], 0.0).astype(np.float32),
                                              finish_reason=finish, proofs=built[i])
                    logprob_sum += float(lps[i, :e].sum())
            seeds = {(p, k): sd for p, k, sd in rows}
            leases = []
            for first in range(0, len(prompts), PER_LEASE):
                group = range(first, min(first + PER_LEASE, len(prompts)))
                comps = [made[(p, k)] for p in group for k in range(SAMPLES) if (p, k) in made]
                if not comps:
                    continue
                lease = TaskLease(lease_id=f"{name}-{dtype[:4]}-{first // PER_LEASE}", samples_per_prompt=SAMPLES,
                                  sampling=sampling, policy_version=0, min_policy_version=0, generation_version=0,
                                  deadline=time.time() + 86400, prompts=[TaskPrompt(prompt_id=f"p{p}",
                                  token_ids=prompts[p].astype(np.int32), seeds=[seeds[(p, k)] for k in range(SAMPLES)])
                                           for p in group])
                # toy task, answer "": rewards only need to run
                items = [TaskItem(f"p{p}", ctx.tok.decode(prompts[p].tolist()), "") for p in group]
                leases.append((lease, items, comps))
            ctx.completions[(dtype, name)] = leases
            tokens = sum(c.token_ids.size for c in made.values())
            r[f"{dtype}/{name}"] = {"completions": len(made), "tokens": tokens, "generate_s": round(gen_s, 2),
                                    "proofs_s": round(proof_s, 2), "tokens_per_s": round(tokens / gen_s) if gen_s
                                    else None, "with_proofs_tokens_per_s": round(tokens / (gen_s + proof_s)) if gen_s
                                    else None, "mean_raw_logprob": round(logprob_sum / max(tokens, 1), 3),
                                    "stopped_by_eos": sum(c.finish_reason == FinishReason.stop for c in made.values())}
        del model
        free(ctx)
    r["settings"] = {k: {"temperature": t, "top_p": p} for k, (t,
        p) in SETTINGS.items()} | {"max_tokens": s["max_tokens"], "prompt_tokens": s["prompt"]}


def verify(ctx: Ctx, r: dict, deadline: float, dtype: str, device: str) -> None:
    """The real Verifier over the worker's `dtype` completions; per setting what it found and how fast."""
    import torch

    from protocol.models import RolloutSubmission
    from verifier.config import VerifierConfig
    from verifier.service import VerifyJob

    cfg = VerifierConfig(dtype=dtype, device=device, max_batch_tokens=ctx.size["verify_batch"], keep_versions=1)
    v = recording_verifier(cfg, ctx.served)
    try:
        started = time.perf_counter()
        v.model(0)
        r["load_s"] = round(time.perf_counter() - started, 2)
        r["config"] = {"dtype": dtype, "device": device, "max_batch_tokens": cfg.max_batch_tokens,
            "threads": torch.get_num_threads()}
        r["limits"] = limits(v.tolerances)
        for name in SETTINGS:
            leases = ctx.completions.get((dtype, name))
            if not leases:
                raise RuntimeError(f"no {dtype} completions at {name}: the worker part made none")
            jobs = [VerifyJob(lease.lease_id, RolloutSubmission(lease_id=lease.lease_id, policy_version=0,
                model_hash="0" * 64, completions=comps),
                              lease, items, "toy", "0" * 64) for lease, items, comps in leases]
            v.rows, v.extra_s, verdicts, wall = [], 0.0, [], 0.0
            for b in range(0, len(jobs), 16):  # 256 completions a call, so that the budget can stop it between calls
                if verdicts and time.monotonic() + wall / len(verdicts) * 16 > deadline - 2:
                    r["status"] = "ran out of time"
                    break
                started = time.perf_counter()
                verdicts += v.verify_many(jobs[b : b + 16])
                wall += time.perf_counter() - started
            r[name] = summary(v.rows, verdicts, wall - v.extra_s)
    finally:
        v.close()
        del v
        free(ctx)


def part_verify_cpu(ctx: Ctx, r: dict, deadline: float) -> None:
    verify(ctx, r, deadline, "float32", "cpu")


def part_verify_gpu(ctx: Ctx, r: dict, deadline: float) -> None:
    verify(ctx, r, deadline, "bfloat16", str(ctx.dev))


def part_throughput(ctx: Ctx, r: dict, deadline: float) -> None:
    """Verification against generation, tokens per second, both on the device in bf16 over the same completions."""
    worker, checked = ctx.report["parts"]["worker"], ctx.report["parts"]["verify_gpu"]
    for name in SETTINGS:
        gen, ver = worker.get(f"bfloat16/{name}"), checked.get(name)
        if not gen or not ver:
            raise RuntimeError(f"{name}: no generation or verification numbers")
        r[name] = {"generate_tokens_per_s": gen["tokens_per_s"],
                   "generate_with_proofs_tokens_per_s": gen["with_proofs_tokens_per_s"],
                   "verify_tokens_per_s": ver["tokens_per_s"],
                   "ratio": round(ver["tokens_per_s"] / gen["tokens_per_s"], 2),
                   "ratio_with_proofs": round(ver["tokens_per_s"] / gen["with_proofs_tokens_per_s"], 2)}
    r["goal"] = ">= 10x"
    r["goal_met"] = all(r[n]["ratio"] >= 10 for n in SETTINGS)


PARTS = [part_setup, part_trainer, part_pretrain, part_worker, part_verify_cpu, part_verify_gpu, part_throughput]


# --------------------------------------------------------------------------------------------------- running


def free(ctx: Ctx) -> None:
    import torch

    gc.collect()
    if ctx.dev.type == "cuda":
        torch.cuda.empty_cache()


def run_part(ctx: Ctx, fn, budget: float) -> dict:
    r: dict = {"budget_s": budget}
    started = time.monotonic()

    def alarm(signum, frame):
        raise OutOfTime()

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, budget)  # the hard stop; the parts' loops stop themselves before it
    try:
        fn(ctx, r, started + budget)
        r.setdefault("status", "ok")
    except OutOfTime:
        r["status"] = "ran out of time"
    except Exception as exc:
        r["status"] = f"failed: {type(exc).__name__}: {exc}"[:500]
        r["traceback"] = traceback.format_exc()[-3000:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    r["seconds"] = round(time.monotonic() - started, 2)
    free(ctx)
    return r


def write(ctx: Ctx) -> None:
    rep = ctx.report
    (ctx.out / "gpu_check.json").write_text(json.dumps(rep, indent=2, default=str))
    lines = [f"# GPU check ({rep['size']}, {rep['device']['name']})", "", f"Command: `{rep['commands']['this_run']}`  ",
             f"On a device machine: `{rep['commands']['device']}` (carry bench/gpu_wheels)  ",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in rep["device"].items()), "",
             "| part | status | seconds | budget |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {p['status']} | {p['seconds']} | {p['budget_s']} |" for n, p in rep["parts"].items()]
    for n, p in rep["parts"].items():
        lines += ["", f"## {n}", "", "```json", json.dumps({k: v for k, v in p.items() if k not in ("budget_s",
            "seconds")}, indent=1, default=str), "```"]
    (ctx.out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default="full",
        help="full: the real qwen3-0.6b shape; tiny: 2 layers, hidden 64 (CI)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
        help="override a part's time budget")
    args = ap.parse_args()
    started = time.monotonic()
    trace_imports()
    wheels = ensure_wheels()
    import torch
    import transformers

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # fp32 means fp32 (the equality checks)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    budgets = BUDGETS[args.size] | {k: float(v) for k, v in (b.split("=", 1) for b in args.budget)}
    ctx = Ctx(args)
    ctx.out.mkdir(parents=True, exist_ok=True)
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
        if x.startswith("model name")), platform.machine())
    name = torch.cuda.get_device_name(ctx.dev) if ctx.dev.type == "cuda" else cpu
    ctx.report = {
        "size": args.size, "budgets_s": budgets, "wheels": wheels,
        "device": {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                   "transformers": transformers.__version__, "python": platform.python_version(), "cpu": cpu,
                   "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "commands": {"this_run": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": DEVICE_COMMAND},
        "parts": {},
    }
    for fn in PARTS:
        part = fn.__name__.removeprefix("part_")
        print(f"[gpu_check] {part} (budget {budgets[part]:.0f} s)", flush=True)
        ctx.report["parts"][part] = rec = run_part(ctx, fn, budgets[part])
        print(f"[gpu_check] {part}: {rec['status']} in {rec['seconds']} s", flush=True)
        ctx.report["total_s"] = round(time.monotonic() - started, 1)
        ctx.report["imports"] = sorted(IMPORTS)
        write(ctx)
    shutil.rmtree(ctx.work, ignore_errors=True)  # two fp32 copies of the model (4.8 GB at full size)
    print(json.dumps({n: p["status"] for n, p in ctx.report["parts"].items()}), flush=True)


if __name__ == "__main__":
    main()
