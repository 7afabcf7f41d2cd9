"""A worker with no --model takes the run's config and tokenizer (inference_worker/base_model.py): the files are
checked against the listing, kept across restarts, and a run that serves none leaves the old behaviour.
The client is a stand-in here; the real path (server, vLLM on dummy weights, accepted work) is the volunteer
tests' (tests/deploy/test_volunteer_install.py, tests/deploy/test_volunteer_docker.py)."""

from __future__ import annotations

import hashlib

import pytest

from inference_worker import client as c
from inference_worker.base_model import fetch_base_model
from protocol.models import ErrorBody, ErrorCode, ModelFile, ModelFiles

FILES = {"config.json": b'{"model_type": "qwen2"}', "tokenizer.json": b'{"version": "1.0"}'}


class RunFiles:
    """The two endpoints, serving `files` (or, for `tamper`, other bytes than it lists)."""

    def __init__(self, files: dict[str, bytes], tamper: str = "", missing: bool = False):
        self.files, self.tamper, self.missing, self.fetched = files, tamper, missing, []

    def model_files(self) -> ModelFiles:
        if self.missing:
            raise c.NotFound(404, ErrorBody(error=ErrorCode.not_found, detail="Not Found"))
        return ModelFiles(files=[ModelFile(name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest())
                                 for n, b in self.files.items()])

    def model_file(self, name: str) -> bytes:
        self.fetched.append(name)
        return b"evil" + self.files[name] if name == self.tamper else self.files[name]


def test_fetches_checks_and_keeps_the_runs_files(tmp_path):
    run = RunFiles(FILES)
    folder = fetch_base_model(run, tmp_path)
    assert folder == tmp_path / "base-model"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == FILES
    # A restart finds them and fetches nothing; a changed file is fetched again.
    again = RunFiles(FILES)
    assert fetch_base_model(again, tmp_path) == folder and again.fetched == []
    (folder / "tokenizer.json").write_bytes(b"stale")
    assert fetch_base_model(again, tmp_path) == folder and again.fetched == ["tokenizer.json"]
    assert (folder / "tokenizer.json").read_bytes() == FILES["tokenizer.json"]


def test_files_the_run_does_not_list_are_not_left_for_the_engine(tmp_path):
    """A work folder that served another run (another base model) keeps none of that model's files: the engine
    would read a stale generation_config.json (its eos ids stop generation) or added_tokens.json as this run's."""
    fetch_base_model(RunFiles(FILES | {"generation_config.json": b'{"eos_token_id": [7]}',
                                       "added_tokens.json": b'{"<x>": 9}'}), tmp_path)
    (tmp_path / "base-model" / ".tokenizer.json.tmp").write_bytes(b"half")  # a write cut short
    folder = fetch_base_model(RunFiles(FILES), tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)


def test_a_file_unlike_its_listing_is_refused_and_not_written(tmp_path):
    with pytest.raises(c.OrchestratorUnavailable, match="tokenizer.json does not match"):
        fetch_base_model(RunFiles(FILES, tamper="tokenizer.json"), tmp_path)
    assert not (tmp_path / "base-model" / "tokenizer.json").exists()
    assert not [p for p in (tmp_path / "base-model").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("run", [RunFiles({}), RunFiles({"tokenizer.json": b"{}"}), RunFiles(FILES, missing=True)],
                         ids=["nothing served", "no config", "older orchestrator"])
def test_a_run_that_serves_no_config_leaves_the_worker_as_it_was(tmp_path, run):
    assert fetch_base_model(run, tmp_path) is None
