"""What one run of the batcher takes: which queued requests (``--merge-lengths``), within which limits (``Limits``),
stacked padded into one batch (``stack``) and cut back into each request's rows (``split``).

A merged run pads every request to its longest, and the weight products, feed-forward layers and norms then run
on the padding too (with lengths spread like real text, merging whatever fits left two thirds of the computed
positions padding: docs/benchmarks.md, "Mixed lengths"); running every request apart costs each run its fixed
overhead instead. ``by_cost`` weighs the two by a cost model of a run, in token-positions, over the whole queue
(the cheapest partition of the queued requests into runs; the one holding the oldest runs):

    Costs.run = fixed + tokens + w x rows x seq^2 / 6E     (tokens: rows x seq; a packed graph's, its own)

(each position's weight products, 12 E^2 multiply-adds, plus its attention, 2 x seq x E), ``fixed`` measured on the
model at load (``measure_costs``: 6-9 positions, default block, 2-core EPYC; a share of it at light load:
``LIGHT_FIXED``). A packed graph (model/packing.py)
computes no padding's products (nor a request's trailing padding): merging costs only attention's padding, of a
weight ``w`` measured at load too (1.4-2.1, default packed graph; 1 padded). ``in_order``: ``--merge-lengths pad``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import numpy as np

from addnorm.model.attention import score_elements
from addnorm.model.contract import positional
from addnorm.model.packing import real_lengths
from addnorm.service.errors import TooLarge

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
    spent merging, running and cutting it, and its positions: ``positions`` computed (rows x the batch's seq; on a
    packed graph the requests' own), ``requested`` the requests' own (each request's rows x its seq; on a packed
    graph less their trailing padding, which it does not compute: ``Queued.tokens``); the rest is padding added by
    merging."""

    rows: int
    requests: int
    seconds: float
    merge_s: float
    split_s: float
    positions: int
    requested: int


class BatchObserver(Protocol):
    """Told of each model run, on the event loop (the queue's depth is read when asked: ``Batcher.depth``)."""

    def batch_done(self, run: Run) -> None: ...


class Observers:
    """Several observers as one (a model's metrics and its statistics)."""

    def __init__(self, *observers: BatchObserver) -> None:
        self.observers = observers

    def batch_done(self, run: Run) -> None:
        for o in self.observers:
            o.batch_done(run)


@dataclass(frozen=True)
class Tokens:
    """A text request's part as it queues: its (rows, seq) padded token ids and token types, embedded by ``embed``
    (the model's embedding layer: ``TextFront.embed_ids``) when a run takes it, with all the text of that run in one
    call (``stack``): on the inference thread, not the event loop, and one embedding run a model run. Shaped as the
    (rows, seq, width) float32 embeddings it stands for (the queue's bytes, the run's limits, live parity)."""

    ids: np.ndarray  # (rows, seq) int64
    types: np.ndarray  # (rows, seq) int64
    embed: Callable[[np.ndarray, np.ndarray], np.ndarray]
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.ids.shape, self.width)

    @property
    def nbytes(self) -> int:
        return self.ids.size * self.width * 4

    def __getitem__(self, key) -> Tokens:
        return Tokens(self.ids[key], self.types[key], self.embed, self.width)

    def embedded(self) -> np.ndarray:
        return self.embed(self.ids, self.types)


def embedded(x: np.ndarray | Tokens) -> np.ndarray:
    """A request's (rows, seq, E) embeddings: its own, or its tokens through its model's embedding layer."""
    return x.embedded() if isinstance(x, Tokens) else x


