"""The server's CPU thread budget: every model's onnxruntime runs draw from one budget of threads.

Each model's session has its own intra-op pool (``--intra-op-threads``, or its ``--model-threads NAME=N``); a
run holds that many of the budget's threads (``--thread-budget``, default the physical cores) while it runs. Two
busy models whose pools are each the whole budget therefore take turns, each run on every core, instead of
running side by side on twice as many threads as there are cores (onnxruntime's pools then preempt each other);
models given a share each (``--model-threads a=1,b=1`` on 2 cores) run side by side. Waiters are served in
arrival order, so a busy model never starves another. Only CPU runs draw from it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator


class CoreBudget:
    """A counting semaphore of threads with first-come, first-served waiting."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._free = self.threads
        self._cond = threading.Condition()
        self._waiting: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def hold(self, threads: int) -> Iterator[None]:
        """Hold ``threads`` of the budget (at most all of it) for the duration of a run."""
        n = min(max(1, threads), self.threads)
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket or self._free < n:
                self._cond.wait()
            self._waiting.popleft()
            self._free -= n
            self._cond.notify_all()  # the next in line may fit in what is left
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()

    @property
    def free(self) -> int:
        return self._free

    @property
    def waiting(self) -> int:
        """How many runs wait for their threads."""
        return len(self._waiting)
