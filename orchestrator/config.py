"""One run, one config: the RunConfig composes every component's config model.

Sources, lowest to highest precedence: model defaults < TOML file < SWARMRL_* environment variables
(nested with `__`, e.g. SWARMRL_ORCHESTRATOR__ADMIN_TOKEN, for secrets injected by Kubernetes) <
command-line overrides (`--trainer.lr 1e-6`).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inference_worker.config import WorkerConfig
from protocol.models import SamplingParams
from shardcast.config import ShardcastConfig
from trainer.config import TrainerConfig
from verifier.config import VerifierConfig

ENV_PREFIX = "SWARMRL_"


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field("", description="a transformers model folder; empty: make a tiny one in the run folder")
    init_size: Literal["tiny", "small"] = "tiny"
    init_seed: int = 0
    tie_embeddings: bool = True
    init_pretrain_steps: int = Field(
        0, ge=0, description="short base-model pretraining of the made model (trainer.tiny_model.pretrain_corpus)"
    )


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field("toy", description="task in verifier's registry that scores completions")
    path: str = Field("", description="JSONL or datasets folder; empty: generate the task's synthetic prompts")
    num_prompts: int = Field(4096, ge=1, description="synthetic prompts to generate")
    pass_rate_column: str = "pass_rate"
    min_pass_rate: float | None = Field(None, ge=0, le=1, description="offline difficulty filter")
    max_pass_rate: float | None = Field(None, ge=0, le=1)
    task_params: dict[str, Any] = {}


class OrchestratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    async_level: int = Field(2, ge=0, description="generation for step N may use any version >= N - async_level")
    samples_per_prompt: int = Field(8, ge=1, description="GRPO group size")
    prompts_per_lease: int = Field(4, ge=1)
    sampling: SamplingParams = SamplingParams()
    lease_timeout_s: float = Field(60.0, gt=0)
    max_open_leases_per_worker: int = Field(2, ge=1)
    rate_limit_per_s: float = Field(50.0, gt=0, description="requests per second per worker")
    strikes_to_ban: int = Field(3, ge=1)
    heartbeat_interval_s: float = Field(5.0, gt=0)
    worker_dead_after_s: float = Field(30.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    join_tokens: list[str] = Field(default_factory=lambda: ["demo-join-token"])
    admin_token: str = "demo-admin-token"
    db_path: str = Field("", description="SQLite file; default <run dir>/orchestrator.sqlite")


class ResourcesConfig(BaseModel):
    """Ray resources of the trusted actors (GPUs on a cluster; 0 on a laptop)."""

    model_config = ConfigDict(extra="forbid")

    trainer_gpus: float = Field(0.0, ge=0)
    verifier_gpus: float = Field(0.0, ge=0)
    trainer_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. {trainer = 1} to land on the trainer group")
    verifier_resources: dict[str, float] = Field(default_factory=dict)
    max_restarts: int = Field(3, ge=0, description="times Ray restarts a crashed trainer or verifier actor")
    cpu_affinity: dict[Literal["workers", "trainer", "verifier", "orchestrator", "relays"], list[int]] = Field(
        default_factory=dict,
        description="pin local components to CPU cores, e.g. {workers = [0], trainer = [1]}: one machine standing in for several",
    )


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("demo", pattern=r"^[\w.-]+$")
    seed: int = 0
    output_dir: str = "runs"
    ray_address: str = Field("", description="empty: start a local Ray")
    num_workers: int = Field(1, ge=0, description="local inference workers started by `swarmrl run`")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    max_minutes: float = Field(0.0, ge=0, description="stop after this much wall time; 0: no limit")
    stop_reward: float | None = Field(
        None, description="stop once the mean reward of the accepted rollouts stays at or above this for 5 steps"
    )
    resources: ResourcesConfig = ResourcesConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    verifier: VerifierConfig = VerifierConfig()
    trainer: TrainerConfig = TrainerConfig()
    shardcast: ShardcastConfig = ShardcastConfig()
    worker: WorkerConfig = WorkerConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @model_validator(mode="after")
    def _whole_groups_per_step(self) -> "RunConfig":
        # The buffer hands out whole GRPO groups; a step of a fraction of a group would leave it short.
        if self.trainer.samples_per_step % self.orchestrator.samples_per_prompt:
            raise ValueError(
                f"trainer.samples_per_step ({self.trainer.samples_per_step}) must be a multiple of "
                f"orchestrator.samples_per_prompt, the group size ({self.orchestrator.samples_per_prompt})"
            )
        return self


class ConfigError(ValueError):
    """A config that cannot be loaded. The message names the key and where it came from."""


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`["--trainer.lr", "1e-6", "--orchestrator.async_level=0"]` -> {"trainer.lr": "1e-6", ...}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            value = args[i + 1]
            i += 1
        out[key.replace("-", "_")] = value
        i += 1
    return out


def _coerce(text: str) -> Any:
    """Override values are strings; JSON-looking ones (lists, objects) are parsed, `null` is None (which
    TOML cannot say), the rest is left to pydantic."""
    if text == "null":
        return None
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _env_overrides(environ: dict[str, str], prefix: str, fields: Any) -> dict[str, str]:
    out = {}
    for key, value in environ.items():
        if key.startswith(prefix):
            dotted = key[len(prefix):].lower().replace("__", ".")
            if dotted.split(".")[0] in fields:
                out[dotted] = value
    return out


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, str] | list[str] | None = None,
    environ: dict[str, str] | None = None,
    *,
    model: type[BaseModel] = RunConfig,
    env_prefix: str = ENV_PREFIX,
) -> Any:
    """Load a config model (a RunConfig by default) from TOML, the environment and command-line overrides.

    `swarmrl worker` loads a WorkerConfig the same way, with env_prefix SWARMRL_WORKER__.
    """
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}  # dotted key -> where its value came from
    source = str(path) if path else "<defaults>"
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    env = _env_overrides(dict(os.environ if environ is None else environ), env_prefix, model.model_fields)
    for key, value in env.items():
        _set_path(data, key, _coerce(value))
        origin[key] = f"environment variable {env_prefix}{key.upper().replace('.', '__')}"
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for key, value in (overrides or {}).items():
        _set_path(data, key, value if not isinstance(value, str) else _coerce(value))
        origin[key] = f"command-line override --{key}"
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            where = next((o for k, o in origin.items() if key == k or key.startswith(k + ".")), source)
            if err["type"] == "extra_forbidden":
                lines.append(f"unknown key '{key}' (in {where})")
            else:
                lines.append(f"'{key}': {err['msg']} (got {err.get('input')!r}, in {where})")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def dump_toml(config: RunConfig) -> str:
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