@dataclass
class Queued:
    """One queued request, or a piece of one: its (rows, seq, E) embeddings (or the ``Tokens`` they are made of),
    mask, the future its answer goes to, and its timings."""

    x: np.ndarray | Tokens  # (rows, seq, E)
    mask: np.ndarray | None  # (rows, seq), true where a position is padding
    future: asyncio.Future
    padded: bool = False  # its own mask marks some padding
    enqueued: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=Timings)
    deadline: float | None = None  # ``time.perf_counter()`` past which it is not run
    solo: bool = field(init=False)  # it must run alone
    queued: list[int] = field(default_factory=lambda: [1])  # of its request's pieces, how many are queued

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def seq(self) -> int:
        return self.x.shape[1]

    @cached_property
    def lengths(self) -> np.ndarray:
        """(rows,) what a packed graph computes of each row: its length less its trailing padding."""
        return real_lengths(self.mask) if self.padded else np.full(self.rows, self.seq)

    @cached_property
    def tokens(self) -> int:
        """The positions a packed graph computes of it (the cost model's and the metrics' own positions)."""
        # without padding, no array: numpy's calls cost tens of µs each run cold after a model's run
        return int(self.lengths.sum()) if self.padded else self.rows * self.seq

    def dropped(self, now: float) -> bool:
        """Answered already (timed out, its client gone) or past its deadline: not to be run."""
        return self.future.done() or (self.deadline is not None and now >= self.deadline)

    def __post_init__(self) -> None:
        # A row that is all padding attends uniformly over its padding, so its (defined, meaningless) output depends
        # on the padded length: it runs alone, so that batching never changes its answer (computed once: asked often).
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
        if rows > self.max_batch_size or rows * seq > self.max_batch_tokens:
            return False
        limit = self.max_batch_attention
        return limit is None or self.attention_cost(rows, seq, padded) <= limit

    def check(self, rows: int, seq: int, padded: bool) -> None:
        """Raise TooLarge for a request whose attention alone is above the limit (the others merge less)."""
        cost = self.attention_cost(rows, seq, padded)
        if self.max_batch_attention is not None and cost > self.max_batch_attention:
            raise TooLarge(
                f"a [{rows}, {seq}] request (less trailing padding) needs an attention working set of {cost} elements "
                f"(batch x heads x seq^2 x {self.attention} attention's copies), above this server's limit of "
                f"{self.max_batch_attention} "
                "(ADDNORM_MAX_BATCH_ATTENTION); send fewer or shorter sequences"
            )


Fits = Callable[[int, int, bool], bool]  # (rows, seq, padded) -> whether a run that size is within the limits

# At light load a run's fixed cost is weighed at this share. The partition charges each run its fixed cost, but a
# request a run leaves queued mostly joins the next run, which follows at once when the model has little waiting: at
# light load the full cost merged requests of different lengths whose padding cost more than leaving them. Measured
# on a 2-core Xeon, all-MiniLM-L6-v2, real sentences through /v1/embeddings, servers side by side (8 rounds): 1.05-1.08x
# tokens/s and 0.93x CPU a request at 4, 8 and 16 clients of one sentence, p99 within 4%; 1.03x at one client of 8
# sentences (docs/benchmarks.md, "A smaller fixed cost at light load"). Not for a lone request's pieces: nothing
# else is coming to join them (0.95x at one client of 8 sentences when they were cut so).
LIGHT_FIXED = 0.4


@dataclass(frozen=True)
class Costs:
    """The cost model's terms for one model: a run's ``fixed`` cost in token-positions, whether its graph is
    ``packed`` (it computes only the requests' own positions), and ``attention``, the weight of attention's term."""

    fixed: float = 32.0
    packed: bool = False
    attention: float = 1.0

    def __str__(self) -> str:
        graph = "packed graph" if self.packed else "padded graph"
        return f"a run's fixed cost {self.fixed:.1f} token-positions, {graph}, attention weight {self.attention:g}"

    def at_light_load(self) -> Costs:
        """The costs a run is cut by when few requests wait on the model (``LIGHT_FIXED``)."""
        return replace(self, fixed=self.fixed * LIGHT_FIXED)

    def run(self, rows: int, seq: int, e: int, tokens: int | None = None) -> float:
        """A run of ``rows`` x ``seq`` (``tokens`` the requests' own positions) on a model ``e`` wide."""
        per_token = tokens if self.packed and tokens is not None else rows * seq
        return self.fixed + per_token + self.attention * rows * seq * seq / (6.0 * e)


