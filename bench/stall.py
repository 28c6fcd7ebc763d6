"""Stall and memory: does one big request hold up everyone else, and does memory come back after it?

Against a text model's server it starts on 127.0.0.1 (``python -m bench --stall --artifact DIR``, DIR exported with
``--from`` a model directory), each case sends its big request(s) while a prober, another client on its own
connection, asks ``/health/live`` and embeds one short sentence back to back. Per case: what the big request was
answered, the prober's slowest answer of each kind while it ran (the goal: under 100 ms), and the server's resident
memory 10 s after (the goal: within 1.5x of its warm baseline). The cases are the issue's: a 10 MB string to
``/v1/embeddings`` and to ``/tokenize``, a 10 MB V2 BYTES element over HTTP and gRPC, a 70 MB body to ``/tokenize``,
the largest text request that is accepted (every input at the model's characters, truncated), and a burst of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench.reliability import proc_rss_mb
from bench.server import serve

SETTLE_S = 10.0  # memory is read this long after a case: the goal is within 1.5x of the warm baseline by then
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."


def _probe(base: str, ready, stop, out) -> None:
    """The prober's process: /health/live and a one-sentence /v1/embeddings back to back until ``stop``; each
    answer's seconds put on ``out`` as two lists."""
    live, small = [], []
    with httpx.Client(base_url=base, timeout=120) as client:
        while not stop.is_set():
            for path, times, body in (
                ("/health/live", live, None),
                ("/v1/embeddings", small, {"input": SENTENCE}),
            ):
                start = time.perf_counter()
                r = client.get(path) if body is None else client.post(path, json=body)
                times.append(time.perf_counter() - start)
                if r.status_code != 200:
                    times[-1] = float("inf")  # a refused probe is a failed probe
            ready.set()
            time.sleep(0.005)
    out.put((live, small))


class Prober:
    """Another client, in its own process (the load generator's own work never delays it): /health/live and a
    one-sentence /v1/embeddings, back to back, each answer's time kept (``live``, ``small``)."""

    def __init__(self, base: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._ready, self._stop, self._out = ctx.Event(), ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_probe, args=(base, self._ready, self._stop, self._out), daemon=True)
        self.live: list[float] = []
        self.small: list[float] = []

    def __enter__(self) -> Prober:
        self._proc.start()
        assert self._ready.wait(60), "the prober did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        live, small = self._out.get(timeout=120)
        self._proc.join(timeout=30)
        self.live, self.small = live[1:], small[1:]  # the first probe of each: the prober's own start


def _v2_text(text: str) -> dict:
    # truncate false: refused (the server's default cuts a text over the model's length)
    return {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}],
        "parameters": {"truncate": False},
    }


def _grpc_big(port: int, model: str, text: bytes) -> str:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    inp = grpcclient.InferInput("text", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text], dtype=object))
    try:
        client.infer(model, [inp], parameters={"truncate": False})
        return "OK"
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()[:120]}"
    finally:
        client.close()


def cases(
    base: str, grpc_port: int, model: str, max_chars: int, max_inputs: int
) -> dict[str, Callable[[], str]]:
    big = "word " * 2_000_000  # 10 MB of text
    longest = ("Retrieval pipelines embed long documents before they rerank them. " * 4096)[:max_chars]

    def post(path: str, doc: object = None, content: bytes | None = None) -> Callable[[], str]:
        # encoded now, before the prober starts: sending it costs the load generator next to nothing
        body = content if content is not None else orjson.dumps(doc)
        headers = {"content-type": "application/json"}

        def send() -> str:
            r = httpx.post(f"{base}{path}", content=body, headers=headers, timeout=300)
            return f"{r.status_code} ({len(r.content)} bytes)"

        return send

    one = post("/v1/embeddings", {"input": [longest] * 64, "truncate": True})

    def burst() -> str:
        statuses = []
        threads = [threading.Thread(target=lambda: statuses.append(one())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return ", ".join(sorted(statuses))

    return {
        "10 MB string, /v1/embeddings": post("/v1/embeddings", {"input": big, "truncate": False}),
        "10 MB string, /tokenize": post("/tokenize", {"inputs": big}),
        "10 MB V2 BYTES element, HTTP": post(f"/v2/models/{model}/infer", _v2_text(big)),
        "10 MB V2 BYTES element, gRPC": lambda: _grpc_big(grpc_port, model, big.encode()),
        "70 MB body, /tokenize": post("/tokenize", content=b'{"inputs": "' + b"a" * 70_000_000 + b'"}'),
        f"largest accepted: {max_inputs} inputs x {max_chars} chars, truncated": post(
            "/v1/embeddings", {"input": [longest] * max_inputs, "truncate": True}
        ),
        "burst: 8 clients x 64 inputs at the cap": burst,
    }


def stall(artifact: Path, settle_s: float = SETTLE_S) -> dict:
    """Each case against one server: its answer, the prober's slowest answers while it ran, memory ``settle_s``
    after."""
    from addnorm.model.artifact import Manifest
    from addnorm.model.tokenize import MAX_CHARS_PER_TOKEN

    manifest = Manifest.load(artifact)
    if manifest.text is None:
        raise SystemExit(
            f"--stall needs a text model (addnorm-export --from DIR); {artifact} takes embeddings"
        )
    max_chars = manifest.text.max_length * MAX_CHARS_PER_TOKEN
    max_inputs = 512  # the default ADDNORM_MAX_CLIENT_BATCH_SIZE
    out: dict = {"model": manifest.name, "max_chars": max_chars, "cases": {}}
    with serve(artifact, grpc=True) as srv:
        for _ in range(50):  # warm: the arenas, the tokenizer, the prober's own route
            httpx.post(f"{srv.base}/v1/embeddings", json={"input": [SENTENCE] * 8}, timeout=60)
        time.sleep(1.0)
        out["baseline_mb"] = baseline = proc_rss_mb(srv.proc.pid)
        for name, send in cases(srv.base, srv.grpc_port, manifest.name, max_chars, max_inputs).items():
            with Prober(srv.base) as probe:
                start = time.perf_counter()
                answer = send()
                took = time.perf_counter() - start
            time.sleep(settle_s)
            rss = proc_rss_mb(srv.proc.pid)
            out["cases"][name] = {
                "answer": answer,
                "seconds": round(took, 3),
                "live_worst_ms": round(1e3 * max(probe.live), 1),
                "small_worst_ms": round(1e3 * max(probe.small), 1),
                "probes": len(probe.live),
                "rss_after_mb": round(rss, 1),
                "rss_ratio": round(rss / baseline, 2),
            }
    return out


def table(result: dict) -> str:
    lines = [
        f"model {result['model']}, at most {result['max_chars']} characters an input; warm baseline "
        f"{result['baseline_mb']:.0f} MB",
        "",
        "| case | answer | took (s) | /health/live worst (ms) | one sentence worst (ms) | memory 10 s after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in result["cases"].items():
        lines.append(
            f"| {name} | {_short(c['answer'])} | {c['seconds']} | {c['live_worst_ms']} | {c['small_worst_ms']} | "
            f"{c['rss_after_mb']:.0f} MB ({c['rss_ratio']}x) |"
        )
    return "\n".join(lines)


def _short(answer: str) -> str:
    """An answer for the table: several equal ones as N x one, a long one cut at 60 characters."""
    parts = answer.split(", ") if answer.startswith(("2", "4", "5")) else [answer]
    if len(parts) > 1 and len(set(parts)) == 1:
        answer = f"{len(parts)} x {parts[0]}"
    return answer if len(answer) <= 60 else answer[:57] + "..."
