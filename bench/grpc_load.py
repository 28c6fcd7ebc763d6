"""gRPC against HTTP binary: the same model, the same server, phases alternating (python -m bench, and --grpc alone).

The gRPC client is as light as bench/loadgen.py's HTTP one: a prebuilt serialized ModelInferRequest, sent on one
channel per client with grpc.aio, the response taken as bytes and not parsed; over gRPC either one ModelInfer
call per request (``grpc``) or one ModelStreamInfer call per client, each request written on it and its answer
read before the next (``stream``: as closed-loop as a unary client). Each phase reads the server's CPU per request
from the OS, so the transports' costs on the server can be compared beside their throughput.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import numpy as np

from addnorm.model.contract import EMBEDDINGS
from addnorm.service.protocols.v2 import inference_pb2 as pb
from addnorm.service.protocols.v2.grpc_server import SERVICE
from bench.loadgen import LoadResult, Send, run_clients, run_load
from bench.server import HOST, serve

INFER = f"/{SERVICE}/ModelInfer"
STREAM = f"/{SERVICE}/ModelStreamInfer"
REPEATS = 3
TRANSPORTS = ("http", "grpc", "stream")
# a ModelStreamInferResponse that begins with its field 2 (infer_response) is an answer; field 1 is a refusal
_ANSWER_TAG = bytes([2 << 3 | 2])


def grpc_request(model: str, x: np.ndarray) -> bytes:
    """A serialized ModelInferRequest with the tensor as raw bytes, as tritonclient.grpc sends it."""
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=EMBEDDINGS, datatype="FP32", shape=x.shape)
    req.raw_input_contents.append(np.ascontiguousarray(x, "<f4").tobytes())
    return req.SerializeToString()


@contextlib.asynccontextmanager
async def grpc_sender(port: int, stream: bool = False) -> AsyncIterator[Callable[[bytes], Awaitable[bool]]]:
    """One client's channel, as ``send(request) -> answered without error``: a ModelInfer call per request, or
    (``stream``) one ModelStreamInfer call for all of them, one request in flight."""
    import grpc

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(f"{HOST}:{port}", options=options) as channel:
        if not stream:
            unary = channel.unary_unary(INFER)  # no serializers: bytes in, bytes out

            async def send(request: bytes) -> bool:
                try:
                    await unary(request)
                except grpc.aio.AioRpcError:
                    return False
                return True

            yield send
            return
        call = channel.stream_stream(STREAM)()

        async def send_on_stream(request: bytes) -> bool:
            try:
                await call.write(request)
                answer = await call.read()
            except grpc.aio.AioRpcError:
                return False
            return answer is not grpc.aio.EOF and answer[:1] == _ANSWER_TAG

        try:
            yield send_on_stream
        finally:
            call.cancel()


def run_grpc_load(
    port: int,
    request: bytes,
    concurrency: int,
    seconds: float,
    max_requests: int = 10**9,
    warmup: int = 2,
    stream: bool = False,
) -> LoadResult:
    """``concurrency`` closed-loop clients, each on its own channel, for ``seconds`` (or ``max_requests`` in all);
    ``stream``: each client's requests on one ModelStreamInfer call."""

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Send]:
        async with grpc_sender(port, stream) as send_one:
            yield lambda: send_one(request)

    return run_clients(connect, concurrency, seconds, max_requests, warmup)


def measure_grpc(s, clients: int) -> dict:
    """V2 binary over HTTP, over gRPC and over a gRPC stream on one server: the big shape with 1 and 8 clients,
    the small one with 1, 8 and ``clients``, each load's transports back to back, REPEATS times; per transport the
    median row, and the median of each gRPC form's ratios to HTTP."""
    from bench.measure import process_cpu_s, v2_request

    # "big" and "small" are the headline loads (the report's targets read them); the others fill in the
    # concurrencies 1, 8 and 32 (issue 28: gRPC should keep up with HTTP at every one)
    phases = {
        "big": (s.x_big, 1),
        "big_8": (s.x_big, 8),
        "small_1": (s.x_small, 1),
        "small_8": (s.x_small, 8),
        "small": (s.x_small, clients),
    }
    rows: dict = {k: {t: [] for t in TRANSPORTS} for k in phases}
    with serve(s.artifact, "--max-batch-size", str(clients), grpc=True) as srv:
        pid = srv.proc.pid
        for _ in range(REPEATS):
            for key, (x, c) in phases.items():
                http_req, grpc_req = v2_request(srv.port, s.name, x), grpc_request(s.name, x)
                loads = {
                    "http": partial(run_load, HOST, srv.port, http_req, c, s.seconds),
                    "grpc": partial(run_grpc_load, srv.grpc_port, grpc_req, c, s.seconds),
                    "stream": partial(run_grpc_load, srv.grpc_port, grpc_req, c, s.seconds, stream=True),
                }
                for transport, load in loads.items():
                    total0, loop0 = process_cpu_s(pid), process_cpu_s(pid, pid)
                    row = load().row()
                    n = max(row["requests"], 1)
                    row["server_cpu_ms_per_request"] = (process_cpu_s(pid) - total0) * 1e3 / n
                    row["loop_cpu_ms_per_request"] = (process_cpu_s(pid, pid) - loop0) * 1e3 / n
                    rows[key][transport].append(row)
    out: dict = {}
    for key, by in rows.items():
        ratios = {
            t: [g["throughput_rps"] / h["throughput_rps"] for h, g in zip(by["http"], by[t], strict=True)]
            for t in ("grpc", "stream")
        }
        out[key] = {
            "grpc_vs_http": statistics.median(ratios["grpc"]),
            "ratios": ratios["grpc"],
            "stream_vs_http": statistics.median(ratios["stream"]),
            "stream_ratios": ratios["stream"],
            **{
                t: min(runs, key=lambda r: abs(r["throughput_rps"] - _median(runs))) for t, runs in by.items()
            },
        }
    return out


def _median(runs: list[dict]) -> float:
    return statistics.median(r["throughput_rps"] for r in runs)


def grpc_table(res: dict, big: str, small: str, clients: int) -> list[str]:
    lines = [
        "",
        f"| gRPC vs HTTP binary (V2, one server, alternating, median of {REPEATS}) | HTTP req/s | gRPC req/s "
        "| gRPC / HTTP | stream req/s | stream / HTTP | server CPU ms/request HTTP | gRPC | stream |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {
        "big": f"[{big}], 1 client",
        "big_8": f"8 clients x [{big}]",
        "small_1": f"1 client x [{small}]",
        "small_8": f"8 clients x [{small}]",
        "small": f"{clients} clients x [{small}]",
    }
    for key, name in names.items():
        if key not in res:  # results from before the other concurrencies were measured
            continue
        r = res[key]
        h, g = r["http"], r["grpc"]
        st = r.get("stream")  # results from before the stream was measured have none
        stream, stream_cpu = "- | -", "-"
        if st:
            stream = (
                f"{st['throughput_rps']:.1f} | {r['stream_vs_http']:.2f}x ({_listed(r['stream_ratios'])})"
            )
            stream_cpu = f"{st['server_cpu_ms_per_request']:.2f}"
        lines.append(
            f"| {name} | {h['throughput_rps']:.1f} | {g['throughput_rps']:.1f} | {r['grpc_vs_http']:.2f}x "
            f"({_listed(r['ratios'])}) | {stream} | {h['server_cpu_ms_per_request']:.2f} "
            f"| {g['server_cpu_ms_per_request']:.2f} | {stream_cpu} |"
        )
    return lines


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)
