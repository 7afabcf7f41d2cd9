"""A reward plug-in for the hostile-swarm soak test: the toy task's own reward, except that text with
"zzzz" in it takes forever, as math-verify did on `\\boxed{9^{9^{9^{9}}}}`. Loaded by the sandboxed reward
pool's processes (`verifier.rewards.import_paths`)."""

import time

from environments.tasks import get_task

TOY = get_task("toy", digits=2)


def reward(text, item):
    if "zzzz" in text:
        time.sleep(3600)
    return TOY.reward(item, text)
