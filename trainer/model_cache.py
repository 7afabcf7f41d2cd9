"""Base models made once per machine.

`tiny_model.init_model` is deterministic for its arguments, and its echo pretraining takes 10-60 s on 2
cores; every test process and every run that makes the same model paid for it again. A made model is kept
in the cache folder, keyed by its arguments and by the source code and library versions that make it, and
copied for the next caller. `SWARMRL_MODEL_CACHE` names the folder (default ~/.cache/swarmrl/models);
`off` disables the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

COMPLETE = ".complete"  # written last: an entry without it is a copy that was cut short


def cache_root() -> Path | None:
    value = os.environ.get("SWARMRL_MODEL_CACHE", "")
    if value.lower() == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "swarmrl" / "models"


def cache_key(maker: str, args: dict[str, Any], sources: list[Path]) -> str:
    import torch
    import transformers

    h = hashlib.sha256(json.dumps({"maker": maker, "args": args, "torch": torch.__version__,
                                   "transformers": transformers.__version__}, sort_keys=True).encode())
    for path in sources:
        h.update(path.read_bytes())
    return f"{maker}-{h.hexdigest()[:20]}"


def cached_model(out: Path, key: str, make: Callable[[Path], Path]) -> Path:
    """`make(out)`, or a copy of what an earlier identical call made."""
    root = cache_root()
    if root is None:
        return make(out)
    entry = root / key
    if (entry / COMPLETE).is_file():
        shutil.copytree(entry, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(COMPLETE))
        return out
    make(out)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(out, tmp)
        (tmp / COMPLETE).touch()
        if entry.exists() and not (entry / COMPLETE).is_file():
            shutil.rmtree(entry)  # damaged by hand: entries only ever appear whole
        os.rename(tmp, entry)  # atomic; fails if another process filled the entry first, which is as good
    except OSError:
        shutil.rmtree(root / f".{key}.{os.getpid()}.tmp", ignore_errors=True)
    return out
