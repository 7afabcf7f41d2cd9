"""The run's base model without its weights: config and tokenizer files, served to registered workers.

A worker needs them to build its engine (architecture, vocabulary, chat template); the weights then come from
shardcast. Served by the run itself, a volunteer needs no model hub and no `--model` that could name another
revision with another tokenizer (whose token ids the verifier would reject). Only the names below are served, each
capped; the list gives every file's size and sha256, so the worker checks what it got.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from orchestrator.admission import RateLimiter
from orchestrator.errors import ApiError
from protocol.models import ErrorCode, ModelFile, ModelFiles

# What transformers and vLLM read besides weights. A file not named here is never served.
SERVED_NAMES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json",
)
# The largest tokenizer among the families people train (Gemma's tokenizer.json) is ~33 MB.
MAX_FILE_BYTES = 64 << 20
# A worker fetches the files once per start (and keeps them): each identity may download this many times their
# total, so that many identities asking for a 33 MB tokenizer at the request rate cannot flood the API's uplink.
DOWNLOADS_PER_IDENTITY = 3
# A new identity is a new allowance, and a token's worker may leave and register again at the token's registration
# rate: the identities of a join token together also draw on the token's, DOWNLOADS_PER_IDENTITY totals per
# identity it may hold, refilled at that many per hour.
TOKEN_REFILL_S = 3600.0


class BaseModelFiles:
    """The served files of `model_dir`, read once (a running run's base model does not change)."""

    def __init__(self, model_dir: Path | None):
        self.model_dir = model_dir
        self._files: dict[str, bytes] | None = None
        self._listing = ModelFiles(files=[])
        self._lock = threading.Lock()
        self._served: dict[str, int] = {}  # worker id -> bytes of model files sent to it
        # join token -> totals downloaded by its identities, per identity it may hold (a token bucket)
        self._per_token = RateLimiter(DOWNLOADS_PER_IDENTITY / TOKEN_REFILL_S, burst=DOWNLOADS_PER_IDENTITY)

    def _load(self) -> dict[str, bytes]:
        with self._lock:
            if self._files is None:
                files: dict[str, bytes] = {}
                for name in SERVED_NAMES if self.model_dir is not None else ():
                    path = self.model_dir / name
                    if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
                        files[name] = path.read_bytes()
                if self.model_dir is not None and "config.json" not in files:
                    return {}  # not made yet (the driver makes the base model before serving): ask again later
                self._listing = ModelFiles(files=[ModelFile(name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest())
                                                  for n, b in files.items()])
                self._files = files
            return self._files

    def listing(self) -> ModelFiles:
        """Every served file with its size and sha256; empty when the run has no base model folder here."""
        self._load()
        return self._listing

    def read(self, name: str, worker_id: str, token_id: str | None = None, token_identities: int = 1) -> bytes:
        """One file for `worker_id`, an identity of `token_id` (which may hold `token_identities` live ones)."""
        files = self._load()
        data = files.get(name)
        if data is None:
            raise ApiError(ErrorCode.not_found, f"the run serves no model file {name!r}")
        total = sum(map(len, files.values()))
        served = self._served.get(worker_id, 0) + len(data)
        if served > DOWNLOADS_PER_IDENTITY * total:
            raise ApiError(ErrorCode.rate_limited, f"this worker has downloaded the model files "
                           f"{DOWNLOADS_PER_IDENTITY} times already; keep them in its work folder",
                           retry_after_s=3600.0)
        if token_id is not None and data:
            try:
                self._per_token.check(token_id, cost=len(data) / total / max(1, token_identities))
            except ApiError as exc:
                raise ApiError(ErrorCode.rate_limited, f"the workers of join token {token_id} have downloaded the "
                               "model files too often; keep them in the work folder",
                               retry_after_s=exc.retry_after_s) from None
        self._served[worker_id] = served
        return data
