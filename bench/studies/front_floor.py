"""The front's floor: the event loop's CPU a request, layer by layer, from a bare HTTP protocol to addnorm's request.

    python -m bench.studies.front_floor [--artifact DIR] [--clients N] [--seconds S] [--rounds N]

Issue 77 asks for at most 0.15 ms of event loop a one-sentence ``/v1/embeddings`` request. This study measures, on
the same machine and load generator (``bench.loadgen``: ``--clients`` closed-loop keep-alive clients), the event
loop's CPU a request (the server's main thread, from /proc) of servers that each add one layer to the one before:

- ``bare``: uvloop and httptools with no framework: parse a request, write a fixed 200 (the floor of any Python
  HTTP server on this CPU: the two syscalls and the parser);
- ``http11 + ASGI``: uvicorn with addnorm's own connection (service/front/http11.py) and an ASGI app that answers
  the same fixed body (what addnorm's connection and ASGI add);
- ``addnorm GET /v1/models``: addnorm-serve on ``--artifact``, a route through FastAPI's router and dependency
  solving (the framework's cost of a route that does nothing);
- ``bare /v1/embeddings``: the same request's least: httptools, its JSON read, the tokenizer, the embedding graph and
  the model's run on addnorm's engine at the server's settings (a lone request's light run: every thread), the
  graph's pooled vectors answered as OpenAI's JSON, all on the event loop's thread, with no batcher, front, checks or
  framework; and ``... on an inference thread``, the same work on one thread beside the loop (a hand-off each way,
  as a server that keeps its loop free must). At ``--clients 1`` these are the floor of one client's lone request
  on this machine (issue 77's "within 0.3 ms of in process"), and addnorm-serve's distance above them is what its
  own path costs; they batch nothing, so at more clients they answer one request at a time;
- ``addnorm /v1/embeddings``: one real sentence a request (the direct lane, the request core, the batcher's
  hand-offs, pooling, JSON);
- ``lean V2 binary [1,16,E]``: addnorm's connection, model and batcher with nothing else around them: read the
  body, split off its header, queue the tensor, answer its output (what any request on this batcher costs);
- ``addnorm's V2 route without its front``: addnorm's V2 infer route itself (its codec and checks, the request core)
  called for every request, without FastAPI's layers and ``Front`` (what the route and the core add to the lean
  one, and, against the next, what the front adds);
- ``addnorm V2 binary [1,16,E]``: addnorm-serve's smallest tensor request (no tokenizer, no JSON).

Every layer's server starts first, and the V2 layers' answers are checked against addnorm-serve's (the lean and
route layers skip no work of the answer's), the bare text layers' vectors against its /v1/embeddings'; then the layers
run in turn, ``--rounds`` times, side by side (the machine's drift falls on each alike); printed: each one's median
loop CPU a request, server CPU, requests/s and the mean time a request (clients over requests a second), and the CPU
flags. An ids artifact (one exported ``--from`` a model directory, e.g. ``bench.text.export_minilm``'s).
docs/benchmarks.md, "The front's floor".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from addnorm.model.artifact import Manifest
from addnorm.model.runtime import cpu_flags
from bench.loadgen import build_request, run_load
from bench.measure import load_with_cpu, v2_request
from bench.server import HOST, ServerProcess, serve
from bench.studies import text_arguments, text_inputs

BODY = b'{"object":"list","data":[]}'
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


def _bare(port: int) -> None:
    """The floor: one protocol per connection, httptools parsing, a fixed answer per request."""
    import httptools
    import uvloop

    class Bare(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_complete(self) -> None:
            self.transport.write(ANSWER)

    async def serve_forever() -> None:
        server = await asyncio.get_running_loop().create_server(Bare, HOST, port)
        await server.serve_forever()

    uvloop.run(serve_forever())


async def _fixed(scope, receive, send) -> None:
    """An ASGI app with the bare server's answer, for any request."""
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def _uvicorn(app, port: int, lifespan: str = "off") -> None:
    """uvicorn as addnorm-serve runs it (its connection, uvloop, no access log), serving ``app``."""
    import uvicorn

    uvicorn.run(
        app,
        host=HOST,
        port=port,
        http="addnorm.service.front.http11:Http11",
        ws="none",
        lifespan=lifespan,
        log_level="warning",
        access_log=False,
    )


