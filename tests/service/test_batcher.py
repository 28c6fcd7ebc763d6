"""Dynamic batching: merged results equal unbatched ones; backpressure; timeouts; no timing assertions, and no
sleep to order events: each step waits until the batcher's state says the previous one happened (``until``)."""

import asyncio
import sys
import threading
import time

import numpy as np
import pytest

from addnorm.model.packing import answered
from addnorm.service.backend.engine import Engine
from addnorm.service.batching import merging
from addnorm.service.batching.batcher import Batcher
from addnorm.service.errors import Overloaded, ShuttingDown, TimedOut, TooLarge, http_status

FP32_ATOL, FP32_RTOL = 1e-5, 1e-4


class Recorder:
    """Wraps a model and records the batch shapes it was run with."""

    def __init__(self, model, gate: threading.Event | None = None):
        self.model, self.gate, self.shapes, self.light = model, gate, [], []
        self.entered = threading.Event()  # a run has begun (and waits at the gate, if there is one)

    def __getattr__(self, name):  # the rest of the backend interface is the wrapped model's
        return getattr(self.model, name)

    def run(self, x, mask=None, light=False):
        self.entered.set()
        self.light.append(light)
        if self.gate is not None:
            self.gate.wait(10)
        self.shapes.append(x.shape)
        return self.model.run(x, mask)


def run(coro):
    return asyncio.run(coro)


