"""Room under the async bound: the signal that wakes lease requests held on the event loop (the long poll
of orchestrator/api.py) when a verdict, a trained batch or a lease given back may have made some.
"""

from __future__ import annotations

import asyncio
from collections import deque


class RoomSignal:
    """Wakes the lease requests held on the event loop (a long poll) when room under the async bound may
    have freed up. `notify` is called from any thread (verification, the trainer's pulls, housekeeping).

    One waiter per notification, first come first served, and a waiter that got a lease (or any answer
    but "the bound is full") passes it on: a freed prompt costs one retry, not one per waiting worker (a
    thousand workers waking for every verdict would be the herd the long poll exists to avoid)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def wait(self, timeout_s: float) -> None:
        loop = self._loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        self._waiters.append(woken)
        try:
            await asyncio.wait_for(woken, timeout_s)
        except TimeoutError:
            pass
        finally:
            if not woken.done() or woken.cancelled():
                try:
                    self._waiters.remove(woken)
                except ValueError:
                    pass

    def notify(self, everyone: bool = False) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, everyone)

    def _wake(self, everyone: bool) -> None:
        while self._waiters:
            woken = self._waiters.popleft()
            if not woken.done():
                woken.set_result(None)
                if not everyone:
                    return
