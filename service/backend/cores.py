"""The server's thread policy, in one place: how many threads a worker has (physical cores, capped by the
container's CPU quota, split among workers: ``default_threads``), each model's share of them (``threads_for``), and
the budget every model's onnxruntime runs draw from.

Each model's session has its own intra-op pool (``--intra-op-threads``, or its ``--model-threads NAME=N``); a
run holds that many of the budget's threads (``--thread-budget``, default the physical cores) while it runs. Two
busy models whose pools are each the whole budget therefore take turns, each run on every core, instead of
running side by side on twice as many threads as there are cores (onnxruntime's pools then preempt each other);
models given a share each (``--model-threads a=1,b=1`` on 2 cores) run side by side. Waiters are served in
arrival order, so a busy model never starves another. Only CPU runs draw from it.

A request's CPU-heavy steps beside the model's runs (decoding a big body, tokenizing many texts, embedding a text
part, joining a request's parts, encoding a big answer) leave the event loop for a worker thread, a few at a time
(``in_worker``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from addnorm.service.settings import Settings

T = TypeVar("T")


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


def physical_cores(cpuinfo: str | None = None, allowed: set[int] | None = None) -> int:
    """Physical cores this process may run on (hyper-threads share a core's GEMM units).

    ``cpuinfo`` (the text of /proc/cpuinfo) and ``allowed`` (the CPU affinity) default to this machine's.
    """
    if allowed is None:
        try:
            allowed = os.sched_getaffinity(0)
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as fh:
                cpuinfo = fh.read()
        except OSError:
            cpuinfo = ""
    cores = set()
    cpu, phys = None, "0"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            cpu = int(value) if value.isdigit() else None
        elif key == "physical id":
            phys = value
        elif key == "core id" and cpu in allowed:
            cores.add((phys, value))
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def cpu_quota(cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPUs this container may use by its cgroup CPU quota (cgroup v2 cpu.max, or v1 cfs_quota_us); None = none."""
    root = Path(cgroup_root)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in ("cpu", "cpu,cpuacct"):
        try:
            quota_us = int((root / v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((root / v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def default_threads(workers: int = 1, cores: int | None = None, quota: float | None = -1.0) -> int:
    """Intra-op threads per worker: physical cores, capped by the container's CPU quota, split among workers.

    A container limited to 2 CPUs on a 64-core host must not start 64 threads: they would be throttled.
    """
    cores = physical_cores() if cores is None else cores
    quota = cpu_quota() if quota == -1.0 else quota
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores // max(1, workers))


def threads_for(settings: Settings, name: str, budget: int, models: int = 1) -> int:
    """The intra-op threads of model ``name``: its --model-threads entry, else --intra-op-threads, else an equal
    share of the budget among the ``models`` served (at least one thread)."""
    for item in settings.model_threads:
        key, _, n = item.partition("=")
        if key.strip() == name:
            return int(n)
    return settings.intra_op_threads or max(1, budget // max(1, models))


# Each event loop's gate on its worker threads' heavy steps: at most half the cores' worth run at once, so that many
# clients' big requests decoding together leave the event loop (another client's small request) and the model their
# cores (docs/reliability.md, "One big request, and the others").
_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


async def in_worker(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a worker thread, behind the running event loop's gate of max(1, cores / 2) such steps."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = asyncio.Semaphore(max(1, default_threads() // 2))
    async with gate:
        return await run_in_threadpool(fn, *args)