async def until(condition, timeout: float = 10.0) -> None:
    """Yield to the event loop until ``condition()`` holds (the batcher's own state), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the batcher never reached the state this step waits for"
        await asyncio.sleep(0.001)


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine(tiny_artifact, "cpu", intra_op_threads=1)


def test_concurrent_requests_are_merged_and_each_gets_its_own_rows(engine):
    rng = np.random.default_rng(0)
    reqs = [(rng.standard_normal((1 + i % 2, 3 + i % 4, 32)).astype(np.float32), None) for i in range(12)]
    mask = np.zeros((2, 6), bool)
    mask[0, 2:] = True
    reqs[3] = (reqs[3][0], mask)  # (2, 6, 32) with padding in its first row
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_batch_tokens=10_000, max_queue_delay_ms=50)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.infer(x, m)) for x, m in reqs]
        await until(model.entered.is_set)  # the first batch is taken (after its queue delay) and held
        gate.set()
        results = await asyncio.gather(*tasks)
        await batcher.stop()
        return results

    results = run(main())
    assert len(model.shapes) < len(reqs)  # merged
    assert max(s[0] for s in model.shapes) > 2
    for (x, m), (out, timings) in zip(reqs, results, strict=True):
        alone = engine.run(x, m)
        assert out.keys() == alone.keys() and out["encoded"].shape == x.shape
        want = answered(alone["encoded"], m)  # its own trailing padding answers zeros
        np.testing.assert_allclose(out["encoded"], want, atol=FP32_ATOL, rtol=FP32_RTOL)
        assert out["encoded"].flags.c_contiguous  # regression: a strided view made orjson fail (a 500 in /v1)
        assert timings.infer_s > 0


def test_batch_size_one_turns_merging_off(engine):
    model = Recorder(engine)

    async def main():
        batcher = Batcher(model, max_batch_size=1, max_queue_delay_ms=50)
        batcher.start()
        xs = [np.zeros((1, 2, 32), np.float32) for _ in range(5)]
        await asyncio.gather(*(batcher.infer(x, None) for x in xs))
        await batcher.stop()

    run(main())
    assert model.shapes == [(1, 2, 32)] * 5


def test_token_budget_splits_batches(engine):
    model = Recorder(engine, threading.Event())

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_batch_tokens=16, max_queue_delay_ms=50)
        batcher.start()
        tasks = [
            asyncio.ensure_future(batcher.infer(np.zeros((1, 8, 32), np.float32), None)) for _ in range(4)
        ]
        await until(model.entered.is_set)
        model.gate.set()
        await asyncio.gather(*tasks)
        await batcher.stop()

    run(main())
    assert all(b * s <= 16 for b, s, _ in model.shapes) and sum(b for b, _, _ in model.shapes) == 4


def test_drain_runs_what_waits_for_company_at_once(engine):
    """An unloaded or replaced model (registry._drain) gets no new requests: what waits in its queue for company
    runs at once instead of after max_queue_delay_ms (here ten minutes: without drain the requests would still
    be waiting when ``until`` gives up), as one batch."""
    model = Recorder(engine)

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_queue_delay_ms=600_000)
        batcher.start()
        tasks = [
            asyncio.ensure_future(batcher.infer(np.ones((1, 3, 32), np.float32), None)) for _ in range(2)
        ]
        await until(lambda: batcher.depth == 2)
        assert not model.entered.is_set()  # waiting for company
        batcher.drain()
        await until(lambda: all(t.done() for t in tasks))
        await batcher.stop()
        return [t.result()[0]["encoded"] for t in tasks]

    outs = run(main())
    assert model.shapes == [(2, 3, 32)]
    alone = engine.run(np.ones((1, 3, 32), np.float32))["encoded"]
    for out in outs:
        np.testing.assert_allclose(out, alone, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize(
    "merge, shapes", [("pad", [(2, 4, 32), (1, 4, 32), (2, 4, 32)]), ("cost", [(4, 4, 32), (1, 4, 32)])]
)
def test_all_padding_rows_run_alone(engine, merge, shapes):
    """A request with an all-padding row runs in a batch of its own; its neighbours still merge (in order with
    merge "pad"; past it with "cost", which takes what fits from the whole queue)."""
    model = Recorder(engine, threading.Event())
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1, 4, 32)).astype(np.float32) for _ in range(5)]
    masks = [None, None, np.ones((1, 4), bool), None, None]  # the third is all padding

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_queue_delay_ms=50, merge=merge)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.infer(x, m)) for x, m in zip(xs, masks, strict=True)]
        await until(model.entered.is_set)
        model.gate.set()
        out = await asyncio.gather(*tasks)
        await batcher.stop()
        return out

    results = run(main())
    assert model.shapes == shapes
    alone = engine.run(xs[2], masks[2])["encoded"]
    assert np.isfinite(results[2][0]["encoded"]).all()
    np.testing.assert_array_equal(results[2][0]["encoded"], alone)


def test_full_queue_answers_429_with_retry_after(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        batcher = Batcher(model, max_batch_size=1, max_queue_size=2, max_queue_delay_ms=0)
        batcher.start()
        x = np.zeros((1, 2, 32), np.float32)
        first = asyncio.ensure_future(batcher.infer(x, None))
        await until(
            model.entered.is_set
        )  # the first is running (blocked on the gate); two more fill the queue
        queued = [asyncio.ensure_future(batcher.infer(x, None)) for _ in range(2)]
        await until(lambda: batcher.depth == 2)
        with pytest.raises(Overloaded, match=r"2 requests queued: ADDNORM_MAX_QUEUE_SIZE\); retry") as info:
            await batcher.infer(x, None)
        gate.set()
        await asyncio.gather(first, *queued)
        await batcher.stop()
        return info.value

    err = run(main())
    assert http_status(err) == 429 and err.retry_after == 1


async def _running_one_blocked(model: Recorder) -> tuple[Batcher, asyncio.Future]:
    """A started one-row batcher whose first request is in its run, held at ``model``'s gate: what is queued next
    waits behind it."""
    batcher = Batcher(model, max_batch_size=1, max_queue_delay_ms=0)
    batcher.start()
    blocker = asyncio.ensure_future(batcher.infer(np.zeros((1, 2, 32), np.float32), None))
    await until(model.entered.is_set)
    return batcher, blocker


def test_timeout_gives_504_and_the_request_is_dropped_before_it_runs(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        batcher, blocker = await _running_one_blocked(model)
        with pytest.raises(TimedOut):
            await batcher.infer(np.zeros((1, 9, 32), np.float32), None, timeout=0.05)
        gate.set()
        await blocker
        await until(lambda: batcher.depth == 0)  # the thread took the expired request (and skipped it)
        await batcher.stop()

    run(main())
    assert (1, 9, 32) not in model.shapes  # timed out while queued: never ran


def test_a_request_past_its_deadline_is_never_run_even_before_its_timer_fires(engine):
    """The event loop answers a timed-out request (its timer); the inference thread does not wait for that: once a
    request's deadline has passed it is skipped, even while the loop is busy (here: blocked) and its timer has not
    run. And a deadline already past is refused before the queue (a gRPC call that arrives after its deadline)."""
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        batcher, blocker = await _running_one_blocked(model)
        late = asyncio.ensure_future(batcher.infer(np.zeros((1, 9, 32), np.float32), None, timeout=0.05))
        await until(lambda: batcher.depth == 1)
        time.sleep(0.1)  # the event loop blocked: the late request's timer cannot run
        gate.set()  # the thread ends the blocked run and takes the queue's next, due already
        deadline = time.monotonic() + 10
        while batcher.depth and time.monotonic() < deadline:  # still blocking the loop: wait for the thread
            time.sleep(0.001)
        await blocker
        with pytest.raises(TimedOut):
            await late
        with pytest.raises(TimedOut):
            await batcher.infer(np.zeros((1, 5, 32), np.float32), None, timeout=0.0)
        await batcher.stop()

    run(main())
    assert (1, 9, 32) not in model.shapes and (1, 5, 32) not in model.shapes


def test_cancelled_request_is_not_run(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        batcher, blocker = await _running_one_blocked(model)
        gone = asyncio.ensure_future(batcher.infer(np.zeros((1, 7, 32), np.float32), None))
        await until(lambda: batcher.depth == 1)
        gone.cancel()  # what the request core does when the client disconnects
        gate.set()
        await blocker
        await until(lambda: batcher.depth == 0)
        await batcher.stop()

    run(main())
    assert (1, 7, 32) not in model.shapes


def _waiting_for_company(thread: threading.Thread) -> bool:
    """Whether the inference thread is in its run's wait for company (``Condition.wait_for`` under ``_take``)."""
    frame = sys._current_frames().get(thread.ident)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "wait_for" in names and "_take" in names


def test_a_request_withdrawn_while_its_run_waits_for_company_leaves_the_batcher_serving(engine):
    """With a queue delay, the run waits for company without the queue's lock; the only queued request's client
    leaving meanwhile withdraws it, and the run then found an empty queue: the inference thread died (IndexError)
    and every later request got 504 (a client hanging up under CPU load, tests/test_e2e.py's, on a 2-core EPYC)."""

    async def main():
        batcher = Batcher(engine, max_queue_delay_ms=60_000)  # waits for company until 32 rows or drain()
        batcher.start()
        gone = asyncio.ensure_future(batcher.infer(np.zeros((1, 7, 32), np.float32), None))
        await until(
            lambda: _waiting_for_company(batcher._threads_of[0])
        )  # it holds the request, the lock let go
        gone.cancel()  # what the request core does when the client disconnects: withdrawn from the queue
        await until(lambda: batcher.depth == 0)
        batcher.drain()  # the wait for company ends, on an empty queue
        out, _ = await asyncio.wait_for(batcher.infer(np.ones((1, 5, 32), np.float32), None), 10)
        alive = batcher._threads_of[0].is_alive()
        await batcher.stop()
        return out, alive

    out, alive = run(main())
    assert alive and out["encoded"].shape == (1, 5, 32)


