"""`swarmrl verifier ...`: check a saved submission offline. (Threshold calibration is a developer tool:
`python -m tools.calibrate` in a source checkout.)"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="TOPLOC-style verifier: offline checks.", no_args_is_help=True)


@app.callback()
def main() -> None:
    """A group of commands even with one, so that the command stays `swarmrl verifier check`."""


@app.command()
def check(
    bundle: Path = typer.Argument(...,
    help='JSON: {"lease": TaskLease, "submission": RolloutSubmission, "items": [{prompt, answer}], "task": "toy"}'),
    model_dir: Path = typer.Option(...,
    help="transformers folder: weights of the claimed version, config and tokenizer"),
    dtype: str = typer.Option("float32"),
) -> None:
    """Verify one saved submission against a model folder and print the verdict."""
    from rich.console import Console

    from environments.tasks import get_task
    from protocol.models import RolloutSubmission, TaskLease
    from verifier.config import VerifierConfig
    from verifier.service import Verifier, VerifyJob

    console = Console()
    try:
        data = json.loads(bundle.read_text())
        lease = TaskLease.model_validate(data["lease"])
        sub = RolloutSubmission.model_validate(data["submission"])
        task = get_task(data.get("task", "toy"), **data.get("task_params", {}))
        items = [task.from_record(r) for r in data["items"]]
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[red]cannot read {bundle}: {exc}")
        raise typer.Exit(2) from None
    verifier = Verifier(VerifierConfig(dtype=dtype), lambda v: model_dir, model_dir)
    verdict = verifier.verify(VerifyJob(submission_id="offline-check", submission=sub, lease=lease, items=items,
                                        task_name=data.get("task", "toy"), expected_model_hash=sub.model_hash,
                                        task_params=data.get("task_params", {})))
    console.print_json(verdict.model_dump_json())
    raise typer.Exit(0 if verdict.status.value == "accepted" else 1)
