"""What the server counts: Prometheus metrics, one registry per app (so several apps in one process never clash),
and the statistics extension of the Open Inference Protocol per model.

The statistics are in the shape Triton gives them: counts and nanoseconds since start-up, per request
(``success``/``fail`` end to end in the server; ``queue``, ``compute_input`` = decoding its tensors,
``compute_infer`` = the run it was part of, ``compute_output`` = encoding its outputs) and per model run
(``batch_stats`` by batch size in rows: merging the batch, the run, cutting each request's rows).
``inference_count`` counts rows answered, ``execution_count`` model runs. Everything is updated on the event loop
(request handlers and the batcher's scheduler), so nothing here takes a lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from addnorm.service.batching.merging import Run, Timings

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self._series: dict[tuple, tuple] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "addnorm_requests", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "addnorm_request_duration_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "addnorm_inference_duration_seconds",
            "time of one model run (one batch)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "addnorm_batch_size", "rows per model run", ["model"], buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "addnorm_batch_requests",
            "requests merged per model run",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.positions = Counter(
            "addnorm_batch_positions",
            "sequence positions computed by model runs: kind=requested (the requests' own, less each row's "
            "trailing padding, which is never computed) or kind=padding (added to merge requests of "
            "different lengths; none on a packed graph)",
            ["model", "kind"],
            registry=r,
        )
        self.queue = Gauge("addnorm_queue_depth", "requests waiting for a model run", ["model"], registry=r)
        self.golden = Gauge(
            "addnorm_golden_verified",
            "load-time golden check: 1 passed, 0 failed, -1 not run",
            ["model"],
            registry=r,
        )
        self.parity = {
            kind: Counter(
                f"addnorm_live_parity_{kind}", f"live parity: sampled answers {what}", ["model"], registry=r
            )
            for kind, what in (
                ("checked", "checked"),
                ("failed", "that failed"),
                ("dropped", "dropped (queue full)"),
                ("errors", "that could not be checked (the checker failed: see the log)"),
            )
        }
        self.parity_ratio = Histogram(
            "addnorm_live_parity_error_ratio",
            "live parity: a sampled answer's error vs float64 over the verdict's allowance (above 1: failed)",
            ["model"],
            buckets=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0),
            registry=r,
        )
        self.golden_err = Gauge(
            "addnorm_golden_max_abs_error",
            "load-time golden check: max abs error vs torch",
            ["model"],
            registry=r,
        )

    def model(self, name: str, queue_depth: Callable[[], int]) -> ModelMetrics:
        """The batch observer that records one model's runs, under its ``model`` label; ``queue_depth`` is read
        at each scrape (kept current per request, it cost the event loop a locked update on every enqueue)."""
        self.queue.labels(name).set_function(queue_depth)
        for counter in self.parity.values():  # live parity's series exist from the start, at 0
            counter.labels(name)
        return ModelMetrics(self, name)

    def verification(self, model: str, v) -> None:
        self.golden.labels(model).set({"passed": 1, "failed": 0}.get(v.status, -1))
        if v.max_abs_err is not None:
            self.golden_err.labels(model).set(v.max_abs_err)

    def live_parity(self, model: str, kind: str, ratio: float | None = None) -> None:
        """A live parity event (service/models/live_parity.py): checked (with its ratio), failed, dropped or errors."""
        self.parity[kind].labels(model).inc()
        if ratio is not None:
            self.parity_ratio.labels(model).observe(ratio)

    def observe_request(self, route: str, method: str, status: int | str, seconds: float) -> None:
        key = (route, method, status)
        series = self._series.get(key)
        if series is None:  # labels() hashes and validates on every call: look each series up once
            series = self._series[key] = (
                self.requests.labels(route, method, str(status)),
                self.latency.labels(route),
            )
        series[0].inc()
        series[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's series (a BatchObserver): the labelled children are looked up once, not per run."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.inference = metrics.inference.labels(name)
        self.batch_rows = metrics.batch_rows.labels(name)
        self.batch_requests = metrics.batch_requests.labels(name)
        self.requested = metrics.positions.labels(name, "requested")
        self.padding = metrics.positions.labels(name, "padding")

    def batch_done(self, run: Run) -> None:
        self.inference.observe(run.seconds)
        self.batch_rows.observe(run.rows)
        self.batch_requests.observe(run.requests)
        self.requested.inc(run.requested)
        self.padding.inc(run.positions - run.requested)


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