def test_a_fault_in_the_batchers_own_code_fails_its_batch_not_the_thread(engine, monkeypatch):
    """A bug in taking or merging a batch (not the engine's run) killed the inference thread before: readiness
    still said 200 and every later request waited out its deadline. Now it fails the batch it held (500) and the
    thread serves on."""
    real, calls = merging.stack, []

    def stack_once_broken(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise IndexError("a bug in merging")
        return real(batch)

    monkeypatch.setattr(merging, "stack", stack_once_broken)

    async def main():
        batcher = Batcher(engine, max_batch_size=1)
        batcher.start()
        with pytest.raises(Exception, match="inference failed: IndexError") as failed:
            await asyncio.wait_for(batcher.infer(np.zeros((1, 3, 32), np.float32), None), 10)
        out, _ = await asyncio.wait_for(batcher.infer(np.ones((1, 5, 32), np.float32), None), 10)
        alive = batcher._threads_of[0].is_alive()
        await batcher.stop()
        return failed.value, out, alive

    error, out, alive = run(main())
    assert http_status(error) == 500 and alive and out["encoded"].shape == (1, 5, 32) and calls == [1, 1]


def test_engine_failure_fails_the_batch_not_the_batcher():
    class Flaky:  # the backend interface's members the batcher reads
        calls, packed, threads = 0, False, 1
        lanes = 1

        def release(self):
            return False

        def run(self, x, mask=None, light=False):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("boom")
            return {"encoded": x}

    async def main():
        batcher = Batcher(Flaky(), max_batch_size=1, max_queue_delay_ms=0)
        batcher.start()
        x = np.zeros((1, 2, 4), np.float32)
        with pytest.raises(Exception, match="inference failed"):
            await batcher.infer(x, None)
        out, _ = await batcher.infer(x, None)  # the scheduler survived
        await batcher.stop()
        return out

    assert run(main())["encoded"].shape == (1, 2, 4)


def test_attention_budget_keeps_long_sequences_apart(engine):
    """Two long sequences are not merged into a run whose attention needs twice the memory of one."""
    model = Recorder(engine, threading.Event())
    heads = 4  # the tiny model's
    long, short = np.zeros((1, 64, 32), np.float32), np.zeros((1, 8, 32), np.float32)

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_batch_tokens=10_000, max_queue_delay_ms=50,
                          max_batch_attention=3 * heads * 64 * 64, heads=heads)  # fmt: skip
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.infer(x, None)) for x in (long, long, short, short)]
        await until(model.entered.is_set)
        model.gate.set()
        await asyncio.gather(*tasks)
        with pytest.raises(TooLarge, match="ADDNORM_MAX_BATCH_ATTENTION"):
            await batcher.infer(np.zeros((2, 64, 32), np.float32), None)  # alone it is over the budget
        await batcher.stop()

    run(main())
    assert model.shapes == [(1, 64, 32), (1, 64, 32), (2, 8, 32)]


def test_attention_budget_follows_the_attention_forms_working_set(engine):
    """mha holds no seq x seq tensor without padding (flash attention), one with it; decomposed holds three."""
    model = Recorder(engine, threading.Event())
    heads = 4
    long = np.zeros((1, 64, 32), np.float32)
    padded = np.ones((1, 64), bool)
    padded[0, -10:] = False  # padded on the left: computed whole (a row's trailing padding would be cut off)

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_batch_tokens=10_000, max_queue_delay_ms=50,
                          max_batch_attention=heads * 64 * 64, heads=heads, attention="mha")  # fmt: skip
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.infer(long, None)) for _ in range(3)]
        tasks += [asyncio.ensure_future(batcher.infer(long, padded)) for _ in range(2)]
        await until(model.entered.is_set)
        model.gate.set()
        await asyncio.gather(*tasks)
        await batcher.infer(np.zeros((8, 64, 32), np.float32), None)  # unpadded: no seq x seq tensor at all
        with pytest.raises(TooLarge, match="mha attention"):
            await batcher.infer(np.zeros((2, 64, 32), np.float32), np.tile(padded, (2, 1)))
        await batcher.stop()
        decomposed = Batcher(model, max_batch_attention=heads * 64 * 64, heads=heads)
        assert decomposed.limits.attention_cost(1, 64, False) == 3 * heads * 64 * 64

    run(main())
    # three unpadded runs merge into one; each padded one runs alone (one score tensor fills the budget)
    assert model.shapes[:3] == [(3, 64, 32), (1, 64, 32), (1, 64, 32)]


def test_queue_is_bounded_by_bytes(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)
    x = np.zeros((1, 16, 32), np.float32)  # 2 KiB

    async def main():
        batcher = Batcher(model, max_batch_size=1, max_queue_bytes=2 * x.nbytes)
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(x, None))
        await until(model.entered.is_set)  # running (blocked on the gate): no longer queued
        queued = [asyncio.ensure_future(batcher.infer(x, None)) for _ in range(2)]
        await until(lambda: batcher.depth == 2)
        with pytest.raises(Overloaded, match="bytes of requests queued") as info:
            await batcher.infer(x, None)
        gate.set()
        await asyncio.gather(first, *queued)
        await batcher.infer(x, None)  # the bytes were given back as the queue drained
        await batcher.stop()
        return info.value

    assert http_status(run(main())) == 429


