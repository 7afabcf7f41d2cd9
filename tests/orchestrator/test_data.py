"""Prompt loading: JSONL, a datasets folder, generated prompts; offline difficulty filter; tokenization."""

from __future__ import annotations

import json
import logging

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
    ps = PromptSet.from_config(DataConfig(task="toy", path=str(tmp_path / "ds"), max_pass_rate=0.15), tiny_model_dir,
        seed=0)
    assert [p.item.answer for p in ps.prompts] == ["000", "001"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(tmp_path / "dd"))
    assert len(PromptSet.from_config(DataConfig(task="toy", path=str(tmp_path / "dd")), tiny_model_dir, seed=0)) == 3


def test_generated_prompts_and_seeded_order(tiny_model_dir):
    ps = PromptSet.from_config(DataConfig(task="toy", num_prompts=50, task_params={"digits": 4}), tiny_model_dir,
        seed=3)
    n = len(ps)
    first_epoch = [ps.order(i) for i in range(n)]
    assert sorted(first_epoch) == list(range(n))  # every prompt once per epoch
    assert [ps.order(i) for i in range(n, 2 * n)] != first_epoch
    ps2 = PromptSet.from_config(DataConfig(task="toy", num_prompts=50, task_params={"digits": 4}), tiny_model_dir,
        seed=3)
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


# --------------------------------------------------------------------------------------------------
# local Hugging Face datasets, the field map, chat templates, the length limit

GSM8K_ROWS = [
    {"question": f"tom has {i} apples and buys {i + 2} more. how many apples?",
    "answer": f"he has {i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}", "level": i % 3, "source": "x"}
    for i in range(6)
]
# A chat template in the tiny tokenizer's alphabet (which has no newline).
SIMPLE_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


def test_parquet_arrow_and_folders_with_splits(tmp_path, tiny_model_dir):
    import datasets

    train, test = datasets.Dataset.from_list(ROWS[:6]), datasets.Dataset.from_list(ROWS[6:])
    train.to_parquet(str(tmp_path / "one.parquet"))
    assert [r["answer"] for r in read_records(tmp_path / "one.parquet")] == [r["answer"] for r in ROWS[:6]]

    # A folder of data files: the splits come from the file names.
    (tmp_path / "files").mkdir()
    train.to_parquet(str(tmp_path / "files" / "train.parquet"))
    test.to_parquet(str(tmp_path / "files" / "test.parquet"))
    assert len(read_records(tmp_path / "files")) == 6
    assert [r["answer"] for r in read_records(tmp_path / "files", split="test")] == ["006", "007", "008", "009"]
    with pytest.raises(DataError, match="no split 'validation'"):
        read_records(tmp_path / "files", split="validation")

    # save_to_disk with splits; an arrow file written by it reads on its own too.
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    cfg = DataConfig(task="toy", path=str(tmp_path / "dd"), split="test")
    assert sorted(p.item.answer for p in PromptSet.from_config(cfg, tiny_model_dir, seed=0).prompts) == ["006", "007",
        "008", "009"]
    arrow = next((tmp_path / "dd" / "test").glob("*.arrow"))
    assert len(read_records(arrow)) == 4

    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="neither"):
        read_records(tmp_path / "nothing")
    with pytest.raises(DataError, match="not a dataset file"):
        read_records(write_jsonl(tmp_path / "x.txt", ROWS))


