"""`python -m tools.calibrate ...`: calibrate the verifier's thresholds on honest vLLM runs (a developer
tool, run from the repository root of a source checkout: tools/ is not installed with swarmrl).

    python -m tools.calibrate --part attacks|episodes|draws|all|steering|weights [options]

Writes bench/results/verifier_*.{md,json}; the options are listed by `python -m tools.calibrate --help`.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


# The models the draw calibration runs on, made locally: (size, pretraining steps). "small-pretrained"
# is the demo's base model (peaked, short completions); the others are freshly initialised (flat
# distributions, long completions: many ties at the top-k / top-p boundary).
DRAW_MODELS = {"tiny": ("tiny", 0), "small": ("small", 0), "small-pretrained": ("small", 60)}


@app.command()
def calibrate(
    out: Path = typer.Option(Path("bench/results"), help="where the results (.md and .json) go"),
    workdir: Path = typer.Option(None, help="scratch folder for models (default: a temporary one)"),
    part: str = typer.Option("all",
    help="attacks (the attack matrix), episodes (its multi-turn rows), draws (seeded-draw tolerances), "
                             "all of those, steering (steering within the tolerances toward the reward) or weights "
                             "(wrong weights, short completions)"),
    base_model: Path = typer.Option(None, "--base-model",
    help="the attack matrix's model (default: a tiny one made here)"),
    trials: int = typer.Option(100, min=1, help="trials per attack"),
    honest_scale: int = typer.Option(1, min=1,
    help="multiplies the attack matrix's honest completions per setting (104 per dtype at 1)"),
    tag: str = typer.Option("calibration",
    help="the attack matrix's results are verifier_attacks_<tag>.{md,json}; steering: a suffix"),
    completions: int = typer.Option(2000, min=1, help="draws: honest completions per setting"),
    max_tokens: int = typer.Option(48, min=1, help="draws: max_tokens of every completion"),
    models: str = typer.Option(",".join(DRAW_MODELS), help=f"draws: which of {', '.join(DRAW_MODELS)}"),
    seed: int = typer.Option(0, help="draws: the prompts' and seeds' random source"),
    accumulate: bool = typer.Option(False,
    help="draws: add this run to the results already in --out (a different --seed each time)"),
    batches: str = typer.Option("1,32", help="draws: vLLM batch sizes (completions generated at once)"),
    dtypes: str = typer.Option("float32,bfloat16", help="draws, steering: compute dtypes"),
    burst: float = typer.Option(8.0, help="steering: the orchestrator's near_tie_burst the ledger is replayed with"),
) -> None:
    """Honest vLLM output against the real verifier: the attack matrix (fp32, bf16; every attack must be
    rejected, every honest rollout accepted), its multi-turn rows (episode attacks on the lookup
    environment), and the seeded-draw calibration (every setting of dtype,
    batch size and sampling: false rejections, near ties, largest honest margin against the tolerance)."""
    import os
    import tempfile

    from rich.console import Console

    from swarmrl.logs import configure_logging
    from trainer.tiny_model import init_model

    if part not in ("attacks", "episodes", "draws", "steering", "weights", "all"):
        raise typer.BadParameter("--part is attacks, episodes, draws, steering, weights or all")
    unknown = [m for m in models.split(",") if m not in DRAW_MODELS]
    if unknown:
        raise typer.BadParameter(f"unknown models {unknown}; choose from {list(DRAW_MODELS)}")
    configure_logging("WARNING")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    console = Console()
    with tempfile.TemporaryDirectory(prefix="swarmrl-calib-") as tmp:
        work = workdir or Path(tmp)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
        if part in ("attacks", "all"):
            from tools.verifier_calibration import run_matrix, table_markdown, write_results

            counts = {"long_t1_b32": 32, "long_t0.7_p0.9_k20_b32": 32, "short_t1_b32": 32, "mixed_b1": 6,
                "greedy_b1": 2}
            counts = {k: v * honest_scale for k, v in counts.items()}
            base = base_model or init_model(work / "models" / "tiny", "tiny", seed=0)
            result = run_matrix(work, base, trials=trials, honest_counts=counts, stale_lrs=(1e-5, 1e-4, 1e-3))
            path = write_results(result, out, tag, {"base_model": str(base_model or "tiny, made here"),
                "trials": trials, "honest": counts})
            console.print(table_markdown(result))
            console.print(f"wrote {path}")
        if part in ("episodes", "all"):
            from tools import episode_calibration

            result = episode_calibration.run(episode_calibration.make_tool_model(work / "models"), trials)
            path = episode_calibration.write_results(result, out, trials)
            console.print(path.read_text())
            console.print(f"wrote {path}")
        if part in ("draws", "all"):
            from tools.draw_calibration import calibrate_draws, merge_rows, read_results
            from tools.draw_calibration import table_markdown as draw_table
            from tools.draw_calibration import write_results as write_draws

            old_rows, old_meta = read_results(out) if accumulate else ([], {})
            if seed in old_meta.get("seeds", []):
                raise typer.BadParameter(f"seed {seed} is already in {out}: the same prompts and draws again would "
                    f"count twice")
            made = {name: init_model(work / "models" / f"draw-{name}", DRAW_MODELS[name][0], seed=0,
                pretrain_steps=DRAW_MODELS[name][1])
                    for name in models.split(",")}
            rows = merge_rows(old_rows, calibrate_draws(made, completions=completions, max_tokens=max_tokens,
                                                         seed=seed, progress=console.print, batches=tuple(int(b)
                                                         for b in batches.split(",")), dtypes=tuple(dtypes.split(","))))
            command = (f"python -m tools.calibrate --part draws --completions {completions} --max-tokens {max_tokens} "
                f"--models {models} "
                       f"--batches {batches} --dtypes {dtypes} --seed {seed}")
            path = write_draws(rows, out, {"models": {k: {"size": DRAW_MODELS[k][0],
                "pretrain_steps": DRAW_MODELS[k][1]} for k in made},
                                           "max_tokens": max_tokens, "seeds": [*old_meta.get("seeds", []), seed],
                                           "commands": [*old_meta.get("commands", [old_meta["command"]]
                                           if "command" in old_meta else []), command]})
            console.print(draw_table(rows))
            console.print(f"wrote {path}")
        if part == "weights":  # not in "all": wrong weights on the demo's short completions
            from protocol.models import SamplingParams
            from tools import wrong_weights

            size, steps = DRAW_MODELS["small-pretrained"]
            bases = {"tied": init_model(work / "models" / "draw-small-pretrained", size, seed=0, pretrain_steps=steps),
                     "untied": init_model(work / "models" / "small-pretrained-untied", size, seed=0,
                     pretrain_steps=steps, tie_embeddings=False)}
            variants = [("tied", "last_layer", 5e-3), ("tied", "last_layer", 3e-3), ("untied", "head", 1e-2),
                ("untied", "head", 1e-3)]
            sampling = SamplingParams(temperature=1.0, max_tokens=8)  # the demo's
            rows = wrong_weights.run(bases, variants, work / "models", trials, sampling, tuple(dtypes.split(",")),
                seed, console.print)
            command = f"python -m tools.calibrate --part weights --trials {trials} --dtypes {dtypes} --seed {seed}"
            path = wrong_weights.write_results(rows, out,
                {"model": "small, 60 echo steps (the demo's base), tied and untied",
                                                           "sampling": sampling.model_dump(), "command": command})
            console.print(path.read_text())
        if part == "steering":  # not in "all": it measures an attack on the draws, not a tolerance
            from tools.draw_calibration import SAMPLINGS
            from tools.steering_attacks import run_steering
            from tools.steering_attacks import write_results as write_steering

            size, steps = DRAW_MODELS["small-pretrained"]
            model = init_model(work / "models" / "draw-small-pretrained", size, seed=0, pretrain_steps=steps)
            rows = run_steering(model, tuple(dtypes.split(",")), tuple(SAMPLINGS), completions, max_tokens, seed,
                burst, console.print)
            command = (f"python -m tools.calibrate --part steering --completions {completions} --max-tokens "
                f"{max_tokens} "
                       f"--dtypes {dtypes} --seed {seed} --burst {burst:g}")
            path = write_steering(rows, out, {"model": "small-pretrained (the demo's base model)", "command": command,
                "max_tokens": max_tokens},
                                  "" if tag == "calibration" else f"_{tag}")
            console.print(path.read_text())


if __name__ == "__main__":
    app()
