"""Scaling table: what each part of swarmrl costs as the model grows, measured side by side on this machine.

For each model (tiny, small: trainer.tiny_model; real architectures: trainer.model_shapes; or a folder
given with --model-dir NAME=PATH), on the same toy-task prompts (environments.tasks "toy", encoded as
tools.verifier_calibration.encode_prompts), all completions of a round in one lease (one vLLM batch):

1. generation (`inference_worker.engine.RolloutEngine`, max_model_len 256, KV cache derived): completion
   tokens/s of three variants, alternated A B C A B C after one warm-up lease each:
     A shipped      seeded sampler + proofs (the worker as it runs)
     B vllm         vLLM's own sampler, no proofs (EngineConfig(seeded_sampler=False, proofs=False))
     C seeded       seeded sampler, no proofs
   so that the seeded sampler's overhead (C against B) and the proofs' (A against C) can be separated.
   Each round's lease is new (new prompts and seeds), the same for the three variants.
2. verification: the real `verifier.service.Verifier` over A's completions, one `verify_many` per lease
   (after a warm-up lease): verified tokens/s, verification time / A's generation time of the same lease,
   false rejections (every honest submission must be accepted). Timing wrappers on the real path give
   its breakdown: `prefill` (the reference forward), of which the lm_head, the token statistics and the
   seeded-draw `replay` (protocol.sampling.replay, as verifier.reference calls it); the proof checks;
   the rewards (the sandboxed reward pool).
3. trainer (`trainer.train.Trainer`, bf16 autocast, AdamW, bf16 publishing) in a fresh process per
   learning rate, on the verified completions with GRPO advantages of their verified rewards: a warm-up
   step on the warm-up lease, then one measured step per round lease. Tokens/s and the peak RSS of the
   process (VmHWM after the steps, before any delta is encoded; the bf16 copy each step publishes is
   part of it, as in a run; the published versions themselves go to disk).
4. bytes per version: a full bf16 version (its safetensors file) and the shardcast delta
   (`shardcast.delta.encode_delta`) from one published version to the next, at lr 1e-6 and 1e-5 (steps
   on the real rollouts): v0 -> v1 (the first AdamW step, sign-like: every weight moves by ~lr) and
   v1 -> v2 (the next one).
5. publish -> generating: a new bf16 version folder is written (shardcast's shard files), the engine
   reloads it (`RolloutEngine.reload`) and generates one token. Transport is excluded (see
   bench/results/reload_latency.md for origin -> relay -> worker).

Each model's parts run in their own subprocesses (`_child`); with --engines together (auto below 50M
parameters) the three generation engines live in one process and the reload part follows in it (closing
one in-process vLLM engine breaks the others, so all close at the end); with --engines sequential every
(variant, round) is a process of its own, then reload. Verification and each learning rate's trainer
always get a process of their own.
The parent merges the records into <out>/scaling.json (models of earlier runs not measured now are kept),
and writes scaling.md and scaling.png.

    python bench/scaling_bench.py --models tiny,small,qwen3-0.6b [--model-dir NAME=PATH ...]
        [--completions 32] [--max-tokens 16] [--rounds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WORK = REPO / "bench" / ".work" / "scaling"
VARIANTS = {  # name -> EngineConfig switches
    "shipped": dict(seeded_sampler=True, proofs=True),
    "vllm": dict(seeded_sampler=False, proofs=False),
    "seeded": dict(seeded_sampler=True, proofs=False),
}
TOY_PRETRAIN = {"tiny": 20, "small": 60}
LRS = (1e-6, 1e-5)
TOGETHER_BELOW = 50_000_000  # parameters: three engines in one process below this (--engines auto)


# =================================================================================================
# Small helpers (parent and children)


def vm_kib(key: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM: peak RSS; VmRSS: current), 0 if unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def spread(xs: list[float]) -> dict:
    xs = [float(x) for x in xs]
    return {"runs": xs, "min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {"runs": []}


def model_info(model_dir: Path) -> dict:
    """Parameters (stored tensors: a tied lm_head counted once), shape and vocabulary, from the folder."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    params = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                params += math.prod(h.get_slice(k).get_shape())
    made = {}
    if (model_dir / "swarmrl_model.json").is_file():
        made = json.loads((model_dir / "swarmrl_model.json").read_text())
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    return {"parameters": int(params), "layers": int(cfg["num_hidden_layers"]), "hidden": hidden,
            "intermediate": int(cfg.get("intermediate_size", 0)), "vocab": vocab,
            "tied": bool(cfg.get("tie_word_embeddings", False)), "embedding_parameters": vocab * hidden * (1
            if cfg.get("tie_word_embeddings") else 2), "architecture": (cfg.get("architectures") or ["?"])[0],
            "pretrain_steps": made.get("pretrain_steps"), "path": str(model_dir)}


# =================================================================================================
# The children: one process per part (or group of parts), a JSON record each


def child_env_setup(spec: dict) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from swarmrl.logs import configure_logging

    configure_logging("WARNING")
    if spec.get("threads"):
        import torch

        torch.set_num_threads(int(spec["threads"]))


def make_leases(spec: dict) -> list[tuple]:
    """(lease, items): index 0 is the warm-up lease, 1..rounds the measured ones. Deterministic."""
    import random
    import time as _t

    from environments.tasks import get_task
    from protocol.models import SamplingParams, TaskLease, TaskPrompt
    from tools.verifier_calibration import encode_prompts

    task = get_task("toy")
    spp = spec["samples_per_prompt"]
    n_prompts = spec["completions"] // spp
    sampling = SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"], top_p=spec["top_p"])
    out = []
    for r in range(spec["rounds"] + 1):
        rng = random.Random(f"scaling-{spec['seed']}-{r}")
        items = task.make_prompts(n_prompts, rng.randrange(1 << 30))
        ids = encode_prompts(Path(spec["model_dir"]), items)
        lease = TaskLease(
            lease_id=f"scaling{r}", samples_per_prompt=spp, sampling=sampling, policy_version=0, min_policy_version=0,
            generation_version=0, deadline=_t.time() + 7 * 86400,
            prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=p, seeds=[rng.randrange(1 << 63) for _ in range(spp)])
            for i, p in enumerate(ids)],
        )
        out.append((lease, items))
    return out


def new_engine(spec: dict, variant: str):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    started = time.perf_counter()
    engine = RolloutEngine(spec["model_dir"], EngineConfig(dtype=spec["dtype"], max_model_len=256,
        **VARIANTS[variant]), policy_version=0, model_hash="0" * 64)
    return engine, time.perf_counter() - started


