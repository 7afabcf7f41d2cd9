"""`swarmrl worker` with no join token, against a real orchestrator on 127.0.0.1: it claims a token by open
join (solving the puzzle), keeps it, joins with the kept one on the next start, claims anew when the kept one
is refused, and says why when the run has no open join. No engine: the worker loop is a stand-in."""

from __future__ import annotations

import contextlib
import json
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "orchestrator"))  # the orchestrator's test doubles
from orch_fakes import make_orchestrator, run_config  # noqa: E402

from inference_worker import client as c  # noqa: E402
from inference_worker import open_join  # noqa: E402
from inference_worker.config import WorkerConfig  # noqa: E402
from orchestrator.server import OrchestratorServer  # noqa: E402
from swarmrl.cli import app  # noqa: E402

REFUSED = 2


@contextlib.contextmanager
def orchestrator(tmp_path: Path, enabled: bool = True):
    cfg = run_config(tmp_path, open_join={"enabled": enabled, "difficulty_bits": 10}, refusal_delay_s=0.0)
    srv = OrchestratorServer(make_orchestrator(cfg), port=0).start()
    try:
        yield srv
    finally:
        srv.stop()


def claimed_tokens(srv) -> list[str]:
    return [t.token_id for t in srv.orch.tokens.all() if t.token_id.startswith("oj-")]


def registers(url: str, token: str) -> bool:
    with c.OrchestratorClient(url, retries=0) as client:
        try:
            client.register(token, "volunteer")
        except c.Unauthorized:
            return False
    return True


def test_a_worker_claims_a_token_keeps_it_and_joins_with_it_again(tmp_path):
    with orchestrator(tmp_path / "orch") as srv:
        cfg = WorkerConfig(orchestrator_url=srv.url + "/", work_dir=str(tmp_path / "work"), retries=0)
        token, kept = open_join.join_token(cfg)
        assert not kept and registers(srv.url, token) and len(claimed_tokens(srv)) == 1
        path = tmp_path / "work" / open_join.TOKEN_FILE_NAME
        assert json.loads(path.read_text()) == {srv.url: token}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a credential: its owner's only
        # The next start joins with the kept token: no second puzzle, no second claim.
        assert open_join.join_token(cfg) == (token, True)
        assert len(claimed_tokens(srv)) == 1


def test_a_kept_token_the_orchestrator_refuses_is_claimed_anew(tmp_path):
    with orchestrator(tmp_path / "orch") as srv:
        cfg = WorkerConfig(orchestrator_url=srv.url, join_token_file=str(tmp_path / "tokens.json"), retries=0)
        open_join.keep_token(Path(cfg.join_token_file), srv.url, "jt-oj-gone.from-an-earlier-run-at-this-address")
        tried: list[str] = []

        def run_worker(worker_cfg: WorkerConfig) -> int:  # the loop's answer to its registration
            tried.append(worker_cfg.join_token.get_secret_value())
            return 0 if registers(srv.url, tried[-1]) else REFUSED

        assert open_join.run(cfg, run_worker, REFUSED) == 0
        assert len(tried) == 2 and tried[0].startswith("jt-oj-gone") and claimed_tokens(srv)
        assert open_join.kept_token(Path(cfg.join_token_file), srv.url) == tried[1]


def test_a_run_without_open_join_is_told_apart(tmp_path):
    with orchestrator(tmp_path / "orch", enabled=False) as srv:
        cfg = WorkerConfig(orchestrator_url=srv.url, work_dir=str(tmp_path / "work"), retries=0)
        with pytest.raises(open_join.OpenJoinFailed, match="--join-token"):
            open_join.join_token(cfg)
        assert not (tmp_path / "work" / open_join.TOKEN_FILE_NAME).exists()
        # The command line: no --join-token, so it tries open join, and says why it cannot.
        res = CliRunner().invoke(app, ["worker", "--orchestrator", srv.url, "--work-dir", str(tmp_path / "cli"),
                                       "--retries", "0"], env={"SWARMRL_JOIN_TOKEN": ""})
        assert res.exit_code == REFUSED and "--join-token" in " ".join(res.output.split())
        assert not claimed_tokens(srv)


def test_a_bad_name_is_refused_before_a_claim(tmp_path):
    cfg = WorkerConfig(orchestrator_url="http://127.0.0.1:9", name="bad name!", work_dir=str(tmp_path))
    with pytest.raises(open_join.OpenJoinFailed, match="invalid worker name"):
        open_join.run(cfg, lambda _: 0, REFUSED)


def test_the_token_is_optional_on_the_command_line():
    res = CliRunner().invoke(app, ["worker", "--orchestrator", "http://o:8000", "--dry-run"],
                             env={"SWARMRL_JOIN_TOKEN": ""})
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["join_token"] == ""
