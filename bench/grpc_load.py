"""gRPC against HTTP binary: the same model, the same server, phases alternating (python -m bench, and --grpc alone).

The gRPC client is as light as bench/loadgen.py's HTTP one: a prebuilt serialized ModelInferRequest, sent on one
channel per client with grpc.aio, the response taken as bytes and not parsed. Each phase reads the server's CPU
per request from the OS, so the two transports' costs on the server can be compared beside their throughput.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import AsyncIterator

import numpy as np

from bench.loadgen import LoadResult, Send, run_clients, run_load
from bench.server import HOST, serve
from model.contract import EMBEDDINGS
from service.protocols.v2 import inference_pb2 as pb
from service.protocols.v2.grpc_server import SERVICE

INFER = f"/{SERVICE}/ModelInfer"
REPEATS = 3


def grpc_request(model: str, x: np.ndarray) -> bytes:
    """A serialized ModelInferRequest with the tensor as raw bytes, as tritonclient.grpc sends it."""
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name=EMBEDDINGS, datatype="FP32", shape=x.shape)
    req.raw_input_contents.append(np.ascontiguousarray(x, "<f4").tobytes())
    return req.SerializeToString()


def run_grpc_load(
    port: int, request: bytes, concurrency: int, seconds: float, max_requests: int = 10**9, warmup: int = 2
) -> LoadResult:
    """``concurrency`` closed-loop clients, each on its own channel, for ``seconds`` (or ``max_requests`` in all)."""
    import grpc

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Send]:
        async with grpc.aio.insecure_channel(f"{HOST}:{port}", options=options) as channel:
            call = channel.unary_unary(INFER)  # no serializers: bytes in, bytes out

            async def send() -> bool:
                try:
                    await call(request)
                except grpc.aio.AioRpcError:
                    return False
                return True

            yield send

    return run_clients(connect, concurrency, seconds, max_requests, warmup)


def measure_grpc(s, clients: int) -> dict:
    """V2 binary over HTTP and over gRPC on one server: the big shape with 1 client and ``clients`` x the small
    shape, each pair back to back, REPEATS times; per transport the median row, and the median of the ratios."""
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
    rows: dict = {k: {"http": [], "grpc": []} for k in phases}
    with serve(s.artifact, "--max-batch-size", str(clients), grpc=True) as srv:
        pid = srv.proc.pid
        for _ in range(REPEATS):
            for key, (x, c) in phases.items():
                http_req, grpc_req = v2_request(srv.port, s.name, x), grpc_request(s.name, x)
                for transport, load in (
                    ("http", lambda req=http_req, c=c: run_load(HOST, srv.port, req, c, s.seconds)),
                    ("grpc", lambda req=grpc_req, c=c: run_grpc_load(srv.grpc_port, req, c, s.seconds)),
                ):
                    total0, loop0 = process_cpu_s(pid), process_cpu_s(pid, pid)
                    row = load().row()
                    n = max(row["requests"], 1)
                    row["server_cpu_ms_per_request"] = (process_cpu_s(pid) - total0) * 1e3 / n
                    row["loop_cpu_ms_per_request"] = (process_cpu_s(pid, pid) - loop0) * 1e3 / n
                    rows[key][transport].append(row)
    out: dict = {}
    for key, by in rows.items():
        ratios = [
            g["throughput_rps"] / h["throughput_rps"] for h, g in zip(by["http"], by["grpc"], strict=True)
        ]
        out[key] = {
            "grpc_vs_http": statistics.median(ratios),
            "ratios": ratios,
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
        "| gRPC / HTTP | server CPU ms/request HTTP | gRPC |",
        "| --- | --- | --- | --- | --- | --- |",
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
        lines.append(
            f"| {name} | {h['throughput_rps']:.1f} | {g['throughput_rps']:.1f} | {r['grpc_vs_http']:.2f}x "
            f"({', '.join(f'{v:.2f}' for v in r['ratios'])}) | {h['server_cpu_ms_per_request']:.2f} "
            f"| {g['server_cpu_ms_per_request']:.2f} |"
        )
    return lines