def test_a_run_is_light_when_few_requests_wait_on_the_model(engine, monkeypatch):
    """``Backend.run(light=True)`` (what lets ``--intra-op-spinning light`` spin) when few requests wait on the
    model, the run's own and those still queued: light from LIGHT_LOAD down (here 1), heavy again only above
    HEAVY_LOAD (here 2). A lone request is light; a run of two with a third queued is not; a run of two with none
    behind stays what the run before it was (light after a lone one, heavy after a run of four waiting); a padded
    request's pieces are one request."""
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "LIGHT_LOAD", 1)
    monkeypatch.setattr(batcher_module, "HEAVY_LOAD", 2)
    model = Recorder(engine, threading.Event())
    x = np.ones((1, 3, 32), np.float32)
    mask = np.zeros((2, 4), bool)
    mask[1, 2:] = True  # two pieces: rows of 4 and of 2 real positions

    async def held_then(batcher, queued: int) -> None:
        """A request held in its run at the gate while ``queued`` more queue behind it; then all answered."""
        model.gate, model.entered = threading.Event(), threading.Event()
        first = asyncio.ensure_future(batcher.infer(x, None))
        await until(model.entered.is_set)
        rest = [asyncio.ensure_future(batcher.infer(x, None)) for _ in range(queued)]
        await until(lambda: batcher.depth == queued)
        model.gate.set()
        await asyncio.gather(first, *rest)

    async def main():
        batcher = Batcher(model, max_batch_size=2)
        batcher.start()
        await held_then(batcher, 3)  # one; two with the third queued; the third
        await held_then(batcher, 2)  # one; two with none behind them: still light
        await held_then(batcher, 4)  # one; two with two queued; two with none behind them: still heavy
        await batcher.infer(np.ones((2, 4, 32), np.float32), mask)
        await batcher.stop()

    run(main())
    # one bound alone would give index 4 heavy (at 1) or index 7 light (at 2)
    assert model.light == [True, False, True, True, True, True, False, False, True], model.light


class Lanes(Recorder):
    """A model of two lanes (``--parallel-runs``) whose runs last a little: how many ran at once, on which threads."""

    lanes, threads = 2, 2

    def __init__(self, model, gate: threading.Event | None = None):
        super().__init__(model, gate)
        self.inside = self.most = 0
        self.names: set[str] = set()
        self.count = threading.Lock()

    def run(self, x, mask=None, light=False):
        with self.count:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.names.add(threading.current_thread().name)
        try:
            time.sleep(0.02)  # time for another lane to start its run beside this one
            return super().run(x, mask, light)
        finally:
            with self.count:
                self.inside -= 1


def behind_a_gated_run(model: Lanes, engine, xs: list[np.ndarray], **kwargs) -> None:
    """``xs[0]``'s run held at the model's gate until the rest are queued behind it (19: heavy load), then all run one
    request a run; each answer is its own, whichever lane ran it."""

    async def main():
        batcher = Batcher(model, max_batch_size=1, **kwargs)
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(xs[0], None))
        await until(model.entered.is_set)
        rest = [asyncio.ensure_future(batcher.infer(x, None)) for x in xs[1:]]
        await until(lambda: batcher.depth == len(rest))
        model.gate.set()
        out = await asyncio.gather(first, *rest)
        await batcher.stop()
        return out

    for x, (rows, _) in zip(xs, run(main()), strict=True):
        np.testing.assert_array_equal(rows["encoded"], engine.run(x)["encoded"])


def test_under_load_each_lane_runs_a_batch_of_its_own_on_one_thread_of_the_budget(engine):
    """A model of two lanes: a lone request's run is light, alone, on every thread; with 19 requests queued behind it
    (more than HEAVY_LOAD) the two lanes run batches side by side, each holding one thread of a budget of two (were
    each to hold both, the second would wait for the first: never two at once)."""
    from addnorm.service.backend.cores import CoreBudget

    model = Lanes(engine, threading.Event())
    xs = [np.full((1, 3 + i % 4, 32), i, np.float32) for i in range(20)]

    behind_a_gated_run(model, engine, xs, cores=CoreBudget(2))
    assert model.light[0] and not all(model.light), model.light
    assert model.most == 2 and model.names == {"addnorm-infer", "addnorm-infer-2"}, (model.most, model.names)


def test_under_load_a_big_run_waits_for_the_others_and_runs_alone_on_every_thread(engine, monkeypatch):
    """Runs side by side hold their activations at once: a run above ALONE_ABOVE_BYTES (here the [1, 6] runs, not
    the [1, 3] ones) waits for the run in progress to end, then has every thread and the model to itself, as at
    light load; the small runs of the same load still go side by side."""
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "ALONE_ABOVE_BYTES", engine.working_bytes(1, 5, False))
    model = Lanes(engine, threading.Event())
    xs = [np.full((1, 6 if i % 5 == 4 else 3, 32), i, np.float32) for i in range(20)]
    seen = []  # (seq, runs in progress) at each run
    run_model = model.run

    def counted(x, mask=None, light=False):
        seen.append((x.shape[1], model.inside + 1, light))
        return run_model(x, mask, light)

    model.run = counted

    behind_a_gated_run(model, engine, xs)
    big = [(inside, light) for seq, inside, light in seen if seq == 6]
    assert len(big) == 4 and all(inside == 1 and light for inside, light in big), seen
    assert model.most == 2, seen  # the small ones side by side


