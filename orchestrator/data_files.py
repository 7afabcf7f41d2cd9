"""Dataset files to rows: a local dataset (JSONL, JSON, parquet, arrow, a `datasets` folder) read into dicts, the
offline pass-rate filter, and a row mapped to a task's record by the field map (orchestrator/data.py makes the
prompts from them).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.config import DataConfig


class DataError(ValueError):
    """Prompts that cannot be loaded. The message names the file and the row."""


DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def read_records(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """Rows of one split of a local dataset: a JSONL / JSON / parquet / arrow file (one split: the file), a
    folder of such files (splits from the file names, e.g. train.parquet, test-00000.parquet), or a folder
    written by `datasets.save_to_disk` (a Dataset, or a DatasetDict and its `split`)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path not found: {p}")
    if p.is_file() and p.suffix == ".jsonl":
        return _read_jsonl(p)  # our own reader: its errors name the line
    import datasets

    if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
        ds = datasets.load_from_disk(str(p))
    else:
        if p.is_file() and p.suffix not in DATA_SUFFIXES:
            raise DataError(f"{p}: not a dataset file (expected one of {', '.join(DATA_SUFFIXES)})")
        if p.is_dir() and not any(f.suffix in DATA_SUFFIXES for f in p.rglob("*") if f.is_file()):
            raise DataError(f"{p}: a folder with neither a save_to_disk dataset nor {', '.join(DATA_SUFFIXES)} files")
        # The arrow cache that load_dataset writes is thrown away: the rows are read into memory anyway.
        with tempfile.TemporaryDirectory(prefix="swarmrl-datasets-") as cache:
            try:
                if p.is_file():
                    ds = datasets.load_dataset(DATA_SUFFIXES[p.suffix], data_files={split: str(p)}, cache_dir=cache)
                else:
                    ds = datasets.load_dataset(str(p), cache_dir=cache)
            except Exception as exc:  # a malformed file: say which, whatever the reader raised
                raise DataError(f"{p}: cannot read: {type(exc).__name__}: {exc}") from None
            return _split(ds, split, p).to_list()
    return _split(ds, split, p).to_list()


def _split(ds: Any, split: str, p: Path) -> Any:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{p}: no split {split!r} (splits: {', '.join(ds)})")
        return ds[split]
    return ds


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{p}:{n}: not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def filter_by_pass_rate(rows: list[dict[str, Any]], column: str, lo: float | None, hi: float | None) -> list[dict[str,
    Any]]:
    """Offline difficulty filter: keep rows whose pass rate is within [lo, hi]."""
    if lo is None and hi is None:
        return rows
    out = []
    for i, row in enumerate(rows):
        if column not in row:
            raise DataError(f"row {i}: no '{column}' column for the pass-rate filter")
        try:
            rate = float(row[column])
        except (TypeError, ValueError):
            raise DataError(f"row {i}: '{column}' is not a number: {row[column]!r}") from None
        if (lo is None or rate >= lo) and (hi is None or rate <= hi):
            out.append(row)
    return out


def to_record(row: dict[str, Any], config: DataConfig) -> dict[str, Any]:
    """A dataset row in the task's record format ({"prompt", "answer", "prompt_id"?, meta...}) by the field map."""
    f = config.fields
    for need in (f.prompt, f.answer, f.system, f.id):
        if need and need not in row:
            raise KeyError(f"no column {need!r} (columns: {', '.join(sorted(row))})")
    answer = row[f.answer]
    if config.answer_pattern:
        m = re.search(config.answer_pattern, str(answer))
        if m is None:
            raise ValueError(f"answer {str(answer)[-80:]!r} does not match answer_pattern {config.answer_pattern!r}")
        answer = (m.group(1) if m.re.groups else m.group(0)).strip()
    mapped = {f.prompt, f.answer, f.system, f.id} - {""}
    meta = {k: v for k, v in row.items() if k not in mapped} if f.meta is None else {k: row[k] for k in f.meta
        if k in row}
    record = {**meta, "prompt": row[f.prompt], "answer": answer}
    if f.id:
        record["prompt_id"] = str(row[f.id])
    system = row[f.system] if f.system else config.system_prompt
    if system:
        record["system"] = str(system)  # item.meta["system"]: rendered by the chat template
    return record


def load_rows(config: DataConfig) -> list[dict[str, Any]]:
    """The configured dataset's rows, after the offline pass-rate filter."""
    return filter_by_pass_rate(read_records(config.path, config.split), config.pass_rate_column, config.min_pass_rate,
        config.max_pass_rate)
