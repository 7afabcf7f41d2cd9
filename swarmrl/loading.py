"""Config loading for every `swarmrl` command: a pydantic model from TOML, the environment and
command-line overrides.

Sources, lowest to highest precedence: model defaults < TOML file < SWARMRL_* environment variables
(nested with `__`, e.g. SWARMRL_ORCHESTRATOR__ADMIN_TOKEN, for secrets injected by Kubernetes) <
command-line overrides (`--trainer.lr 1e-6`). Imports no package of ours, so `swarmrl worker` can use it
without the trusted side's code.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

ENV_PREFIX = "SWARMRL_"


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
    model: type[BaseModel],
    env_prefix: str = ENV_PREFIX,
) -> Any:
    """Load a config model (e.g. swarmrl.config.RunConfig) from TOML, the environment and command-line overrides.

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


def dump_toml(config: BaseModel) -> str:
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