def test_a_lone_requests_run_wakes_no_lane_but_the_one_that_takes_it(engine, monkeypatch):
    """A model of two lanes, one client's requests one after another: each wakes the lane that takes it and no
    other (a run's end wakes the waiting lanes only when a request is queued or another run is in progress: waking
    an idle lane for nothing cost a lone request 0.07-0.2 ms on a 2-core VM, ``bench.studies.lone_request``), and
    the lane takes it without weighing the companions it has none of (``merging.choose``: 25 µs cold)."""
    chose, choose = [], merging.choose
    monkeypatch.setattr(merging, "choose", lambda *a: chose.append(a) or choose(*a))
    model = Lanes(engine, threading.Event())
    model.gate.set()
    wakes = []

    async def main():
        batcher = Batcher(model, max_batch_size=8)
        wait = batcher._ready.wait

        def counted(timeout=None):  # Condition.wait_for calls it too
            notified = wait(timeout)
            if notified:
                wakes.append(threading.current_thread().name)
            return notified

        batcher._ready.wait = counted
        batcher.start()
        for i in range(8):
            x = np.full((1, 3, 32), i, np.float32)
            rows, _ = await batcher.infer(x, None)
            np.testing.assert_array_equal(rows["encoded"], engine.run(x)["encoded"])
        await batcher.stop()

    run(main())
    woken_by_requests = wakes[: len(wakes) - 2]  # stop() wakes the two lanes at the end
    assert len(woken_by_requests) <= 8, wakes
    assert not chose, chose
    assert all(model.light), model.light


def test_a_runs_observers_are_told_after_its_requests_have_their_answers(engine):
    """The batcher's observers (metrics, statistics) are told of a run after the requests it answered have resumed
    (their answers written first), not before: cold after a run, the metrics' updates took 40-60 µs of a lone
    request's path."""
    order = []

    class Observer:
        def batch_done(self, run) -> None:
            order.append(("told", run.rows))

    async def main():
        batcher = Batcher(engine, observer=Observer())
        batcher.start()
        for i in range(3):
            await batcher.infer(np.full((1, 3, 32), i, np.float32), None)
            order.append(("answered", i))
        await asyncio.sleep(0)  # the last run's observers
        await batcher.stop()

    run(main())
    assert order == [
        ("answered", 0),
        ("told", 1),
        ("answered", 1),
        ("told", 1),
        ("answered", 2),
        ("told", 1),
    ], order


def test_a_run_takes_every_thread_only_when_no_other_request_waits(engine):
    """A model of two lanes: a lone request's run is light (every thread, the model to itself), and so is each piece
    of one client's padded request, run one after another (its own pieces are not another request); with other
    requests queued behind a run, even at light load, the lanes run them side by side on one thread each."""
    model = Lanes(engine, threading.Event())
    model.gate.set()
    x = np.ones((4, 8, 32), np.float32)
    mask = np.zeros((4, 8), bool)
    for row, real in enumerate((8, 6, 4, 2)):
        mask[row, real:] = True  # four pieces: one row each of 8, 6, 4 and 2 real positions
    one = np.ones((1, 5, 32), np.float32)

    async def main():
        batcher = Batcher(model, max_batch_size=1)
        batcher.start()
        rows, _ = await batcher.infer(x, mask)
        for row, real in enumerate((8, 6, 4, 2)):
            want = engine.run(x[row : row + 1, :real])["encoded"][0]
            np.testing.assert_allclose(rows["encoded"][row, :real], want, atol=1e-6)
        assert model.light == [True] * 4 and model.most == 1, (model.light, model.most)
        model.gate, model.entered, model.light = threading.Event(), threading.Event(), []
        first = asyncio.ensure_future(batcher.infer(one, None))
        await until(model.entered.is_set)
        rest = [asyncio.ensure_future(batcher.infer(one, None)) for _ in range(3)]
        await until(lambda: batcher.depth == 3)  # three requests behind a light run: light load, four waiting
        model.gate.set()
        await asyncio.gather(first, *rest)
        await batcher.stop()

    run(main())
    assert model.light[:3] == [True, False, False] and model.most == 2, (model.light, model.most)


def test_at_light_load_a_run_is_cut_by_a_smaller_fixed_cost(engine, monkeypatch):
    """Requests of 4 and 16 positions queued behind a run: at light load, two requests waiting, the run's fixed cost
    weighs merging.LIGHT_FIXED of the measured 20 (8): padding the short one to 16 costs more than its own run, and
    the two run apart; at heavy load (the bounds monkeypatched to 1) and for one request's two pieces (nothing else
    is coming to join them) the full cost merges them into one run of 2 x 16."""
    from addnorm.service.batching import batcher as batcher_module

    light = merging.Costs(20.0).at_light_load().fixed
    assert (
        light == pytest.approx(20.0 * merging.LIGHT_FIXED) and light < 12
    )  # under the 12 positions of padding
    short, long = np.ones((1, 4, 32), np.float32), np.ones((1, 16, 32), np.float32)
    pieces = np.zeros((2, 16), bool)
    pieces[0, 4:] = True  # one request: rows of 4 and of 16 real positions

    def runs_after_a_held_one(*requests) -> list[tuple]:
        """The shapes of the runs that follow one held at the gate while ``requests`` (x, mask) queue behind it."""
        model = Recorder(engine, threading.Event())

        async def main():
            batcher = Batcher(model, max_batch_size=16, costs=merging.Costs(20.0))
            batcher.start()
            first = asyncio.ensure_future(batcher.infer(np.ones((1, 3, 32), np.float32), None))
            await until(model.entered.is_set)
            rest = [asyncio.ensure_future(batcher.infer(x, mask)) for x, mask in requests]
            await until(lambda: batcher.depth == len(requests))
            model.gate.set()
            await asyncio.gather(first, *rest)
            await batcher.stop()

        run(main())
        return [shape[:2] for shape in model.shapes[1:]]

    assert runs_after_a_held_one((short, None), (long, None)) == [(1, 4), (1, 16)]
    assert runs_after_a_held_one((np.ones((2, 16, 32), np.float32), pieces)) == [(2, 16)]
    monkeypatch.setattr(batcher_module, "LIGHT_LOAD", 1)
    monkeypatch.setattr(batcher_module, "HEAVY_LOAD", 1)
    assert runs_after_a_held_one((short, None), (long, None)) == [(2, 16)]


