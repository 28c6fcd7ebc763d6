"""The packed graph served (model/packing.py): each request computed on its own positions only, merged with any
others without computing padding, answering as the padded graph of the same weights does, on every way in."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from addnorm.model.attention import score_elements
from addnorm.model.config import EncoderConfig
from addnorm.model.packing import real_lengths
from addnorm.model.verdict import float32_floor
from addnorm.service.backend.engine import Engine
from addnorm.service.batching import merging
from addnorm.service.batching.batcher import Batcher
from addnorm.service.errors import Overloaded, TimedOut, TooLarge
from tests.conftest import SMALL, export_to, start_server
from tests.service.test_batcher import Recorder, RunLog, until

PACKED = dataclasses.replace(SMALL, num_layers=2, pooling="mean", activation="gelu", packed=True)
LENGTHS = (3, 9, 1, 6)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> tuple:
    """The same weights (seed 0) exported packed and padded."""
    root = tmp_path_factory.mktemp("packed")
    packed = export_to(root / "packed", PACKED)
    padded = export_to(root / "padded", dataclasses.replace(PACKED, packed=False))
    return packed, padded


def _ragged(rng: np.random.Generator, lengths=LENGTHS) -> list[np.ndarray]:
    return [rng.standard_normal((1, n, SMALL.d_model)).astype(np.float32) for n in lengths]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=float32_floor(want.astype(np.float64)))


def test_a_packed_batch_computes_each_row_to_its_own_length_and_answers_as_the_padded_graph(artifacts):
    packed, padded = Engine(artifacts[0], "cpu"), Engine(artifacts[1], "cpu")
    assert packed.packed and not padded.packed
    rng = np.random.default_rng(0)
    x = np.zeros((len(LENGTHS), max(LENGTHS), SMALL.d_model), np.float32)
    mask = np.ones(x.shape[:2], bool)
    for i, n in enumerate(LENGTHS):
        x[i, :n] = rng.standard_normal((n, SMALL.d_model))
        mask[i, :n] = False
    mask[1, 4] = True  # a client's own padding inside a row: still computed, still masked
    out = packed.run(x, mask, np.array(LENGTHS))
    reference = padded.run(x, mask)
    for i, n in enumerate(LENGTHS):
        _close(out["encoded"][i, :n], reference["encoded"][i, :n])
        assert not out["encoded"][i, n:].any(), "a position merging added was computed"
        alone = packed.run(x[i : i + 1, :n], mask[i : i + 1, :n])
        _close(out["encoded"][i, :n], alone["encoded"][0])
        _close(out["pooled"][i], alone["pooled"][0])
    _close(out["pooled"], reference["pooled"])


def test_the_batcher_merges_any_lengths_into_one_packed_run_and_counts_no_padding(artifacts):
    engine = Engine(artifacts[0], "cpu")
    runs: list[merging.Run] = []
    gate = threading.Event()
    calls: list[tuple] = []

    class Held:  # the engine, its first run held until every request is queued
        packed = True
        threads = engine.threads
        lanes = 1

        def run(self, x, mask=None, lengths=None, light=False):
            calls.append((x.shape, None if lengths is None else list(lengths)))
            gate.wait(10)
            return engine.run(x, mask, lengths)

    class Observer:
        def batch_done(self, run: merging.Run) -> None:
            runs.append(run)

    requests = _ragged(np.random.default_rng(1), (40, 3, 17, 1, 29, 8))

    async def main():
        batcher = Batcher(Held(), max_batch_size=16, observer=Observer(), costs=merging.Costs(8.0, True))
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(requests[0], None))
        while not calls:
            await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(batcher.infer(r, None)) for r in requests[1:]]
        while batcher.depth < len(rest):
            await asyncio.sleep(0.005)
        gate.set()
        answers = [(await f)[0] for f in (first, *rest)]
        await batcher.stop()
        return answers

    answers = asyncio.run(main())
    merged = [r for r in runs if r.requests > 1]
    assert merged, f"nothing was merged: {calls}"
    assert all(r.positions == r.requested for r in runs), runs
    assert any(c[1] is not None and len(set(c[1])) > 1 for c in calls), calls  # lengths handed to the graph
    for x, answer in zip(requests, answers, strict=True):
        alone = engine.run(x)
        _close(answer["encoded"], alone["encoded"])


def test_real_lengths_drop_only_a_rows_trailing_padding():
    mask = np.array(
        [
            [0, 0, 0, 0, 0, 0],  # none
            [0, 0, 0, 1, 1, 1],  # right-padded, as a tokenizer pads: 3
            [0, 1, 0, 0, 1, 1],  # padding inside stays (masked in attention): 4
            [1, 1, 0, 0, 0, 0],  # left-padded: the whole row
            [1, 1, 1, 1, 1, 1],  # padding only (it runs alone): the whole row
        ],
        bool,
    )
    assert real_lengths(mask).tolist() == [6, 3, 4, 6, 6]


def test_a_clients_own_trailing_padding_is_not_computed(artifacts):
    """A request padded by its client (a tokenizer's batch: each sentence padded to the longest, with a mask) is
    computed to each row's real length, as merging's padding is: the engine is handed those lengths, the run counts
    those positions, real tokens answer as the padded twin's and the trailing padding as zeros."""
    engine, padded = Engine(artifacts[0], "cpu"), Engine(artifacts[1], "cpu")
    runs: list[merging.Run] = []
    calls: list = []

    class Recorded:
        packed, threads, release = True, engine.threads, engine.release
        lanes = 1

        def run(self, x, mask=None, lengths=None, light=False):
            calls.append(None if lengths is None else lengths.tolist())
            return engine.run(x, mask, lengths)

    class Observer:
        def batch_done(self, run: merging.Run) -> None:
            runs.append(run)

    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 12, SMALL.d_model)).astype(np.float32)
    mask = np.arange(12)[None, :] >= np.array([12, 5, 2, 9])[:, None]
    mask[3, 1] = True  # the client's padding inside a row: computed and masked

    async def main():
        batcher = Batcher(Recorded(), observer=Observer(), costs=merging.Costs(8.0, True))
        batcher.start()
        answer, _ = await batcher.infer(x, mask)
        await batcher.stop()
        return answer["encoded"]

    got = asyncio.run(main())
    # queued as pieces by real length, merged back into one run here (the cost model's choice): their lengths
    assert len(calls) == 1 and sorted(calls[0]) == [2, 5, 9, 12], (calls, runs)
    assert runs[0].positions == runs[0].requested == 28, runs
    want = padded.run(x, mask)["encoded"]
    want[np.arange(12)[None, :] >= np.array([12, 5, 2, 9])[:, None]] = 0.0
    _close(got, want)
    assert not got[1, 5:].any() and got[3, 1].any()


