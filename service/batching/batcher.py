"""Runs inference off the event loop, merging concurrent requests into one batch (dynamic batching).

One dedicated inference thread takes requests from a bounded queue, merges them along the batch dimension (which
requests, within which limits, padded and cut how: service/batching/merging.py), runs the batch and hands each request its
own rows on the event loop. The thread takes its next batch the moment a run ends, without waiting for the loop.
With the default ``max_queue_delay_ms=0`` a batch is whatever queued up while the previous one ran (no request waits
for company while the model is idle); a positive delay waits that long for more. ``max_batch_size=1`` turns merging
off.

A model with ``lanes`` > 1 (``--parallel-runs``: one per intra-op thread) has that many inference threads: each takes
its own batch and runs it on one thread, beside the others, unless its run is light: at light load (LIGHT_LOAD), no
other lane running and no other request queued (its own pieces may be), the run takes every thread, alone, and no
other lane starts one until it ends. On 2 cores, all-MiniLM-L6-v2, against one run at a time: 1.16-1.37x a second at
32 clients, 1.12x at 8, 1.03-1.05x at one (docs/benchmarks.md, "Parallel runs under load").

A run is never interrupted, and one of ``max_batch_tokens`` positions takes up to a second on a small CPU. So a second
thread, the express lane, runs small requests (each and all together at most ``express_tokens`` positions,
``--express-tokens``) beside a run that holds a bigger request once its lane has held it EXPRESS_AFTER_S (from its
taking, its wait for the cores included): one sentence from another client is answered in tens of milliseconds while
the largest request runs, not after it (``python -m bench --stall``).
A run of small requests only is never overtaken: they wait their turn among peers, and running some of them beside it
slowed the rest (32 clients of 8 real sentences: p99 1.11-1.20x). The lane's runs are small and draw nothing from the CPU
thread budget (``cores``): they share the model's pool with the run they overtake for their few milliseconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from addnorm.model import packing
from addnorm.service.backend.cores import CoreBudget
from addnorm.service.backend.interface import Backend
from addnorm.service.batching import merging
from addnorm.service.batching.merging import BatchObserver, Outputs, Queued, Run, Timings
from addnorm.service.errors import InferenceFailed, Overloaded, ServiceError, ShuttingDown, TimedOut

log = logging.getLogger("addnorm.batcher")
# After this long without work following a run, the model may give back the memory its runs held (its ``release``
# decides whether there is any to give).
RELEASE_IDLE_S = 1.0
# The express lane takes small requests once a lane has held a bigger request's batch this long (from its taking: its
# run may first wait for the cores): a small request waits at most this plus its own run beside the long one (the "no
# request stalls another" bound: 100 ms).
EXPRESS_AFTER_S = 0.05
# A run is at light load (``Backend.run(light=True)``: its threads may spin) when few requests wait on the model, the
# run's own included: the event loop then has little to do beside the run. The load turns light at LIGHT_LOAD requests
# waiting or fewer and heavy again only above HEAVY_LOAD, so that a load between the two keeps one session (runs
# alternating between the two sessions stream two copies of the weights through the caches). On a 2-core Xeon, real
# sentences through /v1/embeddings, against never spinning: 1.03-1.16x at 4 to 16 clients of one sentence, 1.15-1.19x
# at one client of eight, level at 24 and 32; one bound of 8 gave 0.94-1.04x at 12 and 16 clients, one of 4 0.87x at
# 8 (docs/benchmarks.md, "Spinning at light load" and "Light load with hysteresis"). A run at light load is also cut
# by a smaller fixed cost (merging.LIGHT_FIXED).
LIGHT_LOAD, HEAVY_LOAD = 8, 16
# A run whose activations need more than this (``Backend.working_bytes``) runs alone, on every thread, even where the
# model's lanes run side by side: runs side by side hold their activations at once, so this bounds what they add to
# the one run --max-batch-tokens and --max-batch-attention bound (all-MiniLM-L6-v2: above ~7,000 positions; the
# 768-wide default block: above ~3,600).
ALONE_ABOVE_BYTES = 128 * 1024 * 1024


class Batcher:
    """``await batcher.infer(x, mask)`` -> ({output name: its rows}, timings). ``start()``, then ``stop()``."""

    def __init__(
        self,
        model: Backend,
        max_batch_size: int = 32,
        max_batch_tokens: int = 8192,
        max_queue_delay_ms: float = 0.0,
        max_queue_size: int = 256,
        observer: BatchObserver | None = None,
        max_batch_attention: int | None = None,
        heads: int = 1,
        max_queue_bytes: int | None = None,
        attention: str = "decomposed",
        cores: CoreBudget | None = None,
        merge: str = "cost",
        costs: merging.Costs | None = None,
        express_tokens: int = 0,
    ) -> None:
        self.model = model
        self.merge = (
            merge  # "cost" or "pad": how requests of different lengths merge (service/batching/merging.py)
        )
        self.packed = model.packed  # computes real positions only (model/packing.py)
        # its cost model (merging.measure_costs), of the layout the model has
        self.costs = dataclasses.replace(costs or merging.Costs(), packed=self.packed)
        # a run's, when few requests wait on the model (merging.LIGHT_FIXED)
        self._light_costs = self.costs.at_light_load()
        self.cores = cores  # the server's CPU thread budget: each run holds the model's threads of it
        self._threads = model.threads  # what a run at light load holds of the budget
        self._lanes = model.lanes  # runs at once under load, each holding threads // lanes of the budget
        self.limits = merging.Limits(max_batch_size, max_batch_tokens, max_batch_attention, heads, attention)
        # what the express lane runs: requests within these, while a long run is in progress (0: no lane)
        express = min(express_tokens, max_batch_tokens)
        self.express = (
            merging.Limits(max_batch_size, express, max_batch_attention, heads, attention)
            if express
            else None
        )
        self.max_delay = max_queue_delay_ms / 1000.0
        self.max_queue_size = max_queue_size
        self.max_queue_bytes = max_queue_bytes
        self.observer = observer
        self._queue: collections.deque[Queued] = collections.deque()
        self._queued_bytes = 0
        self.depth = 0  # requests queued: one is until the last of its pieces leaves
        self._light = (
            True  # the lanes': whether the last run taken was at light load (LIGHT_LOAD, HEAVY_LOAD)
        )
        # The queue is shared by the event loop (adding) and the inference threads (taking): all under one lock,
        # with a condition for each thread's wait.
        lock = threading.RLock()
        self._ready = threading.Condition(lock)
        self._express_ready = threading.Condition(lock)
        self._big_since: dict[int, float] = {}  # by lane: when it took a big request (``_hold``)
        self._running = 0  # the lanes' runs in progress
        # the lane whose run has every thread and the model to itself (light, or big): no other lane starts one
        self._whole: int | None = None
        self._threads_of: list[threading.Thread] = []
        self._express_thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._hurry = False  # stop() or drain(): no request waits for company any more
        self._ran_since_release = False
        self._idle_due = False  # _take waited RELEASE_IDLE_S for work after a run, and none came

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for lane in range(self._lanes):
            name = "addnorm-infer" if lane == 0 else f"addnorm-infer-{lane + 1}"
            thread = threading.Thread(target=self._work, args=(lane,), name=name, daemon=True)
            self._threads_of.append(thread)
            thread.start()
        if self.express is not None:
            self._express_thread = threading.Thread(target=self._express, name="addnorm-express", daemon=True)
            self._express_thread.start()

    async def stop(self) -> None:
        """Refuse new requests, let a run in progress finish and answer, fail what is still queued."""
        with self._ready:
            self._closed = self._hurry = True
            self._ready.notify_all()
            self._express_ready.notify_all()
        for thread in (*self._threads_of, self._express_thread):
            if thread is not None:
                await asyncio.to_thread(thread.join)
        with self._ready:
            left = [self._pop() for _ in range(len(self._queue))]
        _fail(left, ShuttingDown("server is shutting down"))

    def drain(self) -> None:
        """No new requests will come (unloaded or replaced): run what is queued without waiting for company."""
        with self._ready:
            self._hurry = True
            self._ready.notify_all()

    def _pop(self) -> Queued:
        self._left([item := self._queue.popleft()])
        return item

    def _left(self, items: list[Queued]) -> None:
        for item in items:
            self._queued_bytes -= item.x.nbytes
            item.queued[0] -= 1
            self.depth -= item.queued[0] == 0

    def _withdraw(self, items: list[Queued]) -> None:
        """Take a request's pieces that are still queued out of the queue, so that they stop counting against
        ADDNORM_MAX_QUEUE_SIZE and _BYTES at once, not when an inference thread next reaches them."""
        with self._ready:
            mine = {id(i) for i in items}
            queued = [i for i in self._queue if id(i) in mine]
            if queued:
                self._queue = collections.deque(i for i in self._queue if id(i) not in mine)
                self._left(queued)

    async def infer(
        self, x: np.ndarray | merging.Tokens, mask: np.ndarray | None, timeout: float | None = None
    ) -> tuple[Outputs, Timings]:
        """Queue one (b, s, E) request (embeddings, or a text part's ``Tokens``, embedded by the run that takes
        it) and wait for its rows of every output. A row's trailing padding is never
        computed (it answers zeros): the request is queued as pieces cut to their rows' real lengths
        (``packing.pieces``), merged like requests, each within the attention budget. On a packed graph too, which
        computes no padding's products but pads a run's attention to its longest: there a short row then runs
        apart from a long one where the cost model says so (32 x 8 real sentences a request: 1.29x tokens/s).
        Raises TooLarge, Overloaded, TimedOut, ShuttingDown or InferenceFailed."""
        if self._closed:
            raise ShuttingDown("server is shutting down")
        if timeout is not None and timeout <= 0:  # its deadline passed before it reached the queue
            raise _timed_out(timeout)
        padded = mask is not None and bool(mask.any())
        loop = asyncio.get_running_loop()
        parts = packing.pieces(mask) if padded else None
        cuts = [(x, mask)] if parts is None else [(x[rows, :n], mask[rows, :n]) for rows, n in parts]
        items = [Queued(px, pm, loop.create_future(), padded=padded and bool(pm.any())) for px, pm in cuts]
        for item in items:  # what runs: each piece alone must fit
            self.limits.check(item.rows, item.seq, item.padded)
        size = sum(item.x.nbytes for item in items)
        with self._ready:
            if self.depth >= self.max_queue_size:
                raise Overloaded.by(f"{self.max_queue_size} requests queued: ADDNORM_MAX_QUEUE_SIZE")
            if self.max_queue_bytes is not None and self._queued_bytes + size > self.max_queue_bytes:
                limit = f"limit {self.max_queue_bytes}: ADDNORM_MAX_QUEUE_BYTES"
                raise Overloaded.by(f"{self._queued_bytes} bytes of requests queued, {limit}")
            for item in items:  # the thread skips one once due, even before the loop runs its timer
                item.deadline = None if timeout is None else item.enqueued + timeout
                item.queued = items[0].queued  # one count, of its pieces still queued
            items[0].queued[0] = len(items)
            self._queue.extend(items)
            self._queued_bytes += size
            self.depth += 1
            self._ready.notify()
            if self._big_since:
                self._express_ready.notify()
        # A timer instead of asyncio.wait_for: no extra task per request. Timing out before the run makes the
        # inference thread skip the items; during the run, their rows are dropped. If the awaiting task is cancelled
        # (the client went away) or a piece fails, the others are cancelled too, so they are skipped the same way.
        timer = None if timeout is None else loop.call_later(timeout, _expire, items, timeout)
        try:
            answers = [await item.future for item in items]
        finally:
            if timer is not None:
                timer.cancel()
            for item in items:
                item.future.cancel()  # none if all were answered
            if items[0].queued[
                0
            ]:  # the client left or its deadline passed while it waited: out of the queue now
                self._withdraw(items)
        timings = max((i.timings for i in items), key=lambda t: t.queue_s + t.infer_s)
        return (answers[0] if parts is None else packing.joined(mask, parts, answers)), timings

    # --- the inference threads (lanes) ---

    def _work(self, lane: int = 0) -> None:
        """An inference thread (lane ``lane``): take a batch, run it, hand each request its rows; until stop().

        A finished batch is handed to the event loop only once the next one is taken and merged, right before it
        runs: handing it over wakes the loop into writing that batch's responses, and the loop then holds the GIL
        this thread would otherwise wait for between runs (that wait left the model idle ~11% at 32 clients).
        With a queue delay, the next batch may wait for company, so a finished one is handed over at once.
        """
        done: tuple | None = None  # a finished batch not yet handed to the loop
        while True:
            batch: list[Queued] | None = None
            whole = False
            try:
                batch, whole = self._take(lane, wait=done is None)
                if batch:
                    self._hold(lane, batch)
                    stacked = self._stack(batch)
            except Exception as exc:  # a fault in taking or merging fails what it took, never the thread
                self._fault("taking the next batch", batch, exc)
                if batch:
                    self._ran(lane)
                batch = []
            if done is not None:
                self._post(self._deliver, *done)
                done = None
            if batch is None:
                return
            if not batch:
                if self._idle_due:
                    self._idle()
                continue
            self._ran_since_release = True
            if whole and self._lanes > 1:  # alone: the other lanes' runs end first (none starts meanwhile)
                with self._ready:
                    self._ready.wait_for(lambda: self._running == 1)
            held = self._threads if whole or self._lanes == 1 else max(1, self._threads // self._lanes)
            try:
                with self.cores.hold(held) if self.cores else contextlib.nullcontext():
                    done = self._run(batch, *stacked, light=whole)
            finally:
                self._ran(lane)
            if done is not None and self.max_delay > 0:
                self._post(self._deliver, *done)
                done = None

    def _hold(self, lane: int, batch: list[Queued]) -> None:
        """``lane`` took ``batch``: if it holds a big request, the express lane may overtake it once it has held it
        EXPRESS_AFTER_S, counted from now, not from its run's start: the run may first wait for the cores (heavy
        steps in workers hold them) or for the other lanes' runs to end, and a small request waits all that time
        too (one sentence queued 62-80 ms behind a burst of the largest text requests, up to 30 ms of it before
        the run began)."""
        if self.express is not None and not all(map(self._small, batch)):
            with self._ready:
                self._big_since[lane] = time.perf_counter()
                self._express_ready.notify()

    def _express(self) -> None:
        """The express lane's thread: small requests, taken once a lane has held a bigger request EXPRESS_AFTER_S,
        run beside its run and answered at once; until stop()."""
        while True:
            batch: list[Queued] | None = None
            try:
                if (batch := self._take_express()) is None:
                    return
                done = self._run(batch, *self._stack(batch))
            except Exception as exc:  # never the thread
                self._fault("the express lane's run", batch, exc)
                continue
            if done is not None:
                self._post(self._deliver, *done)

    def _ran(self, lane: int) -> None:
        """A lane's run ended (or failed before it began): the other lanes may start theirs. They are woken only
        when one may: a request is queued, or another run is in progress (a run alone on every thread waits for
        the others' ends); an idle lane woken for nothing cost a lone request 0.07-0.2 ms on a 2-core VM."""
        with self._ready:
            self._big_since.pop(lane, None)
            self._running -= 1
            if self._whole == lane:
                self._whole = None
            if self._queue or self._running:
                self._ready.notify_all()

    def _fault(self, what: str, batch: list[Queued] | None, exc: Exception) -> None:
        """A fault of the batcher's own (not the engine's: _run fails those): log it, fail the requests it held
        with InferenceFailed (500), and let the thread go on serving. Requests it had taken but not yet returned
        are answered at their deadline (504)."""
        log.error("%s failed: %s", what, type(exc).__name__, exc_info=exc)
        if batch:
            self._post(_fail, batch, InferenceFailed(f"inference failed: {type(exc).__name__}"))

    def _stack(self, batch: list[Queued]) -> tuple[np.ndarray, np.ndarray | None, float, float]:
        """``batch`` as one (x, mask), with when its run started and when merging it ended."""
        started = time.perf_counter()
        for item in batch:
            item.timings.queue_s = started - item.enqueued
        x, mask = merging.stack(batch)
        return x, mask, started, time.perf_counter()

    def _run(
        self,
        batch: list[Queued],
        x: np.ndarray,
        mask: np.ndarray | None,
        started: float,
        merged: float,
        light: bool = False,
    ) -> tuple[list[Queued], list[Outputs], Run] | None:
        """Run a stacked batch: (its requests, their rows, the run) to deliver; None when it failed (its requests
        are failed on the loop). ``light``: the run has every thread and the model to itself (``Backend.run``)."""
        try:
            lengths = (np.concatenate([i.lengths for i in batch]),) if self.packed else ()
            out = self.model.run(x, mask, *lengths, light=light)
            ran = time.perf_counter()
            rows = merging.split(batch, out)
        except ServiceError as exc:
            self._post(_fail, batch, exc)
            return None
        except Exception as exc:  # an engine failure fails its batch, never the thread
            log.exception("inference failed for a batch of %d request(s)", len(batch))
            self._post(_fail, batch, InferenceFailed(f"inference failed: {type(exc).__name__}"))
            return None
        for item in batch:
            item.timings.infer_s = ran - merged
            item.timings.batch_rows = x.shape[0]
        requested = sum(item.tokens for item in batch)  # theirs less trailing padding
        run = Run(
            rows=x.shape[0],
            requests=len({id(item.queued) for item in batch}),
            seconds=ran - merged,
            merge_s=merged - started,
            split_s=time.perf_counter() - ran,
            positions=requested if self.packed else x.shape[0] * x.shape[1],
            requested=requested,
        )
        return batch, rows, run

    def _idle(self) -> None:
        """The model has had no work for RELEASE_IDLE_S after a run: let it give back what its runs held."""
        self._ran_since_release = self._idle_due = False
        try:
            if self.model.release():
                log.debug("idle for %g s: gave back the memory of the last runs", RELEASE_IDLE_S)
                # The last runs' requests may still be being answered (a big text request assembles and encodes
                # its answer after its last run), holding memory this release could not give back: ask again
                # after the next idle second, until the model has nothing more to give.
                self._ran_since_release = True
        except Exception:  # never the thread
            log.exception("releasing the model's memory failed")

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the event loop; dropped if the loop is already closed (the process is ending)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            log.warning("event loop closed: a finished batch of inference was not delivered")

    def _deliver(self, batch: list[Queued], rows: list[Outputs], run: Run) -> None:
        """On the event loop: each request's rows to its future (unless it timed out or its client left); the
        observers are told of the run after the requests' own steps, which write their answers first (cold after
        a run, the metrics' updates took 40-60 µs of a lone request's path: ``bench.studies.lone_request``)."""
        for item, result in zip(batch, rows, strict=True):
            if not item.future.done():
                item.future.set_result(result)
        if self.observer is not None:
            self._loop.call_soon(self.observer.batch_done, run)

    def _light_at(self, waiting: int) -> bool:
        """Whether a run with ``waiting`` requests on the model is at light load: LIGHT_LOAD or fewer, or HEAVY_LOAD or
        fewer while the last run was light (the lanes' state, under the lock)."""
        return waiting <= (HEAVY_LOAD if self._light else LIGHT_LOAD)

    def _take(self, lane: int = 0, wait: bool = True) -> tuple[list[Queued] | None, bool]:
        """Wait for a first request (``wait``; else return [] when none is queued; [] too after RELEASE_IDLE_S
        without one following a run, on lane 0, which alone lets the model release memory), then up to max_delay
        for more, and take what fits; None once stopped. With it, whether its run has every thread and the model to
        itself (``_started``). No lane takes one while such a run is in progress."""
        with self._ready:
            while wait and (not self._queue or self._whole is not None) and not self._closed:
                if self._ran_since_release and lane == 0:
                    if not self._ready.wait(RELEASE_IDLE_S) and not self._queue and not self._running:
                        self._idle_due = True  # idle that long: the caller lets the model release its memory
                        return [], False
                else:
                    self._ready.wait()
            if self._closed:
                return None, False
            if not self._queue or self._whole is not None:
                return [], False
            if self.limits.max_batch_size > 1 and self.max_delay > 0:
                self._ready.wait_for(
                    lambda: self._hurry or sum(i.rows for i in self._queue) >= self.limits.max_batch_size,
                    self.max_delay,
                )
            # skip what timed out or whose client left before it ran (its timer answers it); the wait for company
            # let go of the lock, and a request whose client left meanwhile was withdrawn: the queue may be empty
            now = time.perf_counter()
            while self._queue and self._queue[0].dropped(now):
                self._pop()
            if not self._queue:
                return [], False
            head = self._pop()
            if head.solo or not self._queue:  # alone, or nothing to join it (choosing among none: 25 µs cold)
                return self._started(lane, [head])
            live = (i for i in self._queue if not i.dropped(now))  # the others are dropped as they come up
            # requests waiting on the model, the head's own included: at light load, two or more cut by the light
            # costs (a lone request's pieces have nothing else coming to join them)
            waiting = self.depth + (head.queued[0] == 0)
            costs = self._light_costs if waiting >= 2 and self._light_at(waiting) else self.costs
            chosen = merging.choose(self.merge, head, live, self.limits, costs)
            if chosen:
                taken = {id(i) for i in chosen}
                self._queue = collections.deque(i for i in self._queue if id(i) not in taken)
                self._left(chosen)
            return self._started(lane, [head, *chosen])

    def _started(self, lane: int, batch: list[Queued]) -> tuple[list[Queued], bool]:
        """Under the lock, as ``lane`` takes ``batch``: (it, whether its run has every thread and the model to
        itself). Light: few requests wait on the model (those still queued, and those this run ends:
        ``_light_at``), no other lane is running and, with lanes, no request outside this run is queued (one
        client's request cut into pieces runs them one after another on every thread: 1.05x its sentences a
        second against pieces side by side, 0.85x). With lanes, a run above ALONE_ABOVE_BYTES has the model to
        itself too, once the runs in progress end. No other lane starts a run until it ends (``_ran``)."""
        load = self.depth + len({id(i.queued) for i in batch if not i.queued[0]})
        light = self._light_at(load) and self._running == 0
        if light and self._lanes > 1:  # every thread only when no other request waits for a lane of its own
            mine = {id(i.queued) for i in batch}
            light = all(id(i.queued) in mine for i in self._queue)
        self._light = light
        whole = light or (self._lanes > 1 and self._big(batch))
        self._running += 1
        if whole:
            self._whole = lane
        return batch, whole

    def _big(self, batch: list[Queued]) -> bool:
        """Whether ``batch``'s run needs more than ALONE_ABOVE_BYTES of activations."""
        rows, seq = sum(i.rows for i in batch), max(i.seq for i in batch)
        return self.model.working_bytes(rows, seq, any(i.padded for i in batch)) > ALONE_ABOVE_BYTES

    def _take_express(self) -> list[Queued] | None:
        """Wait until a small request is queued while a lane has held a bigger one EXPRESS_AFTER_S (``_hold``),
        then take it and the small ones that merge with it within ``express``; None once stopped."""
        with self._ready:
            while not self._closed:
                wait = None  # until a request is queued or a run starts
                if self._big_since:
                    since = min(self._big_since.values())
                    now = time.perf_counter()
                    wait = since + EXPRESS_AFTER_S - now
                    if wait <= 0:
                        if batch := self._express_batch(now):
                            return batch
                        wait = None
                self._express_ready.wait(wait)
            return None

    def _small(self, item: Queued) -> bool:
        """Whether ``item`` fits the express lane."""
        return self.express.fits(item.rows, item.seq, item.padded)

    def _express_batch(self, now: float) -> list[Queued]:
        """Out of the queue: the oldest live request that fits the express lane, and those to run with it."""
        small = [i for i in self._queue if not i.dropped(now) and self._small(i)]
        if not small:
            return []
        head = small[0]
        chosen = [] if head.solo else merging.choose(self.merge, head, small[1:], self.express, self.costs)
        taken = {id(i) for i in (head, *chosen)}
        self._queue = collections.deque(i for i in self._queue if id(i) not in taken)
        self._left([head, *chosen])
        return [head, *chosen]


def _timed_out(timeout: float) -> TimedOut:
    return TimedOut(f"request not answered within {timeout:g} s (ADDNORM_REQUEST_TIMEOUT_S)")


def _expire(items: list[Queued], timeout: float) -> None:
    _fail(items, _timed_out(timeout))


def _fail(batch: list[Queued], exc: Exception) -> None:
    for item in batch:
        if not item.future.done():
            item.future.set_exception(exc)
