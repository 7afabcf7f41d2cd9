"""Group-relative advantages (GRPO): the one place in swarmrl that turns a group's rewards into advantages.

    A_i = (R_i - mean_group R) / (std_group R + eps)     # use_std=False drops the division (Dr. GRPO)

The std is the population std (ddof=0), as in INTELLECT-2's (R - mean) / (std + 1e-6). A group whose
rewards are all equal gets all-zero advantages: it carries no learning signal, and the orchestrator's
online filter drops such groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_advantages(rewards: Sequence[float], use_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    if eps <= 0:
        raise ValueError("eps must be > 0")
    if np.ptp(r) == 0:  # exactly zero, not mean-rounding noise divided by eps
        return np.zeros(r.size, dtype=np.float32)
    centered = r - r.mean()
    if use_std:
        centered = centered / (r.std() + eps)
    return centered.astype(np.float32)


def has_signal(advantages: Sequence[float], tol: float = 1e-8) -> bool:
    """False for a zero-signal group (all rewards equal): online difficulty filtering drops those."""
    return bool(np.any(np.abs(np.asarray(advantages)) > tol))