def test_the_next_batch_starts_while_the_event_loop_is_busy(engine):
    """The inference thread takes its next batch itself: a busy event loop (here: blocked outright) does not
    leave the model idle between runs, as a scheduler living on the loop did."""
    gate = threading.Event()
    starts: list[float] = []

    class Timed(Recorder):
        def run(self, x, mask=None, light=False):
            starts.append(time.perf_counter())
            return super().run(x, mask)

    model = Timed(engine, gate)

    async def main():
        batcher = Batcher(model, max_batch_size=1)
        batcher.start()
        x = np.zeros((1, 2, 32), np.float32)
        first = asyncio.ensure_future(batcher.infer(x, None))
        second = asyncio.ensure_future(batcher.infer(x, None))
        await until(lambda: bool(starts))  # the first run is waiting at the gate; the second is queued
        gate.set()
        # the event loop stays blocked until the second run has started (a generous limit, not a measure)
        deadline = time.monotonic() + 60
        while len(starts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        started_while_blocked = len(starts) == 2
        await asyncio.gather(first, second)
        await batcher.stop()
        return started_while_blocked

    assert run(main()), "the second run waited for the event loop"


def test_stop_answers_the_running_batch_and_fails_what_is_queued(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        batcher = Batcher(model, max_batch_size=1)
        batcher.start()
        running = asyncio.ensure_future(batcher.infer(np.zeros((1, 2, 32), np.float32), None))
        queued = asyncio.ensure_future(batcher.infer(np.zeros((1, 3, 32), np.float32), None))
        await until(lambda: model.entered.is_set() and batcher.depth == 1)
        stopping = asyncio.ensure_future(batcher.stop())
        await until(lambda: batcher._closed)  # stop() has begun while the run is under way
        gate.set()
        await asyncio.wait_for(stopping, 10)
        with pytest.raises(ShuttingDown):
            await batcher.infer(np.zeros((1, 2, 32), np.float32), None)
        # bounded: a request whose run was under way when stop() came must still be answered, never left hanging
        return await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 10)

    running, queued = run(main())
    assert running[0]["encoded"].shape == (1, 2, 32)
    assert isinstance(queued, ShuttingDown)
    assert model.shapes == [(1, 2, 32)]


def test_an_idle_model_is_asked_to_release_its_memory_while_it_gives_some(engine, monkeypatch):
    """RELEASE_IDLE_S after the last run with nothing queued, the model's ``release`` runs, on the inference
    thread; never before any run, never between runs that follow each other; asked again after each further idle
    spell while it still gives memory back (what requests being answered held the first time), then not until the
    next run. This model has two releases due after each run, as the engine does (``engine.RELEASES``)."""
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "RELEASE_IDLE_S", 0.05)
    released: list[str] = []

    class Releasing(Recorder):
        due = 0

        def run(self, *args, **kwargs):
            self.due = 2
            return super().run(*args, **kwargs)

        def release(self):
            if not self.due:
                return False
            self.due -= 1
            released.append(threading.current_thread().name)
            return True

    model = Releasing(engine)

    async def main():
        batcher = Batcher(model, max_batch_size=1)
        batcher.start()
        x = np.zeros((1, 2, 32), np.float32)
        time.sleep(0.2)  # idle before any run: nothing to release
        assert released == []
        await asyncio.gather(*(batcher.infer(x, None) for _ in range(5)))  # queued together: back to back
        await until(lambda: len(released) == 2)
        await asyncio.sleep(0.3)  # still idle, nothing more to give: not again
        assert len(released) == 2 and len(model.shapes) == 5
        await batcher.infer(x, None)
        await until(lambda: len(released) == 4)
        await batcher.stop()

    run(main())
    assert set(released) == {"addnorm-infer"}


class LongRuns(Recorder):
    """Holds every run longer than ``seq`` positions at the gate (a long run in progress); records each run's
    shape and the thread that ran it (``ran_on``)."""

    def __init__(self, model, seq: int):
        super().__init__(model, threading.Event())
        self.seq, self.ran_on = seq, []

    def run(self, x, mask=None, light=False):
        self.ran_on.append((x.shape, threading.current_thread().name))
        if x.shape[1] > self.seq:
            return super().run(x, mask)
        return self.model.run(x, mask)


def test_the_express_lane_answers_small_requests_while_a_long_run_holds_the_model(engine, monkeypatch):
    """While a run of a request bigger than --express-tokens has lasted EXPRESS_AFTER_S (held at the gate for good
    here), small requests (within --express-tokens) queued behind it are answered by the express lane, merged, with the answers they get
    alone; a large one waits for the main lane. No clock decides: EXPRESS_AFTER_S is 0."""
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "EXPRESS_AFTER_S", 0.0)
    model = LongRuns(engine, seq=8)
    rng = np.random.default_rng(3)
    small = [rng.standard_normal((1, 3 + i, 32)).astype(np.float32) for i in range(3)]

    async def main():
        batcher = Batcher(model, max_batch_size=8, max_batch_tokens=1024, express_tokens=16)
        batcher.start()
        long = asyncio.ensure_future(batcher.infer(np.zeros((1, 64, 32), np.float32), None))
        await until(model.entered.is_set)
        big = asyncio.ensure_future(
            batcher.infer(np.zeros((1, 20, 32), np.float32), None)
        )  # 20 > 16: not express
        answers = await asyncio.wait_for(asyncio.gather(*(batcher.infer(x, None) for x in small)), 10)
        assert not long.done() and not big.done() and batcher.depth == 1
        model.gate.set()
        await asyncio.gather(long, big)
        await batcher.stop()
        return answers

    answers = run(main())
    for x, (out, _) in zip(small, answers, strict=True):
        np.testing.assert_allclose(out["encoded"], engine.run(x)["encoded"], atol=FP32_ATOL, rtol=FP32_RTOL)
    express = [shape for shape, thread in model.ran_on if thread == "addnorm-express"]
    main_lane = [shape for shape, thread in model.ran_on if thread == "addnorm-infer"]
    assert sum(b for b, _, _ in express) == 3 and all(b * s <= 16 for b, s, _ in express)
    assert main_lane == [(1, 64, 32), (1, 20, 32)]


