"""Honest workers at depth: the seeded-draw calibration on a real-shape model (issue: real sizes, item 4).

The worker's own vLLM engine (seeded sampler and proofs on) generates honest completions from a model
made by `swarmrl init-model --arch ...`; the real `Verifier` with the shipped tolerances judges every
one (any rejection is a false rejection), and `tools.draw_calibration` measures the noise behind the
tolerances: near ties, the largest margin against its tolerance, the largest logprob difference against
its limit. Runs accumulate (a new --seed each time) into bench/results/realsize_draws.{md,json}.

    python bench/realsize_draws.py --model /path/qwen3-0.6b --label qwen3-0.6b-pt4 \
        --completions 1000 --dtypes float32 --samplings "T=1" --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STEM = "realsize_draws"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a model folder (swarmrl init-model --arch ...)")
    ap.add_argument("--label", required=True, help="the model's name in the table")
    ap.add_argument("--completions", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="completions vLLM generates at once")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--samplings", default="T=1;T=0.7,top_p=0.9",
        help="';'-separated names of tools.draw_calibration.SAMPLINGS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from swarmrl.logs import configure_logging
    from tools.draw_calibration import calibrate_draws, merge_rows, read_results, table_markdown, write_results

    configure_logging("WARNING")
    old_rows, old_meta = read_results(a.out, STEM)
    runs = old_meta.get("runs", [])
    if any(r["seed"] == a.seed and r["model"] == a.label for r in runs):
        sys.exit(f"seed {a.seed} is already in {a.out / STEM}.json for {a.label}: the same draws would count twice")
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = calibrate_draws({a.label: a.model}, completions=a.completions, max_tokens=a.max_tokens, batches=(a.batch,),
                           dtypes=tuple(a.dtypes.split(",")), samplings=tuple(a.samplings.split(";")), seed=a.seed)
    info = json.loads((a.model / "swarmrl_model.json").read_text())
    run = {"model": a.label, "seed": a.seed, "completions": a.completions, "max_tokens": a.max_tokens, "batch": a.batch,
           "dtypes": a.dtypes, "samplings": a.samplings, "seconds": round(time.perf_counter() - started, 1),
           "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
           "command": "python bench/realsize_draws.py " + " ".join(sys.argv[1:])}
    models = {**old_meta.get("models", {}), a.label: {k: info.get(k) for k in ("arch", "parameters", "layers",
                                                                               "hidden", "vocab_size", "tied",
                                                                               "pretrain_steps", "pretrain_losses")
                                                                               if k in info}}
    path = write_results(merge_rows(old_rows, rows), a.out, {"models": models, "runs": [*runs, run]}, STEM)
    print(table_markdown(merge_rows(old_rows, rows)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
