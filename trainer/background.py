"""One background thread that makes the trainer's steps durable, in step order, while the next step trains.

    writer = BackgroundWriter()
    writer.submit(job)   # job(): publish, checkpoint, commit; waits first while the previous job runs
    writer.flush()       # returns once every submitted job has finished

At most one job runs and none waits: `submit` blocks while the previous step's job is still writing. That
is the backpressure that keeps the durable state at most one step behind the weights (a slow disk slows
the trainer down instead of piling up copies of the state), and it keeps the jobs in order, so that a
step is never committed before the one before it.

A job that raises fails the writer: the next `submit` or `flush` raises it in the trainer's thread (e.g.
a full disk stops the run with its real error, instead of a run whose checkpoints silently stopped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundWriter:
    def __init__(self, name: str = "trainer-writer"):
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self.waited_s = 0.0  # time submit() spent waiting for the previous job (the critical path's share)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> float:
        """Queue a job once the previous one has finished; returns how long that wait was."""
        t = time.perf_counter()
        with self._cond:
            while self._busy and self._error is None:
                self._cond.wait()
            self._raise()
            self._job, self._busy = job, True
            self._cond.notify_all()
        waited = time.perf_counter() - t
        self.waited_s += waited
        return waited

    @property
    def busy(self) -> bool:
        return self._busy

    def flush(self) -> None:
        with self._cond:
            while self._busy and self._error is None:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the trainer's background writer failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                job = self._job
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
                with self._cond:
                    self._error = exc
            with self._cond:
                self._job, self._busy = None, False
                self._cond.notify_all()
