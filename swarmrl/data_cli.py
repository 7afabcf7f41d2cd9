"""`swarmrl data ...`: offline work on a run's dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
app = typer.Typer(help="Datasets: offline difficulty filtering.", no_args_is_help=True)


@app.command("filter", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def filter_(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c",
    help="run config (TOML): its [data], sampling, engine and reward"),
    out: Path = typer.Option(..., "--out", help="folder to write the kept rows to (datasets.save_to_disk)"),
    samples: int = typer.Option(8, "--samples", "-k", min=1, max=64, help="samples per prompt"),
    min_pass: float = typer.Option(0.0, "--min-pass", min=0.0, max=1.0,
    help="keep prompts whose pass rate is at least this"),
    max_pass: float = typer.Option(1.0, "--max-pass", min=0.0, max=1.0, help="... and at most this"),
    pass_threshold: float = typer.Option(1.0, "--pass-threshold", min=0.0, max=1.0,
    help="a sample passes when its reward is at least this"),
    model: Optional[Path] = typer.Option(None, "--model",
    help="the model to sample (default: model.path, or the run folder's base model)"),
) -> None:
    """Sample every prompt of [data] k times with the model, score the samples with the task's trusted
    reward, and keep the prompts whose pass rate lies in [--min-pass, --max-pass] (INTELLECT-2's offline
    filter). Point `[data] path` at --out to train on them. Config fields can be overridden as in `run`."""
    from orchestrator.data import DataError
    from swarmrl.config import RunConfig
    from swarmrl.loading import ConfigError, load_config
    from swarmrl.logs import configure_logging

    console = Console(stderr=True)
    try:
        cfg = load_config(config or DEFAULT_CONFIG, list(ctx.args), model=RunConfig)
    except ConfigError as exc:
        console.print(f"[red]config error:[/] {exc}")
        raise typer.Exit(2) from None
    if min_pass > max_pass:
        raise typer.BadParameter(f"--min-pass {min_pass} is above --max-pass {max_pass}", param_hint="--min-pass")
    if out.exists() and any(out.iterdir()):
        raise typer.BadParameter(f"{out} exists and is not empty", param_hint="--out")
    configure_logging(cfg.log_level)
    from swarmrl.data_filter import filter_dataset

    if model is None:
        from swarmrl.driver import ensure_model
        from swarmrl.run_dir import RunDir

        model = Path(ensure_model(cfg, RunDir(cfg.run_dir)))
    try:
        res = filter_dataset(cfg, model, out, samples, min_pass, max_pass, pass_threshold)
    except DataError as exc:
        console.print(f"[red]data error:[/] {exc}")
        raise typer.Exit(1) from None
    scored = [r for r in res.rates if r is not None]
    typer.echo(f"kept {res.kept} of {len(res.rates)} prompts (pass rate in [{min_pass}, {max_pass}]; {res.too_long} "
        f"too long); "
               f"mean pass rate {sum(scored) / max(1, len(scored)):.3f}; wrote {out}")