def _lean(port: int, artifact: str) -> None:
    """The least a V2 binary request can do on addnorm's model (loaded as addnorm-serve loads it: its engine, its
    batcher and lanes) and connection: read the body, split off its JSON header, queue the tensor on the batcher,
    answer its output as binary data; no front (request id, guard, access line, metrics), no request core
    (statistics, deadline, cancellation, tracing), no checks, no FastAPI. What the product's features cost a request
    is the gap between this layer and addnorm-serve's own V2 binary request."""
    import orjson

    from addnorm.service.models.state import ServiceState, serving_model
    from addnorm.service.settings import Settings

    loaded: list = []

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            directory = Path(artifact)
            loaded.append(await serving_model(ServiceState(Settings(artifact=(directory,))), "m", directory))
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await loaded[0].batcher.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":  # readiness
            await _fixed(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        n = int(dict(scope["headers"])[b"inference-header-content-length"])
        (tensor,) = orjson.loads(body[:n])["inputs"]
        x = np.frombuffer(body, np.float32, offset=n).reshape(tensor["shape"])
        outputs, _ = await loaded[0].batcher.infer(x, None, 60.0)
        (name, out), *_ = outputs.items()
        header = orjson.dumps(
            {
                "model_name": "m",
                "outputs": [
                    {
                        "name": name,
                        "datatype": "FP32",
                        "shape": list(out.shape),
                        "parameters": {"binary_data_size": out.nbytes},
                    }
                ],
            }
        )
        answer = header + np.ascontiguousarray(out, "<f4").tobytes()
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"inference-header-content-length", b"%d" % len(header)),
            (b"content-length", b"%d" % len(answer)),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    _uvicorn(app, port, lifespan="on")


def _route(port: int, artifact: str) -> None:
    """addnorm-serve's V2 infer route (service/protocols/v2/routes.py: the codec, its checks, the request core:
    statistics, deadline, cancellation, tracing) on addnorm's app and connection, called for every request without
    the front (FastAPI's and Starlette's layers, ``front.middleware.Front``: request id, guard, access line,
    metrics, the body's deadline): between ``_lean`` and addnorm-serve, what the front costs a request."""
    from starlette.requests import Request

    from addnorm.service.front.app import create_app
    from addnorm.service.protocols.v2.routes import _infer
    from addnorm.service.settings import Settings

    served = create_app(Settings(artifact=(Path(artifact),)), load_before_serving=True)
    name = Manifest.load(artifact).name

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # the app's own: its models load
            await served(scope, receive, send)
        elif scope["method"] == "GET":  # readiness
            await _fixed(scope, receive, send)
        else:
            answer = await _infer(Request(scope, receive), served.state.addnorm.known, name, None)
            await answer(scope, receive, send)

    _uvicorn(app, port, lifespan="on")


