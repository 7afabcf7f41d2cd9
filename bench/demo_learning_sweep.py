"""Which demo settings learn the toy task fastest: the real Trainer and the real toy reward, in one process.

Sampling is plain HF (no vLLM, no workers, no verifier), with the behaviour policy `lag` versions behind
the trainer, as in an async run with one worker. It answers "does this config learn, and in how many
steps", cheaply; the wall-clock answer is the real demo (`swarmrl run`).

    python bench/demo_learning_sweep.py --steps 150 --variant base --variant lr1e-3
    python bench/demo_learning_sweep.py --steps 60 --seed 0 1 2 --variant
    '{"lr":5e-4,"pretrain":60,"pretrain_target":0.5}'
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from environments.tasks import get_task
from trainer.advantages import group_advantages, has_signal
from trainer.config import LossConfig, TrainerConfig
from trainer.policy_model import load_model
from trainer.samples import TrainSample
from trainer.tiny_model import EOS_ID, init_model, make_tokenizer
from trainer.train import Trainer


@torch.no_grad()
def sample(model, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, gen):
    """n completions per prompt (prompts of equal length), stopped at EOS; [(prompt, completion, logprobs)]."""
    ids = torch.tensor([p for p in prompts for _ in range(n)])
    done = torch.zeros(len(ids), dtype=torch.bool)
    toks, lps = [], []
    for _ in range(max_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
        logp = torch.log_softmax(logits / temperature, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        toks.append(nxt[:, 0])
        lps.append(logp.gather(-1, nxt)[:, 0])
        ids = torch.cat([ids, nxt], 1)
        done |= nxt[:, 0] == EOS_ID
        if done.all():
            break
    toks, lps = torch.stack(toks, 1), torch.stack(lps, 1)
    out = []
    for i in range(len(ids)):
        c = toks[i].tolist()
        k = c.index(EOS_ID) + 1 if EOS_ID in c else len(c)
        out.append((prompts[i // n], c[:k], lps[i, :k].numpy()))
    return out


VARIANTS = {
    "base": {},
}


def run(variant: dict, steps: int, model_dir: Path, seed: int) -> dict:
    torch.manual_seed(seed)
    import environments.tasks as tasks_mod

    if variant.get("exact_digits"):
        tasks_mod._digit_credit = lambda want, got: float(want == got)
    if variant.get("reward") == "match_len":  # no credit for "is a digit": it rewards the commonest digit most
        def reward(self, item, c, w=variant.get("match_weight", 0.8)):
            a = item.answer
            matched = sum(x == y for x, y in zip(a, c)) / len(a)
            length = max(0.0, 1.0 - abs(len(c) - len(a)) / len(a))
            return w * matched + (1 - w) * length
        tasks_mod.ToyCopyTask.reward = reward
    if variant.get("reward") == "contains":
        def reward(self, item, c):
            a = item.answer
            if c == a:
                return 1.0
            if a in c:
                return 0.5
            return 0.4 * sum(x == y for x, y in zip(a, c)) / len(a)
        tasks_mod.ToyCopyTask.reward = reward
    if variant.get("reward") == "circular":  # near-digit credit by distance mod 10: no digit is favoured a priori
        def credit(x, y):
            if x == y:
                return 1.0
            if x.isdigit() and y.isdigit():
                d = abs(int(x) - int(y))
                return variant.get("near", 0.5) * (1 - min(d, 10 - d) / 5)
            return 0.0

        def reward(self, item, c, w=variant.get("match_weight", 0.8)):
            a = item.answer
            matched = sum(credit(x, y) for x, y in zip(a, c)) / len(a)
            length = max(0.0, 1.0 - abs(len(c) - len(a)) / len(a))
            return w * matched + (1 - w) * length
        tasks_mod.ToyCopyTask.reward = reward
    task = get_task("toy", **variant.get("task_params", {"digits": 1}))
    tok = make_tokenizer()
    items = task.make_prompts(variant.get("num_prompts", 1000), seed=0)
    loss = LossConfig(**variant.get("loss", {"entropy_coef": 0.01}))
    cfg = TrainerConfig(lr=variant.get("lr", 2e-3), loss=loss, max_staleness=2, checkpoint_every=10**6, max_steps=10**6)
    published = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, model_dir, Path(tmp), publish=lambda v, s: published.__setitem__(v, {k: t.clone() for k,
            t in s.items()}))
        actor = load_model(model_dir, torch.device("cpu"), attention="sdpa")
        gen = torch.Generator().manual_seed(seed)
        lag, group, per_step = variant.get("lag", 2), variant.get("group", 16), variant.get("samples_per_step", 64)
        temperature = variant.get("temperature", 1.0)
        rng = np.random.default_rng(seed)
        history, dropped, t0 = [], 0, time.time()
        for step in range(steps):
            v = max(0, trainer.version - lag)
            actor.load_state_dict(published[v], strict=False)
            batch, rewards = [], []
            tries = 0
            while len(batch) < per_step and tries < 20:
                tries += 1
                chosen = [items[j] for j in rng.integers(len(items), size=per_step // group)]
                prompts = [tok(it.prompt)["input_ids"] for it in chosen]
                comps = sample(actor, prompts, group, 8, temperature, gen)
                for g, item in enumerate(chosen):
                    grp = comps[g * group : (g + 1) * group]
                    r = [task.reward(item, tok.decode([t for t in c if t != EOS_ID and t < len(tok)],
                        skip_special_tokens=True)) for _, c, _ in grp]
                    rewards += r
                    adv = group_advantages(r)
                    if not has_signal(adv):
                        dropped += 1
                        continue
                    batch += [TrainSample(p, c, lp, float(a), rr, v) for (p, c, lp), a, rr in zip(grp, adv, r)]
            m = trainer.step(batch) if batch else {}
            texts = [tok.decode([t for t in c if t < len(tok)]) for _, c, _ in comps[:: max(1, len(comps) // 8)]]
            history.append(dict(step=step, reward=float(np.mean(rewards)), dropped=dropped, entropy=m.get("entropy",
                float("nan")), seen=texts))
            if step % 10 == 0:
                print(json.dumps(history[-1]), flush=True)
            if variant.get("stop_reached") and len(history) >= 5 and min(h["reward"] for h in history[-5:]) >= 0.9:
                break  # the demo's stop rule: reward >= 0.9 for 5 steps
    rew = [h["reward"] for h in history]
    reach = next((i for i in range(len(rew)) if np.mean(rew[i : i + 5]) >= 0.9 and i + 5 <= len(rew)), None)
    return dict(final=float(np.mean(rew[-10:])), steps_to_0_9=reach, steps=len(rew), dropped=dropped,
        seconds=time.time() - t0, history=rew)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--variant", action="append", help="JSON dict of overrides, or a name in VARIANTS")
    ap.add_argument("--size", default="small")
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
        help="one run per seed; the seed also makes the base model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variant or ["base"]:
            variant = VARIANTS[v] if v in VARIANTS else json.loads(v)
            for seed in args.seed:
                t0 = time.time()
                model_dir = init_model(Path(tmp) / f"model-{seed}", size=args.size, seed=seed,
                                       pretrain_steps=variant.get("pretrain", 0),
                                       pretrain_target=variant.get("pretrain_target"),
                                       pretrain_max_steps=variant.get("pretrain_max", 0))
                base = json.loads((model_dir / "swarmrl_model.json").read_text())
                made_s = time.time() - t0
                res = run(variant, args.steps, model_dir, seed)
                print("RESULT", json.dumps({"variant": v, "seed": seed, "pretrain_steps": base["pretrain_steps"],
                                            "echo_accuracy": base.get("pretrain_echo_accuracy"),
                                            "base_model_s": round(made_s, 1), **{k: res[k] for k in ("final",
                                            "steps_to_0_9", "steps", "dropped", "seconds")}, "first5": [round(r, 3)
                                            for r in res["history"][:5]]}), flush=True)


if __name__ == "__main__":
    main()
