"""The `swarmrl` command line: every command of every component. Each command imports what it needs
lazily, so that a volunteer's install (`swarmrl[worker]`, no Ray, no fastapi) can run `swarmrl worker`,
which imports no orchestrator code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from swarmrl.logs import configure_logging

app = typer.Typer(
    name="swarmrl",
    help="Asynchronous, decentralized RL post-training with untrusted vLLM workers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"


def _load(config: Optional[Path], extra: list[str] | dict, model: Any = None, **kwargs):
    """Load a config (a RunConfig unless `model` says otherwise); a bad one prints which key is wrong and
    where it came from, and exits 2."""
    from swarmrl.loading import ConfigError, load_config

    if model is None:
        from swarmrl.config import RunConfig

        model = RunConfig
        if config is None:
            config = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    try:
        return load_config(config, extra, model=model, **kwargs)
    except ConfigError as exc:
        console.print(f"[red]config error:[/] {exc}")
        raise typer.Exit(2) from None


def _print_config(cfg) -> None:
    from swarmrl.loading import dump_toml

    sys.stdout.write(dump_toml(cfg))


@app.command(context_settings=OVERRIDES)
def run(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="run config (TOML); default configs/demo.toml"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster address; default: local Ray"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and exit"),
) -> None:
    """Run the whole loop: Ray, orchestrator, verifiers, trainer, shardcast and local workers.

    Any config field can be overridden: --trainer.lr 1e-6 --orchestrator.async_level 0
    """
    extra = list(ctx.args) + ([f"--ray_address={ray_address}"] if ray_address else [])
    cfg = _load(config, extra)
    if dry_run:
        _print_config(cfg)
        return
    configure_logging(cfg.log_level)
    from swarmrl.driver import run as run_loop

    raise typer.Exit(run_loop(cfg))


@app.command(context_settings=OVERRIDES)
def orchestrator(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="run config (TOML); default configs/demo.toml"),
    origin_url: list[str] = typer.Option([], "--origin-url",
    help="shardcast server(s) the verifiers pull weights from"),
    public_key: str = typer.Option("", "--public-key", help="the run's manifest public key (base64)"),
    relay_url: list[str] = typer.Option([], "--relay-url", help="relays that workers are told to pull from"),
    run_id: str = typer.Option("", "--run-id",
    help="the run id the origin signs into manifests (default: shardcast.run_id)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and exit"),
) -> None:
    """Serve the orchestrator's HTTP API on its own (with a Ray verifier pool), until SIGTERM.

    `swarmrl run` starts it together with everything else; this is for deployments that run the
    trainer and shardcast origin separately.
    """
    cfg = _load(config, list(ctx.args))
    if dry_run:
        _print_config(cfg)
        return
    if not origin_url:
        raise typer.BadParameter("at least one --origin-url is needed for the verifiers' weights",
            param_hint="--origin-url")
    run_id = run_id or cfg.shardcast.run_id
    if not run_id:
        raise typer.BadParameter("the run id is needed (the origin signs it into every manifest): --run-id or "
            "--shardcast.run_id", param_hint="--run-id")
    cfg = cfg.model_copy(update={"shardcast": cfg.shardcast.model_copy(update={"run_id": run_id})})
    configure_logging(cfg.log_level)
    from orchestrator.server import OrchestratorServer
    from swarmrl.actors import RayVerifierPool, ShardcastWeights, build_orchestrator, init_ray
    from swarmrl.run_dir import RunDir

    # The verifier pool's actors pull each claimed version's weights from the shardcast servers.
    init_ray(cfg.ray_address)
    weights = ShardcastWeights(origin_url, public_key, str(RunDir(cfg.run_dir).verifier_weights), run_id,
                               max(cfg.verifier.versions_on_disk, cfg.verifier.keep_versions))
    pool = RayVerifierPool.start(cfg.verifier, weights, str(Path(cfg.model.path) if cfg.model.path
        else RunDir(cfg.run_dir).model_dir))
    try:
        orch = build_orchestrator(cfg, pool, relay_urls=relay_url or origin_url, manifest_public_key=public_key,
            origin_url=origin_url[0])
        OrchestratorServer(orch).run()
    finally:
        pool.shutdown()


@app.command()
def status(
    orchestrator_url: str = typer.Option("http://127.0.0.1:8000", "--orchestrator", help="orchestrator base URL"),
    admin_token: str = typer.Option(..., "--admin-token", envvar="SWARMRL_ADMIN_TOKEN", help="the run's admin token"),
    as_json: bool = typer.Option(False, "--json", help="print the raw status JSON"),
) -> None:
    """Show a running run's status (step, version, throughput, acceptance, staleness, workers) and each
    identity's credit (accepted submissions and verified tokens by join token)."""
    from swarmrl.status_view import fetch_status, fetch_workers, render_credit, render_status

    try:
        st = fetch_status(orchestrator_url, admin_token)
        workers = None if as_json else fetch_workers(orchestrator_url, admin_token)
    except Exception as exc:  # connection refused, 401, ...: say it plainly
        console.print(f"[red]cannot get status from {orchestrator_url}:[/] {exc}")
        raise typer.Exit(1)
    if as_json:
        sys.stdout.write(st.model_dump_json(indent=2) + "\n")
    else:
        render_status(st)
        render_credit(workers)


