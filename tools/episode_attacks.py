"""Episode attacks: what a dishonest worker can do to a multi-turn episode (protocol.models.Completion with
an env_mask), for the verifier's tests and the attack matrix. Each takes an honest episode and the hidden
states [n_model, H] that produced its model tokens, and returns a forged episode whose proofs are rebuilt
over the model rows it keeps: the rejection must come from the episode checks, not from stale proofs.

- forged_observation: one environment token changed (a friendlier tool result);
- truncated: the episode cut after its first model turn, claimed complete;
- extra_turn: an observation and a model turn appended after the environment ended the episode;
- env_as_model: the first observation claimed as model-sampled (logprobs invented for it);
- model_as_env: the first token of the second model turn claimed as the environment's.
"""

from __future__ import annotations

import numpy as np
import torch

from environments.base import model_turns
from protocol.models import Completion, FinishReason
from verifier.proofs import build_proofs


def _episode(c: Completion, ids, mask, logprobs, hidden: torch.Tensor, finishes) -> Completion:
    return c.model_copy(update=dict(
        token_ids=np.asarray(ids, dtype=np.int32), env_mask=np.asarray(mask, dtype=np.uint8),
        logprobs=np.asarray(logprobs, dtype=np.float32), proofs=build_proofs(hidden),
        turn_finish_reasons=list(finishes), finish_reason=finishes[-1]))


def multi_turn(c: Completion) -> bool:
    return c.env_mask is not None and len(model_turns(np.asarray(c.env_mask))) >= 2


def forged_observation(c: Completion, hidden: torch.Tensor, rng: np.random.Generator) -> Completion:
    ids, mask = np.asarray(c.token_ids).copy(), np.asarray(c.env_mask)
    env_pos = np.flatnonzero(mask == 1)
    p = int(rng.choice(env_pos))
    vocab_small = 64  # the tiny models' (padded) vocabulary: any other id than the environment's
    ids[p] = (int(ids[p]) + int(rng.integers(1, vocab_small))) % vocab_small
    return _episode(c, ids, mask, c.logprobs, hidden, c.turn_finish_reasons)


def truncated(c: Completion, hidden: torch.Tensor, rng: np.random.Generator | None = None) -> Completion:
    a, b = model_turns(np.asarray(c.env_mask))[0]
    return _episode(c, np.asarray(c.token_ids)[:b], np.asarray(c.env_mask)[:b], np.asarray(c.logprobs)[: b - a],
        hidden[: b - a], c.turn_finish_reasons[:1])


def extra_turn(c: Completion, hidden: torch.Tensor, rng: np.random.Generator) -> Completion:
    ids, mask = np.asarray(c.token_ids), np.asarray(c.env_mask)
    first_obs = ids[mask == 1][:4] if (mask == 1).any() else ids[:2]
    turn = ids[mask == 0][-3:]  # replay the last answer once more
    new_ids = np.concatenate([ids, first_obs, turn])
    new_mask = np.concatenate([mask, np.ones(first_obs.size, np.uint8), np.zeros(turn.size, np.uint8)])
    lps = np.concatenate([np.asarray(c.logprobs), np.asarray(c.logprobs)[-turn.size:]])
    h = torch.cat([hidden, hidden[-turn.size:]])
    return _episode(c, new_ids, new_mask, lps, h, [*c.turn_finish_reasons, FinishReason.stop])


def env_as_model(c: Completion, hidden: torch.Tensor, rng: np.random.Generator | None = None) -> Completion:
    ids, mask = np.asarray(c.token_ids), np.asarray(c.env_mask).copy()
    turns = model_turns(mask)
    (a0, b0), (a1, _) = turns[0], turns[1]
    mask[b0:a1] = 0  # turns 0 and 1 merge into one model turn over the observation
    obs_lp = np.full(a1 - b0, -0.1, dtype=np.float32)
    n0 = b0 - a0
    lps = np.concatenate([np.asarray(c.logprobs)[:n0], obs_lp, np.asarray(c.logprobs)[n0:]])
    h = torch.cat([hidden[:n0], hidden[n0 - 1 : n0].expand(a1 - b0, -1), hidden[n0:]])
    return _episode(c, ids, mask, lps, h, [c.turn_finish_reasons[0], *c.turn_finish_reasons[2:]])


def model_as_env(c: Completion, hidden: torch.Tensor, rng: np.random.Generator | None = None) -> Completion:
    ids, mask = np.asarray(c.token_ids), np.asarray(c.env_mask).copy()
    (a0, b0), (a1, b1) = model_turns(mask)[:2]
    if b1 - a1 < 2:  # the turn must keep a model token: claim its first one only if it has more
        raise ValueError("the second model turn has a single token")
    mask[a1] = 1
    k = (b0 - a0)  # index of turn 1's first model token among model tokens
    keep = np.ones(hidden.shape[0], dtype=bool)
    keep[k] = False
    return _episode(c, ids, mask, np.asarray(c.logprobs)[keep], hidden[torch.from_numpy(keep)], c.turn_finish_reasons)


ATTACKS = {"forged_observation": forged_observation, "truncated_claimed_complete": truncated, "extra_turn": extra_turn,
           "env_tokens_as_model": env_as_model, "model_tokens_as_env": model_as_env}
