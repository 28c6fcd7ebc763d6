"""NVIDIA's perf_analyzer, unmodified, against a plain addnorm-serve over HTTP, gRPC and gRPC streams (issue 25).

The binary comes from PyPI's perf-analyzer wheel, with a newer C runtime from Debian beside it when this glibc is
older than it needs (bench/perf_analyzer.py fetches both into ~/.cache/addnorm on first use). Where neither PyPI
nor Debian can be reached, the test is skipped and says why; it never passes without running the binary.
"""

from __future__ import annotations

import pytest

from addnorm.model.artifact import Manifest
from bench import perf_analyzer as pa
from tests.conftest import start_server


@pytest.fixture(scope="module")
def command() -> list[str]:
    try:
        return pa.binary()
    except pa.Unavailable as exc:
        pytest.skip(f"perf_analyzer could not be fetched here, so it did not run: {exc}")


def test_perf_analyzer_measures_addnorm_over_http_and_grpc(command, tiny_artifact):
    """Its start-up reads the model configuration (GET .../config, gRPC ModelConfig), its load runs at two
    concurrencies with batch 2 (HTTP with binary tensors and with JSON ones, gRPC with a call per request and with
    its --streaming; no shared memory), and its server-side columns come from our statistics API."""
    e = Manifest.load(tiny_artifact).config.d_model
    # Any window counts as stable: a busy CI machine must not turn a measurement's noise into a failure.
    stable = ("--stability-percentage", "1000")
    json_tensors = ("--input-tensor-format", "json", "--output-tensor-format", "json")
    with start_server(tiny_artifact, grpc=True) as srv:
        runs = [
            ("http", srv.port, stable),
            ("http", srv.port, stable + json_tensors),  # without the binary tensor extension
            ("grpc", srv.grpc_port, stable),
            ("grpc", srv.grpc_port, stable + ("--streaming",)),  # ModelStreamInfer
        ]
        for protocol, port, extra in runs:
            url = f"127.0.0.1:{port}"
            rows = pa.run(
                command, url, protocol, "encoder", 2, pa.zeros(8, e), [1, 4], interval_ms=500, extra=extra
            )
            assert [r["concurrency"] for r in rows] == [1, 4], rows
            for r in rows:
                assert r["infer_per_s"] > 0 and r["p50_ms"] > 0, (protocol, extra, r)
                assert r["server_infer_ms"] > 0, (protocol, r)  # read from /v2/models/encoder/stats


def test_perf_analyzer_sends_requests_of_mixed_lengths_from_a_data_file(command, tiny_artifact, tmp_path):
    """``--lengths real``'s data file (bench.perf_analyzer_real): each entry its own shape, the embeddings in base64
    as written, and perf_analyzer sends them all, unmodified, over HTTP, gRPC and a stream: the server counts the
    real tokens of the requests it ran, whose mean lies strictly between the shortest and the longest entry."""
    import base64
    import json

    import numpy as np

    from bench import perf_analyzer_real as real
    from bench.mixed import served

    e = Manifest.load(tiny_artifact).config.d_model
    data = tmp_path / "real.json"
    xs = real.real_lengths(data, e, count=12)
    entries = json.loads(data.read_text())["data"]
    assert [entry["embeddings"]["shape"] for entry in entries] == [list(x.shape[1:]) for x in xs]
    first = np.frombuffer(base64.b64decode(entries[0]["embeddings"]["b64"]), np.float32)
    np.testing.assert_array_equal(first, xs[0].ravel())
    assert entries[0]["mask"] == {"content": [False] * xs[0].shape[1], "shape": [xs[0].shape[1]]}
    lengths = sorted(x.shape[1] for x in xs)
    assert lengths[0] < lengths[-1], lengths
    stable = ("--stability-percentage", "1000")
    with start_server(tiny_artifact, grpc=True) as srv:
        _every_transport_sends_every_entry(command, srv, "encoder", data, len(xs), lengths, 3)
        # open loop (bench.perf_analyzer_real --loads): perf_analyzer's own Poisson arrivals at a fixed rate
        before = served(srv.port)
        flags = ["--input-data", str(data)]
        [row] = pa.run(
            command, f"127.0.0.1:{srv.port}", "http", "encoder", 1, flags, [], 500, stable, rates=[40.0]
        )
        assert row["rate"] == 40.0 and 0 < row["requests_per_s"] < 80, row
        answered = served(srv.port)["requests"] - before["requests"]
        assert answered >= 20, answered  # three windows of 0.5 s: about 60 expected
    cells = {
        f"{label}/1.0": {"answered": 0.9, "p50_ms": 10.0, "p99_ms": 50.0} for label, _, _ in pa.TRANSPORTS
    }
    res = {"unpadded_limit_tokens_per_s": 3000.0, "unpadded_limits": [3000.0], "mean_tokens": 30.0}
    text = real.table_rates({**res, "loads": [1.0], "cells": cells})
    assert "100.0 requests/s of 30.0 tokens" in text and "| 1x | 0.90, 10 / 50 | 0.90, 10 / 50 |" in text


def test_perf_analyzer_sends_text_as_bytes(command, tmp_path, tiny_text_artifact):
    """Issue 65: perf_analyzer, unmodified, sends sentences from a data file as the V2 BYTES input ``text`` to a model
    exported from a model directory, over HTTP, gRPC and a stream: the server tokenizes them, and the tokens it ran
    per request lie between the shortest and the longest sentence's."""
    import json

    from addnorm.model.text import TOKENIZER_FILE
    from addnorm.model.tokenize import TextTokenizer
    from tests.text_models import TEXTS

    artifact = tiny_text_artifact
    data = tmp_path / "text.json"
    data.write_text(json.dumps({"data": [{"text": {"content": [t], "shape": [1]}} for t in TEXTS]}))
    tokenizer = TextTokenizer((artifact / TOKENIZER_FILE).read_bytes(), Manifest.load(artifact).text)
    lengths = sorted(tokenizer.encode(TEXTS).lengths)
    name = Manifest.load(artifact).name
    with start_server(artifact, grpc=True) as srv:
        rows = _every_transport_sends_every_entry(command, srv, name, data, len(TEXTS), lengths, 2)
    assert all(row["server_infer_ms"] > 0 for row in rows.values()), rows


def _every_transport_sends_every_entry(command, srv, model, data, entries, lengths, concurrency) -> dict:
    """perf_analyzer on the data file ``data`` (``entries`` entries, ``lengths`` their sorted token counts) over
    each transport: every entry sent, more than once, and the tokens the server ran per request between the shortest
    and the longest entry's. Returns each transport's row."""
    from bench.mixed import served

    rows = {}
    for label, protocol, extra in pa.TRANSPORTS:
        before = served(srv.port)
        url = f"127.0.0.1:{srv.port if protocol == 'http' else srv.grpc_port}"
        flags = ("--stability-percentage", "1000", *extra)
        [row] = pa.run(
            command, url, protocol, model, 1, ["--input-data", str(data)], [concurrency], 500, flags
        )
        assert row["infer_per_s"] > 0, (label, row)
        after = served(srv.port)
        tokens, requests = (after[k] - before[k] for k in ("requested", "requests"))
        assert requests > 2 * entries, (label, requests)  # every entry sent, more than once
        assert lengths[0] < tokens / requests < lengths[-1], (label, tokens, requests, lengths)
        rows[label] = row
    return rows