def test_on_a_packed_graph_a_clients_short_rows_do_not_pay_its_long_rows_attention(artifacts):
    """A packed graph computes no padding's products, but its attention runs padded to its run's longest: a client's
    batch of one long row and short ones is queued as pieces by real length too, so where attention weighs (the
    cost model), the short rows run apart from the long one instead of paying seq^2 each; answers as the padded
    twin's."""
    engine, padded = Engine(artifacts[0], "cpu"), Engine(artifacts[1], "cpu")
    calls: list = []

    class Recorded:
        packed, threads, release = True, engine.threads, engine.release
        lanes = 1

        def run(self, x, mask=None, lengths=None, light=False):
            calls.append((x.shape[1], None if lengths is None else sorted(lengths.tolist())))
            return engine.run(x, mask, lengths)

    lengths = np.array([64, 2, 3, 2])
    x = np.random.default_rng(5).standard_normal((4, 64, SMALL.d_model)).astype(np.float32)
    mask = np.arange(64)[None, :] >= lengths[:, None]

    async def main():
        batcher = Batcher(Recorded(), costs=merging.Costs(8.0, True, 64.0))
        batcher.start()
        answer, _ = await batcher.infer(x, mask)
        await batcher.stop()
        return answer["encoded"]

    got = asyncio.run(main())
    assert sorted(calls) == [(3, [2, 2, 3]), (64, [64])], calls
    want = padded.run(x, mask)["encoded"]
    want[mask] = 0.0
    _close(got, want)


def test_a_padded_graph_queues_a_clients_rows_by_their_real_lengths(artifacts):
    """On a padded graph a request padded by its client is queued as pieces, runs of its rows cut to their real
    length, which merge like requests (by cost): no run computes its trailing padding, each row answers as it would
    alone and zeros beyond its length (the pooled output too: its real tokens'), interior padding is still computed,
    and it counts as one request (the queue's bound and depth, a run's requests)."""
    engine = Engine(artifacts[1], "cpu")
    model, observer = Recorder(engine, threading.Event()), RunLog()
    lengths = [12, 5, 5, 2, 9]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 12, SMALL.d_model)).astype(np.float32)
    mask = np.arange(12)[None, :] >= np.array(lengths)[:, None]
    mask[4, 1] = True  # inside a row: computed and masked

    async def main():
        # two requests wait (light load): their runs are cut by LIGHT_FIXED of this fixed cost, 8 positions
        costs = merging.Costs(8.0 / merging.LIGHT_FIXED)
        batcher = Batcher(model, observer=observer, costs=costs, max_queue_size=2)
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(x[:1, :1], None))
        await until(model.entered.is_set)
        client = asyncio.ensure_future(batcher.infer(x, mask))
        await until(lambda: len(batcher._queue) == 4)  # rows 0 | 1-2 | 3 | 4
        assert batcher.depth == 1
        other = asyncio.ensure_future(batcher.infer(x[:1, :3], None))
        await until(lambda: batcher.depth == 2)
        with pytest.raises(Overloaded):  # two requests queued, five pieces
            await batcher.infer(x[:1, :3], None)
        model.gate.set()
        answer, _ = await client
        await asyncio.gather(first, other)
        await batcher.stop()
        return answer

    got = asyncio.run(main())
    # the 9-long piece merges into the 12-long one's run (3 positions of padding are cheaper than a run), the 2-long
    # one and the other 3-long request into the 5-long pair's
    assert [shape[:2] for shape in model.shapes] == [(1, 1), (2, 12), (4, 5)]
    assert [(r.requests, r.positions, r.requested) for r in observer.runs] == [
        (1, 1, 1),
        (1, 24, 21),
        (2, 20, 15),
    ]
    for i, n in enumerate(lengths):
        alone = engine.run(x[i : i + 1, :n], mask[i : i + 1, :n])
        _close(got["encoded"][i : i + 1, :n], alone["encoded"])
        _close(got["pooled"][i : i + 1], alone["pooled"])
        assert not got["encoded"][i, n:].any()
    assert got["encoded"][4, 1].any()