def choose(merge: str, head: Queued, queued: Iterable[Queued], limits: Limits, costs: Costs) -> list[Queued]:
    """The requests to run with ``head`` by the policy ``merge`` ("cost": ``by_cost``; "pad": ``in_order``), among
    the pieces of the oldest 2 x max_batch_size requests queued: in a long queue (an overload) newer ones of a
    handier length do not overtake a request without end (docs/benchmarks.md, "Latency against offered load")."""
    oldest: list[Queued] = []
    reach: set[int] = set()
    for item in queued:
        reach.add(id(item.queued))  # its request's: the pieces of one request share it
        if len(reach) > 2 * limits.max_batch_size:
            break
        oldest.append(item)
    if merge == "cost":
        return by_cost(head, oldest, limits.fits, costs)
    return in_order(head, oldest, limits.fits)


def in_order(head: Queued, queued: Sequence[Queued], fits: Fits) -> list[Queued]:
    """``--merge-lengths pad``: the requests that follow ``head`` in the queue, in order, while the run ``fits``
    (shorter ones padded), up to the first that must run alone."""
    rows, seq, padded = head.rows, head.seq, head.padded
    chosen: list[Queued] = []
    for item in queued:
        new_rows, new_seq = rows + item.rows, max(seq, item.seq)
        new_padded = padded or item.padded or item.seq != seq
        if item.solo or not fits(new_rows, new_seq, new_padded):
            break
        chosen.append(item)
        rows, seq, padded = new_rows, new_seq, new_padded
    return chosen


# The most queued pieces ``by_cost`` partitions (those nearest the head's length): its work grows faster than their
# number, a run's only with what it takes, and this many keeps planning a small share of a run (bench.ab's phases
# of mixed lengths show it: docs/benchmarks.md, "Merging by cost").
PARTITION_ITEMS = 128


def by_cost(head: Queued, queued: Sequence[Queued], fits: Fits, costs: Costs) -> list[Queued]:
    """The requests of ``queued`` to run with ``head``: its run in the cheapest partition of ``head`` and
    ``queued`` into runs that ``fit``, by ``Costs.run`` (each run its fixed cost, its positions padded to its
    longest, or on a packed graph its own and attention's padding). Ordered by length, such a partition's runs are
    consecutive lengths; it is found exactly (a shortest path over the sorted requests, each run at most one
    ``fits`` long). Weighing a request's padding against a run of its own instead (each one greedily, nearest
    length first) merged as soon as its padding cost less than the fixed cost, where under load its own length's
    run was coming anyway: at 32 clients of one real sentence each, 23% of the computed positions were padding,
    6% so (docs/benchmarks.md, "Text")."""
    others = [i for i in queued if not i.solo]  # each of those runs alone when its turn comes
    if len(others) > PARTITION_ITEMS:
        others = sorted(others, key=lambda i: abs(i.seq - head.seq))[:PARTITION_ITEMS]  # stable: oldest first
    items = sorted([head, *others], key=lambda i: i.seq)  # stable: the queue's order within a length
    # Costs.run's terms inlined (this loop is the hot one). best[end]: the cheapest partition of items[:end];
    # first[end]: where its last run starts.
    per_row = costs.attention / (6.0 * head.x.shape[2])
    best, first = [0.0] * (len(items) + 1), [0] * (len(items) + 1)
    for end in range(1, len(items) + 1):
        seq = items[end - 1].seq
        rows = tokens = 0
        padded, cheapest = False, float("inf")
        for start in range(end - 1, -1, -1):  # the last run is items[start:end]
            item = items[start]
            rows += item.rows
            padded = padded or item.padded or item.seq != seq
            if start < end - 1 and not fits(rows, seq, padded):
                break  # longer runs ending here do not fit either
            tokens += item.tokens if costs.packed else item.rows * seq
            cost = best[start] + costs.fixed + tokens + per_row * rows * seq * seq
            if cost < cheapest:
                cheapest, first[end] = cost, start
        best[end] = cheapest
    end = len(items)
    while not any(i is head for i in items[first[end] : end]):
        end = first[end]
    return [i for i in items[first[end] : end] if i is not head]


