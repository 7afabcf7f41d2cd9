"""A user's own task (`data.task = "package.module:TaskClass"`): loaded from a folder of its own, streamed and
scored through the same paths as the built-ins, and every way of getting it wrong named in the error."""

from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import pytest

from environments.task_api import Task, TaskItem
from environments.tasks import get_task
from orchestrator.config import DataConfig
from orchestrator.data import DataError, PromptSet, first_item, load_items

REPO = Path(__file__).resolve().parents[2]
USER_TASK = '''
from environments.task_api import Task, TaskItem, stream_rng


class ReverseTask(Task):
    """Reverse the digits: `rev:123=` -> `321`."""

    name = "reverse"
    stream = True

    def __init__(self, digits: int = 3):
        self.digits = digits

    def item(self, seed, index, level=0):
        digits = "".join(stream_rng(self.name, seed, index).choice("0123456789") for _ in range(self.digits))
        return TaskItem(f"rev-{index}", f"rev:{digits}=", digits[::-1])

    def reward(self, item, completion_text):
        return 1.0 if completion_text.strip() == item.answer else 0.0


class Unscored(Task):
    def item(self, seed, index, level=0):
        return TaskItem("x", "x", "x")


class OnlyScores(Task):
    def reward(self, item, completion_text):
        return 0.0


def not_a_class(text, item):
    return 1.0


class NotATask:
    pass
'''


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty folder with the user's module in it, on sys.path (as PYTHONPATH=$PWD puts it)."""
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent(USER_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_user_task_loads_streams_and_scores(user_folder):
    task = get_task("my_tasks:ReverseTask", digits=4)
    assert isinstance(task, Task) and task.digits == 4
    items = [task.item(7, i) for i in range(20)]
    assert items == [task.item(7, i) for i in range(20)]  # a pure function of (seed, index)
    assert items != [task.item(8, i) for i in range(20)]
    for it in items:
        assert it.prompt == f"rev:{it.answer[::-1]}=" and task.reward(it, it.answer) == 1.0
    assert task.reward(items[0], "nope") == 0.0
    # The default finite set is the stream's first n items.
    assert task.make_prompts(5, seed=7) == items[:5]


def test_a_user_task_through_the_orchestrators_data_path(user_folder, tiny_model_dir):
    cfg = DataConfig(task="my_tasks:ReverseTask", task_params={"digits": 2})
    stream = PromptSet.from_config(cfg, tiny_model_dir, seed=3)
    assert stream.streamed  # the task's default (stream = True)
    prompts = [stream.prompts[stream.order(p)] for p in range(200)]
    # More positions than 2 digits have prompts: no cap, a prompt per position (repeats are allowed).
    assert len({p.prompt_id for p in prompts}) == 200 and len({p.item.prompt for p in prompts}) <= 100
    assert first_item(cfg, seed=3).prompt == prompts[0].item.prompt
    finite = PromptSet.from_config(cfg.model_copy(update={"stream": False, "num_prompts": 50}), tiny_model_dir, seed=3)
    assert not finite.streamed and len(finite) == 50


def test_the_worked_example_of_docs_tasks_md(tmp_path, monkeypatch, tiny_model_dir):
    """docs/tasks.md's task and run.toml, from an empty folder: the config resolves, the orchestrator streams the
    task's prompts, and the verifier's sandboxed reward processes load the task by its name and score with it."""
    from swarmrl.config import RunConfig
    from verifier.reward_config import RewardPoolConfig
    from verifier.reward_pool import RewardPool
    from verifier.reward_requests import RewardRequest, RewardStatus

    doc = (REPO / "docs" / "tasks.md").read_text()
    code = re.search(r"`reverse_task.py`:\n\n```python\n(.*?)```", doc, re.S).group(1)
    toml = re.search(r"`run.toml`.*?\n\n```toml\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "reverse_task.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=$PWD
    cfg = RunConfig.model_validate(tomllib.loads(toml))
    stream = PromptSet.from_config(cfg.data, tiny_model_dir, cfg.seed)
    items = [stream.prompts[stream.order(p)].item for p in range(8)]
    assert all(it.prompt == f"rev:{it.answer[::-1]}=" and len(it.answer) == 2 for it in items)
    params = cfg.data.task_params
    with RewardPool(RewardPoolConfig(processes=1, import_paths=[str(tmp_path)])) as pool:
        right, half, wrong = pool.score_many([RewardRequest(cfg.data.task, items[0], items[0].answer, params),
                                              RewardRequest(cfg.data.task, items[0], items[0].answer[0] + "x", params),
                                              RewardRequest(cfg.data.task, items[0], "", params)])
    assert [r.status for r in (right, half, wrong)] == [RewardStatus.ok] * 3
    assert (right.reward, half.reward, wrong.reward) == (1.0, 0.5, 0.0)


@pytest.mark.parametrize("name, why", [
    ("no_such_module:Task", "no module named 'no_such_module'"),
    ("my_tasks:Missing", "module 'my_tasks' has no 'Missing'"),
    ("my_tasks:not_a_class", "not a class"),
    ("my_tasks:NotATask", "not a subclass of environments.task_api.Task"),
    ("my_tasks:Unscored", "does not write reward"),
    ("my_tasks", "unknown task"),
])
def test_errors_name_what_is_missing(user_folder, name, why):
    with pytest.raises(ValueError, match=why):
        get_task(name)


def test_bad_parameters_and_a_task_without_prompts(user_folder, tiny_model_dir):
    with pytest.raises(ValueError, match="bad parameters"):
        get_task("my_tasks:ReverseTask", colour="red")
    with pytest.raises(DataError, match="makes no prompts"):
        load_items(DataConfig(task="my_tasks:OnlyScores"), seed=0)
    with pytest.raises(DataError, match="cannot stream"):
        PromptSet.from_config(DataConfig(task="my_tasks:OnlyScores", stream=True), tiny_model_dir, seed=0)
    # A task that only scores still takes its prompts from a dataset (Task.from_record).
    rows = user_folder / "rows.jsonl"
    rows.write_text('{"prompt": "rev:12=", "answer": "21"}\n')
    item = load_items(DataConfig(task="my_tasks:OnlyScores", path=str(rows)), seed=0)[0]
    assert (item.prompt, item.answer) == ("rev:12=", "21")


def test_a_task_importing_a_broken_module_says_what_it_raised(tmp_path, monkeypatch):
    (tmp_path / "broken_task.py").write_text("raise RuntimeError('no licence key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="importing 'broken_task' raised RuntimeError: no licence key"):
        get_task("broken_task:Task")


def test_builtin_tasks_are_written_on_the_same_api():
    for name in ("toy", "countdown", "math", "lookup"):
        task = get_task(name)
        assert isinstance(task, Task)
        item = task.item(5, 11)
        assert isinstance(item, TaskItem) and item == task.item(5, 11) and item != task.item(6, 11)
        assert task.reward(item, item.answer) == 1.0
