"""The start-up check of a run's reward (verifier/reward_preflight.py) in a real reward pool: every process
loads the reward and makes its first call under the limits, and a reward that cannot work is an error
naming it and the fix. Also: loading a plug-in's module is not charged to a completion's limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from environments.tasks import TaskItem
from verifier.reward_pool import RewardPool, RewardPoolConfig
from verifier.reward_preflight import check
from verifier.reward_requests import RewardRequest, RewardStatus

MOD = "swarmrl_preflight_rewards"
SLOW_IMPORT = "swarmrl_preflight_slow_import"
BURN_IMPORT = "swarmrl_preflight_burn_import"
BAD_IMPORT = "swarmrl_preflight_bad_import"
HUNG_IMPORT = "swarmrl_preflight_hung_import"
LIMIT_S = 1.0

PLUGINS = {
    MOD: '''
import os, time

_called = False

def exact(text, item, log):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    return 1.0 if text == item.answer else 0.0

def lazy(text, item, log, first_call_s):
    """Pays `first_call_s` on its first call in a process, as a library imported inside the function."""
    global _called
    if not _called:
        time.sleep(first_call_s)
        _called = True
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
    return 1.0

def boom(text, item):
    raise KeyError("solution")

def half_again(text, item):
    return 1.5
''',
    SLOW_IMPORT: '''
import time
time.sleep(2.5)  # a slow library imported at the top of the module: 2.5 x the limit of a completion

def score(text, item):
    return 1.0
''',
    BURN_IMPORT: '''
import time
end = time.process_time() + 2.5  # CPU at import: more than a completion may use (1 s, armed in whole seconds: < 2)
while time.process_time() < end:
    pass

def score(text, item):
    return 1.0
''',
    BAD_IMPORT: '''
raise RuntimeError("cannot find its data file")
''',
    HUNG_IMPORT: '''
import time
time.sleep(3600)
''',
}
ITEM = TaskItem("p0", "say 7", "7")


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("preflight-plugins")
    for name, text in PLUGINS.items():
        (d / f"{name}.py").write_text(text)
    return d


def pool_config(plugin_dir: Path, **kw) -> RewardPoolConfig:
    return RewardPoolConfig(**{"processes": 2, "time_limit_s": LIMIT_S, "import_paths": [str(plugin_dir)], **kw})


def pids_in(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


def test_a_good_reward_is_called_once_in_every_process(plugin_dir, tmp_path):
    log = tmp_path / "calls"
    with RewardPool(pool_config(plugin_dir, processes=3)) as pool:
        result = check(pool, RewardRequest(f"{MOD}:exact", ITEM, ITEM.answer, {"log": str(log)}), f"{MOD}:exact")
        assert result.error == "" and result.processes == 3
        assert sorted(pids_in(log)) == sorted(pool.pids())  # each process once, none twice


def test_the_check_warms_every_process_so_no_completion_pays_the_first_call(plugin_dir, tmp_path):
    """A reward whose first call in a process is slow (a library imported inside the function), within the
    limit: after the check, every process has paid it, and scoring pays it nowhere again."""
    log = tmp_path / "first-calls"
    params = {"log": str(log), "first_call_s": 0.3}
    with RewardPool(pool_config(plugin_dir, processes=2, time_limit_s=5.0)) as pool:
        assert check(pool, RewardRequest(f"{MOD}:lazy", ITEM, "7", params), "lazy").error == ""
        warmed = pids_in(log)
        assert sorted(warmed) == sorted(pool.pids())
        results = pool.score_many([RewardRequest(f"{MOD}:lazy", ITEM, str(i), params) for i in range(40)])
        assert all(r.status is RewardStatus.ok for r in results)
        assert pids_in(log) == warmed


def test_a_plugin_missing_from_import_paths_stops_the_run_with_the_fix(plugin_dir):
    with RewardPool(RewardPoolConfig(processes=2, time_limit_s=LIMIT_S)) as pool:
        result = check(pool, RewardRequest(f"{MOD}:exact", ITEM, "7", {"log": os.devnull}), f"{MOD}:exact")
    assert f"{MOD}:exact" in result.error and "ModuleNotFoundError" in result.error
    assert "verifier.rewards.import_paths" in result.error


def test_a_first_call_over_the_limit_stops_the_run_with_the_fix(plugin_dir, tmp_path):
    params = {"log": str(tmp_path / "calls"), "first_call_s": 2 * LIMIT_S}
    with RewardPool(pool_config(plugin_dir)) as pool:
        result = check(pool, RewardRequest(f"{MOD}:lazy", ITEM, "7", params), f"{MOD}:lazy")
    assert f"{MOD}:lazy" in result.error and "time_limit_s" in result.error
    assert "top of the plug-in's module" in result.error


def test_a_module_whose_import_raises_stops_the_run(plugin_dir):
    with RewardPool(pool_config(plugin_dir)) as pool:
        result = check(pool, RewardRequest(f"{BAD_IMPORT}:score", ITEM, "7"), f"{BAD_IMPORT}:score")
    assert all(w in result.error for w in (f"{BAD_IMPORT}:score", "RuntimeError", "cannot find its data file"))


@pytest.mark.parametrize("fn, words", [("boom", ["KeyError", "raised"]),
                                       ("half_again", ["outside [0, 1]", "TRL-style"])])
def test_a_reward_that_raises_or_gives_no_reward_stops_the_run(plugin_dir, fn, words):
    with RewardPool(pool_config(plugin_dir)) as pool:
        result = check(pool, RewardRequest(f"{MOD}:{fn}", ITEM, "7"), f"{MOD}:{fn}")
    assert f"{MOD}:{fn}" in result.error and all(w in result.error for w in words)


def test_a_slow_import_at_the_top_of_the_module_is_not_charged_to_a_completion(plugin_dir):
    """Loading gets start_timeout_s, not the completion's limit, in a process that has already scored others
    (so its CPU limit is armed: the import may also burn more CPU than a completion may)."""
    with RewardPool(pool_config(plugin_dir, processes=1, cpu_limit_s=1)) as pool:
        assert pool.score(RewardRequest("toy", TaskItem("t", "copy:12=", "12"), "12")).reward == 1.0
        for mod in (SLOW_IMPORT, BURN_IMPORT):
            assert check(pool, RewardRequest(f"{mod}:score", ITEM, "7"), mod).error == ""
            assert pool.score(RewardRequest(f"{mod}:score", ITEM, "7")).status is RewardStatus.ok


def test_an_import_that_hangs_is_stopped_at_the_start_timeout_and_the_pool_lives_on(plugin_dir):
    with RewardPool(pool_config(plugin_dir, processes=1, start_timeout_s=3.0)) as pool:
        result = check(pool, RewardRequest(f"{HUNG_IMPORT}:score", ITEM, "7"), HUNG_IMPORT)
        assert "start_timeout_s" in result.error and HUNG_IMPORT in result.error
        # its replacement does not load the hung module at its start: it starts, and scores
        assert pool.score(RewardRequest("toy", TaskItem("t", "copy:12=", "12"), "12")).reward == 1.0
