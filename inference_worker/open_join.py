"""Open join, on the worker's side: with no join token, claim one from an orchestrator that allows it by
solving its puzzle (protocol/join_puzzle.py), keep it, and join with the kept one on every later start.

The kept tokens are a JSON file mapping orchestrator URLs to tokens, readable by its owner only (a token is a
credential). A claimed token holds one live worker: give each worker its own work_dir (or join_token_file).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from pydantic import SecretStr, ValidationError

from inference_worker import client as c
from inference_worker.config import WorkerConfig
from protocol.join_puzzle import solve
from protocol.models import WorkerRegistration

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "open-join-token.json"
# A challenge that expires before it is solved (a slow machine) is replaced, at most this many times.
MAX_CHALLENGES = 3


class OpenJoinFailed(Exception):
    """No token could be claimed: the run has no open join, its limits refuse us for now, or it is unreachable."""


def token_file(cfg: WorkerConfig) -> Path:
    if cfg.join_token_file:
        return Path(cfg.join_token_file).expanduser()
    return (Path(cfg.work_dir) if cfg.work_dir else Path.home() / ".swarmrl") / TOKEN_FILE_NAME


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def kept_token(path: Path, url: str) -> str | None:
    return _read(path).get(url) or None


def keep_token(path: Path, url: str, token: str | None) -> None:
    """Keep (or, with None, forget) the token for this orchestrator; written whole, then renamed."""
    data = _read(path)
    if token is None:
        data.pop(url, None)
    else:
        data[url] = token
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def claim(client: c.OrchestratorClient) -> tuple[str, int, float]:
    """A new token for a solved puzzle: (token, hashes tried, CPU seconds spent solving)."""
    for _ in range(MAX_CHALLENGES):
        puzzle = client.join_challenge()
        cpu = time.process_time()
        solved = solve(puzzle.challenge, puzzle.difficulty_bits, deadline=time.monotonic() + 0.9 * puzzle.expires_in_s)
        cpu = time.process_time() - cpu
        if solved is None:
            log.warning("the open-join puzzle (%d bits) expired before it was solved; asking for another",
                        puzzle.difficulty_bits)
            continue
        solution, hashes = solved
        return client.join_claim(puzzle.challenge, solution).token, hashes, cpu
    raise OpenJoinFailed(f"{MAX_CHALLENGES} open-join puzzles expired before this machine solved them")


def join_token(cfg: WorkerConfig) -> tuple[str, bool]:
    """(the token to join with, whether it was kept from before): the one kept for this orchestrator, or a
    new claim, which is then kept."""
    url, path = cfg.orchestrator_url.rstrip("/"), token_file(cfg)
    token = kept_token(path, url)
    if token:
        log.info("joining with the open-join token kept in %s", path)
        return token, True
    started = time.monotonic()
    try:
        with c.OrchestratorClient(url, retries=cfg.retries, timeout_s=cfg.request_timeout_s,
                                  backoff_initial_s=cfg.backoff_initial_s, backoff_max_s=cfg.backoff_max_s) as client:
            token, hashes, cpu = claim(client)
    except c.Forbidden as exc:
        raise OpenJoinFailed(f"{url} refused open join: {exc.body.detail} (without it, pass --join-token)") from None
    except c.RateLimited as exc:
        raise OpenJoinFailed(f"{url} refuses open-join claims for now ({exc.body.detail}); try again in "
                             f"{exc.retry_after_s or 60:.0f} s") from None
    except (c.OrchestratorError, c.OrchestratorUnavailable) as exc:
        raise OpenJoinFailed(f"could not claim a join token from {url}: {exc}") from None
    try:
        keep_token(path, url, token)
    except OSError as exc:  # a read-only home, say: this start still joins; the next one claims again
        log.warning("could not keep the claimed join token in %s: %s", path, exc)
    log.info("claimed a join token by open join in %.1f s (%d hashes, %.1f CPU s); kept in %s",
             time.monotonic() - started, hashes, cpu, path)
    return token, False


def run(cfg: WorkerConfig, run_worker: Callable[[WorkerConfig], int], refused_code: int) -> int:
    """`run_worker` with a token claimed by open join (or kept from an earlier claim). A kept token the
    orchestrator refuses (`refused_code`: a new run at the same address, say) is forgotten and claimed anew, once."""
    try:
        WorkerRegistration(name=cfg.name)  # a bad name would be refused too: found before a claim is spent on it
    except ValidationError as exc:
        raise OpenJoinFailed(f"invalid worker name {cfg.name!r}: {exc.errors()[0]['msg']}") from None
    token, kept = join_token(cfg)
    code = run_worker(cfg.model_copy(update={"join_token": SecretStr(token)}))
    if code == refused_code and kept:
        log.warning("the orchestrator refused the kept open-join token; claiming a new one")
        keep_token(token_file(cfg), cfg.orchestrator_url.rstrip("/"), None)
        token, _ = join_token(cfg)
        code = run_worker(cfg.model_copy(update={"join_token": SecretStr(token)}))
    return code