def part_gen(spec: dict, ctx: dict) -> dict:
    """Generation: the variants alternated over the rounds given (spec["gen_rounds"]), one warm-up lease each."""
    leases = make_leases(spec)
    variants = spec["gen_variants"]
    rec: dict = {"runs": [], "engine_start_s": {}, "warmup_s": {}}
    engines = {}
    try:
        for v in variants:
            engines[v], rec["engine_start_s"][v] = new_engine(spec, v)
            started = time.perf_counter()
            comps = engines[v].generate(leases[0][0])
            rec["warmup_s"][v] = time.perf_counter() - started
            if v == "shipped":
                save_completions(spec, 0, leases[0], comps)
        for r in spec["gen_rounds"]:
            lease, items = leases[r]
            for v in variants:
                started = time.perf_counter()
                comps = engines[v].generate(lease)
                took = time.perf_counter() - started
                st = engines[v].last_stats
                tokens = int(sum(c.token_ids.size for c in comps))
                rec["runs"].append({"variant": v, "round": r, "seconds": took, "completions": len(comps),
                                    "tokens": tokens, "tokens_per_s": tokens / took,
                                    "capture_record_s": st.capture_record_s, "proof_thread_s": st.proof_thread_s,
                                    "capture_take_s": st.capture_take_s, "stopped": sum(c.finish_reason.value == "stop"
                                    for c in comps)})
                if v == "shipped":
                    save_completions(spec, r, leases[r], comps, took)
    finally:
        # In one process, closing one in-process vLLM engine tears down the distributed state that the others
        # use ("pipeline model parallel group is not initialized" at their next generate): all are closed
        # together, at the end of the child (child_main), after the reload part has used the shipped one.
        ctx["engines"] = engines
    return rec


def save_completions(spec: dict, r: int, lease_items: tuple, comps, gen_s: float | None = None) -> None:
    path = Path(spec["work"]) / "completions" / f"round{r}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"lease": lease_items[0], "items": lease_items[1], "completions": comps,
        "gen_s": gen_s}))


def load_completions(spec: dict, r: int) -> dict:
    return pickle.loads((Path(spec["work"]) / "completions" / f"round{r}.pkl").read_bytes())


class Timers:
    """Seconds spent in wrapped functions (CPU: torch ops are synchronous, so wall time is the cost)."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, key: str, fn):
        def timed(*a, **kw):
            started = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - started
                self.calls[key] = self.calls.get(key, 0) + 1

        return timed

    def reset(self) -> None:
        self.s, self.calls = {}, {}


def part_verify(spec: dict, ctx: dict) -> dict:
    """The real Verifier over the shipped worker's completions, one verify_many per lease, timed in parts."""
    import numpy as np

    import verifier.proofs as vproofs
    import verifier.reference as vref
    import verifier.service as vservice
    from protocol.models import RolloutSubmission
    from protocol.verdicts import VerdictStatus
    from tools.verifier_calibration import version_hash
    from trainer.advantages import group_advantages
    from verifier.config import VerifierConfig
    from verifier.service import Verifier, VerifyJob

    model_dir = Path(spec["model_dir"])
    timers = Timers()
    vref.replay = timers.wrap("replay", vref.replay)  # verifier.reference.prefill calls it by this name
    vref.token_stats = timers.wrap("token_stats", vref.token_stats)
    vservice.prefill = timers.wrap("prefill", vservice.prefill)
    vproofs.check_proofs = timers.wrap("proofs", vproofs.check_proofs)
    v = Verifier(VerifierConfig(dtype=spec["dtype"], keep_versions=1), lambda version: model_dir, model_dir)
    rec: dict = {"runs": []}
    samples: dict[int, list[dict]] = {}
    try:
        started = time.perf_counter()
        model = v.model(0)
        rec["model_load_s"] = time.perf_counter() - started
        head_t: dict[str, float] = {}
        model.lm_head.register_forward_pre_hook(lambda m, a: head_t.__setitem__("t", time.perf_counter()))
        model.lm_head.register_forward_hook(lambda m, a, o: timers.s.__setitem__("lm_head", timers.s.get("lm_head",
            0.0) + time.perf_counter() - head_t["t"]))
        v.rewards.score_many = timers.wrap("rewards", v.rewards.score_many)
        for r in [0, *spec["verify_rounds"]]:
            got = load_completions(spec, r)
            lease, items, comps = got["lease"], got["items"], got["completions"]
            job = VerifyJob(f"s{lease.lease_id}", RolloutSubmission(lease_id=lease.lease_id, policy_version=0,
                model_hash=version_hash(0), completions=comps),
                            lease, items, "toy", version_hash(0))
            timers.reset()
            started = time.perf_counter()
            verdict = v.verify_many([job])[0]
            took = time.perf_counter() - started
            tokens = int(sum(c.token_ids.size for c in comps))
            accepted = verdict.status == VerdictStatus.accepted
            run = {"round": r, "seconds": took, "tokens": tokens, "completions": len(comps),
                   "tokens_per_s": tokens / took, "accepted": accepted, "false_rejections": 0 if accepted
                   else (len({x.completion_index for x in verdict.rejections} - {None}) or len(comps)),
                   "rejection_codes": sorted({x.code.value for x in verdict.rejections}), "parts_s": dict(timers.s),
                   "near_ties": verdict.near_ties, "max_draw_margin": verdict.max_draw_margin}
            if got["gen_s"]:
                run["gen_s"] = got["gen_s"]
                run["verify_over_gen"] = took / got["gen_s"]
            if r == 0:
                rec["warmup"] = run
            else:
                rec["runs"].append(run)
            if accepted:  # the trainer's samples: verified rewards, GRPO advantages per prompt group
                rewards = np.asarray(verdict.rewards, dtype=np.float64)
                by_prompt: dict[int, list[int]] = {}
                for i, c in enumerate(comps):
                    by_prompt.setdefault(c.prompt_index, []).append(i)
                adv = np.zeros(len(comps))
                for idx in by_prompt.values():
                    adv[idx] = group_advantages(rewards[idx])
                samples[r] = [{"prompt_ids": np.asarray(lease.prompts[c.prompt_index].token_ids),
                               "completion_ids": np.asarray(c.token_ids),
                               "behaviour_logprobs": np.minimum(np.asarray(verdict.behaviour_logprobs[i]
                               if verdict.behaviour_logprobs else c.logprobs), 0.0), "reward": float(rewards[i]),
                               "advantage": float(adv[i])} for i, c in enumerate(comps)]
    finally:
        v.close()
    (Path(spec["work"]) / "samples.pkl").write_bytes(pickle.dumps(samples))
    rec["reward_mean"] = float(np.mean([s["reward"] for ss in samples.values() for s in ss])) if samples else None
    rec["nonzero_advantages"] = int(sum(abs(s["advantage"]) > 1e-9 for ss in samples.values() for s in ss))
    return rec


