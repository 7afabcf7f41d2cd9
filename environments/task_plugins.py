"""Loading plug-ins by name ("module:attr"): a user's task class (`data.task = "package.module:TaskClass"`), and
the reward functions and environments that name their plug-ins the same way. A name that does not load gives
a ValueError that says what is missing: the module, the class in it, or a method the class must write.

A plug-in's module must be importable where it runs: a task's in the orchestrator (which makes the prompts)
and in the verifier's reward processes (which score them; `verifier.rewards.import_paths` is put before
sys.path there). Run with its folder on PYTHONPATH, which every process of a local run inherits, or install it.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

from environments.task_api import Task, writes


def import_plugin(name: str, what: str) -> Any:
    """The object a plug-in name "module:attr" names (attr may be dotted), for plug-in rewards and
    environments alike. ValueError, saying why, when the name is not of that form or does not load."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {name!r} is not a plug-in name of the form 'module:name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        where = "" if exc.name != module_name.split(".")[0] else (
            " (put its folder on PYTHONPATH, or verifier.rewards.import_paths for the reward processes, or install it)")
        raise ValueError(f"cannot load {what} {name!r}: ModuleNotFoundError: no module named {exc.name!r}{where}") \
            from None
    except Exception as exc:  # whatever the module raises at import time
        raise ValueError(f"cannot load {what} {name!r}: importing {module_name!r} raised {type(exc).__name__}: "
                         f"{exc}") from None
    try:
        return operator.attrgetter(attr)(module)
    except AttributeError:
        raise ValueError(f"cannot load {what} {name!r}: AttributeError: module {module_name!r} has no {attr!r}") \
            from None


def task_class(name: str) -> type[Task]:
    """The Task subclass that a plug-in name "package.module:TaskClass" names, checked for what a task needs."""
    cls = import_plugin(name, "task")
    if not isinstance(cls, type):
        raise ValueError(f"task {name!r} is a {type(cls).__name__}, not a class (a reward function goes in "
                         "data.reward)")
    if not issubclass(cls, Task):
        raise ValueError(f"task {name!r} is not a subclass of environments.task_api.Task")
    if not writes(cls, "reward"):
        raise ValueError(f"task {name!r} does not write reward(self, item, completion_text) -> float")
    return cls  # one that writes neither item nor make_prompts takes its prompts from data.path (from_record)
