"""Config: one TOML describes a run; any field can be overridden; errors name the key and the source."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from swarmrl.config import RunConfig
from swarmrl.config import load_run_config as load_config
from swarmrl.loading import ConfigError, dump_toml, parse_overrides

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.toml"


def test_demo_config_loads_and_sets_values():
    cfg = load_config(DEMO, environ={})
    raw = tomllib.loads(DEMO.read_text())
    assert cfg.name == raw["name"]
    assert cfg.trainer.lr == raw["trainer"]["lr"]
    assert cfg.orchestrator.sampling.max_tokens == raw["orchestrator"]["sampling"]["max_tokens"]


def test_every_configs_toml_resolves(tmp_path):
    for path in sorted((REPO / "configs").glob("*.toml")):
        load_config(path, environ={})


def test_gpu_recipes_autoscale_the_verifier_pool_and_fit_their_gpus():
    """The GPU recipes use the pool that follows the load, and their trainer ranks plus the largest
    pool fit the GPUs their comments document."""
    small = tomllib.loads((REPO / "configs" / "qwen3-0.6b-math-gpu.toml").read_text())
    cfg = RunConfig.model_validate(small)
    lo, hi = cfg.verifier.actor_bounds()
    assert lo < hi
    assert cfg.resources.trainer_gpus + hi * cfg.resources.verifier_gpus <= 2  # "2x A100/H100"
    big = tomllib.loads((REPO / "configs" / "qwen3-8b-math-8gpu.toml").read_text())
    assert big["trainer"]["world_size"] == 4 and big["resources"]["trainer_placement"] == "PACK"
    assert (big["verifier"]["min_actors"], big["verifier"]["max_actors"]) == (1, 4)
    r = big["resources"]
    assert big["trainer"]["world_size"] * r["trainer_gpus"] + big["verifier"]["max_actors"] * r["verifier_gpus"] == 8


def test_overrides_take_precedence_and_are_typed():
    cfg = load_config(DEMO, ["--trainer.lr", "1e-6", "--orchestrator.async_level=0", "--trainer.loss.normalizer",
        "sequence"], environ={})
    assert cfg.trainer.lr == 1e-6
    assert cfg.orchestrator.async_level == 0
    assert cfg.trainer.loss.normalizer == "sequence"


def test_list_override_is_parsed_as_json():
    cfg = load_config(DEMO, ["--orchestrator.join_tokens", '["a", "b"]'], environ={})
    assert [t.get_secret_value() for t in cfg.orchestrator.join_tokens] == ["a", "b"]


def test_null_override_clears_an_optional_field():
    assert load_config(DEMO, environ={}).stop_reward is not None
    assert load_config(DEMO, ["--stop_reward", "null"], environ={}).stop_reward is None
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_config(DEMO, ["--trainer.lr", "null"], environ={})  # not optional: refused, not None


def test_environment_between_file_and_command_line():
    env = {"SWARMRL_TRAINER__LR": "0.5", "SWARMRL_ORCHESTRATOR__ADMIN_TOKEN": "from-env", "SWARMRL_LOG_LEVEL": "DEBUG",
        "UNRELATED": "x"}
    cfg = load_config(DEMO, environ=env)
    assert cfg.trainer.lr == 0.5 and cfg.orchestrator.admin_token.get_secret_value() == "from-env"
    assert cfg.log_level == "DEBUG"
    cfg = load_config(DEMO, ["--trainer.lr", "0.25"], environ=env)
    assert cfg.trainer.lr == 0.25


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, environ={})
    assert "trainer.learning_rate" in str(err.value) and str(bad) in str(err.value)


def test_wrong_type_names_key_and_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[orchestrator]\nasync_level = "two"\n')
    with pytest.raises(ConfigError) as err:
        load_config(bad, environ={})
    assert "orchestrator.async_level" in str(err.value) and str(bad) in str(err.value)


def test_bad_override_names_the_flag():
    with pytest.raises(ConfigError, match=r"trainer\.lr.*command-line override --trainer\.lr"):
        load_config(DEMO, ["--trainer.lr", "fast"], environ={})
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.nope'"):
        load_config(DEMO, ["--trainer.nope", "1"], environ={})


def test_parse_overrides_errors():
    assert parse_overrides(["--a.b=1", "--c", "2"]) == {"a.b": "1", "c": "2"}
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["a.b", "1"])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", environ={})
    bad = tmp_path / "broken.toml"
    bad.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})


SECRETS = {"orchestrator": {"admin_token", "join_tokens"}, "worker": {"join_token"}}


def test_dump_round_trips_everything_but_the_secrets():
    cfg = load_config(DEMO, ["--trainer.lr", "3e-4", "--orchestrator.admin_token", "s3cret-admin"],
        environ={"SWARMRL_WORKER__JOIN_TOKEN": "s3cret-join"})
    text = dump_toml(cfg)
    for secret in ("s3cret-admin", "s3cret-join", "demo-join-token"):
        assert secret not in text  # the run folder's config.toml and --dry-run show ********** instead
    again = RunConfig.model_validate(tomllib.loads(text))
    assert again.model_dump(exclude=SECRETS) == cfg.model_dump(exclude=SECRETS)


def test_dry_run_never_prints_secrets():
    env = dict(os.environ, SWARMRL_ORCHESTRATOR__ADMIN_TOKEN="admin-from-env",
        SWARMRL_ORCHESTRATOR__JOIN_TOKENS='["join-from-env"]')
    out = subprocess.run([sys.executable, "-m", "swarmrl", "run", "--dry-run", "--orchestrator.admin_token",
        "admin-from-flag"],
                         capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert "admin-from" not in out.stdout and "join-from-env" not in out.stdout and "**********" in out.stdout
    out = subprocess.run([sys.executable, "-m", "swarmrl", "worker", "--orchestrator", "http://x", "--join-token",
        "worker-secret", "--dry-run"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "worker-secret" not in out.stdout and "**********" in out.stdout


def test_demo_tokens_are_refused_on_a_non_loopback_address():
    from orchestrator.config import OrchestratorConfig, refuse_exposed_demo_secrets

    refuse_exposed_demo_secrets(OrchestratorConfig())  # loopback: the local demo
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(ValueError, match="admin_token, join_tokens still hold the demo"):
            refuse_exposed_demo_secrets(OrchestratorConfig(host=host))
    with pytest.raises(ValueError, match="join_tokens"):
        refuse_exposed_demo_secrets(OrchestratorConfig(host="0.0.0.0", admin_token="a-real-one",
            join_tokens=["CHANGE-ME-join-token"]))
    refuse_exposed_demo_secrets(OrchestratorConfig(host="0.0.0.0", admin_token="a-real-one",
        join_tokens=["another-real-one"]))


def test_cli_dry_run_prints_resolved_config_and_errors_exit_2(tmp_path):
    swarmrl = [sys.executable, "-m", "swarmrl"]
    out = subprocess.run(swarmrl + ["run", "--dry-run", "--trainer.lr", "7e-5"], capture_output=True, text=True,
        cwd=REPO)
    assert out.returncode == 0, out.stderr
    resolved = tomllib.loads(out.stdout)
    assert resolved["trainer"]["lr"] == 7e-5
    assert RunConfig.model_validate(resolved).trainer.lr == 7e-5
    bad = tmp_path / "bad.toml"
    bad.write_text("[shardcast]\nkeep = 3\n")
    out = subprocess.run(swarmrl + ["run", "--config", str(bad), "--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert "shardcast.keep" in out.stderr and "bad.toml" in out.stderr


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_every_recipe_resolves_with_dry_run(recipe, tmp_path):
    path = REPO / "configs" / recipe
    out = subprocess.run([sys.executable, "-m", "swarmrl", "run", "--config", str(path), "--dry-run"],
        capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    resolved = RunConfig.model_validate(tomllib.loads(out.stdout))
    raw = tomllib.loads((REPO / "configs" / recipe).read_text())
    assert resolved.name == raw["name"]
    for key in ("min_actors", "max_actors"):
        if key in raw.get("verifier", {}):
            assert getattr(resolved.verifier, key) == raw["verifier"][key]


@pytest.mark.parametrize("config", ["demo.toml", "realsize-cpu.toml", "qwen3-0.6b-math-gpu.toml"])
def test_a_local_worker_started_by_the_run_gets_the_runs_engine_settings(config, tmp_path):
    """The command `swarmrl run` starts its workers with, parsed by the real `swarmrl worker` (--dry-run):
    every engine setting arrives as the run configured it, unset ones (None) included."""
    import json

    from swarmrl.cli import _load
    from swarmrl.processes import worker_command

    cfg = _load(Path(__file__).resolve().parents[2] / "configs" / config, [])
    cmd = worker_command("http://127.0.0.1:1", tmp_path / "model", tmp_path / "work", 0, cfg)
    out = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SWARMRL_JOIN_TOKEN": "t"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["engine"] == cfg.worker.engine.model_dump()
