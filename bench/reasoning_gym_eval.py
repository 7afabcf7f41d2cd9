"""Greedy answers of model folders on fresh items of a reasoning-gym dataset, scored by its own scorer, by answer.

    python bench/reasoning_gym_eval.py MODEL_DIR [MODEL_DIR ...] [--dataset letter_counting] [--items 400]

It tells what a run learnt beyond its reward curve: a skewed dataset (letter_counting's answer is "1" for ~90% of
one-word items) rewards a model that always gives the common answer. Items come from a seed no run uses.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from environments.tasks import get_task


def evaluate(model_dir: str, task, items: int, max_tokens: int) -> dict:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    by_answer: dict[str, list[float]] = defaultdict(list)
    for i in range(items):
        item = task.item(12345, i)
        ids = tok(item.prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        by_answer[item.answer].append(task.reward(item, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    every = [r for rs in by_answer.values() for r in rs]
    return {"model": model_dir, "mean_reward": round(sum(every) / len(every), 3),
            "by_answer": {a: {"items": len(rs), "mean_reward": round(sum(rs) / len(rs), 3)}
                          for a, rs in sorted(by_answer.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--dataset", default="letter_counting")
    ap.add_argument("--config", default='{"min_words": 1, "max_words": 1}', help="the dataset's config, JSON")
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=3)
    args = ap.parse_args()
    task = get_task("reasoning_gym", dataset=args.dataset, config=json.loads(args.config), answer_format="strip")
    for m in args.models:
        print(json.dumps(evaluate(m, task, args.items, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
