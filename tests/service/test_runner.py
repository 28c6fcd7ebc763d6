"""Dynamic batching: merged results equal unbatched ones; backpressure; timeouts; no timing assertions."""

import asyncio
import threading

import numpy as np
import pytest

from service.engine import Engine
from service.errors import Overloaded, Timeout
from service.runner import Runner

FP32_ATOL, FP32_RTOL = 1e-5, 1e-4


class Recorder:
    """Wraps a model and records the batch shapes it was run with."""

    def __init__(self, model, gate: threading.Event | None = None):
        self.model, self.gate, self.shapes = model, gate, []

    def run(self, x, mask=None):
        if self.gate is not None:
            self.gate.wait(10)
        self.shapes.append(x.shape)
        return self.model.run(x, mask)


def run(coro):
    return asyncio.run(coro)


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
        runner = Runner(model, max_batch_size=64, max_batch_tokens=10_000, max_queue_delay_ms=50)
        runner.start()
        tasks = [asyncio.ensure_future(runner.infer(x, m)) for x, m in reqs]
        await asyncio.sleep(0.2)
        gate.set()
        results = await asyncio.gather(*tasks)
        await runner.stop()
        return results

    results = run(main())
    assert len(model.shapes) < len(reqs)  # merged
    assert max(s[0] for s in model.shapes) > 2
    for (x, m), (out, timings) in zip(reqs, results, strict=True):
        alone = engine.run(x, m)
        assert out.shape == x.shape
        np.testing.assert_allclose(out, alone, atol=FP32_ATOL, rtol=FP32_RTOL)
        assert timings.infer_s > 0


def test_batch_size_one_turns_merging_off(engine):
    model = Recorder(engine)

    async def main():
        runner = Runner(model, max_batch_size=1, max_queue_delay_ms=50)
        runner.start()
        xs = [np.zeros((1, 2, 32), np.float32) for _ in range(5)]
        await asyncio.gather(*(runner.infer(x, None) for x in xs))
        await runner.stop()

    run(main())
    assert model.shapes == [(1, 2, 32)] * 5


def test_token_budget_splits_batches(engine):
    model = Recorder(engine, threading.Event())

    async def main():
        runner = Runner(model, max_batch_size=64, max_batch_tokens=16, max_queue_delay_ms=50)
        runner.start()
        tasks = [
            asyncio.ensure_future(runner.infer(np.zeros((1, 8, 32), np.float32), None)) for _ in range(4)
        ]
        await asyncio.sleep(0.1)
        model.gate.set()
        await asyncio.gather(*tasks)
        await runner.stop()

    run(main())
    assert all(b * s <= 16 for b, s, _ in model.shapes) and sum(b for b, _, _ in model.shapes) == 4


def test_all_padding_rows_run_alone(engine):
    model = Recorder(engine, threading.Event())
    x = np.ones((1, 4, 32), np.float32)

    async def main():
        runner = Runner(model, max_batch_size=64, max_queue_delay_ms=50)
        runner.start()
        tasks = [asyncio.ensure_future(runner.infer(x, None)),
                 asyncio.ensure_future(runner.infer(x, np.ones((1, 4), bool))),
                 asyncio.ensure_future(runner.infer(x, None))]  # fmt: skip
        await asyncio.sleep(0.1)
        model.gate.set()
        out = await asyncio.gather(*tasks)
        await runner.stop()
        return out

    results = run(main())
    assert np.isfinite(results[1][0]).all()
    assert (1, 4, 32) in model.shapes


def test_full_queue_answers_429_with_retry_after(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        runner = Runner(model, max_batch_size=1, max_queue_size=2, max_queue_delay_ms=0)
        runner.start()
        x = np.zeros((1, 2, 32), np.float32)
        first = asyncio.ensure_future(runner.infer(x, None))
        await asyncio.sleep(0.05)  # the first is running (blocked on the gate); two more fill the queue
        queued = [asyncio.ensure_future(runner.infer(x, None)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded) as info:
            await runner.infer(x, None)
        gate.set()
        await asyncio.gather(first, *queued)
        await runner.stop()
        return info.value

    err = run(main())
    assert err.status == 429 and err.headers["Retry-After"] == "1"


def test_timeout_gives_504_and_the_request_is_dropped_before_it_runs(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        runner = Runner(model, max_batch_size=1, max_queue_delay_ms=0)
        runner.start()
        blocker = asyncio.ensure_future(runner.infer(np.zeros((1, 2, 32), np.float32), None))
        await asyncio.sleep(0.05)
        with pytest.raises(Timeout):
            await runner.infer(np.zeros((1, 9, 32), np.float32), None, timeout=0.05)
        gate.set()
        await blocker
        await asyncio.sleep(0.05)
        await runner.stop()

    run(main())
    assert (1, 9, 32) not in model.shapes  # timed out while queued: never ran


def test_cancelled_request_is_not_run(engine):
    gate = threading.Event()
    model = Recorder(engine, gate)

    async def main():
        runner = Runner(model, max_batch_size=1, max_queue_delay_ms=0)
        runner.start()
        blocker = asyncio.ensure_future(runner.infer(np.zeros((1, 2, 32), np.float32), None))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(runner.infer(np.zeros((1, 7, 32), np.float32), None))
        await asyncio.sleep(0.01)
        gone.cancel()  # what the HTTP layer does when the client disconnects
        gate.set()
        await blocker
        await asyncio.sleep(0.05)
        await runner.stop()

    run(main())
    assert (1, 7, 32) not in model.shapes


def test_engine_failure_fails_the_batch_not_the_runner():
    class Flaky:
        calls = 0

        def run(self, x, mask=None):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("boom")
            return x

    async def main():
        runner = Runner(Flaky(), max_batch_size=1, max_queue_delay_ms=0)
        runner.start()
        x = np.zeros((1, 2, 4), np.float32)
        with pytest.raises(Exception, match="inference failed"):
            await runner.infer(x, None)
        out, _ = await runner.infer(x, None)  # the scheduler survived
        await runner.stop()
        return out

    assert run(main()).shape == (1, 2, 4)