def test_field_map_answer_pattern_system_and_meta(tmp_path, tiny_model_dir):
    import datasets

    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(tmp_path / "gsm.parquet"))
    cfg = DataConfig(
        task="math", path=str(tmp_path / "gsm.parquet"), answer_pattern=r"####\s*(.+)",
        fields={"prompt": "question", "answer": "answer", "meta": ["level"]}, system_prompt="solve it",
    )
    ps = PromptSet.from_config(cfg, tiny_model_dir, seed=0)
    items = sorted((p.item for p in ps.prompts), key=lambda it: int(it.answer))
    assert [it.answer for it in items] == [str(2 * i + 2) for i in range(6)]
    assert items[0].prompt == GSM8K_ROWS[0]["question"]
    assert items[0].meta == {"level": 0, "system": "solve it"}  # only the mapped meta columns, and the system prompt
    # Without a chat template the system prompt is the line before the prompt.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert ps.prompts[0].token_ids.tolist() == tok("solve it\n" + ps.prompts[0].item.prompt)["input_ids"]

    # A per-row system column and an id column; every other column becomes meta.
    rows = [dict(r, sys=f"s{i}", uid=f"q{i}") for i, r in enumerate(GSM8K_ROWS)]
    write_jsonl(tmp_path / "gsm.jsonl", rows)
    cfg2 = cfg.model_copy(update={"path": str(tmp_path / "gsm.jsonl"),
        "fields": cfg.fields.model_copy(update={"system": "sys", "id": "uid", "meta": None})})
    item = next(p.item for p in PromptSet.from_config(cfg2, tiny_model_dir, seed=0).prompts if p.prompt_id == "q3")
    assert item.meta == {"level": 0, "source": "x", "system": "s3"}

    bad = cfg.model_copy(update={"answer_pattern": r"answer is (\d+)"})
    with pytest.raises(DataError, match="row 0: answer .* does not match answer_pattern"):
        PromptSet.from_config(bad, tiny_model_dir, seed=0)
    missing = cfg.model_copy(update={"fields": cfg.fields.model_copy(update={"prompt": "problem"})})
    with pytest.raises(DataError, match="row 0: no column 'problem'"):
        PromptSet.from_config(missing, tiny_model_dir, seed=0)
    with pytest.raises(ValueError, match="not a regular expression"):
        DataConfig(answer_pattern="(")


def test_chat_template_auto_on_off(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:3])
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert not tok.chat_template  # the tiny tokenizer has none: auto means off
    plain = PromptSet.from_config(DataConfig(task="toy", path=str(path)), tiny_model_dir, seed=0)
    assert all(p.token_ids.tolist() == tok(p.item.prompt)["input_ids"] for p in plain.prompts)
    with pytest.raises(DataError, match="no chat template"):
        PromptSet.from_config(DataConfig(task="toy", path=str(path), chat_template="on"), tiny_model_dir, seed=0)

    # A template given in the config: auto now means on, and the prompt is the template's rendering.
    cfg = DataConfig(task="toy", path=str(path), chat_template_jinja=SIMPLE_TEMPLATE, system_prompt="copy digits")
    chat = PromptSet.from_config(cfg, tiny_model_dir, seed=0)
    for p in chat.prompts:
        text = f"system: copy digits;user: {p.item.prompt};assistant:"
        assert p.token_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    # The switch overrides: off uses the plain text even though a template is there.
    off = PromptSet.from_config(cfg.model_copy(update={"chat_template": "off"}), tiny_model_dir, seed=0)
    assert off.prompts[0].token_ids.tolist() == tok("copy digits\n" + off.prompts[0].item.prompt)["input_ids"]


def test_prompts_over_the_token_limit_are_dropped_counted_and_logged(tmp_path, tiny_model_dir, caplog):
    rows = [{"prompt": "copy:" + "1" * n + "=", "answer": "1" * n} for n in range(1, 11)]  # 7 to 16 tokens
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="orchestrator.data"):
        ps = PromptSet.from_config(DataConfig(task="toy", path=str(path), max_prompt_tokens=10), tiny_model_dir, seed=0)
    assert sorted(len(p.item.answer) for p in ps.prompts) == [1, 2, 3, 4]
    assert all(p.token_ids.size <= 10 for p in ps.prompts)
    assert ps.dropped["too_long"] == 6
    [record] = [r for r in caplog.records if "longer than the token limit" in r.getMessage()]
    assert record.dropped == 6 and record.limit == 10
