"""`swarmrl data filter`: real vLLM sampling of a local GSM8K-style dataset, rewards from the sandboxed pool,
the pass-rate window, and an output folder that [data] reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A reward plug-in whose pass rate per row is known whatever the model writes: 1 for rows marked easy.
PLUGIN = '''
def by_row(text, item):
    if not isinstance(text, str):
        raise TypeError("the completion should be decoded text")
    return 1.0 if item.meta["easy"] else 0.0
'''


def swarmrl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmrl", *args], capture_output=True, text=True, cwd=REPO,
        timeout=timeout)


def test_filter_keeps_the_pass_rate_window_and_writes_a_dataset_data_reads(tmp_path):
    import datasets

    from orchestrator.config import DataConfig
    from orchestrator.data import PromptSet

    rows = [{"question": f"what is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", "easy": i % 2 == 0}
        for i in range(6)]
    rows.append({"question": "a very long question " * 10, "answer": "#### 1", "easy": True})  # over the token limit
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "gsm.parquet"))
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "filter_rewards.py").write_text(PLUGIN)
    out = tmp_path / "filtered"
    overrides = [
        "--output_dir", str(tmp_path), "--name", "filter", "--model.path", "", "--model.init_size", "tiny",
        "--data.path", str(tmp_path / "gsm.parquet"), "--data.system_prompt", "", "--data.max_prompt_tokens", "60",
        "--data.reward", "filter_rewards:by_row", "--verifier.rewards.import_paths", f'["{tmp_path / "plugins"}"]',
        "--verifier.rewards.processes", "1",
        "--orchestrator.sampling.max_tokens", "4", "--worker.engine.max_model_len", "128",
        "--worker.engine.kv_cache_bytes", str(32 << 20), "--worker.engine.dtype", "float32",
        "--worker.engine.multiprocess", "false",
    ]
    # The GSM8K-style recipe's [data] (field map, answer pattern, math task), with a CPU engine and the tiny model.
    res = swarmrl("data", "filter", "--config", str(REPO / "configs" / "math-gsm8k-style.toml"), "--out", str(out),
                  "--samples", "3", "--min-pass", "0.5", "--max-pass", "1", *overrides)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "kept 3 of 7 prompts" in res.stdout and "1 too long" in res.stdout

    kept = datasets.load_from_disk(str(out)).to_list()
    assert [r["question"] for r in kept] == [rows[i]["question"] for i in (0, 2, 4)]
    # columns unchanged
    assert all(r["pass_rate"] == 1.0 and r["answer"] == rows[2 * k]["answer"] for k, r in enumerate(kept))

    # [data] reads the folder with the same field map (and may filter on the pass rate again).
    cfg = DataConfig(task="math", path=str(out), fields={"prompt": "question"}, answer_pattern=r"####\s*(.+)",
        min_pass_rate=0.9)
    ps = PromptSet.from_config(cfg, tmp_path / "filter" / "base_model", seed=0)
    assert sorted(p.item.answer for p in ps.prompts) == ["0", "4", "8"]


def test_filter_refuses_bad_arguments(tmp_path):
    res = swarmrl("data", "filter", "--out", str(tmp_path / "o"), "--min-pass", "0.8", "--max-pass", "0.2", timeout=120)
    assert res.returncode == 2 and "above --max-pass" in res.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    res = swarmrl("data", "filter", "--out", str(tmp_path / "full"), timeout=120)
    assert res.returncode == 2 and "not empty" in res.stderr
    res = swarmrl("data", "filter", "--out", str(tmp_path / "o"), "--data.path", "", "--model", str(tmp_path),
        timeout=120)
    assert res.returncode == 1 and "set data.path" in res.stderr
