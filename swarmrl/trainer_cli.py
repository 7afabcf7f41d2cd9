"""`swarmrl trainer checkpoints|inspect|export`: look into and export trainer checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(name="trainer", help="Trainer checkpoints: list, inspect, export.", no_args_is_help=True,
    add_completion=False)


def _resolve(path: Path) -> Path:
    """A checkpoint folder, or a run folder / checkpoints folder (then its latest checkpoint)."""
    from trainer.checkpoint import checkpoint_root, latest_checkpoint

    if (path / "trainer_state.json").is_file():
        return path
    for root in (checkpoint_root(path), path):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise typer.BadParameter(f"{path} is neither a checkpoint nor a folder holding checkpoints")


@app.command()
def checkpoints(run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="a run folder")) -> None:
    """List the complete checkpoints of a run, oldest first."""
    from rich.console import Console
    from rich.table import Table

    from trainer.checkpoint import checkpoint_root, list_checkpoints

    root = checkpoint_root(run_dir)
    table = Table("checkpoint", "step", "published version", title=str(root))
    for path in list_checkpoints(root):
        state = json.loads((path / "trainer_state.json").read_text())
        table.add_row(path.name, str(state["step"]), str(state["published_version"]))
    Console().print(table)


@app.command()
def inspect(
    checkpoint: Path = typer.Argument(..., exists=True, file_okay=False, help="a checkpoint, or a run folder (latest)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Show a checkpoint's step, data cursor, and model tensors."""
    from safetensors import safe_open

    from trainer.checkpoint import MODEL_FILE

    path = _resolve(checkpoint)
    state = json.loads((path / "trainer_state.json").read_text())
    params = 0
    tensors = 0
    with safe_open(str(path / "model" / MODEL_FILE), framework="pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            n = 1
            for d in shape:
                n *= d
            params += n
            tensors += 1
    info = {"checkpoint": str(path), **state, "tensors": tensors, "parameters": params}
    if as_json:
        typer.echo(json.dumps(info))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("field", "value", title=str(path))
    for k, v in info.items():
        table.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    Console().print(table)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., exists=True, file_okay=False, help="a checkpoint, or a run folder (latest)"),
    out: Path = typer.Argument(..., help="new folder for the transformers model"),
) -> None:
    """Export a checkpoint's model as a plain transformers folder (from_pretrained loads it)."""
    from trainer.checkpoint import export_checkpoint

    path = _resolve(checkpoint)
    try:
        export_checkpoint(path, out)
    except (FileExistsError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from e
    typer.echo(json.dumps({"exported": str(out), "from": str(path)}))
