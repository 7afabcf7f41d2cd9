"""How good is the demo's locally made base model, per seed? Cheap: no vLLM, no RL, plain HF sampling.

For each seed it makes the base model as `init_model` does, with the fixed step count (`--steps`) and with the
demo's quality bar (configs/demo.toml: `init_pretrain_target`, `init_pretrain_max_steps`), and reports the
pretraining steps, the echo accuracy on fresh echo lines (greedy), and on the demo's task (never seen in
pretraining) the exact-copy rate and mean toy reward of samples at temperature 1.

    python bench/base_model_quality.py --seeds 0 1 2 3 4 5 6 7 8 9 [--rules fixed]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

from environments.tasks import get_task  # noqa: E402
from swarmrl.config import load_run_config  # noqa: E402
from trainer.tiny_model import EOS_ID, echo_accuracy, init_model, make_tokenizer, pretrain_corpus  # noqa: E402


@torch.no_grad()
def task_quality(model, items, samples: int, max_tokens: int, seed: int) -> tuple[float, float]:
    """Exact-copy rate and mean toy reward of `samples` completions per prompt at temperature 1."""
    tok = make_tokenizer()
    ids = torch.tensor([tok(it.prompt)["input_ids"] for it in items for _ in range(samples)])  # equal lengths
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = model(input_ids=ids).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        out.append(nxt)
        ids = torch.cat([ids, nxt], 1)
    exact, rewards = 0, []
    for i, row in enumerate(torch.cat(out, 1).tolist()):
        row = row[: row.index(EOS_ID)] if EOS_ID in row else row
        text = tok.decode([t for t in row if t < len(tok)], skip_special_tokens=True)
        item = items[i // samples]
        exact += text == item.answer
        rewards.append(get_task("toy", digits=len(item.answer)).reward(item, text))
    return exact / len(rewards), sum(rewards) / len(rewards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--steps", type=int, default=None,
        help="fixed pretraining steps (default: the demo's init_pretrain_steps)")
    ap.add_argument("--samples", type=int, default=4, help="completions per task prompt (100 prompts)")
    ap.add_argument("--rules", nargs="+", choices=["fixed", "bar"], default=["fixed", "bar"],
                    help="fixed: --steps steps; bar: the demo's quality bar (init_pretrain_target)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_run_config(REPO / "configs" / "demo.toml")
    m = cfg.model
    steps = args.steps if args.steps is not None else m.init_pretrain_steps
    from transformers import AutoModelForCausalLM

    items = get_task(cfg.data.task, **cfg.data.task_params).make_prompts(100, seed=0)
    rows, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for rule, target in (("fixed", None), ("bar", m.init_pretrain_target)):
                if rule not in args.rules:
                    continue
                t0 = time.time()
                path = init_model(Path(tmp) / f"{seed}-{rule}", m.init_size, seed, m.tie_embeddings, steps, target,
                    m.init_pretrain_max_steps)
                made_s = time.time() - t0
                info = json.loads((path / "swarmrl_model.json").read_text())
                model = AutoModelForCausalLM.from_pretrained(path).eval()
                # other lines than the rule's
                echo = echo_accuracy(model, pretrain_corpus(256, random.Random(f"quality-{seed}")))
                exact, reward = task_quality(model, items, args.samples, cfg.orchestrator.sampling.max_tokens, seed)
                rows.append({"seed": seed, "rule": rule, "pretrain_steps": info["pretrain_steps"],
                             "echo_accuracy": round(echo, 3), "task_exact": round(exact, 4),
                             "task_reward": round(reward, 3), "make_s": round(made_s, 1)})
                load.append(os.getloadavg()[0])
                print(json.dumps(rows[-1]), flush=True)
    meta = {"command": "python bench/base_model_quality.py " + " ".join(sys.argv[1:]), "fixed_steps": steps,
            "target": m.init_pretrain_target, "max_steps": m.init_pretrain_max_steps, "samples": 100 * args.samples,
            "load_avg_1min": {"mean": round(sum(load) / len(load), 2), "max": round(max(load), 2)},
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (RESULTS / "base_model_quality.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# The demo's base model per seed: `bench/base_model_quality.py`", "",
        f"{meta['when']}, `{meta['command']}`; load average (1 min) {meta['load_avg_1min']['mean']} mean, "
        f"{meta['load_avg_1min']['max']} max",
        "(2 cores, shared: `make s` is not comparable between rows). Echo accuracy: greedy, whole answer and EOS, on "
        "256",
        f"fresh echo lines. Task (`copy:<2 digits>=`, never in pretraining): {meta['samples']} samples at temperature "
        f"1.", "",
        "| seed | rule | pretrain steps | echo accuracy | task exact copies | task mean reward | make s |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r['seed']} | {r['rule']} | {r['pretrain_steps']} | {r['echo_accuracy']:.3f} | {r['task_exact']:.3f} | "
        f"{r['task_reward']:.3f} | {r['make_s']} |" for r in rows),
    ]
    (RESULTS / "base_model_quality.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
