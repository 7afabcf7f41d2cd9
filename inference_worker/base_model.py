"""A worker with no `--model` takes the base model's config and tokenizer from the run (GET /v1/model/files).

The files go to `<work_dir>/base-model`, each checked against the size and sha256 the run listed, written whole
and renamed; a file already there with the listed digest is kept (a restarted worker fetches nothing), and one the
run does not list is removed. The folder holds no weights: the engine starts from it with vLLM's dummy weights, and
the first policy version, pulled from shardcast and checked against its signed hash, replaces every one of them
before any lease is served.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from inference_worker import client as c

log = logging.getLogger(__name__)

FOLDER_NAME = "base-model"


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def fetch_base_model(client: c.OrchestratorClient, work_dir: Path) -> Path | None:
    """The run's base model files in `work_dir/base-model`; None when the run serves none (an orchestrator
    without a base model folder, or an older one). Raises the client's errors, and OrchestratorUnavailable
    for a file that does not match its listing."""
    try:
        listing = client.model_files()
    except c.NotFound:  # an orchestrator from before this endpoint
        return None
    if not any(f.name == "config.json" for f in listing.files):
        return None
    dest = work_dir / FOLDER_NAME
    dest.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for f in listing.files:
        path = dest / f.name  # the name's pattern (protocol.models.ModelFile) has no "/" and no leading "."
        if _sha256(path) == f.sha256:
            continue
        data = client.model_file(f.name)
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise c.OrchestratorUnavailable(f"the run's model file {f.name} does not match its listing "
                                            f"({len(data)} bytes, {f.size} listed)")
        tmp = path.with_name(f".{f.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        fetched += 1
    # Nothing else is left for the engine: a folder that served another run keeps that model's files otherwise
    # (a stale generation_config.json or added_tokens.json would be read as this run's), or a write cut short.
    listed = {f.name for f in listing.files}
    for stale in dest.iterdir():
        if stale.name not in listed and (stale.is_symlink() or stale.is_file()):
            stale.unlink()
    log.info("base model config and tokenizer from the run: %d files in %s (%d fetched)", len(listing.files), dest,
             fetched)
    return dest
