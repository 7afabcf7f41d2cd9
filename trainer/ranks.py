"""Rank 0 leads, the other ranks follow: how N trainer processes stay in step while only rank 0 talks
to the outside (takes batches, publishes through the origin, commits, writes each checkpoint's model and
state; every rank writes its own shard of the optimizer state).

Every call that all ranks must make together (a step and the collectives inside it, the state of a
checkpoint, the weights to publish) is a `Trainer` method marked `@collective`. On rank 0, entering such
a method from outside any other first broadcasts its name and arguments (a step's samples included);
each other rank sits in `follow`, receives the call and makes it, so every collective runs in the same
order on every rank. Only the trainer's own thread makes collective calls (the background writer does
not), so the broadcasts never interleave.

    lead(trainer)      # rank 0, after the Trainer is built (its constructor's collectives run on all ranks)
    follow(trainer)    # ranks > 0: returns when rank 0 calls release()
    heartbeat(trainer) # rank 0, while it waits for batches: the followers' receive must not time out
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from trainer import distributed as dist_utils

log = logging.getLogger(__name__)

NOOP = "noop"  # a heartbeat: nothing to do
STOP = "stop"


def collective(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Trainer method that every rank must call together. On rank 0 of a Ray group (`lead`), a call from
    outside any other collective method first tells the other ranks to make it too."""

    @functools.wraps(method)
    def call(self: Any, *args: Any) -> Any:
        if self.announce is None or self._in_collective:
            return method(self, *args)
        self.announce(method.__name__, args)
        self._in_collective = True
        try:
            return method(self, *args)
        finally:
            self._in_collective = False

    call.collective = True  # type: ignore[attr-defined]
    return call


def lead(trainer: Any) -> None:
    """Make `trainer` (rank 0 of a group) announce every collective call to the followers."""
    if not trainer.env.is_main:
        raise ValueError("only rank 0 leads")
    if trainer.env.enabled:
        trainer.announce = lambda name, args: dist_utils.broadcast_object((name, args), trainer.env)


def heartbeat(trainer: Any) -> None:
    """A call that does nothing: the followers' pending receive completes, so no rank waits on a collective
    for longer than rank 0 waits between two heartbeats (a receive times out after the group's timeout)."""
    if trainer.announce is not None:
        trainer.announce(NOOP, ())


def release(trainer: Any) -> None:
    """End the followers' `follow` (the group is done)."""
    if trainer.announce is not None:
        trainer.announce(STOP, ())
        trainer.announce = None


def follow(trainer: Any) -> int:
    """Make every call rank 0 announces, until it releases the group. Returns the number of calls made."""
    if trainer.env.is_main:
        raise ValueError("rank 0 leads; it does not follow")
    calls = 0
    while True:
        name, args = dist_utils.broadcast_object(None, trainer.env)  # type: ignore[misc]
        if name == STOP:
            return calls
        if name == NOOP:
            continue
        method = getattr(type(trainer), name, None)
        if not getattr(method, "collective", False):
            raise RuntimeError(f"rank 0 announced {name!r}, which is not a collective Trainer method")
        getattr(trainer, name)(*args)
        calls += 1
