"""configs/math-gsm8k-style.toml end to end on the CPU: a GSM8K-format local dataset through the field map,
a chat template, math-verify rewards and TensorBoard tracking, three training steps with the tiny model.

The tiny locally-made tokenizer has no chat template, so the test gives one in data.chat_template_jinja (in
the tokenizer's alphabet, which has no newline or capital letters). The recipe's GPU settings are
overridden with the CPU values of tests/e2e/e2e_helpers.FAST.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
from e2e_helpers import FAST, REPO, db, metrics, stop_run

pytestmark = pytest.mark.e2e

RECIPE = REPO / "configs" / "math-gsm8k-style.toml"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CPU = [
    "--model.path", "",
    "--num_workers", "1",
    "--resources.trainer_gpus", "0", "--resources.verifier_gpus", "0",
    "--orchestrator.host", "127.0.0.1", "--shardcast.host", "127.0.0.1", "--shardcast.origin_port", "0",
    "--verifier.dtype", "float32",
    "--trainer.bf16", "false", "--trainer.publish_dtype", "float32", "--trainer.micro_batch_tokens", "4096",
    "--trainer.warmup_steps", "0", "--trainer.lr", "1e-4", "--trainer.max_steps", "3",
    "--worker.engine.dtype", "float32", "--worker.engine.max_model_len", "512", "--worker.engine.multiprocess", "false",
    "--orchestrator.lease_timeout_s", "30",
    # A random tiny model writes the right one-digit answer in ~2% of samples; groups of 16 give a step
    # enough groups with a learning signal (all-equal groups are dropped).
    "--orchestrator.samples_per_prompt", "16", "--trainer.samples_per_step", "32",
    "--orchestrator.sampling.max_tokens", "4",
    "--data.chat_template_jinja", TEMPLATE,
    "--data.system_prompt", "answer with a number",
    "--data.max_prompt_tokens", "120",
]


def gsm8k_rows(n: int) -> list[dict]:
    """GSM8K-format rows (question, reasoning ending in `#### <number>`), one-digit answers, lowercase."""
    rows = []
    for i in range(n):
        a, b = 1 + i % 4, 1 + (i * 3) % 5
        rows.append({"question": f"sam has {a} pens and finds {b} more. how many pens now?",
            "answer": f"sam has {a} + {b} = {a + b} pens.\n#### {a + b}"})
    rows.append({"question": "a very long question " * 20, "answer": "#### 1"})  # over max_prompt_tokens: dropped
    return rows


def test_math_recipe_trains_three_steps_on_a_gsm8k_style_dataset(tmp_path):
    import datasets

    data = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(gsm8k_rows(12)),
        "test": datasets.Dataset.from_list(gsm8k_rows(3))}).save_to_disk(str(data))
    argv = [sys.executable, "-m", "swarmrl", "run", "--config", str(RECIPE), "--output_dir", str(tmp_path), *FAST,
        *CPU, "--data.path", str(data)]

    # The recipe, with these overrides, resolves.
    dry = subprocess.run([*argv, "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert dry.returncode == 0, dry.stderr
    resolved = tomllib.loads(dry.stdout)
    assert resolved["data"]["fields"] == {"prompt": "question", "answer": "answer", "system": "", "id": ""}
    assert resolved["data"]["task"] == "math" and resolved["tracking"]["backends"] == ["jsonl", "tensorboard"]

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with (tmp_path / "driver.log").open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        code = proc.wait(timeout=240)
    finally:
        stop_run(proc)
    run_dir = tmp_path / "math-gsm8k-style"
    driver_log = (tmp_path / "driver.log").read_text()
    assert code == 0, driver_log[-4000:]

    rows = metrics(run_dir)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["reward_mean"] is not None for r in rows)

    # The prompts the workers got are the chat template's rendering of the system prompt and the question.
    with db(run_dir) as con:
        trained = con.execute("SELECT COUNT(*) FROM samples WHERE status = 'trained'").fetchone()[0]
    assert trained == 3 * 32
    from orchestrator.config import DataConfig
    from orchestrator.data import PromptSet

    cfg = DataConfig.model_validate(resolved["data"])
    assert cfg.system_prompt == "answer with a number"
    ps = PromptSet.from_config(cfg, run_dir / "base_model", seed=0)
    assert len(ps) == 12 and ps.dropped["too_long"] == 1
    assert sorted({p.item.answer for p in ps.prompts}) == sorted({str(r["answer"].split("#### ")[1])
        for r in gsm8k_rows(12)[:12]})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run_dir / "base_model"))
    first = ps.prompts[0]
    want = f"system: {cfg.system_prompt};user: {first.item.prompt};assistant:"
    assert first.token_ids.tolist() == tok(want, add_special_tokens=False)["input_ids"]

    # Every step trained on completions that math-verify rewarded (only groups with a signal are kept).
    assert all(r["reward/mean"] > 0 for r in rows), [r["reward/mean"] for r in rows]

    # TensorBoard got the same steps as metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in rows])
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
