"""`swarmrl verifier ...`: calibrate thresholds on honest vLLM runs, check a saved submission."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="TOPLOC-style verifier: calibration, attack matrix, offline checks.", no_args_is_help=True)


def _calibration_tools():
    """Calibration is a developer tool (tools/ in a source checkout), not part of the installed package."""
    import sys

    root = Path(__file__).resolve().parent.parent
    if not (root / "tools" / "verifier_calibration.py").is_file():
        raise typer.BadParameter("calibration needs a source checkout of swarmrl (its tools/ folder); install with `pip install -e .`")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tools.verifier_calibration import run_matrix, table_markdown, write_results

    return run_matrix, table_markdown, write_results


@app.command()
def calibrate(
    out: Path = typer.Option(Path("bench/results"), help="where verifier_attacks_<tag>.{md,json} go"),
    workdir: Path = typer.Option(None, help="scratch folder for models (default: a temporary one)"),
    base_model: Path = typer.Option(..., "--base-model", help="the model to calibrate on (e.g. made by `swarmrl init-model`)"),
    trials: int = typer.Option(64, min=1, help="trials per attack"),
    honest_scale: int = typer.Option(1, min=1, help="multiplies the honest completions per setting (104 per dtype at 1)"),
    tag: str = typer.Option("calibration"),
) -> None:
    """Run honest vLLM-vs-transformers rollouts (fp32, bf16) and every attack; write the table."""
    import os
    import tempfile

    from rich.console import Console

    from swarmrl.logs import configure_logging

    configure_logging("WARNING")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run_matrix, table_markdown, write_results = _calibration_tools()

    counts = {"long_t1_b32": 32, "long_t0.7_p0.9_k20_b32": 32, "short_t1_b32": 32, "mixed_b1": 6, "greedy_b1": 2}
    counts = {k: v * honest_scale for k, v in counts.items()}
    with tempfile.TemporaryDirectory(prefix="swarmrl-calib-") as tmp:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "vllm-cache"))
        result = run_matrix(workdir or Path(tmp), base_model, trials=trials, honest_counts=counts, stale_lrs=(1e-5, 1e-4, 1e-3))
    path = write_results(result, out, tag, {"base_model": str(base_model), "trials": trials, "honest": counts})
    console = Console()
    console.print(table_markdown(result))
    console.print(json.dumps(result.honest_stats, indent=1))
    console.print(f"wrote {path}")


@app.command()
def check(
    bundle: Path = typer.Argument(..., help='JSON: {"lease": TaskLease, "submission": RolloutSubmission, "items": [{prompt, answer}], "task": "toy"}'),
    model_dir: Path = typer.Option(..., help="transformers folder: weights of the claimed version, config and tokenizer"),
    dtype: str = typer.Option("float32"),
) -> None:
    """Verify one saved submission against a model folder and print the verdict."""
    from rich.console import Console

    from protocol.models import RolloutSubmission, TaskLease
    from verifier.config import VerifierConfig
    from verifier.service import Verifier, VerifyJob
    from verifier.tasks import get_task

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