def part_reload(spec: dict, ctx: dict) -> dict:
    """Publish -> generating: write a bf16 version folder, reload it into the engine, generate one token."""
    import torch
    from safetensors.torch import load_file

    from protocol.models import SamplingParams, TaskLease, TaskPrompt
    from shardcast.precision import cast_for_publishing
    from shardcast.weights import plan_shards, serialize_shard, shard_file_name, split_aliases

    engine = ctx.get("engines", {}).get("shipped")
    rec: dict = {"runs": [], "transport": "excluded: see bench/results/reload_latency.md"}
    if engine is None:
        engine, rec["engine_start_s"] = new_engine(spec, "shipped")
        ctx.setdefault("engines", {})["shipped"] = engine
        engine.generate(make_leases(spec)[0][0])  # warm-up
    model_dir = Path(spec["model_dir"])
    master = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        master.update(load_file(str(f)))
    base = cast_for_publishing(master)  # as the trainer publishes: bf16, tied lm_head already absent from the files
    del master
    prompt = make_leases({**spec, "rounds": 0})[0][0].prompts[0]
    one = TaskLease(lease_id="one", prompts=[TaskPrompt(prompt_id="p0", token_ids=prompt.token_ids, seeds=[1])],
                    samples_per_prompt=1, sampling=SamplingParams(max_tokens=1, temperature=1.0), policy_version=0,
                    min_policy_version=0, deadline=time.time() + 86400)
    norm = next(k for k in base if k.endswith("norm.weight"))
    try:
        for k in range(1, spec["reload_repeats"] + 1):
            state = dict(base)
            # a new version (values do not change the cost)
            state[norm] = (base[norm].float() * (1 + 0.01 * k)).to(torch.bfloat16)
            tensors, aliases = split_aliases(state)
            folder = Path(spec["work"]) / "versions" / f"v{k}"
            shutil.rmtree(folder, ignore_errors=True)
            t0 = time.perf_counter()
            folder.mkdir(parents=True)
            plan = plan_shards(tensors, 64 << 20)
            written = 0
            for i, names in enumerate(plan):
                data = serialize_shard({n: tensors[n] for n in names}, aliases)
                (folder / shard_file_name(i, len(plan))).write_bytes(data)
                written += len(data)
            t1 = time.perf_counter()
            engine.reload(folder, k, f"{k:064x}")
            t2 = time.perf_counter()
            comps = engine.generate(one.model_copy(update={"policy_version": k}))
            t3 = time.perf_counter()
            assert comps and comps[0].token_ids.size == 1
            rec["runs"].append({"version": k, "write_s": t1 - t0, "reload_s": t2 - t1, "first_token_s": t3 - t2,
                                "total_s": t3 - t0, "folder_to_token_s": t3 - t1, "bytes": written,
                                "shards": len(plan)})
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(Path(spec["work"]) / "versions", ignore_errors=True)
    rec["bytes"] = rec["runs"][0]["bytes"] if rec["runs"] else None
    return rec


def part_train(spec: dict, ctx: dict) -> dict:
    """One trainer, one learning rate: warm-up step, measured steps, bf16 versions to disk; then deltas."""
    import torch
    from safetensors.torch import load_file, save_file

    from shardcast.delta import delta_stats, encode_delta
    from trainer.config import TrainerConfig
    from trainer.samples import TrainSample
    from trainer.train import Trainer

    lr = float(spec["lr"])
    samples = pickle.loads((Path(spec["work"]) / "samples.pkl").read_bytes())
    if not samples:
        raise RuntimeError("no verified samples (every submission was rejected?)")
    batches = []
    synthetic = False
    for r in sorted(samples):
        batch = [TrainSample(prompt_ids=s["prompt_ids"], completion_ids=s["completion_ids"],
                             behaviour_logprobs=s["behaviour_logprobs"], advantage=s["advantage"], reward=s["reward"],
                             behaviour_version=0, sample_id=f"r{r}-{i}") for i, s in enumerate(samples[r])]
        if not any(abs(s.advantage) > 1e-9 for s in batch):  # all groups tied: no gradient; give it a signal
            synthetic = True
            for i, s in enumerate(batch):
                s.advantage = 1.0 if i % 2 else -1.0
        batches.append(batch)
    while len(batches) < 3:
        batches.append(batches[-1])
    run_dir = Path(spec["work"]) / f"trainer-lr{lr:g}"
    shutil.rmtree(run_dir, ignore_errors=True)
    versions_dir = run_dir / "published"
    versions_dir.mkdir(parents=True)
    rss_start = vm_kib("VmRSS")
    started = time.perf_counter()
    cfg = TrainerConfig(lr=lr, bf16=True, publish_dtype="bfloat16", max_staleness=10**6, checkpoint_every=10**6,
                        samples_per_step=max(len(b) for b in batches), num_threads=int(spec.get("threads") or 0))
    trainer = Trainer(cfg, Path(spec["model_dir"]), run_dir, resume=False)
    rec: dict = {"lr": lr, "trainer_start_s": time.perf_counter() - started, "runs": [],
        "synthetic_advantages": synthetic}

    def publish(trainer: Trainer, k: int) -> Path:
        from shardcast.weights import split_aliases

        state = trainer.state_dict_for_publish()  # the bf16 cast the trainer publishes (a fresh copy)
        tensors, _ = split_aliases(state)
        path = versions_dir / f"v{k}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
        del state, tensors
        return path

    paths = [publish(trainer, 0)]
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        m = trainer.step(batch)
        took = time.perf_counter() - t0
        comp = int(sum(s.completion_ids.size for s in batch))
        run = {"step": i, "seconds": took, "samples": len(batch), "completion_tokens": comp,
               "tokens": int(m.get("tokens", 0)), "completion_tokens_per_s": comp / took,
               "tokens_per_s": m.get("tokens", 0) / took, "loss": m.get("loss"), "grad_norm": m.get("grad_norm")}
        if i == 0:
            rec["warmup"] = run
        else:
            rec["runs"].append(run)
        if i < 2:
            paths.append(publish(trainer, i + 1))
    rec["peak_rss_bytes"] = vm_kib("VmHWM") * 1024  # the training process's peak, before any delta is encoded
    rec["rss_at_start_bytes"] = rss_start * 1024
    del trainer
    rec["full_bytes"] = paths[1].stat().st_size
    for a, b in ((0, 1), (1, 2)):
        base, new = load_file(str(paths[a])), load_file(str(paths[b]))
        t0 = time.perf_counter()
        delta = encode_delta(base, new)
        took = time.perf_counter() - t0
        st = delta_stats(delta)
        changed = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base)
        total = sum(t.numel() for t in base.values())
        rec[f"delta_v{a}_v{b}"] = {"bytes": len(delta), "ratio": len(delta) / paths[b].stat().st_size,
                                   "encode_s": took, "changed_weights": changed, "changed_share": changed / total,
                                   **{k: st[k] for k in ("same", "xor", "sparse")}}
        del base, new, delta
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def part_make(spec: dict, ctx: dict) -> dict:
    """Make a model folder: tiny/small (trainer.tiny_model) or a real architecture (trainer.model_shapes)."""
    out = Path(spec["model_dir"])
    started = time.perf_counter()
    name = spec["make"]
    if name in TOY_PRETRAIN:
        from trainer.tiny_model import init_model

        init_model(out, name, seed=0, pretrain_steps=spec.get("pretrain_steps", TOY_PRETRAIN[name]))
    else:
        from trainer import model_shapes

        steps = spec.get("pretrain_steps")
        model_shapes.init_model(out, name, seed=0, pretrain_steps=model_shapes.DEFAULT_PRETRAIN_STEPS if steps is None
            else steps)
    return {"seconds": time.perf_counter() - started}


