"""What one run of the batcher takes: which queued requests (``--merge-lengths``), within which limits
(``Limits``), stacked padded into one batch (``stack``) and cut back into each request's rows (``split``).

A merged run pads every request to its longest, and the weight products, feed-forward layers and norms (over 90%
of a layer's arithmetic at 128 positions) then run on the padding too: with lengths spread like real text, the
longest of 16 requests is several times their mean, and merging whatever fits left two thirds of the computed
positions padding (docs/benchmarks.md, "Mixed lengths"). Running every request apart costs each run its fixed
overhead instead. ``by_cost`` weighs the two by a cost model of a run, in token-positions:

    run_cost(rows, seq) = fixed + rows x seq x (1 + seq / 6E)

(each position's weight products, 12 E^2 multiply-adds, plus its attention, 2 x seq x E), with ``fixed`` measured
on the model at load (``measure_fixed_cost``: 5-9 positions for the default 768-wide block on a 2-core EPYC).
``in_order`` is ``--merge-lengths pad``: whatever follows the head while it fits. Nothing here touches the queue
or a lock: the batcher (service/batcher.py) hands in the queue's head and the live requests behind it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from model.attention import score_elements
from model.contract import positional
from service.errors import TooLarge

Outputs = dict[str, np.ndarray]  # output name -> (B, S, ...) array, or (B, ...) without a sequence axis


@dataclass
class Timings:
    """A request's seconds queued and in its run, and the rows of the batch it ran in."""

    queue_s: float = 0.0
    infer_s: float = 0.0
    batch_rows: int = 0


@dataclass(frozen=True)
class Run:
    """One model run, as its observers are told of it (on the event loop): its rows and requests, the seconds
    spent merging, running and cutting it, and its positions: ``positions`` computed (rows x the batch's seq),
    ``requested`` the requests' own (each request's rows x its seq); the rest is padding added by merging."""

    rows: int
    requests: int
    seconds: float
    merge_s: float
    split_s: float
    positions: int
    requested: int


class BatchObserver(Protocol):
    """Told of each model run; called on the event loop. (The queue's depth is read when asked for:
    ``Batcher.depth``.)"""

    def batch_done(self, run: Run) -> None: ...


class Observers:
    """Several observers as one (a model's metrics and its statistics)."""

    def __init__(self, *observers: BatchObserver) -> None:
        self.observers = observers

    def batch_done(self, run: Run) -> None:
        for o in self.observers:
            o.batch_done(run)


@dataclass
class Request:
    """One queued request: its (rows, seq, E) embeddings, mask, the future its answer goes to, and its timings."""

    x: np.ndarray  # (rows, seq, E)
    mask: np.ndarray | None  # (rows, seq), true where a position is padding
    future: asyncio.Future
    padded: bool = False  # its own mask marks some padding
    enqueued: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=Timings)
    deadline: float | None = None  # ``time.perf_counter()`` past which it is not run
    solo: bool = field(init=False)  # it must run alone

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def seq(self) -> int:
        return self.x.shape[1]

    def dropped(self, now: float) -> bool:
        """Answered already (timed out, its client gone) or past its deadline: not to be run."""
        return self.future.done() or (self.deadline is not None and now >= self.deadline)

    def __post_init__(self) -> None:
        # A row that is all padding attends uniformly over its padding, so its (defined, meaningless) output
        # depends on the padded length: such a request runs alone so that batching never changes its answer.
        # Computed once: the scheduler asks for every item it considers, and for the batch's first each time.
        self.solo = self.padded and bool(self.mask.all(axis=1).any())


@dataclass(frozen=True)
class Limits:
    """How big one run may be: ``max_batch_size`` rows, ``max_batch_tokens`` rows x seq positions and
    ``max_batch_attention`` elements of the seq x seq tensors the artifact's ``attention`` form holds
    (``model.attention.score_elements``; None: no limit)."""

    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_batch_attention: int | None = None
    heads: int = 1
    attention: str = "decomposed"

    def attention_cost(self, rows: int, seq: int, padded: bool) -> int:
        """Elements of seq x seq tensors a run of ``rows`` x ``seq`` holds: it grows with seq squared."""
        return score_elements(self.attention, rows, self.heads, seq, padded)

    def fits(self, rows: int, seq: int, padded: bool) -> bool:
        """Whether a run of ``rows`` x ``seq`` stays within the limits."""
        return (
            rows <= self.max_batch_size
            and rows * seq <= self.max_batch_tokens
            and (
                self.max_batch_attention is None
                or self.attention_cost(rows, seq, padded) <= self.max_batch_attention
            )
        )

    def check(self, rows: int, seq: int, padded: bool) -> None:
        """Raise TooLarge for a request whose attention alone is above the limit (the others merge less)."""
        cost = self.attention_cost(rows, seq, padded)
        if self.max_batch_attention is not None and cost > self.max_batch_attention:
            raise TooLarge(
                f"a [{rows}, {seq}] request needs an attention working set of {cost} elements "
                f"(batch x heads x seq^2 x {self.attention} attention's copies), above this server's limit of "
                f"{self.max_batch_attention} "
                "(ADDNORM_MAX_BATCH_ATTENTION); send fewer or shorter sequences"
            )


Fits = Callable[[int, int, bool], bool]  # (rows, seq, padded) -> whether a run that size is within the limits


