"""Checks of a multi-turn episode that need no model: every model turn's termination, and the environment
replayed on the trusted side with every environment position required to match it exactly.

An episode (protocol.models.Completion with an env_mask) is model turns and environment observations
interleaved. Walking it turn by turn from the start:
- a model turn may sample at most the environment's per-turn cap (also bounded by what is left of the
  lease's episode cap); it ends on its last token, which is EOS or a stop token (the environment's tool
  call or the lease's stop tokens) with none of them earlier ("stop"), or it has exactly the cap and no
  stop token at all ("length"); its claimed turn finish reason must say which;
- after it, the trusted environment (from the trusted task item and the leased seed) either answers with
  an observation, which must be exactly the next environment positions, or ends the episode, which must
  then end there. Its tool runs in the sandboxed pool, before this check: `tool_calls` lists what to run
  (one call per turn that asks for the tool), and `check_episode` gets the pool's results; a call that
  failed there (timed out, crashed, raised) rejects the episode as `tool_failed`.
A forged tool result, a dropped or an extra turn, a moved turn boundary, and tokens claimed by the wrong
side each break one of these (the model-position checks, seeded draws and proofs, are the service's).
"""

from __future__ import annotations

import numpy as np

from environments.base import Environment, model_turns
from environments.tasks import TaskItem
from protocol.models import Completion, FinishReason, SamplingParams
from verifier.checks import Finding
from verifier.reward_requests import RewardResult, RewardStatus


def _bounds(env: Environment, ids: np.ndarray, turns: list) -> Finding | None:
    episode_cap = env.limits.max_episode_tokens  # the orchestrator's leases have max_tokens >= it
    if ids.size > episode_cap:
        return Finding("bad_termination", f"the episode has {ids.size} tokens, over its cap of {episode_cap}",
            {"num_tokens": float(ids.size)})
    if len(turns) > env.limits.max_turns:
        return Finding("bad_termination", f"{len(turns)} model turns, over the environment's {env.limits.max_turns}",
            {"turns": float(len(turns))})
    return None


def tool_calls(env: Environment, c: Completion) -> list[tuple[int, str]]:
    """(model turn, tool input) for every turn after which the environment's tool must run: what the
    verifier sends to its sandboxed pool. None at all for an episode over its bounds (check_episode rejects
    it without them)."""
    ids = np.asarray(c.token_ids, dtype=np.int64)
    mask = np.asarray(c.env_mask, dtype=np.int8)
    turns = model_turns(mask)
    if _bounds(env, ids, turns):
        return []
    calls = []
    for k, (_, b) in enumerate(turns):
        call = env.pending_call(ids[:b], mask[:b])
        if call is not None:
            calls.append((k, call))
    return calls


def check_episode(env: Environment, item: TaskItem, seed: int, c: Completion, sampling: SamplingParams,
                  eos_ids: set[int], tools: dict[int, RewardResult]) -> Finding | None:
    """`tools`: the pool's result for each (turn, call) of `tool_calls(env, c)`, by turn."""
    ids = np.asarray(c.token_ids, dtype=np.int64)
    mask = np.asarray(c.env_mask, dtype=np.int8)
    turns = model_turns(mask)
    enders = set(eos_ids) | set(sampling.stop_token_ids) | set(env.stop_token_ids)
    found = _bounds(env, ids, turns)
    if found:
        return found
    for k, (a, b) in enumerate(turns):
        found = _check_turn(k, ids[a:b], a, c.turn_finish_reasons[k], env.turn_cap(a), enders)
        if found:
            return found
        reply = None
        if env.pending_call(ids[:b], mask[:b]) is not None:
            ran = tools.get(k)
            if ran is None or ran.status is not RewardStatus.ok:
                why = "was not run" if ran is None else f"{ran.status.value}: {ran.message}"
                return Finding("tool_failed",
                               f"the trusted replay of the tool call after model turn {k} (position {b}) {why}",
                               {"position": float(b), "turn": float(k), "seconds": float(ran.seconds if ran else 0.0)})
            reply = env.observation(b, ran.output)
        last = k == len(turns) - 1
        if reply is None:
            if not last:
                return Finding("env_mismatch", f"the environment ends the episode after model turn {k} (position {b}); "
                               f"{ids.size - b} more tokens follow", {"position": float(b), "turn": float(k)})
            continue
        if last:
            return Finding("episode_incomplete",
                f"the episode ends after model turn {k}, but the environment answers it "
                           f"(with {len(reply)} tokens at position {b})", {"position": float(b), "turn": float(k)})
        env_end = turns[k + 1][0]
        claimed = ids[b:env_end]
        want = np.asarray(reply, dtype=np.int64)
        if claimed.size != want.size or not np.array_equal(claimed, want):
            n = min(claimed.size, want.size)
            diff = np.flatnonzero(claimed[:n] != want[:n])
            at = b + (int(diff[0]) if diff.size else n)
            return Finding("env_mismatch",
                f"environment positions {b}..{env_end} after model turn {k} are not the environment's "
                           f"reply ({want.size} tokens): first difference at position {at}", {"position": float(at),
                           "turn": float(k)})
    return None


def _check_turn(k: int, turn: np.ndarray, start: int, claimed: FinishReason, cap: int,
    enders: set[int]) -> Finding | None:
    n = int(turn.size)
    is_end = np.isin(turn, np.array(sorted(enders), dtype=np.int64))
    stats = {"turn": float(k), "position": float(start), "num_tokens": float(n), "cap": float(cap)}
    if n > cap:
        return Finding("bad_termination", f"model turn {k} (position {start}) has {n} tokens, over its cap of {cap}",
            stats)
    early = np.flatnonzero(is_end[:-1])
    if early.size:
        return Finding("bad_termination",
            f"model turn {k}: a stop token at position {start + int(early[0])} is followed by more model tokens", stats)
    if FinishReason(claimed) == FinishReason.stop:
        if not is_end[-1]:
            return Finding("bad_termination",
                f"model turn {k} claims stop, but its last token {int(turn[-1])} is no stop token", stats)
    elif n != cap or is_end[-1]:
        return Finding("bad_termination",
            f"model turn {k} claims length with {n} tokens (cap {cap}){' ending on a stop token' if n == cap else ''}",
            stats)
    return None
