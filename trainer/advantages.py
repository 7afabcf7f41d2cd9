"""Group-relative advantages (GRPO): the one place in swarmrl that turns a group's rewards into advantages.

    A_i = (R_i - mean_group R) / (std_group R + eps)     # use_std=False drops the division (Dr. GRPO)

The std is the population std (ddof=0), as in INTELLECT-2's (R - mean) / (std + 1e-6). A group whose
rewards are all equal gets all-zero advantages: it carries no learning signal, and the orchestrator's
online filter drops such groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_advantages(rewards: Sequence[float] | np.ndarray, use_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """Advantages of one group (rewards of shape (k,)) or of several groups of the same size at once
    (shape (groups, k), one group per row: one numpy pass for all the groups of a submission)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim not in (1, 2) or r.size == 0:
        raise ValueError(f"rewards must be a non-empty group (k,) or groups (groups, k), got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("rewards must be finite")
    if eps <= 0:
        raise ValueError("eps must be > 0")
    # numpy's mean and std, computed as they compute them (sum / k; sqrt(sum(centered^2) / k)) with
    # the reductions called directly: the same bits, without their Python wrappers (the orchestrator
    # calls this once per submission; the wrappers were most of its time).
    k = r.shape[-1]
    centered = r - np.add.reduce(r, axis=-1, keepdims=True) / k
    if use_std:
        centered = centered / (np.sqrt(np.add.reduce(centered * centered, axis=-1, keepdims=True) / k) + eps)
    # Rewards all equal: exactly zero, not mean-rounding noise divided by eps.
    centered[np.maximum.reduce(r, axis=-1) == np.minimum.reduce(r, axis=-1)] = 0.0
    return centered.astype(np.float32)


def has_signal(advantages: Sequence[float] | np.ndarray, tol: float = 1e-8) -> bool | np.ndarray:
    """False for a zero-signal group (all rewards equal): online difficulty filtering drops those.
    For groups (groups, k): one bool per group."""
    a = np.abs(np.asarray(advantages)) > tol
    return bool(a.any()) if a.ndim == 1 else a.any(axis=-1)
