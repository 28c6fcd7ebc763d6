"""What each codec step costs against a thread hop: which ones should leave the event loop.

    python -m bench.studies.codec_cost [--artifact DIR] [--shapes 1,16 1,128 8,128 8,512] [--runs N]

In this process, on the artifact's manifest: the V2 codec's decode and encode of each ``[B,S,E]`` request with
binary data and with JSON data, /v1's with a raw body and with JSON, the gRPC codec's with raw contents, each the
median of ``--runs`` calls (JSON ones of a fifth as many); then a hop to a worker thread and back
(``run_in_threadpool``, what ``service.core.inference.offload`` does) on uvloop, median and p90 of 300. Printed with
each step's work as ``service.core.inference.work`` counts it (bytes of JSON text; a raw byte counts 1/RAW_SHARE), and
whether ``offload`` sends it to a worker thread. docs/benchmarks.md, "What the measurements decided".
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import uvloop
from starlette.concurrency import run_in_threadpool

from addnorm.commands import DEFAULT_ARTIFACT, Parser
from addnorm.model.artifact import Manifest
from addnorm.model.contract import EMBEDDINGS, ENCODED
from addnorm.model.runtime import cpu_flags
from addnorm.service.core.inference import OFFLOAD_BYTES
from addnorm.service.protocols.v1 import codec as v1
from addnorm.service.protocols.v2 import codec as v2
from addnorm.service.protocols.v2 import grpc_codec
from addnorm.service.protocols.v2 import inference_pb2 as pb
from bench.server import ROOT


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(max(runs, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def steps(m: Manifest, x: np.ndarray) -> list[tuple[str, Callable, Callable, int, int, bool]]:
    """(name, decode, encode, decode work, encode work, JSON) for each codec on the request ``x``."""
    big, name, e = 10**12, m.name, m.config.d_model
    spec = {"name": EMBEDDINGS, "shape": list(x.shape), "datatype": "FP32"}
    out = {ENCODED: x}
    header = json.dumps(
        {
            "inputs": [{**spec, "parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": ENCODED, "parameters": {"binary_data": True}}],
        }
    ).encode()
    model = _Model(m, e)
    resolve = lambda _name: model  # noqa: E731
    rows = []
    for label, codec, body in (
        ("V2 binary", v2.InferCodec(name, str(len(header)), big), header + x.tobytes()),
        (
            "V2 JSON",
            v2.InferCodec(name, None, big),
            json.dumps({"inputs": [{**spec, "data": x.ravel().tolist()}]}).encode(),
        ),
        (
            "/v1 raw",
            v1.EncodeCodec(v1.OCTET, {"x-shape": ",".join(map(str, x.shape))}, None, v1.OCTET, None, big),
            x.tobytes(),
        ),
        (
            "/v1 JSON",
            v1.EncodeCodec(v1.JSON, {}, None, v1.JSON, None, big),
            json.dumps({EMBEDDINGS: x.tolist()}).encode(),
        ),
        (
            "gRPC raw",
            grpc_codec.GrpcInferCodec(name, big),
            pb.ModelInferRequest(
                model_name=name,
                inputs=[
                    pb.ModelInferRequest.InferInputTensor(name=EMBEDDINGS, datatype="FP32", shape=x.shape)
                ],
                raw_input_contents=[x.tobytes()],
            ),
        ),
    ):
        req = codec.decode(body, resolve)
        rows.append(
            (
                label,
                lambda c=codec, b=body: c.decode(b, resolve),
                lambda c=codec, r=req: c.encode(r, model, out),
                codec.decode_work(body),
                codec.encode_work(req, x.nbytes),
                "JSON" in label,
            )
        )
    return rows


class _Model:
    """What a codec asks of the model serving a request: its manifest, d_model, name and version."""

    def __init__(self, manifest: Manifest, d_model: int) -> None:
        self.engine = self
        self.manifest, self.d_model, self.name, self.version = manifest, d_model, manifest.name, "1"


async def hop_ms(n: int = 300) -> tuple[float, float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await run_in_threadpool(int)
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1e3, times[int(len(times) * 0.9)] * 1e3


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.studies.codec_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=ROOT / DEFAULT_ARTIFACT)
    p.add_argument("--shapes", nargs="+", default=["1,16", "1,128", "8,128"], metavar="B,S")
    p.add_argument("--runs", type=int, default=25)
    args = p.parse_args(argv)
    m = Manifest.load(args.artifact)
    rng = np.random.default_rng(0)
    print(f"{m.name}, d_model {m.config.d_model}; CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}\n")
    print("| request | codec | decode ms | work | off the loop | encode ms | work | off the loop |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        b, s = map(int, shape.split(","))
        x = rng.standard_normal((b, s, m.config.d_model)).astype(np.float32)
        for label, decode, encode, dw, ew, is_json in steps(m, x):
            runs = args.runs // 5 if is_json else args.runs
            d, e = median_ms(decode, runs), median_ms(encode, runs)
            print(
                f"| [{b},{s},{m.config.d_model}] | {label} | {d:.3f} | {dw} | {dw > OFFLOAD_BYTES} | {e:.3f} "
                f"| {ew} | {ew > OFFLOAD_BYTES} |"
            )
    median, p90 = uvloop.run(hop_ms())
    print(
        f"\nthread hop (run_in_threadpool, uvloop): median {median:.3f} ms, p90 {p90:.3f} ms; "
        f"OFFLOAD_BYTES {OFFLOAD_BYTES}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
