"""`swarmrl run` with a real architecture made by the run itself: Qwen3 (q/k-norm) with the real 151,936-token
vocabulary and the BPE tokenizer trained here (multi-character tokens), scaled to 2 layers x 64 wide so CI
can afford it. The same code paths as the 0.6B model: init, vLLM worker, shardcast, verifier, trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_helpers import db, metrics, start_run, stop_run
from transformers import AutoTokenizer

from protocol.models import TaskLease

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_a_run_makes_and_trains_a_qwen3_architecture_with_the_real_vocabulary(tmp_path, monkeypatch):
    # the trained tokenizer's cache: not the home folder
    monkeypatch.setenv("SWARMRL_CACHE_DIR", str(tmp_path / "cache"))
    # A random model scores 0 on the toy task everywhere (no group would have a signal): a reward with signal.
    proc = start_run(tmp_path, "--name", "arch", "--trainer.max_steps", "3", "--num_workers", "1", "--stop_reward",
                     "null", "--model.init_arch", "qwen3-0.6b", "--model.init_layers", "2", "--model.init_hidden", "64",
                     "--model.init_pretrain_steps", "0", "--model.init_pretrain_target", "null",
                     "--model.init_pretrain_max_steps", "0", "--data.reward", "length_parity:reward",
                     "--verifier.rewards.import_paths", json.dumps([str(ROOT / "configs" / "rewards")]))
    try:
        code = proc.wait(timeout=600)
    finally:
        stop_run(proc)
    run_dir = tmp_path / "arch"
    assert code == 0, (tmp_path / "driver.log").read_text()[-4000:]
    made = json.loads((run_dir / "base_model" / "swarmrl_model.json").read_text())
    config = json.loads((run_dir / "base_model" / "config.json").read_text())
    assert made["arch"] == "qwen3-0.6b" and config["model_type"] == "qwen3" and config["vocab_size"] == 151_936
    assert [r["version"] for r in metrics(run_dir)] == [1, 2, 3]
    with db(run_dir) as con:
        statuses = {s for (s,) in con.execute("SELECT status FROM submissions WHERE verdict IS NOT NULL")}
        prompts = con.execute("SELECT body FROM leases LIMIT 1").fetchone()[0]
    assert statuses == {"accepted"}  # an honest worker on this model is never rejected
    # The prompts are multi-character BPE tokens: fewer ids than characters.
    ids = TaskLease.model_validate_json(prompts).prompts[0].token_ids.tolist()
    text = AutoTokenizer.from_pretrained(run_dir / "base_model").decode(ids)
    assert "copy:" in text and len(ids) < len(text)
