"""Prometheus metrics, one registry per app (so several apps in one process never clash)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from service.batcher import Run

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
            "sequence positions computed by model runs: kind=requested (the requests' own, their padding "
            "included) or kind=padding (added to merge requests of different lengths)",
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
        """A live parity event (service/live_parity.py): checked (with its ratio), failed or dropped."""
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
