"""Structured, leveled logging, configured in one place for every process we start.

Modules only call `logging.getLogger(__name__)` and pass structured fields through `extra={...}`;
this module decides how records look: `text` (rich, for people) or `json` (one object per line,
for log collectors).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
# Attributes that Ray and vLLM add to every record: noise in our lines.
_HIDDEN_PREFIXES = ("_ray", "ray_", "vllm_")


def _fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith(_HIDDEN_PREFIXES)}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger. Level and format default to SWARMRL_LOG_LEVEL / SWARMRL_LOG_FORMAT."""
    level = (level or os.environ.get("SWARMRL_LOG_LEVEL") or "INFO").upper()
    fmt = fmt or os.environ.get("SWARMRL_LOG_FORMAT") or "text"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Libraries that are loud at INFO.
    for noisy in ("httpx", "httpcore", "uvicorn.access", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
