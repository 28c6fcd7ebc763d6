"""Live parity: a sample of served answers recomputed in float64 and judged by the gate's own rule.

The request core (``inference.run``) offers each answered request with probability ``--live-parity-rate``: its
input and the answer it was sent are copied to a bounded queue, or dropped and counted when the queue is full; the
request never waits. One thread takes samples and recomputes each with the numpy reference
(``model.reference``, no torch) in float64 (the oracle), in float32 (what any float32 implementation's own error
looks like, standing in for the gate's torch fp32) and, for a lossy variant (int8, fp16), in that variant's own
arithmetic (``model.schemes``, as the gate's scheme), then judges the served answer with ``model.verdict.compare``
under the artifact's own tolerance (the one its gate and its load-time check used).
The thread keeps its CPU share under ``--live-parity-budget`` by resting after each check. With
``--live-parity-action unready``, ``--live-parity-failures`` failures within ``--live-parity-window-s`` mark the
model UNAVAILABLE with the reason, so an orchestrator stops routing to this replica.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from addnorm.model import reference, schemes
from addnorm.model.artifact import Manifest, read_weights
from addnorm.model.contract import positional
from addnorm.model.packing import answered
from addnorm.model.verdict import Tolerance, compare
from addnorm.service import logs
from addnorm.service.backend import engine
from addnorm.service.batching.merging import Tokens, embedded

log = logging.getLogger("addnorm.live_parity")
QUEUE = 8  # samples waiting for the checker; more are dropped (and counted)
WEIGHTS_KEPT = 4  # artifacts whose weights the checker keeps in memory
# After checking a sample this large (elements of its input), the heap's free pages go back to the OS: its float64
# temporaries run to megabytes. A smaller one's fit in what the heap keeps anyway, and malloc_trim walks and locks
# every arena the request path allocates from: trimming after every sample would stall the requests it samples.
TRIM_AFTER_ELEMENTS = 1 << 16
# The reference holds a request's seq x seq scores in float64: one [1, 4096, 768] request would take 1.6 GB. A
# request whose batch x heads x seq^2 is above this (32 MB of scores; [8, 128] at 12 heads is 1.6M) is not sampled.
MAX_SCORES = 4 * 1024 * 1024


@dataclass
class Counts:
    """One model's live parity so far (for /v1/model and the statistics)."""

    checked: int = 0
    failed: int = 0
    dropped: int = 0
    errors: int = 0  # samples the checker could not check (its weights unreadable, say): logged each time
    worst_ratio: float = 0.0  # the largest error over the verdict's allowance seen
    recent_failures: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))

    def to_dict(self) -> dict:
        return {
            "checked": self.checked,
            "failed": self.failed,
            "dropped": self.dropped,
            "errors": self.errors,
            # 4 significant digits, not 4 decimals: an int8 graph is 1e-5 of its allowance from its scheme
            "worst_ratio": float(f"{self.worst_ratio:.4g}"),
        }


@dataclass
class _Sample:
    model: object  # service.models.state.ServingModel
    request_id: str
    embeddings: np.ndarray | Tokens  # a text request's tokens are embedded by the checker (``_work``)
    mask: np.ndarray | None
    answers: dict[str, np.ndarray]  # every output by name, the rows the client was sent


def _rows(name: str, real: np.ndarray | None) -> np.ndarray | None:
    """The real tokens of a positional output; every row of a pooled one."""
    return real if positional(name) else None


def judged(manifest) -> bool:
    """Whether live parity judges this model: every variant whose arithmetic model/schemes.py knows (fp32, fused,
    int8, fp16); a variant it does not know (a newer exporter's) is not judged, and /v1/model says so."""
    return schemes.for_variant(manifest.variant) is not None


@dataclass
class _Weights:
    """One artifact's weights as the checker computes with them."""

    f64: dict
    f32: dict
    scheme: schemes.Exact  # the variant's arithmetic
    scheme_weights: dict | None  # None for an exact variant (no scheme run)