def measure_costs(model, e: int, packed: bool = False, repeats: int = 15, seq: int = 256) -> Costs:
    """``model``'s Costs (anything with ``run(x)``; a packed one also ``run(x, mask, lengths)``), from the fastest
    of ``repeats`` runs each, taking turns so that a busy machine's drift slows both alike (default block, loaded
    2-core machine, 15 fits: ``fixed`` 1.0-17.8 from 5 runs in a row, 4.5-10.2 from 15 turns). ``fixed``, beyond
    its positions (per-operator overhead, small products' lower efficiency): an 8- and a 128-long sequence fitted to
    ``Costs.run``; at least 1. A packed graph's attention weight: what merging an 8-long sequence into a ``seq``-long
    one's run costs beyond its own positions over its padded attention (``seq^2 / 6E``); 1 to 64."""
    short, long = (np.zeros((1, n, e), np.float32) for n in (8, 128))  # the lengths fitted
    t_short, t_long = _fastest((lambda: model.run(short), lambda: model.run(long)), repeats)
    positions = Costs(0.0).run
    per_position = (t_long - t_short) / (positions(1, 128, e) - positions(1, 8, e))
    if per_position <= 0:
        return Costs(1.0, packed)
    fixed = max(1.0, (t_short - per_position * positions(1, 8, e)) / per_position)
    if not packed:  # a padded graph's merging is dominated by its padding's products
        return Costs(fixed)
    x, mask = np.zeros((2, seq, e), np.float32), np.arange(seq)[None, :] >= np.array([[seq], [8]])
    lengths = np.array([seq, 8])
    merged, alone = _fastest((lambda: model.run(x, mask, lengths), lambda: model.run(x[:1])), repeats)
    extra = (merged - alone) / per_position - 8
    return Costs(fixed, True, float(min(64.0, max(1.0, extra / (seq * seq / (6.0 * e))))))


def _fastest(runs: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in runs]  # each run's, over ``repeats`` rounds of all in turn
    for _ in range(repeats):
        for run, took in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            took.append(time.perf_counter() - start)
    return [min(took) for took in times]


def stack(batch: Sequence[Queued]) -> tuple[np.ndarray, np.ndarray | None]:
    """Stack requests along the batch dim, padding shorter sequences and masking the padding; text (``Tokens``)
    embedded here, a run's text of one model in one call (its ids stacked, padded with id 0 under the mask)."""
    if len(batch) == 1:
        return embedded(batch[0].x), batch[0].mask
    seq = max(i.seq for i in batch)
    first = batch[0].x
    if isinstance(first, Tokens) and all(isinstance(i.x, Tokens) and i.x.embed == first.embed for i in batch):
        ids, types = _padded([i.x.ids for i in batch], seq), _padded([i.x.types for i in batch], seq)
        return first.embed(ids, types), _mask(batch, seq)
    xs = [embedded(i.x) for i in batch]
    if all(i.seq == seq for i in batch) and all(i.mask is None for i in batch):
        return np.concatenate(xs), None
    return _padded(xs, seq), _mask(batch, seq)


def _padded(arrays: list[np.ndarray], seq: int) -> np.ndarray:
    """(rows, seq_i, ...) arrays stacked along rows, zeros past each one's own seq."""
    out = np.zeros((sum(a.shape[0] for a in arrays), seq, *arrays[0].shape[2:]), dtype=arrays[0].dtype)
    r = 0
    for a in arrays:
        out[r : r + a.shape[0], : a.shape[1]] = a
        r += a.shape[0]
    return out


def _mask(batch: Sequence[Queued], seq: int) -> np.ndarray:
    """The stacked batch's mask: each request's own, and true over the padding stacking added."""
    mask = np.ones((sum(i.rows for i in batch), seq), dtype=bool)
    r = 0
    for i in batch:
        mask[r : r + i.rows, : i.seq] = False if i.mask is None else i.mask
        r += i.rows
    return mask


def split(batch: Sequence[Queued], out: Outputs) -> list[Outputs]:
    """Each request's own rows of every output of a run of ``stack(batch)`` (and its own positions of a positional
    one), contiguous: a shorter request's slice of the padded batch is a strided view that codecs writing raw
    buffers cannot take (and that would keep the whole batch alive)."""
    rows, row = [], 0
    for item in batch:
        end = row + item.rows
        cut = {k: v[row:end, : item.seq] if positional(k) else v[row:end] for k, v in out.items()}
        rows.append({k: np.ascontiguousarray(v) for k, v in cut.items()})
        row = end
    return rows