def test_a_piece_that_times_out_fails_its_request_and_no_other_piece_runs(artifacts):
    model = Recorder(Engine(artifacts[1], "cpu"), threading.Event())
    x = np.ones((3, 8, SMALL.d_model), np.float32)
    mask = np.arange(8)[None, :] >= np.array([8, 4, 2])[:, None]

    async def main():
        batcher = Batcher(model)
        batcher.start()
        first = asyncio.ensure_future(batcher.infer(x[:1, :1], None))
        await until(model.entered.is_set)
        with pytest.raises(TimedOut):
            await batcher.infer(x, mask, timeout=0.05)
        model.gate.set()
        await first
        await batcher.infer(x[:1, :6], None)  # runs after whatever was still queued
        await batcher.stop()
        return batcher.depth

    assert asyncio.run(main()) == 0
    assert [shape[:2] for shape in model.shapes] == [(1, 1), (1, 6)]


def test_the_attention_budget_holds_for_what_runs_a_clients_padding_left_out(artifacts):
    """A request is held to ``max_batch_attention`` by what runs of it: padded to 16 its two rows would be over a
    budget of one 16-long row, but its second row is 4 long and runs apart, so it is served; two 16-long rows are
    refused, naming the rows that would run."""
    engine = Engine(artifacts[1], "cpu")
    x = np.ones((2, 16, SMALL.d_model), np.float32)
    mask = np.arange(16)[None, :] >= np.array([16, 4])[:, None]

    async def main():
        batcher = Batcher(engine, max_batch_attention=score_elements("decomposed", 1, 1, 16, True), heads=1)
        batcher.start()
        answer, _ = await batcher.infer(x, mask)
        with pytest.raises(TooLarge, match=r"a \[2, 16\] request"):
            await batcher.infer(x, np.zeros((2, 16), bool))
        await batcher.stop()
        return answer["encoded"]

    got = asyncio.run(main())
    assert got.shape == x.shape and not got[1, 4:].any() and got[1, :4].all()


def test_merging_by_cost_on_a_packed_graph_pays_only_for_attentions_padding():
    """A 64-long head and an 8-long request: padded, merging costs 56 positions of every weight product (more
    than a run's fixed cost); packed, only the attention's padding."""

    def request(seq: int) -> merging.Queued:
        return merging.Queued(np.zeros((1, seq, 768), np.float32), None, asyncio.Future(loop=loop))

    loop = asyncio.new_event_loop()
    try:
        head, short = request(64), request(8)
        fits = merging.Limits().fits
        assert merging.by_cost(head, [short], fits, merging.Costs(8.0)) == []
        assert merging.by_cost(head, [short], fits, merging.Costs(8.0, packed=True)) == [short]
        # attention's padding still counts (at a weight measured on the default packed graph): a 4-long request
        # beside a 512-long one runs alone
        long, tiny = request(512), request(4)
        assert merging.by_cost(long, [tiny], fits, merging.Costs(8.0, packed=True, attention=2.0)) == []
    finally:
        loop.close()


