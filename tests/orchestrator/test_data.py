"""Prompt loading: JSONL, a datasets folder, generated prompts; offline difficulty filter; tokenization."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import DataConfig
from orchestrator.data import DataError, PromptSet, filter_by_pass_rate, read_records


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


ROWS = [{"prompt": f"copy:{i:03d}=", "answer": f"{i:03d}", "pass_rate": i / 10} for i in range(10)]


def test_jsonl_with_pass_rate_filter(tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = DataConfig(task="toy", path=str(path), min_pass_rate=0.2, max_pass_rate=0.6)
    ps = PromptSet.from_config(cfg, tiny_model_dir, seed=0)
    assert sorted(p.item.answer for p in ps.prompts) == ["002", "003", "004", "005", "006"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for p in ps.prompts:
        assert p.token_ids.tolist() == tok(p.item.prompt)["input_ids"]
    assert ps.vocab_size == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


def test_datasets_folder(tmp_path, tiny_model_dir):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    ps = PromptSet.from_config(DataConfig(task="toy", path=str(tmp_path / "ds"), max_pass_rate=0.15), tiny_model_dir, seed=0)
    assert [p.item.answer for p in ps.prompts] == ["000", "001"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(tmp_path / "dd"))
    assert len(PromptSet.from_config(DataConfig(task="toy", path=str(tmp_path / "dd")), tiny_model_dir, seed=0)) == 3


def test_generated_prompts_and_seeded_order(tiny_model_dir):
    ps = PromptSet.from_config(DataConfig(task="toy", num_prompts=50, task_params={"digits": 4}), tiny_model_dir, seed=3)
    n = len(ps)
    first_epoch = [ps.order(i) for i in range(n)]
    assert sorted(first_epoch) == list(range(n))  # every prompt once per epoch
    assert [ps.order(i) for i in range(n, 2 * n)] != first_epoch
    ps2 = PromptSet.from_config(DataConfig(task="toy", num_prompts=50, task_params={"digits": 4}), tiny_model_dir, seed=3)
    assert [ps2.order(i) for i in range(n)] == first_epoch


def test_bad_data_gives_clear_errors(tmp_path, tiny_model_dir):
    with pytest.raises(DataError, match="not found"):
        read_records(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        read_records(bad)
    with pytest.raises(DataError, match="no 'pass_rate' column"):
        filter_by_pass_rate([{"prompt": "x"}], "pass_rate", 0.1, None)
    with pytest.raises(DataError, match="not a number"):
        filter_by_pass_rate([{"pass_rate": "hard"}], "pass_rate", 0.1, None)
    nofield = write_jsonl(tmp_path / "nofield.jsonl", [{"question": "x"}])
    with pytest.raises(DataError, match="row 0"):
        PromptSet.from_config(DataConfig(task="toy", path=str(nofield)), tiny_model_dir, seed=0)
    empty = write_jsonl(tmp_path / "e.jsonl", ROWS)
    with pytest.raises(DataError, match="no prompts"):
        PromptSet.from_config(DataConfig(task="toy", path=str(empty), min_pass_rate=0.95), tiny_model_dir, seed=0)
