"""The Python a request costs, counted: function calls a request on each of addnorm-serve's threads, by module, for
one or more checkouts side by side. A count is the same from run to run, where a timing on these machines moves by
more than a small change to the request's path saves (docs/benchmarks.md, "The front outside FastAPI's stack").

    python -m bench.studies.calls [--artifact DIR] [--requests N] [CHECKOUT ...]

Each checkout (default: this one; an older commit: ``git worktree add /tmp/before REV``) serves the artifact from its
own code (``PYTHONPATH``), at its defaults, in a process whose every thread counts its calls (``sys.setprofile`` and
``threading.setprofile``: each Python function entered, each built-in called); one client on one keep-alive
connection sends lone requests: a real sentence on ``/v1/embeddings`` (an ids artifact), a V2 binary ``[1,16,E]``
(an artifact of embeddings). The counts of a warm-up are dropped, the next ``--requests`` are counted. Printed: per
checkout and request, the calls a request on the event loop's thread, on the inference threads and on the rest
(Python functions, and built-ins), and the modules with the most calls on the event loop. Calls are not time: a
call to a built-in can cost a nanosecond or a millisecond; what they count is the interpreted work a change adds or
removes, which a request pays again, cold, after each run at one client (bench/studies/lone_request.py).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import threading
from pathlib import Path

# where the counting server writes its counts on SIGUSR1 (then starts again at 0)
COUNTS = "ADDNORM_STUDY_COUNTS"


def _thread_kind(name: str) -> str:
    if name == "MainThread":
        return "event loop"
    if name.startswith(("addnorm-infer", "addnorm-express")):  # the batcher's lanes and express lane
        return "inference"
    return "other"  # the log's writer (addnorm-log), live parity's, onnxruntime's pools, workers


def counting(argv: list[str]) -> int:
    """addnorm-serve with every thread counting its calls by (thread kind, module); SIGUSR1 writes them as JSON to
    $ADDNORM_STUDY_COUNTS and starts the counts again. The threads started later count from their start; the event
    loop's thread from the first SIGUSR1 (its start-up, imports and all, would take long counted). Imports nothing
    of the study's own checkout: it runs against another checkout's ``addnorm`` (``PYTHONPATH``)."""
    counts: collections.Counter = collections.Counter()
    kinds: dict[int, str] = {}

    def profile(frame, event: str, arg: object) -> None:
        if event == "call":
            key = frame.f_code.co_filename
        elif event == "c_call":
            key = "(built-ins)"
        else:
            return
        ident = threading.get_ident()
        kind = kinds.get(ident)
        if kind is None:
            kind = kinds[ident] = _thread_kind(threading.current_thread().name)
        counts[kind, key] += 1

    path = Path(os.environ[COUNTS])

    def write(*_: object) -> None:
        taken = list(counts.items())  # at once: the other threads count on
        counts.clear()
        part = path.with_suffix(".part")
        part.write_text(json.dumps([[k, m, n] for (k, m), n in taken]))
        part.replace(path)
        sys.setprofile(profile)  # the event loop's thread, where signal handlers run, counts from now

    signal.signal(signal.SIGUSR1, write)
    threading.setprofile(profile)
    from addnorm.service.cli import main

    return main(argv)


def _module(filename: str) -> str:
    """A file's place: the checkout's own modules by their path in it, the rest by package (or ``(built-ins)``)."""
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1].split("/", 1)[0]
    for top in ("service/", "model/", "export/", "addnorm/"):
        if f"/{top}" in filename:
            return top + filename.split(f"/{top}", 1)[1]
    if filename.startswith("<") or filename == "(built-ins)":
        return filename
    return "python: " + Path(filename).name


def counted(checkout: Path, artifact: Path, send, warmup: int, requests: int) -> dict[tuple[str, str], float]:
    """Calls a request by (thread kind, module), for ``requests`` lone requests after ``warmup``, each sent by
    ``send(conn)`` on one keep-alive connection to a counting server of ``checkout``."""
    import http.client
    import tempfile
    import time

    from bench.server import HOST, ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        env = {COUNTS: str(out), "PYTHONPATH": str(checkout)}
        srv = ServerProcess([__file__, "--count", "--artifact", str(artifact)], env=env)
        with srv:
            conn = http.client.HTTPConnection(HOST, srv.port)
            rounds = []
            for n in (0, warmup, requests):  # the first signal starts the event loop's count
                for _ in range(n):
                    send(conn)
                out.unlink(missing_ok=True)
                srv.proc.send_signal(signal.SIGUSR1)
                for _ in range(200):
                    if out.is_file():
                        break
                    time.sleep(0.05)
                rounds.append(json.loads(out.read_text()))
            conn.close()
    per: dict[tuple[str, str], float] = collections.defaultdict(float)
    for kind, filename, n in rounds[-1]:
        per[kind, _module(filename)] += n / requests
    return per


def _senders(artifact: Path) -> list[tuple[str, object]]:
    """(what, send(conn)) for the artifact: its lone text request, or its lone V2 binary one."""
    import numpy as np

    from addnorm.model.artifact import Manifest
    from addnorm.model.contract import EMBEDDINGS
    from bench.text import sentences

    m = Manifest.load(artifact)

    def answered(conn, path: str, body: bytes, headers: dict) -> None:
        conn.request("POST", path, body, headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{path} answered {r.status}: {data[:300]!r}")

    if m.text is not None:
        texts = iter(sentences() * 1000)

        def text(conn) -> None:
            body = json.dumps({"model": m.name, "input": next(texts)}).encode()
            answered(conn, "/v1/embeddings", body, {"Content-Type": "application/json"})

        return [("/v1/embeddings, one real sentence", text)]
    x = np.full((1, 16, m.config.d_model), 0.5, np.float32)
    inputs = [{"name": EMBEDDINGS, "shape": list(x.shape), "datatype": "FP32"}]
    inputs[0]["parameters"] = {"binary_data_size": x.nbytes}
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }

    def v2(conn) -> None:
        answered(conn, f"/v2/models/{m.name}/infer", header + x.tobytes(), headers)

    return [(f"V2 binary [1,16,{m.config.d_model}]", v2)]


def report(what: str, checkouts: list[Path], per: list[dict], top: int) -> str:
    names = [str(c) for c in checkouts]
    lines = [f"### {what}: calls a request", "", "| thread | " + " | ".join(names) + " |"]
    lines.append("| --- |" + " --- |" * len(names))
    for kind in ("event loop", "inference", "other"):
        for label, pick in (
            ("Python", lambda m: m != "(built-ins)"),
            ("built-ins", lambda m: m == "(built-ins)"),
        ):
            cells = [sum(n for (k, m), n in p.items() if k == kind and pick(m)) for p in per]
            lines.append(f"| {kind}, {label} | " + " | ".join(f"{c:,.1f}" for c in cells) + " |")
    threads = (
        ("event loop", "The event loop's"),
        ("inference", "The inference threads'"),
        ("other", "The other threads'"),
    )
    for kind, whose in threads:
        most = collections.Counter()
        for p in per:
            for (k, m), n in p.items():
                if k == kind and m != "(built-ins)":
                    most[m] = max(most[m], n)
        lines += ["", f"{whose} Python calls a request by module (the {top} with the most):", ""]
        lines += ["| module | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for m, _ in most.most_common(top):
            lines.append(f"| {m} | " + " | ".join(f"{p.get((kind, m), 0.0):,.1f}" for p in per) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--count"]:  # the server side: calls.py --count SERVER-ARGS
        return counting(argv[1:])
    from addnorm.commands import Parser
    from addnorm.model.runtime import cpu_flags
    from bench.studies import checkout_arguments, checkouts_of, text_arguments, text_inputs

    p = Parser(prog="python -m bench.studies.calls", description=__doc__.split("\n\n")[0])
    text_arguments(p)
    p.add_argument(
        "--requests", type=int, default=300, help="lone requests counted, after as many to warm up"
    )
    p.add_argument("--top", type=int, default=12, help="modules listed for each thread")
    checkout_arguments(p)
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    checkouts = checkouts_of(p, args)
    with text_inputs(args) as (artifact, _name, _texts):
        print(
            f"{args.requests} lone requests counted per checkout; CPU flags: {' '.join(sorted(cpu_flags()))}"
        )
        for what, send in _senders(artifact):
            per = [counted(c, artifact, send, args.requests, args.requests) for c in checkouts]
            print()
            print(report(what, checkouts, per, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
