"""Evaluation during training, end to end: a short `swarmrl run` with eval on (real Ray, real HTTP, a real
vLLM worker, real verifiers), then `swarmrl eval` on the run's last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_helpers import REPO, db, metrics

pytestmark = pytest.mark.e2e


def check_record(r: dict, k: int) -> None:
    assert r["samples_per_prompt"] == k and 0 <= r["prompts"] <= r["prompts_planned"] == 4
    if r["prompts"]:
        assert 0.0 <= r["avg_reward"] <= 1.0
        assert 1.0 <= r["mean_completion_tokens"] <= 8.0  # orchestrator.sampling.max_tokens
        passes = [r["pass_at"][str(n)] for n in sorted(map(int, r["pass_at"]))]
        assert set(r["pass_at"]) == {"1", str(k)} and all(0.0 <= p <= 1.0 for p in passes) and passes == sorted(passes)
        # pass@1 is the mean fraction of passing samples: at most avg@k when passing means reward 1.
        assert r["pass_at"]["1"] <= r["avg_reward"] + 1e-9


def test_run_with_eval_logs_held_out_results_per_version(short_run, tmp_path):
    run_dir, code, log = short_run  # conftest.py: also observed by test_run.py
    assert code == 0, log[-4000:]
    assert [r["version"] for r in metrics(run_dir)] == list(range(1, 7))

    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(set(versions)) and set(versions) <= {0, 2, 4, 6} and 0 in versions
    for r in records:
        check_record(r, k=4)
    base = records[0]
    assert base["complete"] and base["prompts"] == 4  # version 0: the worker holds it from the start

    with db(run_dir) as con:
        eval_leases = con.execute(
            "SELECT prompt_indices, eval_version, body FROM leases WHERE eval_version IS NOT NULL").fetchall()
        train_leases = con.execute("SELECT prompt_indices FROM leases WHERE eval_version IS NULL").fetchall()
        buffered_eval = con.execute(
            "SELECT COUNT(*) FROM sample_groups g JOIN submissions s ON s.submission_id = g.submission_id "
            "JOIN leases l ON l.lease_id = s.lease_id WHERE l.eval_version IS NOT NULL"
        ).fetchone()[0]
        accepted_eval = con.execute(
            "SELECT COUNT(*) FROM submissions s JOIN leases l ON l.lease_id = s.lease_id WHERE l.eval_version IS NOT "
            "NULL AND s.status = 'accepted'"
        ).fetchone()[0]
    held = {i for row in eval_leases for i in json.loads(row[0])}
    held_ids = {p["prompt_id"] for row in eval_leases for p in json.loads(row[2])["prompts"]}
    trained_on = {i for row in train_leases for i in json.loads(row[0])}
    assert len(held) == 4 and not held & trained_on  # held out: never leased for training
    assert buffered_eval == 0 and accepted_eval >= 2  # verified like any lease, never buffered
    for _, version, body in eval_leases:  # each pinned to exactly the version it evaluates
        assert json.loads(body)["generation_version"] == version

    # The same evaluation offline, with the run's config (so the same held-out prompts): on the run's last
    # checkpoint, and on the published version folder of the same version (weights only, plus the base model).
    def offline_eval(name: str, *args: str) -> dict:
        out = tmp_path / f"{name}.json"
        res = subprocess.run(
            [sys.executable, "-m", "swarmrl", "eval", *args, "--samples", "4", "--out", str(out), "--config",
             str(run_dir / "config.toml"), "--worker.engine.kv_cache_bytes", str(64 << 20)],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        result = json.loads(out.read_text())
        assert result == json.loads(res.stdout)  # stdout is the JSON alone (vLLM logs to stderr)
        return result

    offline = offline_eval("checkpoint", "--checkpoint", str(run_dir))
    assert offline["policy_version"] == 6 and offline["prompts"] == 4 and offline["complete"]
    assert set(offline["prompt_ids"]) == held_ids
    check_record(offline, k=4)
    published = offline_eval("published", "--checkpoint", str(run_dir / "weights" / "origin" / "v0000000006"),
        "--base-model", str(run_dir / "base_model"))
    # Same weights, same seeds: the same draws.
    for key in ("policy_version", "avg_reward", "pass_at", "mean_completion_tokens", "prompt_ids"):
        assert published[key] == offline[key], key