def _text(port: int, artifact: str, hop: bool) -> None:
    """The least a ``/v1/embeddings`` request can do on addnorm's model: httptools, the body's JSON, the tokenizer,
    the embedding graph and a lone request's run on addnorm's engine as addnorm-serve makes it (the server's
    settings: a light run, every thread), the graph's pooled vectors answered as OpenAI's JSON; all of it on the
    event loop's thread, or with ``hop`` on one inference thread (a queue there, ``call_soon_threadsafe`` back)."""
    import queue
    import threading

    import httptools
    import orjson
    import uvloop

    from addnorm.model.contract import POOLED
    from addnorm.service.backend.engine import Engine
    from addnorm.service.settings import Settings

    s = Settings()
    engine = Engine(Path(artifact), s.providers, 0, s.kernels, s.intra_op_spinning, s.parallel_runs == "on")
    text, name = engine.text, engine.name

    def answer(body: bytes) -> bytes:
        inputs = orjson.loads(body)["input"]
        batch = text.tokenizer.encode([inputs] if isinstance(inputs, str) else inputs, truncate=True)
        pooled = engine.run(text.embed(batch), batch.mask, light=True)[POOLED]
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(pooled)]
        usage = {"prompt_tokens": batch.tokens, "total_tokens": batch.tokens}
        out = orjson.dumps(
            {"object": "list", "data": data, "model": name, "usage": usage}, option=orjson.OPT_SERIALIZE_NUMPY
        )
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(out),
            out,
        )

    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def inference() -> None:
        while True:
            write, body = jobs.get()
            loop.call_soon_threadsafe(write, answer(body))

    class Text(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.body = transport, []
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            if not body:  # a GET: readiness
                self.transport.write(ANSWER)
            elif hop:
                jobs.put((self.transport.write, body))
            else:
                self.transport.write(answer(body))

    async def serve_forever() -> None:
        server = await loop.create_server(Text, HOST, port)
        await server.serve_forever()

    loop = uvloop.new_event_loop()
    if hop:
        threading.Thread(target=inference, name="inference", daemon=True).start()
    loop.run_until_complete(serve_forever())


def _get(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: keep-alive\r\n\r\n".encode()


def layers(artifact: Path, name: str, sentence: str) -> list[tuple[str, Callable, Callable]]:
    """(name, a server not yet waited for, its request from the port), from the floor up."""
    width = Manifest.load(artifact).config.d_model
    study = ["-m", "bench.studies.front_floor", "--serve"]
    embeddings = json.dumps({"model": name, "input": sentence}).encode()
    x = np.full((1, 16, width), 0.5, np.float32)
    json_type = {"Content-Type": "application/json"}
    return [
        (
            "bare: uvloop + httptools",
            lambda: ServerProcess([*study, "bare"], ready_path="/"),
            lambda p: _get(p, "/"),
        ),
        (
            "http11 + ASGI app",
            lambda: ServerProcess([*study, "http11"], ready_path="/"),
            lambda p: _get(p, "/"),
        ),
        ("addnorm GET /v1/models", lambda: serve(artifact), lambda p: _get(p, "/v1/models")),
        (
            "bare /v1/embeddings, 1 sentence: one thread, no framework",
            lambda: ServerProcess([*study, "text", str(artifact)], ready_path="/"),
            lambda p: build_request(HOST, p, "/v1/embeddings", embeddings, json_type),
        ),
        (
            "bare /v1/embeddings, 1 sentence, on an inference thread",
            lambda: ServerProcess([*study, "text-hop", str(artifact)], ready_path="/"),
            lambda p: build_request(HOST, p, "/v1/embeddings", embeddings, json_type),
        ),
        (
            "addnorm /v1/embeddings, 1 sentence",
            lambda: serve(artifact),
            lambda p: build_request(HOST, p, "/v1/embeddings", embeddings, json_type),
        ),
        (
            f"lean V2 binary [1,16,{width}]: http11, the batcher",
            lambda: ServerProcess([*study, "lean", str(artifact)], ready_path="/"),
            lambda p: v2_request(p, name, x),
        ),
        (
            f"addnorm's V2 route without its front [1,16,{width}]",
            lambda: ServerProcess([*study, "route", str(artifact)], ready_path="/"),
            lambda p: v2_request(p, name, x),
        ),
        (f"addnorm V2 binary [1,16,{width}]", lambda: serve(artifact), lambda p: v2_request(p, name, x)),
    ]


def measure(stack: list, clients: int, seconds: float, rounds: int) -> dict[str, list[dict]]:
    """Each layer's load with its server's CPU: every layer's server started first, then the layers in turn,
    ``rounds`` times (side by side: the machine's drift falls on every layer alike)."""
    cells: dict[str, list[dict]] = {}
    with contextlib.ExitStack() as servers:
        started = [(name, servers.enter_context(server()), request) for name, server, request in stack]
        asked = [(name, srv, request(srv.port)) for name, srv, request in started]
        for _name, srv, req in asked:
            load_with_cpu(srv, req, clients, min(1.0, seconds))  # warm-up
        same_answers([(name, srv.port, req) for name, srv, req in asked if "V2 binary" in name])
        same_vectors([(name, srv.port, req) for name, srv, req in asked if "/v1/embeddings" in name])
        for _ in range(rounds):
            for name, srv, req in asked:
                row = load_with_cpu(srv, req, clients, seconds)
                if row["errors"]:
                    raise SystemExit(f"{name}: {row['errors']} requests failed")
                cells.setdefault(name, []).append(row)
    return cells


def same_answers(v2: list[tuple[str, int, bytes]]) -> None:
    """The V2 layers answer alike (the lean and route layers do the work addnorm-serve does, not less): each one's
    first output against the same output of the last (addnorm-serve's), within float32's batching spread."""
    outputs = {}
    for name, port, request in v2:
        (body,) = run_load(HOST, port, request, 1, 30.0, max_requests=1, warmup=0, keep=1).bodies
        doc, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))  # the JSON header, then binary data
        sizes = [out["parameters"]["binary_data_size"] for out in doc["outputs"]]
        offsets = np.cumsum([end, *sizes])
        outputs[name] = {
            out["name"]: np.frombuffer(body[start : start + size], np.float32)
            for out, start, size in zip(doc["outputs"], offsets, sizes, strict=False)
        }
    *others, (last, reference) = outputs.items()
    for name, answer in others:
        (output, values), *_ = answer.items()
        if not np.allclose(values, reference[output], rtol=1e-4, atol=1e-5):
            raise SystemExit(f"{name} answers {output} unlike {last}")