def choose(
    merge: str, head: Request, queued: Sequence[Request], limits: Limits, fixed: float
) -> list[Request]:
    """The requests to run with ``head`` by the policy ``merge`` ("cost": ``by_cost``; "pad": ``in_order``)."""
    if merge == "cost":
        return by_cost(head, queued, limits.fits, fixed)
    return in_order(head, queued, limits.fits)


def run_cost(fixed: float, rows: int, seq: int, e: int) -> float:
    """A run of ``rows`` x ``seq`` on a model ``e`` wide, in token-positions (the module's cost model)."""
    return fixed + rows * seq * (1.0 + seq / (6.0 * e))


def in_order(head: Request, queued: Sequence[Request], fits: Fits) -> list[Request]:
    """``--merge-lengths pad``: the requests that follow ``head`` in the queue, in order, while the run ``fits``
    (shorter ones padded), up to the first that must run alone."""
    rows, seq, padded = head.rows, head.seq, head.padded
    chosen: list[Request] = []
    for item in queued:
        new_rows, new_seq = rows + item.rows, max(seq, item.seq)
        new_padded = padded or item.padded or item.seq != seq
        if item.solo or not fits(new_rows, new_seq, new_padded):
            break
        chosen.append(item)
        rows, seq, padded = new_rows, new_seq, new_padded
    return chosen


def by_cost(head: Request, queued: Sequence[Request], fits: Fits, fixed: float) -> list[Request]:
    """The requests of ``queued`` (in queue order) to run with ``head``, in the order chosen: nearest length
    first, each one taken while merging it costs no more than a run of its own would (the padding it adds, its
    rows up to the batch's length or the batch up to its length, against ``fixed``) and the run ``fits``."""
    rows, seq, padded = head.rows, head.seq, head.padded
    e = head.x.shape[2]
    queued = [i for i in queued if not i.solo]  # each of those runs alone when its turn comes
    below = sorted((i for i in queued if i.seq <= seq), key=lambda i: -i.seq)  # nearest first, stable
    above = sorted((i for i in queued if i.seq > seq), key=lambda i: i.seq)
    chosen: list[Request] = []

    def extra(item: Request, rows: int, seq: int) -> float:
        """What merging ``item`` into a run of ``rows`` x ``seq`` costs beyond a run of its own (negative:
        merging saves)."""
        merged = run_cost(fixed, rows + item.rows, max(seq, item.seq), e) - run_cost(fixed, rows, seq, e)
        return merged - run_cost(fixed, item.rows, item.seq, e)

    while below or above:
        cost, side = min(((extra(s[0], rows, seq), s) for s in (below, above) if s), key=lambda c: c[0])
        item = side[0]
        new_rows, new_seq = rows + item.rows, max(seq, item.seq)
        new_padded = padded or item.padded or item.seq != seq
        if cost > 0 or not fits(new_rows, new_seq, new_padded):
            break
        side.pop(0)
        chosen.append(item)
        rows, seq, padded = new_rows, new_seq, new_padded
    return chosen


def measure_fixed_cost(model, e: int, repeats: int = 5) -> float:
    """A run's fixed cost (beyond its positions: per-operator overhead, small products' lower efficiency) in
    token-positions: the fastest of ``repeats`` runs of one 8- and one 128-long sequence on ``model`` (anything
    with ``run(x)``), fitted to ``run_cost``; at least 1."""

    def fastest(seq: int) -> float:
        x = np.zeros((1, seq, e), np.float32)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.run(x)
            times.append(time.perf_counter() - start)
        return min(times)

    short, long = 8, 128
    t_short, t_long = fastest(short), fastest(long)
    per_position = (t_long - t_short) / (run_cost(0.0, 1, long, e) - run_cost(0.0, 1, short, e))
    if per_position <= 0:
        return 1.0
    return max(1.0, (t_short - per_position * run_cost(0.0, 1, short, e)) / per_position)


def stack(batch: Sequence[Request]) -> tuple[np.ndarray, np.ndarray | None]:
    """Stack requests along the batch dim, padding shorter sequences and masking the padding."""
    if len(batch) == 1:
        return batch[0].x, batch[0].mask
    seq = max(i.seq for i in batch)
    rows = sum(i.rows for i in batch)
    e = batch[0].x.shape[2]
    if all(i.seq == seq for i in batch) and all(i.mask is None for i in batch):
        return np.concatenate([i.x for i in batch]), None
    x = np.zeros((rows, seq, e), dtype=batch[0].x.dtype)
    mask = np.ones((rows, seq), dtype=bool)
    r = 0
    for i in batch:
        x[r : r + i.rows, : i.seq] = i.x
        mask[r : r + i.rows, : i.seq] = False if i.mask is None else i.mask
        r += i.rows
    return x, mask


def split(batch: Sequence[Request], out: Outputs) -> list[Outputs]:
    """Each request's own rows of every output of a run of ``stack(batch)`` (and its own positions of a positional
    one), contiguous: a shorter request's slice of the padded batch is a strided view that codecs writing raw
    buffers cannot take (and that would keep the whole batch alive)."""
    rows, row = [], 0
    for item in batch:
        end = row + item.rows
        rows.append(
            {
                k: np.ascontiguousarray(v[row:end, : item.seq] if positional(k) else v[row:end])
                for k, v in out.items()
            }
        )
        row = end
    return rows
