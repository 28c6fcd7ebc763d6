"""The server's CPU thread budget (service/backend/cores.py, issue 28): runs never hold more threads than the budget,
waiters are served in arrival order, and the settings give each model its threads."""

from __future__ import annotations

import threading
import time

import pytest

from addnorm.service.backend.cores import CoreBudget, threads_for
from addnorm.service.settings import Settings
from tests.helpers import wait_until

pytestmark = pytest.mark.unit


def _run_all(budget: CoreBudget, wants: list[int], hold_s: float = 0.02) -> tuple[int, list[int]]:
    """Each want in its own thread, started in order, each one started once the one before has arrived (holds its
    threads, or waits in line for them); the most threads held at once, and the order they ran."""
    lock, held, peak, order, acquired = threading.Lock(), [0], [0], [], [0]

    def run(i: int, n: int) -> None:
        with budget.hold(n):
            with lock:
                acquired[0] += 1
                held[0] += min(n, budget.threads)
                peak[0] = max(peak[0], held[0])
                order.append(i)
            time.sleep(hold_s)
            with lock:
                held[0] -= min(n, budget.threads)

    threads = []
    for i, n in enumerate(wants):
        threads.append(threading.Thread(target=run, args=(i, n)))
        threads[-1].start()
        wait_until(lambda i=i: acquired[0] + budget.waiting == i + 1, 10, f"run {i} arrived")
    for t in threads:
        t.join(10)
    return peak[0], order


def test_two_whole_budget_models_take_turns_in_arrival_order():
    peak, order = _run_all(CoreBudget(2), [2, 2, 2, 2])
    assert peak == 2 and order == [0, 1, 2, 3]


def test_shares_run_side_by_side_up_to_the_budget():
    peak, _ = _run_all(CoreBudget(2), [1, 1, 1, 1], hold_s=0.1)
    assert peak == 2  # two at a time, never three


def test_a_small_run_does_not_overtake_a_waiting_big_one():
    """First come, first served: a 1-thread run that arrives after a waiting 2-thread one waits behind it."""
    budget = CoreBudget(2)
    peak, order = _run_all(budget, [1, 2, 1], hold_s=0.05)
    assert order == [0, 1, 2] and peak == 2 and budget.free == 2


def test_a_run_wanting_more_than_the_budget_holds_all_of_it():
    budget = CoreBudget(2)
    with budget.hold(8):
        assert budget.free == 0
    assert budget.free == 2


def test_model_threads_setting():
    s = Settings(model_threads="a=1, b=3", intra_op_threads=0)
    assert threads_for(s, "a", 4) == 1 and threads_for(s, "b", 4) == 3 and threads_for(s, "c", 4) == 4
    assert threads_for(Settings(intra_op_threads=2), "c", 4) == 2
    for bad in ("a", "a=0", "=2", "a=x"):
        with pytest.raises(ValueError, match="NAME=N"):
            Settings(model_threads=bad)


def test_a_two_model_server_gives_each_model_an_equal_share(model_repository):
    """--thread-budget 2 over two models: one thread each (measured: side by side they serve 1.02x / 1.03x what
    one model alone on both cores does; docs/benchmarks.md); --model-threads overrides one model's share."""
    from fastapi.testclient import TestClient

    from addnorm.service import create_app
    from tests.helpers import wait_until_ready

    for extra, want in (
        ({}, {"encoder": 1, "encoder-int8": 1}),
        ({"model_threads": "encoder=2"}, {"encoder": 2, "encoder-int8": 1}),
    ):
        app = create_app(Settings(model_repository=model_repository, thread_budget=2, **extra))
        with TestClient(app) as client:
            wait_until_ready(client)
            got = {m: client.get(f"/v1/model?model={m}").json()["intra_op_threads"] for m in want}
            assert got == want, (extra, got)
            assert app.state.addnorm.cores.threads == 2
            serving = app.state.addnorm.known.models.get("encoder")
            assert serving.batcher.cores is app.state.addnorm.cores  # every CPU run draws from the budget


@pytest.mark.parametrize("cores, at_once", [(2, 1), (8, 4)])
def test_heavy_steps_run_in_workers_a_few_at_a_time(monkeypatch, cores, at_once):
    """``in_worker``: a request's heavy steps leave the event loop for worker threads, at most max(1, cores / 2)
    at once; the rest wait their turn and each still gets its own answer. Each step holds until all that may run
    at once have started (no clock: a step past the gate would find the count above ``at_once``)."""
    import asyncio

    from addnorm.service.backend import cores as module

    monkeypatch.setattr(module, "default_threads", lambda *a, **k: cores)
    lock, running, peak, loop_thread = threading.Lock(), [0], [0], []
    full = threading.Event()

    def step(i: int) -> tuple[int, bool]:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            if running[0] == at_once:
                full.set()
        full.wait(10)
        with lock:
            running[0] -= 1
        return i, threading.current_thread() is loop_thread[0]

    async def main():
        loop_thread.append(threading.current_thread())
        return await asyncio.gather(*(module.in_worker(step, i) for i in range(3 * at_once)))

    answers = asyncio.run(main())
    assert [i for i, _ in answers] == list(range(3 * at_once))
    assert not any(on_loop for _, on_loop in answers)
    assert peak[0] == at_once