def test_the_express_lane_counts_from_the_taking_of_a_big_request_not_its_runs_start(engine, monkeypatch):
    """A lane that took a big request may wait before its run starts (here for the cores, which a worker's heavy
    step holds, for good in this test); a small request queued behind it waits all that time too, so the express
    lane's clock starts at the taking: the small one is answered while the big one still waits for the cores (its
    run has not started). Before, it waited until the cores came back: up to 30 ms of the 62-80 ms a sentence queued
    behind a burst of the largest text requests."""
    from addnorm.service.backend.cores import CoreBudget
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "EXPRESS_AFTER_S", 0.0)
    model = LongRuns(engine, seq=0)  # nothing is held at the gate: only the cores hold the big run back
    model.gate.set()
    budget = CoreBudget(engine.threads)
    x = np.random.default_rng(4).standard_normal((1, 3, 32)).astype(np.float32)

    async def main():
        batcher = Batcher(model, max_batch_size=8, express_tokens=16, cores=budget)
        batcher.start()
        with budget.hold(engine.threads):  # a worker's heavy step holds every core
            big = asyncio.ensure_future(batcher.infer(np.zeros((1, 64, 32), np.float32), None))
            await until(lambda: batcher.depth == 0)  # taken: its lane waits for the cores
            out, _ = await asyncio.wait_for(batcher.infer(x, None), 10)
            assert not big.done() and model.ran_on == [((1, 3, 32), "addnorm-express")]
        await big
        await batcher.stop()
        return out

    out = run(main())
    np.testing.assert_allclose(out["encoded"], engine.run(x)["encoded"], atol=FP32_ATOL, rtol=FP32_RTOL)
    assert [shape for shape, _ in model.ran_on] == [(1, 3, 32), (1, 64, 32)]


def _behind_a_held_run(model: LongRuns, first: int, express_tokens: int) -> list:
    """A [1, ``first``, 32] request held at the gate, a [1, 3, 32] one queued behind it, then the gate opened:
    which thread ran each (``model.ran_on``)."""

    async def main():
        batcher = Batcher(model, max_batch_size=8, express_tokens=express_tokens)
        batcher.start()
        assert (batcher._express_thread is not None) == bool(express_tokens)
        held = asyncio.ensure_future(batcher.infer(np.zeros((1, first, 32), np.float32), None))
        await until(model.entered.is_set)
        small = asyncio.ensure_future(batcher.infer(np.zeros((1, 3, 32), np.float32), None))
        await until(lambda: batcher.depth == 1)
        model.gate.set()
        await asyncio.gather(held, small)
        await batcher.stop()

    run(main())
    return model.ran_on


@pytest.mark.parametrize("express_tokens", [16, 0])
def test_the_express_lane_leaves_runs_shorter_than_its_wait_alone(engine, monkeypatch, express_tokens):
    """A small request queued behind a run that has not lasted EXPRESS_AFTER_S (an hour here) waits for the main
    lane, as with no express lane at all (--express-tokens 0: no second thread)."""
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "EXPRESS_AFTER_S", 3600.0)
    threads = _behind_a_held_run(LongRuns(engine, seq=8), 64, express_tokens)
    assert threads == [((1, 64, 32), "addnorm-infer"), ((1, 3, 32), "addnorm-infer")]


def test_the_express_lane_never_overtakes_a_run_of_small_requests(engine, monkeypatch):
    """A run that holds only requests the express lane could take (here one held at the gate for good) is not
    overtaken, however long it lasts: small requests queued behind it wait their turn among peers."""
    from addnorm.service.batching import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "EXPRESS_AFTER_S", 0.0)
    threads = _behind_a_held_run(LongRuns(engine, seq=0), 4, 16)  # every run waits at the gate
    assert threads == [((1, 4, 32), "addnorm-infer"), ((1, 3, 32), "addnorm-infer")]


def _queued_then_released(model, xs, masks=None, **kwargs):
    """Queue every request while the model holds its first run at the gate, then let them all run; returns the
    answers in the order of ``xs``. The first request runs alone (it is taken before the others arrive)."""
    masks = masks or [None] * len(xs)

    async def main():
        batcher = Batcher(model, max_batch_size=64, max_batch_tokens=100_000, **kwargs)
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(np.zeros((1, 1, xs[0].shape[2]), np.float32), None))
        await until(model.entered.is_set)
        tasks = [asyncio.ensure_future(batcher.infer(x, m)) for x, m in zip(xs, masks, strict=True)]
        await until(lambda: batcher.depth == len(xs))
        model.gate.set()
        out = await asyncio.gather(*tasks)
        await first
        await batcher.stop()
        return [o for o, _ in out]

    return run(main())


class RunLog:
    """A batch observer that keeps every Run it is told of."""

    def __init__(self):
        self.runs = []

    def batch_done(self, run):
        self.runs.append(run)


