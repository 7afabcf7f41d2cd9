"""Reward functions written for TRL's GRPOTrainer, run as swarmrl rewards (`[verifier.rewards] style = "trl"`).

TRL calls a reward function on a batch, `fn(prompts=[...], completions=[...], completion_ids=[...], **columns)`,
one list entry per completion and every other dataset column as a keyword argument (a list too), and takes
back one float or None per completion, unbounded. `data.reward` may name one such function or a list of them
(TRL's `reward_funcs`); their values are summed, weighted by `reward_params = {reward_weights = [...]}` (TRL's
`GRPOConfig.reward_weights`; default 1 each), a None leaving its function out of the sum.

Here each call gets one completion: the pool's time limit is per completion (verifier/reward_pool.py), so a
function that hangs on one text costs that text only. So every list has one entry; a function that looks
across its batch (normalizes within it, say) sees a batch of one. The columns: the item's `answer` (the
column that `[data.fields] answer` names, after `answer_pattern`) and every other column the item keeps
(`item.meta`). TRL's `trainer_state` is not passed: there is no trainer in a reward process.

Values. Each value and their sum must be finite and at most MAX_ABS_REWARD (1e6) in magnitude; nothing else.
GRPO's advantage is (r - group mean) / (group std + eps), the same for r and a*r + b (a > 0): a [0, 1] range buys
nothing there. With `trainer.loss.advantage_std = false` (Dr. GRPO) the advantage keeps the reward's scale,
so the reward's scale is the step size's, as in TRL with scale_rewards off. A None from every function
means "no reward for this completion": it is unscored, like a reward that timed out (status error, kind
"none"): its GRPO group is dropped, never trained with a made-up value, and no worker is charged. (TRL would
count it as 0 in its sum; a 0 would be a made-up reward here.)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping, Sequence

# With trainer.loss.advantage_std = false an advantage is the reward's own scale, cast to float32 for the loss
# (trainer/advantages.py): a loss over ~1e5 tokens and its squared gradient norm must stay finite in float32
# (3.4e38): 1e6 x 1e5 = 1e11, squared 1e22. TRL users' rewards are within ±10 or so.
MAX_ABS_REWARD = 1e6
COLUMNS_NOT_PASSED = frozenset({"prompts", "completions", "completion_ids"})  # TRL's own arguments


class Refused:
    """A value that is not a reward, and why: (kind, message), as the pool reports it."""

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message


class TrlReward:
    """One or more TRL reward functions as one scorer of the reward pool: `__call__(item, text, ids)` gives
    the weighted sum, None, or a Refused; `check` turns that into the pool's (value, kind, message)."""

    def __init__(self, name: str, fns: Sequence[Callable[..., Any]], weights: Sequence[float]):
        self.name, self.fns, self.weights = name, list(fns), [float(w) for w in weights]

    @classmethod
    def load(cls, name: str, obj: Any, params: dict[str, Any]) -> "TrlReward":
        """From what `data.reward` names: a function or a list of functions. ValueError saying why not."""
        fns = list(obj) if isinstance(obj, (list, tuple)) else [obj]
        if not fns or not all(callable(f) for f in fns):
            raise ValueError(f"reward {name!r} (style trl) is a {type(obj).__name__}, not a function or a list of them")
        unknown = sorted(set(params) - {"reward_weights"})
        if unknown:
            raise ValueError(f"reward {name!r} (style trl) takes no reward_params but reward_weights, got {unknown}: "
                             "dataset columns reach it as keyword arguments")
        weights = params.get("reward_weights", [1.0] * len(fns))
        if (not isinstance(weights, (list, tuple)) or len(weights) != len(fns)
                or not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights)):
            raise ValueError(f"reward {name!r}: reward_weights must be {len(fns)} finite numbers, got {weights!r}")
        return cls(name, fns, weights)

    def __call__(self, item: Any, text: str, ids: Sequence[int] | None) -> float | None | Refused:
        columns = {k: [v] for k, v in item.meta.items() if k not in COLUMNS_NOT_PASSED}
        columns.setdefault("answer", [item.answer])
        total, scored = 0.0, False
        for fn, weight in zip(self.fns, self.weights):
            token_ids = None if ids is None else [int(t) for t in ids]
            out = fn(prompts=[item.prompt], completions=[text], completion_ids=[token_ids], **columns)
            value = one_value(out, getattr(fn, "__name__", self.name))
            if isinstance(value, Refused):
                return value
            if value is not None:
                total, scored = total + weight * value, True
        if not scored:
            return None
        if not (math.isfinite(total) and abs(total) <= MAX_ABS_REWARD):
            return Refused("out_of_range", f"weighted sum {total!r} is not finite or beyond ±{MAX_ABS_REWARD:g}")
        return total

    @staticmethod
    def check(value: float | None | Refused) -> tuple[float, str, str]:
        """(reward, kind, message), as reward_child.check_value: kind "" for a reward."""
        if isinstance(value, Refused):
            return 0.0, value.kind, value.message
        if value is None:
            return 0.0, "none", "returned None: no reward for this completion (its group is dropped, as if timed out)"
        return value, "", ""


def one_value(out: Any, fn_name: str) -> float | None | Refused:
    """The one value of a TRL function's answer for one completion (a list, a tuple or a numpy array)."""
    if isinstance(out, (str, bytes, Mapping)) or not (hasattr(out, "__len__") and hasattr(out, "__getitem__")):
        return Refused("not_a_list", f"{fn_name} returned a {type(out).__name__}, not a list of a value per completion")
    if len(out) != 1:
        return Refused("wrong_length", f"{fn_name} returned {len(out)} values for 1 completion")
    v = out[0]
    if v is None:
        return None
    if not isinstance(v, numbers.Real):  # bool, int, float, numpy scalars pass; str, complex do not
        return Refused("not_a_number", f"{fn_name} returned a {type(v).__name__} in its list, not a number")
    try:
        f = float(v)
    except (OverflowError, ValueError, TypeError):
        return Refused("out_of_range", f"{fn_name} returned a number that is not a finite float")
    if math.isnan(f):
        return Refused("nan", f"{fn_name} returned NaN")
    if not abs(f) <= MAX_ABS_REWARD:
        return Refused("out_of_range", f"{fn_name} returned {f!r}, not finite or beyond ±{MAX_ABS_REWARD:g}")
    return f
