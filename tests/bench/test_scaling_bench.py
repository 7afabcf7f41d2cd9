"""bench/scaling_bench.py: its tiny run measures every part (positive numbers, no honest completion rejected) and
writes the json, the table and the chart; the slopes and the "faster than the parameters" section follow the numbers."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "scaling_bench.py"
# A benchmark's own check: 60-110 s of vLLM and trainer start-ups on 2 cores, so `make test-all`, not CI; the
# product paths it measures (engine, verifier, trainer, shardcast) have their own tests.
pytestmark = pytest.mark.slow
PARTS = ("gen", "verify", "reload", "train_lr1e-06", "train_lr1e-05")


def load_bench():
    spec = importlib.util.spec_from_file_location("scaling_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    started = time.monotonic()
    # One torch thread: on 2 shared cores OpenMP's two threads wait on each other (as tests/bench/test_gpu_check.py).
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "tiny", "--completions", "8", "--max-tokens", "4",
                           "--out", str(out), "--work", str(out / "work"), "--fresh"], cwd=REPO, capture_output=True,
                          text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "scaling.json").read_text()), time.monotonic() - started


def test_tiny_run_measures_every_part(tiny_run):
    out, data, wall = tiny_run
    tiny = data["models"]["tiny"]
    assert not tiny["errors"], tiny["errors"]
    assert set(PARTS) <= set(tiny["parts"]), sorted(tiny["parts"])
    assert tiny["info"]["parameters"] > 0 and tiny["info"]["vocab"] > 0 and tiny["info"]["layers"] > 0
    gen = tiny["parts"]["gen"]["runs"]
    # 2 rounds of each, alternated
    assert {r["variant"] for r in gen} == {"shipped", "vllm", "seeded"} and len(gen) == 3 * 2
    assert [r["variant"] for r in gen[:3]] == ["shipped", "vllm", "seeded"]
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in gen)
    ver = tiny["parts"]["verify"]["runs"]
    assert len(ver) == 2 and all(r["accepted"] and r["tokens_per_s"] > 0 and r["verify_over_gen"] > 0
        and r["parts_s"]["replay"] > 0 for r in ver)
    for lr in ("1e-06", "1e-05"):
        t = tiny["parts"][f"train_lr{lr}"]
        assert t["runs"] and all(r["completion_tokens_per_s"] > 0 for r in t["runs"])
        assert t["peak_rss_bytes"] > 0 and t["full_bytes"] > 0
        assert 0 < t["delta_v1_v2"]["bytes"] < t["full_bytes"] and t["delta_v0_v1"]["changed_share"] > 0
    rel = tiny["parts"]["reload"]["runs"]
    assert len(rel) == 3 and all(r["reload_s"] > 0 and r["total_s"] >= r["reload_s"] for r in rel)
    s = tiny["summary"]
    assert s["false_rejections"] == 0
    for key in ("gen_shipped_tokens_per_s", "verify_tokens_per_s", "verify_over_gen_time", "verify_replay_share",
                "train_tokens_per_s", "train_peak_rss_bytes", "publish_to_generating_s"):
        assert s[key]["median"] > 0, key
    for key in ("sampler_overhead", "proofs_overhead"):
        assert len(s[key]["runs"]) == 2, key
    md = (out / "scaling.md").read_text()
    assert "| tiny | " in md and "python bench/scaling_bench.py --models tiny" in md and "load average before" in md
    assert (out / "scaling.png").stat().st_size > 10_000


def test_slopes_and_the_report_follow_the_numbers(tiny_run, tmp_path):
    """A made-up second model, 100x the parameters, whose costs grow as chosen: the table's slopes and its
    "faster than the parameters" list come from them."""
    bench = load_bench()
    _, data, _ = tiny_run
    tiny = data["models"]["tiny"]
    big = copy.deepcopy(tiny)
    big["info"]["parameters"] *= 100
    big["info"]["vocab"] *= 1000
    s = big["summary"]
    for key, factor in (("verify_replay_s_per_token", 1000.0), ("full_bytes", 100.0), ("gen_shipped_s_per_token",
        10.0)):
        v = s[key]
        if isinstance(v, dict):
            v.update(median=v["median"] * factor, min=v["min"] * factor, max=v["max"] * factor, runs=[x * factor
                for x in v["runs"]])
        else:
            s[key] = v * factor
    models = {"tiny": tiny, "big": big}
    sl = bench.slopes(models)
    assert sl["verify_replay_s_per_token"]["end_to_end"] == pytest.approx(1.5)
    assert sl["full_bytes"]["end_to_end"] == pytest.approx(1.0)
    assert sl["gen_shipped_s_per_token"]["end_to_end"] == pytest.approx(0.5)
    assert sl["train_s_per_token"]["end_to_end"] == pytest.approx(0.0, abs=1e-9)
    bench.write_report({"meta": data["meta"], "models": models, "slopes": sl}, tmp_path)
    bench.write_chart({"meta": data["meta"], "models": models, "slopes": sl}, tmp_path)
    md = (tmp_path / "scaling.md").read_text()
    faster = md.split("Faster than the parameters")[1].split("\n\n")[1]
    assert "draw replay s/token" in faster and "slope 1.50" in faster and "bytes per full" not in faster
    assert "vocabulary ×1e+03" in md and (tmp_path / "scaling.png").is_file()