def test_merge_by_cost_groups_requests_of_near_lengths(engine):
    """Requests of two length groups queued together: merge "cost" runs each group on its own (no request
    padded further than a run's fixed cost is worth), the queue's head first; merge "pad" pads all to the
    longest. Every answer equals the request's answer alone."""
    rng = np.random.default_rng(5)
    lengths = [40, 3, 38, 4, 40, 5, 39]
    xs = [rng.standard_normal((1, n, 32)).astype(np.float32) for n in lengths]
    masks = [None] * len(xs)
    masks[2] = np.zeros((1, 38), bool)
    masks[2][0, 30:] = True  # its trailing padding is never computed: it queues as a 30-long request
    for merge, want, requested in (
        ("cost", [(1, 1, 32), (3, 40, 32), (3, 5, 32), (1, 30, 32)], [1, 40 + 40 + 39, 3 + 4 + 5, 30]),
        ("pad", [(1, 1, 32), (7, 40, 32)], [1, sum(lengths) - 8]),
    ):
        model, observer = Recorder(engine, threading.Event()), RunLog()
        answers = _queued_then_released(
            model, xs, masks, merge=merge, costs=merging.Costs(8.0), observer=observer
        )
        runs = observer.runs
        assert model.shapes == want, merge
        # every run tells its observer its positions: computed, and the requests' own (the rest is padding)
        assert [(r.positions, r.requested) for r in runs] == [
            (b * s, n) for (b, s, _), n in zip(want, requested, strict=True)
        ]
        for x, m, out in zip(xs, masks, answers, strict=True):
            want = answered(engine.run(x, m)["encoded"], m)
            np.testing.assert_allclose(out["encoded"], want, atol=FP32_ATOL, rtol=FP32_RTOL)


def test_merge_by_cost_weighs_padding_against_the_fixed_cost(engine):
    """The same queue merges into one run when a run's fixed cost outweighs the padding, and stays apart when
    it does not; equal lengths always merge."""
    xs = [np.ones((1, n, 32), np.float32) for n in (20, 24, 20, 24)]
    for fixed_cost, want in (
        (100.0, [(1, 1, 32), (4, 24, 32)]),
        (2.0, [(1, 1, 32), (2, 20, 32), (2, 24, 32)]),
    ):
        model = Recorder(engine, threading.Event())
        _queued_then_released(model, xs, merge="cost", costs=merging.Costs(fixed_cost))
        assert model.shapes == want, fixed_cost


def test_merge_by_cost_leaves_a_request_to_its_own_lengths_run(engine):
    """Merging is weighed against the runs the queue will make anyway, not against a run per request: six
    6-long requests behind a 10-long head run together on their own (2 runs: about 19 + 45 token-positions at a
    fixed cost of 8), where weighing each against a run of its own padded all six to 10 (1 run: about 82). The
    head still runs first."""
    xs = [np.ones((1, n, 32), np.float32) for n in (10, 6, 6, 6, 6, 6, 6)]
    model = Recorder(engine, threading.Event())
    _queued_then_released(model, xs, merge="cost", costs=merging.Costs(8.0))
    assert model.shapes == [(1, 1, 32), (1, 10, 32), (6, 6, 32)]


def test_merge_by_cost_keeps_the_limits(engine):
    """What merge "cost" takes still fits the batch limits (rows here)."""
    xs = [np.ones((1, 6, 32), np.float32) for _ in range(5)]
    model = Recorder(engine, threading.Event())

    async def main():
        batcher = Batcher(model, max_batch_size=2, merge="cost")
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(np.zeros((1, 1, 32), np.float32), None))
        await until(model.entered.is_set)
        tasks = [asyncio.ensure_future(batcher.infer(x, None)) for x in xs]
        await until(lambda: batcher.depth == len(xs))
        model.gate.set()
        await asyncio.gather(first, *tasks)
        await batcher.stop()

    run(main())
    assert model.shapes == [(1, 1, 32), (2, 6, 32), (2, 6, 32), (1, 6, 32)]


def test_a_run_takes_from_the_oldest_requests_only():
    """Merging looks at the oldest 2 x max_batch_size queued requests past the head (a request's pieces count
    once): one of the head's own length further back waits for its turn instead of overtaking those of other
    lengths (under an overload, ever newer requests of convenient lengths kept a request waiting up to 2.5x the
    queue's length in time)."""
    loop = asyncio.new_event_loop()
    try:

        def request(seq: int) -> merging.Queued:
            return merging.Queued(np.zeros((1, seq, 32), np.float32), None, loop.create_future())

        head, near = request(8), request(8)
        for max_batch_size in (2, 3):
            limits = merging.Limits(max_batch_size=max_batch_size)
            far = [request(100) for _ in range(2 * max_batch_size)]  # padding 8 to 100 costs more than a run
            assert merging.choose("cost", head, [*far, near], limits, merging.Costs(8.0)) == []
            within = [*far[:-1], near]
            assert merging.choose("cost", head, within, limits, merging.Costs(8.0)) == [near]
            pieces = [request(100) for _ in range(4 * max_batch_size)]  # of one request: one in reach
            for piece in pieces:
                piece.queued = pieces[0].queued
            assert merging.choose("cost", head, [*pieces, near], limits, merging.Costs(8.0)) == [near]
    finally:
        loop.close()


def test_a_runs_fixed_cost_is_measured_from_the_model(monkeypatch):
    """merging.measure_costs fits fixed + positions x (1 + seq / 6E) to a model's run times: a model whose runs
    cost (a + b x that) comes out at a / b, its slowest runs (here: every third one, twice as long) ignored, the
    two lengths taking turns (a machine's drift slows both alike). The clock is the model's own: no real time is
    measured."""
    from addnorm.service.batching import merging as module

    e, clock, seqs = 64, [0.0], []

    class Timed:
        def run(self, x, mask=None, light=False):
            s = x.shape[1]
            seqs.append(s)
            slow = 2 if len(seqs) % 3 == 0 else 1
            clock[0] += (0.002 + 0.0001 * s * (1 + s / (6 * e))) * slow  # a / b = 20
            return {"encoded": x}

    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    assert module.measure_costs(Timed(), e, repeats=3) == module.Costs(pytest.approx(20.0))
    assert seqs == [8, 128] * 3