def same_vectors(texts: list[tuple[str, int, bytes]]) -> None:
    """The /v1/embeddings layers answer alike (the bare ones do the work addnorm-serve does): each one's vectors
    against the last's (addnorm-serve's), within float32's spread."""
    vectors = {}
    for name, port, request in texts:
        (body,) = run_load(HOST, port, request, 1, 30.0, max_requests=1, warmup=0, keep=1).bodies
        vectors[name] = np.array([d["embedding"] for d in json.loads(body)["data"]], np.float32)
    *others, (last, reference) = vectors.items()
    for name, got in others:
        if got.shape != reference.shape or not np.allclose(got, reference, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"{name} answers unlike {last}")


def table(cells: dict[str, list[dict]], rounds: int, clients: int) -> list[str]:
    lines = [
        f"| layer | event loop ms a request (median of {rounds}) | server CPU ms a request | requests/s "
        f"| ms a request ({clients} / requests/s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, rows in cells.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
        lines.append(
            f"| {name} | {med['loop_cpu_ms_per_request']:.3f} | {med['server_cpu_ms_per_request']:.3f} "
            f"| {med['throughput_rps']:,.0f} | {clients / med['throughput_rps'] * 1e3:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # one layer's server, in its own process: --serve KIND --port P
        kind, port = argv[1], int(argv[argv.index("--port") + 1])
        if kind == "bare":
            _bare(port)
        elif kind == "http11":
            _uvicorn("bench.studies.front_floor:_fixed", port)
        elif kind in ("text", "text-hop"):
            _text(port, argv[2], hop=kind == "text-hop")
        else:  # lean or route ARTIFACT
            {"lean": _lean, "route": _route}[kind](port, argv[2])
        return 0
    parser = Parser(prog="python -m bench.studies.front_floor", description=__doc__.split("\n\n")[0])
    text_arguments(parser)
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients (default 32)")
    parser.add_argument("--seconds", type=float, default=3.0, help="each layer's load a round (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every layer in turn (default 3)")
    args = parser.parse_args(argv)
    with text_inputs(args) as (artifact, model, sentences):
        sentence = sorted(sentences, key=len)[len(sentences) // 2]  # a sentence of median length
        print(
            f"CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}; {args.clients} clients, {args.rounds} rounds"
        )
        cells = measure(layers(artifact, model, sentence), args.clients, args.seconds, args.rounds)
    print("\n".join(["", *table(cells, args.rounds, args.clients)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