@app.command(context_settings=OVERRIDES)
def worker(
    ctx: typer.Context,
    orchestrator_url: str = typer.Option(..., "--orchestrator",
    help="orchestrator base URL, e.g. https://run.example.org"),
    join_token: str = typer.Option(
        "", "--join-token", envvar="SWARMRL_JOIN_TOKEN",
        help="join token from the run's operator; none: claim one by open join, where the run allows it",
    ),
    name: Optional[str] = typer.Option(None, "--name", help="a name for this worker (letters, digits, ._@-)"),
    model: Optional[str] = typer.Option(None, "--model", help="base model folder or hub id (config + tokenizer)"),
    work_dir: Optional[str] = typer.Option(None, "--work-dir", help="where downloaded weights go"),
    display: Optional[bool] = typer.Option(None, "--display/--no-display",
    help="rich live panel (default: on a terminal)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="worker config (TOML of the [worker] fields)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and exit"),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Join a run as an inference worker: register, pull weights, then lease, generate and submit.

    Any worker config field can be overridden: --engine.dtype bfloat16 --max_prompts_per_lease 4.
    SIGTERM or Ctrl-C finishes the current task and exits; a second one releases it and exits.
    """
    from inference_worker.config import WorkerConfig
    from swarmrl.loading import ConfigError, parse_overrides

    try:
        overrides: dict = parse_overrides(list(ctx.args))
    except ConfigError as exc:
        console.print(f"[red]config error:[/] {exc}")
        raise typer.Exit(2) from None
    overrides.update(orchestrator_url=orchestrator_url)
    if join_token:
        overrides["join_token"] = join_token
    for key, value in (("name", name), ("model", model), ("work_dir", work_dir), ("display", display)):
        if value is not None:
            overrides[key] = value
    cfg = _load(config, overrides, model=WorkerConfig, env_prefix="SWARMRL_WORKER__")
    if dry_run:
        sys.stdout.write(cfg.model_dump_json(indent=2) + "\n")
        return
    configure_logging(log_level)
    if cfg.work_dir:
        from shardcast.store import FolderInUse, lock_folder

        try:
            lock_folder(Path(cfg.work_dir), cfg.work_dir_wait_s, "worker")
        except FolderInUse as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from None
    from inference_worker.loop import EXIT_REFUSED, run_worker

    if cfg.join_token.get_secret_value():
        raise typer.Exit(run_worker(cfg))
    from inference_worker import open_join

    try:
        code = open_join.run(cfg, run_worker, EXIT_REFUSED)
    except open_join.OpenJoinFailed as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(EXIT_REFUSED) from None
    raise typer.Exit(code)


@app.command("eval", context_settings=OVERRIDES)
def eval_(
    ctx: typer.Context,
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", exists=True, file_okay=False,
        help="a trainer checkpoint, a run folder (its latest checkpoint), a transformers folder, or a published "
        "version folder (with --base-model)",
    ),
    samples: Optional[int] = typer.Option(None, "--samples", "-k", min=1, max=64,
    help="samples per prompt; default eval.samples_per_prompt or the run's group size"),
    data: Optional[Path] = typer.Option(None, "--data", exists=True,
    help="JSONL or datasets folder of prompts (the task's format); default: the run's held-out prompts"),
    config: Optional[Path] = typer.Option(None, "--config", "-c",
    help="run config (TOML) for the task, reward, sampling and held-out split; default configs/demo.toml"),
    base_model: Optional[Path] = typer.Option(None, "--base-model",
    help="config and tokenizer for a folder of weights only"),
    num_prompts: int = typer.Option(0, "--num-prompts", min=0, help="evaluate at most this many prompts (0: all)"),
    seed: int = typer.Option(0, "--seed", help="the sampling seeds: the same seed draws the same samples"),
    out: Path = typer.Option(Path("eval_result.json"), "--out", help="where the JSON result is written"),
) -> None:
    """Evaluate a model on held-out prompts on this machine: avg@k, pass@k (unbiased estimator) and mean
    completion length, with the workers' vLLM engine and the task's trusted reward. Prints and writes JSON.

    Config fields can be overridden as for `run`: --orchestrator.sampling.max_tokens 8
    """
    import json
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON result only
    cfg = _load(config, list(ctx.args))
    configure_logging(cfg.log_level)
    from swarmrl.offline_eval import evaluate

    k = samples or cfg.eval.samples_per_prompt or cfg.orchestrator.samples_per_prompt
    try:
        result, info = evaluate(cfg, checkpoint, samples=k, data=data, base_model=base_model, num_prompts=num_prompts,
            seed=seed)
    except (ValueError, FileNotFoundError) as exc:  # a folder that is not a model, prompts that cannot be loaded
        console.print(f"[red]cannot evaluate:[/] {exc}")
        raise typer.Exit(2) from None
    text = json.dumps({**result.model_dump(), **info}, indent=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    sys.stdout.write(text + "\n")


@app.command("init-model")
def init_model(
    out: Path = typer.Option(..., "--out", help="folder to write the model and tokenizer to"),
    arch: Optional[str] = typer.Option(
        None, "--arch",
        help="a real architecture (qwen2.5-0.5b | qwen3-0.6b | llama-3.2-1b) with a BPE tokenizer; default: the toy "
        "--size model"
    ),
    size: Optional[str] = typer.Option(None, "--size",
    help="the toy model: tiny | small (default tiny; not with --arch)"),
    seed: int = typer.Option(0, "--seed"),
    tie_embeddings: bool = typer.Option(True, "--tie-embeddings/--no-tie-embeddings"),
    untied: bool = typer.Option(False, "--untied", help="a separate LM head (as --no-tie-embeddings)"),
    layers: Optional[int] = typer.Option(None, "--layers", min=1,
    help="with --arch: fewer layers than the real model (tests)"),
    hidden: Optional[int] = typer.Option(None, "--hidden", min=32,
    help="with --arch: a narrower model, same architecture and vocabulary (tests)"),
    intermediate: Optional[int] = typer.Option(None, "--intermediate", min=1,
    help="with --arch: the MLP width (default: scaled with --hidden)"),
    pretrain_steps: Optional[int] = typer.Option(
        None, "--pretrain-steps", min=0,
        help="short base-model pretraining: echo data for --size (default 0), corpus text for --arch "
        "(default 2 steps of 8 x 128 tokens, ~100 s each at the real 0.6B shape on 2 CPU cores)",
    ),
    pretrain_target: Optional[float] = typer.Option(
        None, "--pretrain-target", min=0.0, max=1.0,
        help="then pretrain on until this echo accuracy (checked every 10 steps; --size only)"
    ),
    pretrain_max_steps: int = typer.Option(0, "--pretrain-max-steps", min=0,
    help="cap on the steps with --pretrain-target"),
    tokenizer_cache: Optional[Path] = typer.Option(
        None, "--tokenizer-cache",
        help="with --arch: where trained tokenizers are cached (default $SWARMRL_CACHE_DIR or ~/.cache/swarmrl)"
    ),
) -> None:
    """Write a model and tokenizer made locally (no hub): the toy Qwen2 (--size), or a real architecture at
    its real shape (--arch), random weights and optionally a short pretraining."""
    import json

    tied = tie_embeddings and not untied
    if arch is None:
        from trainer.tiny_model import SIZES
        from trainer.tiny_model import init_model as make

        size = size or "tiny"
        if size not in SIZES:
            raise typer.BadParameter(f"choose one of {', '.join(SIZES)}", param_hint="--size")
        if layers is not None or hidden is not None or intermediate is not None or tokenizer_cache is not None:
            raise typer.BadParameter("--layers, --hidden, --intermediate and --tokenizer-cache go with --arch",
                param_hint="--arch")
        # type: ignore[arg-type]
        path = make(out, size, seed, tied, pretrain_steps or 0, pretrain_target, pretrain_max_steps)
        steps = json.loads((path / "swarmrl_model.json").read_text())["pretrain_steps"]
        console.print(f"wrote a {size} model (seed {seed}, tied={tied}, pretrain steps {steps}) to {path}")
        return

    from trainer.model_shapes import DEFAULT_PRETRAIN_STEPS, PRESETS
    from trainer.model_shapes import init_model as make_arch

    if arch not in PRESETS:
        raise typer.BadParameter(f"choose one of {', '.join(PRESETS)}", param_hint="--arch")
    if size is not None or pretrain_target is not None or pretrain_max_steps:
        raise typer.BadParameter("--size, --pretrain-target and --pretrain-max-steps are for the toy model",
            param_hint="--arch")
    steps = DEFAULT_PRETRAIN_STEPS if pretrain_steps is None else pretrain_steps
    try:
        path = make_arch(out, arch, seed, not tied, layers, hidden, intermediate, steps, tokenizer_cache)
    except ValueError as exc:  # a shape the architecture cannot take
        raise typer.BadParameter(str(exc), param_hint="--hidden") from None
    info = json.loads((path / "swarmrl_model.json").read_text())
    loss = f", final loss {info['pretrain_final_loss']:.3f}" if steps else ""
    console.print(f"wrote {arch} ({info['parameters']:,} parameters, tied={tied}, pretrain steps {steps}{loss}) to "
        f"{path}")


def _add_component_clis() -> None:
    """The commands of each component, mounted as subcommands (each imports its heavy modules lazily)."""
    from swarmrl.data_cli import app as data_app
    from swarmrl.shardcast_cli import app as shardcast_app
    from swarmrl.trainer_cli import app as trainer_app
    from swarmrl.verifier_cli import app as verifier_app

    app.add_typer(data_app, name="data")
    app.add_typer(shardcast_app, name="shardcast")
    app.add_typer(trainer_app, name="trainer")
    app.add_typer(verifier_app, name="verifier")


_add_component_clis()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