def test_attentions_weight_is_measured_from_a_packed_model(monkeypatch):
    """merging.measure_costs on a packed model whose runs cost a + b x (its own positions + k x rows x seq^2 / 6E),
    k 1 alone and 2 when merged (masked): fixed a / b = 20, and merging an 8-long sequence into a 256-long one's
    run costs (2 x 2 - 1) = 3 of the padded attention counted for it. The clock is the model's own."""
    e, clock = 64, [0.0]

    class Timed:
        def run(self, x, mask=None, lengths=None, light=False):
            rows, seq = x.shape[:2]
            tokens = rows * seq if lengths is None else int(np.sum(lengths))
            k = 2.0 if mask is not None and mask.any() else 1.0
            clock[0] += 0.002 + 0.0001 * (tokens + k * rows * seq * seq / (6 * e))
            return {"encoded": x}

    monkeypatch.setattr(merging.time, "perf_counter", lambda: clock[0])
    costs = merging.measure_costs(Timed(), e, packed=True, repeats=2)
    assert costs == merging.Costs(pytest.approx(20.0), True, pytest.approx(3.0))
    assert merging.measure_costs(Timed(), e, repeats=2) == merging.Costs(
        pytest.approx(20.0)
    )  # padded: weight 1


def test_every_way_in_answers_a_packed_model_as_its_padded_twin(artifacts):
    """/v1 ragged lists, V2 requests of different lengths from different clients (one with a mask), gRPC."""
    import json
    import urllib.request

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    padded = Engine(artifacts[1], "cpu")
    rng = np.random.default_rng(2)
    requests = _ragged(rng, (5, 31, 2, 12, 7, 19, 1, 26))
    masked = rng.standard_normal((2, 6, SMALL.d_model)).astype(np.float32)
    mask = np.zeros((2, 6), bool)
    mask[1, 4:] = True
    with start_server(artifacts[0], "--max-queue-delay-ms", "20", grpc=True) as srv:
        http = httpclient.InferenceServerClient(srv.base.removeprefix("http://"), concurrency=8)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")

        def inputs(x, m=None, mod=httpclient):
            tensors = [mod.InferInput("embeddings", list(x.shape), "FP32")]
            tensors[0].set_data_from_numpy(x)
            if m is not None:
                tensors.append(mod.InferInput("mask", list(m.shape), "BOOL"))
                tensors[1].set_data_from_numpy(m)
            return tensors

        def v2(x, m=None, client=http, mod=httpclient):
            return client.infer("encoder", inputs(x, m, mod)).as_numpy("encoded")

        # concurrent requests of different lengths (tritonclient.http's own concurrency): merged, packed
        handles = [http.async_infer("encoder", inputs(x)) for x in requests]
        answers = [h.get_result().as_numpy("encoded") for h in handles]
        for x, got in zip(requests, answers, strict=True):
            _close(got, padded.run(x)["encoded"])
        stats = http.get_inference_statistics("encoder")["model_stats"][0]
        assert stats["execution_count"] < stats["inference_count"], "nothing was merged: nothing was tested"
        want = padded.run(masked, mask)["encoded"]
        want[mask] = 0.0  # its own trailing padding: not computed, answered as zeros
        _close(v2(masked, mask), want)
        _close(v2(masked, mask, grpc, grpcclient), want)
        body = json.dumps({"embeddings": [r[0].tolist() for r in requests[:3]]}).encode()
        req = urllib.request.Request(f"{srv.base}/v1/encode", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            ragged = json.loads(r.read())["encoded"]
        for x, got in zip(requests[:3], ragged, strict=True):
            _close(np.array(got, np.float32), padded.run(x)["encoded"][0])
        with urllib.request.urlopen(f"{srv.base}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        padding = _metric(metrics, "addnorm_batch_positions_total", 'kind="padding"')
        requested = _metric(metrics, "addnorm_batch_positions_total", 'kind="requested"')
        assert padding == 0 and requested > 0, (padding, requested)


def _metric(text: str, name: str, label: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


def test_a_packed_graph_needs_batch_first():
    with pytest.raises(ValueError, match="packed needs batch_first"):
        EncoderConfig(batch_first=False, packed=True)


def test_no_reduction_of_the_packed_graph_sees_an_empty_axis_with_one_sequence(artifacts):
    """onnxruntime's CUDA ReduceSum refuses to reduce an axis of length 0, where its CPU kernel returns zeros: a
    packed graph that summed over ``starts[1:]`` failed every one-sequence batch on an H100 (its golden check at
    load, every lone request). Here on CPU: every reduction's input is made an output too, and a run of one
    sequence shows their shapes; none may have a 0."""
    import onnx
    import onnxruntime as ort

    from addnorm.model import packing
    from addnorm.model.artifact import MODEL_FILE

    model = onnx.load(str(artifacts[0] / MODEL_FILE))
    reductions = {n.input[0]: n.name for n in model.graph.node if n.op_type.startswith("Reduce")}
    assert reductions, "a packed graph without a reduction: the test would check nothing"
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in reductions)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 5, SMALL.d_model)).astype(np.float32)
    outputs = session.run(list(reductions), packing.feed(x, np.zeros((1, 5), bool)))
    empty = {reductions[name]: a.shape for name, a in zip(reductions, outputs, strict=True) if 0 in a.shape}
    assert not empty, f"reductions over an empty axis (CUDA refuses them): {empty}"
