"""The statistics extension of the Open Inference Protocol, in the shape Triton gives it, for one model.

Counts and nanoseconds since start-up, per request (``success``/``fail`` end to end in the server; ``queue``,
``compute_input`` = decoding its tensors, ``compute_infer`` = the run it was part of, ``compute_output`` = encoding
its outputs) and per model run (``batch_stats`` by batch size in rows: merging the batch, the run, cutting each
request's rows). ``inference_count`` counts rows answered, ``execution_count`` model runs. Everything is updated on
the event loop (request handlers and the batcher's scheduler), so nothing here takes a lock. And ``InFlight``: the
requests using a model right now, which model control waits for before it stops a replaced one.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from service.batcher import Run, Timings

_NS = 1e9


class Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * _NS)

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class _Batch:
    __slots__ = ("compute_input", "compute_infer", "compute_output")

    def __init__(self) -> None:
        self.compute_input, self.compute_infer, self.compute_output = Duration(), Duration(), Duration()


class ModelStatistics:
    """One model's statistics; a BatchObserver for its batcher, and ``request()`` times each request."""

    STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.stages = {stage: Duration() for stage in self.STAGES}
        self.batches: dict[int, _Batch] = {}

    def request(self, started: float | None = None) -> RequestTimer:
        """``with stats.request() as t:`` around a request once its model is known: it counts as a failure if
        the block raises (anything: a bad input, a timeout, a client gone). ``started``: a ``perf_counter`` time
        the request began before the block (when the model was known only once its body was read)."""
        return RequestTimer(self, started)

    # BatchObserver
    def batch_done(self, run: Run) -> None:
        self.execution_count += 1
        self.last_inference_ms = time.time_ns() // 1_000_000
        batch = self.batches.get(run.rows)
        if batch is None:
            batch = self.batches[run.rows] = _Batch()
        batch.compute_input.add(run.merge_s)
        batch.compute_infer.add(run.seconds)
        batch.compute_output.add(run.split_s)

    def to_dict(self) -> dict:
        """One ``model_stats`` entry, as Triton's HTTP statistics endpoint writes it."""
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                **{stage: d.to_dict() for stage, d in self.stages.items()},
                "cache_hit": {"count": 0, "ns": 0},  # no response cache
                "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.to_dict(),
                    "compute_infer": b.compute_infer.to_dict(),
                    "compute_output": b.compute_output.to_dict(),
                }
                for size, b in sorted(self.batches.items())
            ],
        }


class RequestTimer:
    """Times one request's stages; see ModelStatistics.request."""

    __slots__ = ("stats", "started", "start", "decoded_at", "inferred_at", "timings", "rows")

    def __init__(self, stats: ModelStatistics, started: float | None = None) -> None:
        self.stats = stats
        self.started = started
        self.timings: Timings | None = None
        self.rows = 0

    def __enter__(self) -> RequestTimer:
        self.start = self.decoded_at = self.inferred_at = time.perf_counter()
        if self.started is not None:
            self.start = self.started
        return self

    def decoded(self) -> None:
        self.decoded_at = time.perf_counter()

    def inferred(self, timings: Timings, rows: int) -> None:
        self.inferred_at = time.perf_counter()
        self.timings, self.rows = timings, rows

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        end = time.perf_counter()
        stages = self.stats.stages
        if kind is not None or self.timings is None:
            stages["fail"].add(end - self.start)
            return
        stages["success"].add(end - self.start)
        stages["queue"].add(self.timings.queue_s)
        stages["compute_input"].add(self.decoded_at - self.start)
        stages["compute_infer"].add(self.timings.infer_s)
        stages["compute_output"].add(end - self.inferred_at)
        self.stats.inference_count += self.rows


class InFlight:
    """The requests using a model right now (``ServingModel.request`` in the request core), so that a model
    being replaced or unloaded is stopped only once the last of them is answered (``idle``)."""

    __slots__ = ("count", "_idle")

    def __init__(self) -> None:
        self.count = 0
        self._idle: asyncio.Event | None = None

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self) -> None:
        while self.count:
            self._idle = asyncio.Event()
            await self._idle.wait()