class LiveParity:
    """The sampler (``offer``, on the event loop) and its checker thread; one per server."""

    @classmethod
    def from_settings(cls, settings, metrics, unready: Callable[[str, str], None]) -> LiveParity:
        """The checker the ``--live-parity-*`` settings describe."""
        return cls(
            settings.live_parity_rate,
            settings.live_parity_budget,
            settings.live_parity_action,
            settings.live_parity_failures,
            settings.live_parity_window_s,
            metrics,
            unready,
        )

    def __init__(
        self,
        rate: float,
        budget: float,
        action: str,
        failures: int,
        window_s: float,
        metrics,  # service.metrics.Metrics
        unready: Callable[[str, str], None],  # (model name, reason), called on the app's event loop
    ) -> None:
        self.rate, self.budget, self.action = rate, budget, action
        self.failures, self.window_s = failures, window_s
        self.metrics, self.unready = metrics, unready
        self.counts: dict[str, Counts] = collections.defaultdict(Counts)
        self._queue: queue.Queue[_Sample | None] = queue.Queue(QUEUE)
        self._weights: dict[Path, _Weights] = {}  # by artifact directory
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the checker; ``unready`` is called on ``loop`` (the app's)."""
        self._loop = loop
        if self.rate > 0:
            self._thread = threading.Thread(target=self._work, name="addnorm-live-parity", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # full: a daemon thread, it ends with the process
                self._queue.put_nowait(None)
            self._thread = None

    def offer(
        self, model, embeddings: np.ndarray, mask: np.ndarray | None, answers: dict[str, np.ndarray]
    ) -> None:
        """Called for every answered request (the request core): keeps a copy with probability ``rate``; never
        blocks. ``embeddings`` (B, S, E) as the model ran them, ``answers`` the rows of every output the client
        may be sent."""
        if self.rate <= 0 or random.random() >= self.rate or not judged(model.engine.manifest):
            return
        b, seq = embeddings.shape[:2]
        if b * model.engine.heads * seq * seq > MAX_SCORES:  # too big for the checker: not sampled
            return
        sample = _Sample(
            model,
            logs.request_id.get(),
            embeddings if isinstance(embeddings, Tokens) else np.array(embeddings, copy=True),
            None if mask is None else np.array(mask, copy=True),
            {name: np.array(a, copy=True) for name, a in answers.items()},
        )
        try:
            self._queue.put_nowait(sample)
        except queue.Full:
            self.counts[model.name].dropped += 1
            self.metrics.live_parity(model.name, "dropped")

    # --- the checker thread ---

    def _work(self) -> None:
        # At the server's own priority: at nice 19 (once, for only the CPU the server left idle) it held the
        # interpreter lock while the busy cores were given to others, and every thread waited for it (a one-sentence
        # request 180-440 ms during a burst of big text requests, python -m bench --stall). Its budget keeps it small.
        while (sample := self._queue.get()) is not None:
            start = time.perf_counter()  # wall time: numpy's BLAS threads work for it too
            try:
                sample.embeddings = embedded(sample.embeddings)  # as the run embedded them: the same layer
                self.check(sample)
            except Exception:  # never the thread; counted, so checked 0 and failed 0 cannot read as all well
                log.exception("live parity check of %s failed to run", sample.model.name)
                self.counts[sample.model.name].errors += 1
                self.metrics.live_parity(sample.model.name, "errors")
            if sample.embeddings.size >= TRIM_AFTER_ELEMENTS:
                engine.trim()  # the reference's float64 temporaries: give their pages back
            busy = time.perf_counter() - start
            if self.budget < 1:  # rest so that busy / (busy + rest) <= budget
                time.sleep(busy * (1 / self.budget - 1))

    def check(self, s: _Sample) -> None:
        manifest = s.model.engine.manifest
        # the API's layout (batch first), whatever the graph's
        config = dataclasses.replace(manifest.config, batch_first=True)
        w = self._weights_of(s.model.engine.directory, manifest)
        with np.errstate(all="ignore"):  # fp16's scheme overflows on large inputs; compare() then ignores it
            x64 = reference.outputs(config, w.f64, s.embeddings, s.mask)
            x32 = reference.outputs(config, w.f32, s.embeddings, s.mask)
            scheme = {}
            if w.scheme_weights is not None:
                scheme = reference.outputs(config, w.scheme_weights, s.embeddings, s.mask, w.scheme)
        # no graph computes a row's trailing padding (service/batching/batcher.py): it answers zeros there
        for outputs in (x64, x32, scheme):
            outputs.update({k: answered(v, s.mask) for k, v in outputs.items() if positional(k)})
        tol = Tolerance(**manifest.parity["tolerance"])
        real = None if s.mask is None else ~np.asarray(s.mask, bool)  # a lossy answer: its real tokens
        # A lossy answer is judged on its implementation (the graph computes its scheme): its quality against fp32
        # is the scheme's, decided at export on representative inputs, and a client's input need not be one.
        comparisons = [
            compare(
                name, a, x32[name], x64[name], tol, scheme.get(name), quality=False, real=_rows(name, real)
            )
            for name, a in s.answers.items()
        ]
        c = max(comparisons, key=lambda c: (not c.passed, c.ratio))  # the worst output
        ratio = max(c.ratio for c in comparisons)
        name = s.model.name
        counts = self.counts[name]
        counts.checked += 1
        counts.worst_ratio = max(counts.worst_ratio, ratio)
        self.metrics.live_parity(name, "checked", ratio)
        if all(c.passed for c in comparisons):
            return
        counts.failed += 1
        self.metrics.live_parity(name, "failed")
        log.warning(
            "live parity FAILED for request %s on model %s, shape %s, output %s: error %.3e vs float64%s is %.1fx the "
            "allowance",
            s.request_id, name, list(s.embeddings.shape), c.output, c.onnx_vs_f64,
            "" if c.graph_vs_scheme is None else f", {c.graph_vs_scheme:.3e} vs its scheme (per row)", ratio,
        )  # fmt: skip
        now = time.monotonic()
        counts.recent_failures.append(now)
        recent = [t for t in counts.recent_failures if now - t <= self.window_s]
        if self.action == "unready" and len(recent) >= self.failures and self._loop is not None:
            reason = (
                f"live parity: {len(recent)} sampled answers failed the parity rule within {self.window_s:g} s "
                f"(the last {ratio:.1f}x its allowance); see the log"
            )
            self._loop.call_soon_threadsafe(self.unready, name, reason)

    def _weights_of(self, directory: Path, manifest: Manifest) -> _Weights:
        """A model's weights in float64 and float32, read once; the last WEIGHTS_KEPT artifacts' are kept (model
        control may load new versions for as long as the server runs). int8's scheme runs in float64 (exactly,
        as the gate's), fp16's in float32 rounded to half."""
        if directory not in self._weights:
            w64 = reference.load_weights(read_weights(directory, manifest), np.float64)  # as exported
            w32 = {k: v.astype(np.float32) for k, v in w64.items()}
            scheme = schemes.for_variant(manifest.variant, manifest.scheme, w64) or schemes.Exact()
            lossy = {schemes.Int8: w64, schemes.Half: w32}.get(type(scheme))
            self._weights[directory] = _Weights(w64, w32, scheme, lossy)
            while len(self._weights) > WEIGHTS_KEPT:
                self._weights.pop(next(iter(self._weights)))  # the oldest
        return self._weights[directory]