PARTS = {"make": part_make, "gen": part_gen, "verify": part_verify, "reload": part_reload, "train": part_train}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    child_env_setup(spec)
    ctx: dict = {}
    out: dict = {}
    try:
        for part in spec["parts"]:
            started = time.perf_counter()
            rec = PARTS[part](spec, ctx)
            rec["part_s"] = time.perf_counter() - started
            rec["peak_rss_bytes_process"] = vm_kib("VmHWM") * 1024
            if "torch" in sys.modules:
                rec["torch_threads"] = sys.modules["torch"].get_num_threads()
            out[part] = rec
    finally:
        for engine in ctx.get("engines", {}).values():
            engine.close()
    Path(spec["result"]).write_text(json.dumps(out, indent=1, default=float))


# =================================================================================================
# The parent


def run_child(spec: dict, log: Path, timeout: float | None) -> dict:
    spec_path = Path(spec["result"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    started = time.perf_counter()
    with open(log, "ab") as f:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_child", str(spec_path)], cwd=REPO,
                              stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"child {spec['parts']} exited {proc.returncode} after {wall:.0f} s; log {log}:\n{tail}")
    got = json.loads(Path(spec["result"]).read_text())
    for rec in got.values():
        rec["process_wall_s"] = wall
    return got


def resolve_model(name: str, given: dict[str, Path], args, work: Path, log) -> tuple[Path, dict | None]:
    if name in given:
        return given[name], None
    model_dir = work / "models" / name
    if (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors")):
        return model_dir, None  # made by an earlier run
    shutil.rmtree(model_dir, ignore_errors=True)
    spec = {"parts": ["make"], "make": name, "model_dir": str(model_dir), "result": str(work / f"make-{name}.json"),
        "threads": args.threads}
    if args.pretrain_steps is not None:
        spec["pretrain_steps"] = args.pretrain_steps
    log(f"{name}: making the model in {model_dir}")
    return model_dir, run_child(spec, work / f"make-{name}.log", args.child_timeout)["make"]


def measure_model(name: str, model_dir: Path, args, work: Path, log) -> dict:
    info = model_info(model_dir)
    mwork = work / name
    shutil.rmtree(mwork, ignore_errors=True)
    mwork.mkdir(parents=True)
    logf = mwork / "children.log"
    spp = 4 if args.completions % 4 == 0 else 1
    rounds = list(range(1, args.rounds + 1))
    base = {"model_dir": str(model_dir), "work": str(mwork), "dtype": args.dtype, "completions": args.completions,
            "samples_per_prompt": spp, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "rounds": args.rounds, "seed": args.seed, "threads": args.threads,
            "reload_repeats": args.reload_repeats, "verify_rounds": rounds}
    together = args.engines == "together" or (args.engines == "auto" and info["parameters"] < TOGETHER_BELOW)
    settings = {k: getattr(args, k) for k in ("dtype", "completions", "max_tokens", "rounds", "reload_repeats",
        "temperature", "top_p", "seed", "threads")}
    rec: dict = {"info": info, "settings": {**settings, "samples_per_prompt": spp}, "engines": "together" if together
                 else "sequential", "load_before": [round(x, 2) for x in os.getloadavg()], "parts": {}, "errors": {},
                 "command": " ".join(["python bench/scaling_bench.py", *sys.argv[1:]]),
                 "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    started = time.perf_counter()

    def run(tag: str, spec: dict) -> dict:
        try:
            return run_child({**base, **spec, "result": str(mwork / f"{tag}.json")}, logf, args.child_timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rec["errors"][tag] = str(exc)[-2000:]
            log(f"{name}: {tag} failed: {str(exc)[-600:]}")
            return {}

    order = list(VARIANTS)  # shipped, vllm, seeded: A B C
    if together:
        # Verification always gets a process of its own, as the verifier service has: vLLM's CPU worker binds the
        # OpenMP threads and memory of the process that builds an engine.
        log(f"{name}: generation (3 engines in one process), then publish -> generating in it")
        rec["parts"].update(run("gen-reload", {"parts": ["gen", "reload"], "gen_variants": order,
            "gen_rounds": rounds}))
        log(f"{name}: verification")
        rec["parts"].update(run("verify", {"parts": ["verify"]}))
    else:
        runs, starts = [], {}
        for r in rounds:
            for v in order:
                log(f"{name}: generation, round {r}, {v} (own process)")
                got = run(f"gen-{v}-r{r}", {"parts": ["gen"], "gen_variants": [v], "gen_rounds": [r]}).get("gen")
                if got:
                    runs += got["runs"]
                    starts.setdefault(v, []).append(got["engine_start_s"][v])
        rec["parts"]["gen"] = {"runs": runs, "engine_start_s": starts}
        log(f"{name}: publish -> generating")
        rec["parts"].update(run("reload", {"parts": ["reload"]}))
        log(f"{name}: verification")
        rec["parts"].update(run("verify", {"parts": ["verify"]}))
    if "verify" in rec["parts"]:
        for lr in LRS:
            log(f"{name}: trainer, lr {lr:g}")
            got = run(f"train-lr{lr:g}", {"parts": ["train"], "lr": lr}).get("train")
            if got:
                rec["parts"][f"train_lr{lr:g}"] = got
    rec["seconds"] = time.perf_counter() - started
    rec["load_after"] = [round(x, 2) for x in os.getloadavg()]
    rec["summary"] = summarize(rec)
    if not args.keep_work:
        shutil.rmtree(mwork / "completions", ignore_errors=True)
        shutil.rmtree(mwork / "versions", ignore_errors=True)
    return rec


def summarize(rec: dict) -> dict:
    """The numbers of the table: medians with their spreads, derived ratios and per-token costs."""
    p = rec["parts"]
    s: dict = {}
    gen = p.get("gen", {}).get("runs", [])
    by_v = {v: [r for r in gen if r["variant"] == v] for v in VARIANTS}
    for v, rs in by_v.items():
        if rs:
            s[f"gen_{v}_tokens_per_s"] = spread([r["tokens_per_s"] for r in rs])
            s[f"gen_{v}_s_per_token"] = spread([r["seconds"] / r["tokens"] for r in rs])
    # Per round (same lease for the three variants): overheads as ratios of seconds per generated token minus one
    # (per token: vLLM's own sampler draws other tokens, so its completions can stop at other lengths).
    rounds = sorted({r["round"] for r in gen})
    per = {r: {x["variant"]: x for x in gen if x["round"] == r} for r in rounds}
    for key, (num, den) in {"sampler_overhead": ("seeded", "vllm"), "proofs_overhead": ("shipped", "seeded"),
        "total_overhead": ("shipped", "vllm")}.items():
        xs = [(per[r][num]["seconds"] / per[r][num]["tokens"]) / (per[r][den]["seconds"] / per[r][den]["tokens"]) - 1
              for r in rounds if num in per[r] and den in per[r]]
        if xs:
            s[key] = spread(xs)
            # Per generated token (absolute seconds): what the slopes are computed on.
            s[key + "_s_per_token"] = spread(
                [per[r][num]["seconds"] / per[r][num]["tokens"] - per[r][den]["seconds"] / per[r][den]["tokens"]
                                              for r in rounds if num in per[r] and den in per[r]])
    ver = p.get("verify", {}).get("runs", [])
    if ver:
        s["verify_tokens_per_s"] = spread([r["tokens_per_s"] for r in ver])
        s["verify_s_per_token"] = spread([r["seconds"] / r["tokens"] for r in ver])
        s["verify_over_gen_time"] = spread([r["verify_over_gen"] for r in ver if "verify_over_gen" in r])
        s["verify_speed_over_gen_speed"] = spread([1 / r["verify_over_gen"] for r in ver if "verify_over_gen" in r])
        for part in ("replay", "prefill", "lm_head", "token_stats", "proofs", "rewards"):
            s[f"verify_{part}_share"] = spread([r["parts_s"].get(part, 0.0) / r["seconds"] for r in ver])
        s["verify_replay_s_per_token"] = spread([r["parts_s"].get("replay", 0.0) / r["tokens"] for r in ver])
        s["false_rejections"] = sum(r["false_rejections"] for r in ver) + p["verify"].get("warmup",
            {}).get("false_rejections", 0)
        s["verified_completions"] = sum(r["completions"] for r in ver)
    train_runs, rss = [], []
    for lr in LRS:
        t = p.get(f"train_lr{lr:g}")
        if not t:
            continue
        train_runs += t["runs"]
        rss.append(t["peak_rss_bytes"])
        s["full_bytes"] = t["full_bytes"]
        for d in ("delta_v0_v1", "delta_v1_v2"):
            if d in t:
                s[f"{d}_lr{lr:g}_bytes"] = t[d]["bytes"]
                s[f"{d}_lr{lr:g}_ratio"] = t[d]["ratio"]
                s[f"{d}_lr{lr:g}_changed_share"] = t[d]["changed_share"]
    if train_runs:
        s["train_tokens_per_s"] = spread([r["completion_tokens_per_s"] for r in train_runs])
        s["train_all_tokens_per_s"] = spread([r["tokens_per_s"] for r in train_runs])
        s["train_s_per_token"] = spread([r["seconds"] / r["completion_tokens"] for r in train_runs])
        s["train_peak_rss_bytes"] = spread(rss)
    rel = p.get("reload", {}).get("runs", [])
    if rel:
        s["publish_to_generating_s"] = spread([r["total_s"] for r in rel])
        s["reload_s"] = spread([r["reload_s"] for r in rel])
        s["write_s"] = spread([r["write_s"] for r in rel])
        s["first_token_s"] = spread([r["first_token_s"] for r in rel])
    return s


# Costs whose growth with the parameters the report computes: key in the summary, label, unit.
COSTS = [
    ("gen_shipped_s_per_token", "generation s/token (worker as shipped)", "s"),
    ("gen_vllm_s_per_token", "generation s/token (vLLM's sampler, no proofs)", "s"),
    ("sampler_overhead_s_per_token", "seeded sampler's overhead, s/token", "s"),
    ("proofs_overhead_s_per_token", "proofs' overhead, s/token", "s"),
    ("verify_s_per_token", "verification s/token", "s"),
    ("verify_replay_s_per_token", "draw replay s/token (inside verification)", "s"),
    ("train_s_per_token", "training s/token", "s"),
    ("train_peak_rss_bytes", "trainer peak RSS", "B"),
    ("full_bytes", "bytes per full bf16 version", "B"),
    ("delta_v1_v2_lr1e-06_bytes", "bytes per bf16 delta, lr 1e-6", "B"),
    ("delta_v1_v2_lr1e-05_bytes", "bytes per bf16 delta, lr 1e-5", "B"),
    ("publish_to_generating_s", "publish -> generating, s", "s"),
]
WHY = {
    "gen_shipped_s_per_token": "every decode step runs the lm_head (V x H) and, with the seeded sampler, a score over "
    "all V tokens per row: "
                               "vocabulary-sized work that follows V, not the parameter count",
    "gen_vllm_s_per_token": "the lm_head (V x H) and the logits (one row of V per token) follow the vocabulary; a "
    "model that no longer fits the "
                            "CPU caches streams its weights from memory every decode step",
    "sampler_overhead_s_per_token": "the seeded draw hashes a score for every one of the V tokens of every row: its "
    "cost is ~V per token, and V "
                                    "grew faster than the parameters",
    "proofs_overhead_s_per_token": "proofs copy and encode the hidden state (H per token): they grow with H, slower "
    "than the parameters; where "
                                   "they grow faster, the capture's per-row copies compete with generation for memory "
                                   "bandwidth",
    "verify_s_per_token": "the prefill itself is ~2 x parameters FLOPs per token, but the lm_head, the token "
    "statistics (a log-softmax over V) and "
                          "the draw replay (scores over V) are vocabulary-sized",
    "verify_replay_s_per_token": "the replay scores all V tokens of each position (hash, top-k/top-p support): ~V per "
    "token, independent of the "
                                 "layers",
    "train_s_per_token": "the logits, their log-softmax and its gradient are [tokens x V] in float32; the backward of "
    "the lm_head is V x H",
    "train_peak_rss_bytes": "float32 master, gradients and two AdamW states are 16 bytes per parameter, plus the "
    "[tokens x V] float32 logits and "
                            "their log-softmax copies, which follow V",
    "full_bytes": "2 bytes per parameter: proportional by construction (a tied lm_head is stored once)",
    "delta_v1_v2_lr1e-06_bytes": "a delta holds the bf16 values that flipped; the share of weights small enough for "
    "an lr-sized step to flip "
                                 "their bf16 rounding depends on the weights' magnitudes, which differ between "
                                 "architectures and inits",
    "delta_v1_v2_lr1e-05_bytes": "as at lr 1e-6: the flipped share depends on the weights' magnitudes relative to lr",
    "publish_to_generating_s": "writing and reading 2 bytes per parameter, vLLM's weight loading and the CPU build's "
    "repacking of every linear "
                               "layer: proportional at best, plus fixed costs that dominate small models",
}


WHY_SLOWER = {
    "": "fixed costs per step, per request or per process (Python, vLLM's scheduling, kernel launches, thread "
    "wake-ups) dominate the "
        "smaller model, so its per-unit cost says little about its size",
    "train_peak_rss_bytes": "the process's libraries (torch, transformers: the RSS before the trainer is made, under "
    "Every run) dominate "
                            "a small model's peak",
    "proofs_overhead_s_per_token": "proofs work on the hidden state (H values per token), and H grows slower than the "
    "parameters",
    "publish_to_generating_s": "fixed costs of a reload (vLLM's weight-loading machinery, resetting the prefix cache, "
    "one decode step) "
                               "dominate a small model's",
    "full_bytes": "a safetensors header and per-tensor entries are a fixed cost",
    "delta_v1_v2_lr1e-06_bytes": "a delta holds the bf16 values that flipped; their share depends on the weights' "
    "magnitudes against lr, "
                                 "not on the size, and the header and per-tensor frames are fixed costs",
    "delta_v1_v2_lr1e-05_bytes": "as at lr 1e-6: the flipped share depends on the weights' magnitudes against lr",
}


def slopes(models: dict) -> dict:
    """log-log slope of each cost against the parameters, between consecutive models and end to end."""
    rows = sorted(((m["info"]["parameters"], name, m) for name, m in models.items() if m.get("summary")),
        key=lambda x: x[0])
    out: dict = {}
    for key, _, _ in COSTS:
        pts = []
        for params, name, m in rows:
            v = m["summary"].get(key)
            v = v.get("median") if isinstance(v, dict) else v
            if v is not None and v > 0:
                pts.append((params, name, v))
        pairs = []
        for (p1, n1, v1), (p2, n2, v2) in zip(pts, pts[1:]):
            if p2 > p1:
                pairs.append({"from": n1, "to": n2, "slope": math.log(v2 / v1) / math.log(p2 / p1)})
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            end = math.log(pts[-1][2] / pts[0][2]) / math.log(pts[-1][0] / pts[0][0])
            out[key] = {"pairs": pairs, "end_to_end": end, "from": pts[0][1], "to": pts[-1][1]}
    return out


def fmt_num(x, unit: str = "") -> str:
    if x is None:
        return "-"
    if unit == "B":
        for u, d in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(x) >= d:
                return f"{x / d:.3g} {u}"
        return f"{x:.0f} B"
    if unit == "%":
        return f"{100 * x:+.0f}%"
    if unit == "share":
        return f"{100 * x:.1f}%"
    ax = abs(x)
    return f"{x:,.0f}" if ax >= 100 else f"{x:.3g}"


def cell(s: dict, key: str, unit: str = "") -> str:
    v = s.get(key)
    if v is None:
        return "-"
    if isinstance(v, dict):
        if not v.get("runs"):
            return "-"
        return f"{fmt_num(v['median'], unit)} [{fmt_num(v['min'], unit)}–{fmt_num(v['max'], unit)}]"
    return fmt_num(v, unit)


def _slope_list(title: str, items: list, why, bold: bool = False) -> list[str]:
    """One line per (cost, pair of models); each cost's reason once."""
    lines, seen = [title, ""], set()
    for key, label, p in items:
        name = f"**{label}**" if bold else label
        lines.append(f"- {name}, {p['from']} → {p['to']}: slope {p['slope']:.2f}." + ("" if key in seen
            else f" Why: {why(key)}."))
        seen.add(key)
    return lines + [""]


def write_report(data: dict, out: Path) -> None:
    models = data["models"]
    order = sorted(models, key=lambda n: models[n]["info"]["parameters"])
    meta = data["meta"]
    L = ["# Scaling: what each part costs as the model grows", "",
         f"Measured side by side on this machine: {meta['machine']}. Each model in its own subprocesses "
         f"(bench/scaling_bench.py). "
         "Cells: median [min–max] over all runs (every run is listed below and in scaling.json).", ""]
    cmds = sorted({models[n]["command"] for n in order})
    L += ["Commands:", "", *[f"    {c}" for c in cmds], ""]
    L += ["| model | parameters | layers | hidden | vocab | gen tok/s (worker as shipped) | seeded sampler overhead | "
        "proofs overhead | "
          "verify tok/s | verify time / gen time | draw replay share of verify | trainer tok/s | trainer peak RSS | "
          "full bf16 version | "
          "delta lr 1e-6 (of full) | delta lr 1e-5 (of full) | publish → generating (s) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in order:
        m, s = models[n], models[n].get("summary", {})
        i = m["info"]

        def delta(lr: str) -> str:
            b, r = s.get(f"delta_v1_v2_lr{lr}_bytes"), s.get(f"delta_v1_v2_lr{lr}_ratio")
            return "-" if b is None else f"{fmt_num(b, 'B')} ({100 * r:.1f}%)"

        L.append(
            f"| {n} | {i['parameters']:,} | {i['layers']} | {i['hidden']} | {i['vocab']:,} | "
            f"{cell(s, 'gen_shipped_tokens_per_s')} | {cell(s, 'sampler_overhead', '%')} | "
            f"{cell(s, 'proofs_overhead', '%')} | {cell(s, 'verify_tokens_per_s')} | "
            f"{cell(s, 'verify_over_gen_time')} | {cell(s, 'verify_replay_share', 'share')} | "
            f"{cell(s, 'train_tokens_per_s')} | {cell(s, 'train_peak_rss_bytes', 'B')} | "
            f"{cell(s, 'full_bytes', 'B')} | {delta('1e-06')} | {delta('1e-05')} | "
            f"{cell(s, 'publish_to_generating_s')} |")
    L += ["",
          "- tokens are completion tokens (generated, verified, trained); `dtype` of engines and verifier: "
          + meta["args"]["dtype"] + "; "
          f"{meta['args']['completions']} completions per lease (one vLLM batch), max_tokens "
          f"{meta['args']['max_tokens']}, T={meta['args']['temperature']}, "
          f"top_p={meta['args']['top_p']}, toy task prompts; {meta['args']['rounds']} measured rounds after a warm-up "
          f"lease (the last run's "
          "settings; each model's are under Every run).",
          "- sampler overhead: (s/token, seeded sampler, no proofs) / (s/token, vLLM's sampler, no proofs) − 1, per "
          "round (same lease); "
          "proofs overhead: (s/token, seeded + proofs, as shipped) / (s/token, seeded, no proofs) − 1.",
          "- verify time / gen time: the real Verifier's `verify_many` over one lease's completions against the "
          "shipped worker's "
          "generation of that lease (below 1: a verifier keeps up with more than one worker). All submissions must be "
          "accepted: "
          "false rejections are listed below.",
          "- draw replay share: time inside `protocol.sampling.replay` (wrapped where verifier.reference calls it) / "
          "verify time.",
          "- trainer: `trainer.train.Trainer`, bf16 autocast, AdamW, one step per lease of verified completions (GRPO "
          "advantages of the "
          "verified rewards), after a warm-up step; both learning rates' steps are runs; peak RSS = VmHWM of the "
          "trainer's own process "
          "after its steps (before any delta is encoded), one value per learning rate.",
          "- bytes: a full version = its bf16 safetensors file; delta = `shardcast.delta.encode_delta` between two "
          "consecutive published "
          "versions (v1 → v2, the second step; the first step v0 → v1 is in the runs below).",
          "- publish → generating: write the version folder (shardcast's shard files), `RolloutEngine.reload`, "
          "generate one token. "
          "Transport is excluded: see bench/results/reload_latency.md for origin → relay → worker.", ""]
    sl = data.get("slopes", {})
    L += ["## What grows faster than the parameters, and why", ""]
    if not sl:
        L += ["(one model only: no slopes)", ""]
    else:
        L += ["log-log slope of each cost against the parameter count (1: proportional; above 1: faster than the "
            "parameters), between "
              "consecutive models and end to end. Computed from the medians above.", "",
              "| cost | " + " | ".join(f"{a} → {b}" for a, b in zip(order, order[1:])) + " | end to end |",
              "|---|" + "---|" * (len(order)) + ""]
        for key, label, _ in COSTS:
            if key not in sl:
                continue
            by = {(p["from"], p["to"]): p["slope"] for p in sl[key]["pairs"]}
            cells = [f"{by[(a, b)]:.2f}" if (a, b) in by else "-" for a, b in zip(order, order[1:])]
            L.append(f"| {label} | " + " | ".join(cells) + f" | {sl[key]['end_to_end']:.2f} |")
        L.append("")
        # The size ratios behind the slopes: parameters against the vocabulary.
        for a, b in zip(order, order[1:]):
            ia, ib = models[a]["info"], models[b]["info"]
            L.append(
                f"- {a} → {b}: parameters ×{ib['parameters'] / ia['parameters']:.3g}, "
                f"vocabulary ×{ib['vocab'] / ia['vocab']:.3g}, "
                f"hidden ×{ib['hidden'] / ia['hidden']:.3g}, layers ×{ib['layers'] / ia['layers']:.3g}; "
                f"embedding share of the parameters "
                f"{ia['embedding_parameters'] / ia['parameters']:.0%} → "
                f"{ib['embedding_parameters'] / ib['parameters']:.0%}.")
        L.append("")
        faster = [(key, label, p) for key, label, _ in COSTS if key in sl for p in sl[key]["pairs"] if p["slope"] > 1.1]
        slower = [(key, label, p) for key, label, _ in COSTS if key in sl for p in sl[key]["pairs"] if p["slope"] < 0.5]
        if faster:
            L += _slope_list("Faster than the parameters (slope > 1.1):", faster, lambda key: WHY[key], bold=True)
        else:
            L += ["No cost grew faster than the parameters (no slope above 1.1) between these models.", ""]
        if slower:
            L += _slope_list("Much slower than the parameters (slope < 0.5): costs that do not depend on the size "
                "dominate the smaller model of the pair:",
                             slower, lambda key: WHY_SLOWER.get(key, WHY_SLOWER[""]))
        for a, b in zip(order, order[1:]):
            ia, ib = models[a]["info"], models[b]["info"]
            pr, vr = ib["parameters"] / ia["parameters"], ib["vocab"] / ia["vocab"]
            if vr > 1.1 * pr:
                L.append(f"- {a} → {b}: the vocabulary grew ×{vr:.3g}, faster than the parameters (×{pr:.3g}). The "
                    f"vocabulary-sized parts "
                         "(the lm_head, the logits and their log-softmax, the seeded draw over V tokens per position "
                         "in the worker and in the "
                         "verifier's replay, the trainer's [tokens × V] float32 logits) follow V, not the parameter "
                         "count: their share of each "
                         "per-token cost grows.")
            else:
                L.append(f"- {a} → {b}: the vocabulary grew ×{vr:.3g}, the parameters ×{pr:.3g}: the vocabulary-sized "
                    f"parts grew no faster than the rest.")
        L += ["", "(The sentences above are generated from the measured slopes and the models' shapes.)", ""]
    L += ["## Every run", ""]
    for n in order:
        m = models[n]
        p = m["parts"]
        L += [f"### {n}", "",
            f"- path {m['info']['path']} ({m['info']['architecture']}, pretraining steps "
            f"{m['info'].get('pretrain_steps')}); "
              f"engines {m['engines']}; measured {m['measured_at']} in {m['seconds']:.0f} s; load average before "
              f"{m['load_before']}, after {m['load_after']}",
              f"- command: `{m['command']}`", f"- settings: {json.dumps(m.get('settings', {}))}"]
        if m.get("errors"):
            L += [f"- **failed**: {k}: {v[-300:]!r}" for k, v in m["errors"].items()]
        g = p.get("gen", {})
        if g.get("runs"):
            L.append("- generation (variant round: tokens in s → tok/s): " + "; ".join(
                f"{r['variant']} r{r['round']}: {r['tokens']} in {r['seconds']:.3g} s → {r['tokens_per_s']:.0f}"
                for r in g["runs"]))
            L.append(f"- engine start s: {json.dumps(g.get('engine_start_s'), default=lambda x: round(x, 1))}")
        v = p.get("verify", {})
        if v.get("runs"):
            L.append("- verification (round: tokens in s → tok/s, verify/gen, accepted; replay / prefill / lm_head / "
                "token stats / proofs / rewards s): " + "; ".join(
                f"r{r['round']}: {r['tokens']} in {r['seconds']:.3g} s → {r['tokens_per_s']:.0f}, "
                f"{r.get('verify_over_gen', float('nan')):.3g}, "
                f"{'accepted' if r['accepted'] else 'REJECTED ' + ','.join(r['rejection_codes'])}; "
                + " / ".join(f"{r['parts_s'].get(k, 0.0):.3g}" for k in ("replay", "prefill", "lm_head", "token_stats",
                "proofs", "rewards")) for r in v["runs"]))
            L.append(f"- false rejections: {m['summary'].get('false_rejections')} of "
                f"{m['summary'].get('verified_completions')} completions "
                     f"(+ the warm-up lease); reward mean {v.get('reward_mean')}")
        for lr in LRS:
            t = p.get(f"train_lr{lr:g}")
            if not t:
                continue
            L.append(f"- trainer lr {lr:g}: steps (completion tokens in s → tok/s) " + "; ".join(
                f"{r['completion_tokens']} in {r['seconds']:.3g} s → {r['completion_tokens_per_s']:.0f}"
                for r in t["runs"])
                + f"; warm-up {t['warmup']['seconds']:.3g} s; peak RSS {fmt_num(t['peak_rss_bytes'], 'B')} (the "
                f"process before the trainer was "
                  f"made: {fmt_num(t['rss_at_start_bytes'], 'B')})"
                + (" (synthetic ±1 advantages: every group's rewards tied)" if t.get("synthetic_advantages") else ""))
            for d in ("delta_v0_v1", "delta_v1_v2"):
                x = t.get(d)
                if x:
                    L.append(
                        f"  - {d.replace('delta_', '').replace('_', ' → ')}: {fmt_num(x['bytes'], 'B')} = "
                        f"{100 * x['ratio']:.2f}% of "
                        f"{fmt_num(t['full_bytes'], 'B')}; bf16 values changed {100 * x['changed_share']:.3f}%; "
                        f"encode {x['encode_s']:.3g} s "
                        f"(tensors same/xor/sparse {x['same']}/{x['xor']}/{x['sparse']})")
        r = p.get("reload", {})
        if r.get("runs"):
            L.append("- publish → generating (write + reload + first token = total s): " + "; ".join(
                f"{x['write_s']:.3g} + {x['reload_s']:.3g} + {x['first_token_s']:.3g} = {x['total_s']:.3g}"
                for x in r["runs"]))
        L.append("")
    (out / "scaling.md").write_text("\n".join(L))


def write_chart(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    models = data["models"]
    order = sorted(models, key=lambda n: models[n]["info"]["parameters"])
    params = [models[n]["info"]["parameters"] for n in order]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    groups = [
        (axes[0], "seconds per token (s)", [("gen_shipped_s_per_token", "generation (as shipped)"),
                                            ("gen_vllm_s_per_token", "generation (vLLM sampler)"),
                                            ("verify_s_per_token", "verification"), ("verify_replay_s_per_token",
                                            "draw replay (in verification)"), ("train_s_per_token", "training")]),
        (axes[1], "bytes per version", [("full_bytes", "full bf16"), ("delta_v1_v2_lr1e-06_bytes", "delta lr 1e-6"),
        ("delta_v1_v2_lr1e-05_bytes", "delta lr 1e-5")]),
    ]
    for ax, ylabel, series in groups:
        firsts = []
        for key, label in series:
            pts = []
            for n, x in zip(order, params):
                v = models[n].get("summary", {}).get(key)
                v = v.get("median") if isinstance(v, dict) else v
                if v:
                    pts.append((x, v))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
                firsts.append(pts[0])
        if firsts and len(params) > 1:
            x0, y0 = min(firsts, key=lambda p: (p[0], -p[1]))
            y0 = math.exp(statistics.mean(math.log(p[1]) for p in firsts if p[0] == x0))
            xs = [min(params), max(params)]
            ax.plot(xs, [y0 * x / x0 for x in xs], "k--", lw=1, label="slope 1 (∝ parameters)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("parameters")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        for n, x in zip(order, params):
            ax.annotate(n, (x, ax.get_ylim()[0]), textcoords="offset points", xytext=(0, 4), fontsize=7, ha="center")
    fig.suptitle("swarmrl costs against parameters (log-log; medians; this machine)")
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)


def machine() -> str:
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} cores ({cpu or platform.processor()}), {mem / 2**30:.1f} GiB memory, "
            f"{platform.system()} {platform.release()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--models", default="tiny,small",
        help="comma-separated: tiny, small, an architecture of trainer.model_shapes.PRESETS, or a --model-dir name")
    ap.add_argument("--model-dir", action="append", default=[], metavar="NAME=PATH",
        help="an already-made model folder under this name")
    ap.add_argument("--completions", type=int, default=32,
        help="completions per lease (one vLLM batch); groups of 4 per prompt when divisible")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2,
        help="measured rounds (leases) per generation variant, after a warm-up lease")
    ap.add_argument("--reload-repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
        help="engines' and verifier's compute dtype")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="auto", choices=["auto", "together", "sequential"],
                    help=f"the three generation engines in one process (together) or one process per variant and "
                    f"round; auto: together below {TOGETHER_BELOW:,} parameters")
    ap.add_argument("--pretrain-steps", type=int, default=None,
        help=f"for models made here (default: tiny/small {TOY_PRETRAIN}, architectures trainer.model_shapes' default)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every child (0: torch's default)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds per child process")
    ap.add_argument("--work", type=Path, default=WORK, help="made models (reused) and scratch")
    ap.add_argument("--keep-work", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="do not keep the models of an earlier scaling.json in --out")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    if args.completions < 1 or args.rounds < 1:
        ap.error("--completions and --rounds must be at least 1")
    given = {}
    for item in args.model_dir:
        name, _, path = item.partition("=")
        if not name or not path or not Path(path).is_dir():
            ap.error(f"--model-dir {item!r}: want NAME=PATH of a model folder")
        given[name] = Path(path)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    names += [n for n in given if n not in names]
    from trainer.model_shapes import PRESETS  # light: no model is built here

    for n in names:
        if n not in given and n not in TOY_PRETRAIN and n not in PRESETS:
            ap.error(f"unknown model {n!r}: tiny, small, {', '.join(sorted(PRESETS))}, or a --model-dir NAME")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    path = args.out / "scaling.json"
    data = json.loads(path.read_text()) if path.is_file() and not args.fresh else {"models": {}}
    data["meta"] = {"machine": machine(), "args": {k: (str(v) if isinstance(v, Path) else v) for k,
        v in vars(args).items()},
                    "command": " ".join(["python bench/scaling_bench.py", *sys.argv[1:]])}
    started = time.perf_counter()
    failed = False
    for n in names:
        model_dir, made = resolve_model(n, given, args, args.work, log)
        rec = measure_model(n, model_dir, args, args.work, log)
        if made:
            rec["made"] = made
        failed |= bool(rec["errors"])
        data["models"][n] = rec
        data["slopes"] = slopes(data["models"])
        path.write_text(json.dumps(data, indent=1))
        write_report(data, args.out)
        log(f"{n}: done in {rec['seconds']:.0f} s")
    write_chart(data, args.out)
    log(f"wrote {path}, {args.out / 'scaling.md'}, {args.out / 'scaling.png'} in {time.perf_counter() - started:.0f} s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        child_main(sys.argv[2])
    else:
        main()
