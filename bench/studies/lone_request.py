"""Where a lone request's time goes: one client sending one real sentence at a time to addnorm-serve, step by step,
against the same sentence's steps in this process (issue 77's one-client goal: within 0.3 ms of in-process).

    python -m bench.studies.lone_request [--artifact DIR] [--rounds N]

addnorm-serve runs at its defaults in a subprocess that stamps the time at each of a request's steps (``STEPS``: the
functions it wraps, entered or left); one client on one keep-alive connection sends each of bench.text's sentences
as a lone ``/v1/embeddings`` request, ``--rounds`` times (the first a warm-up). ``time.perf_counter`` is the
system's monotonic clock, the same in both processes, so each step is timed from the client's send. After each round
through the server the same sentences run in this process (tokenized, embedded, run on the session a lone run takes,
pooled: what the server's steps do, without HTTP and threads), so a slow phase of the machine falls on both sides.
Printed: per step, the median ms from the send and what the step added; then the in-process latency and how far the
client's wall time is above it. An ids artifact (one exported ``--from`` a model
directory). docs/benchmarks.md, "One client, step by step".
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import importlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from addnorm.commands import Parser
from addnorm.model.artifact import Manifest
from addnorm.model.runtime import cpu_flags
from bench.server import HOST, ServerProcess
from bench.studies import text_arguments, text_inputs

MARKS = "ADDNORM_STUDY_MARKS"  # where the traced server writes its marks on SIGUSR1

# (what the step is, module, class or None, function, "enter" or "leave"): a request's steps in their order
STEPS = (
    ("read: the server's first bytes", "addnorm.service.front.http11", "Http11", "data_received", "enter"),
    ("routed: HTTP parsed, front, route", "addnorm.service.protocols.text.codec", None, "answer", "enter"),
    ("body parsed: JSON", "addnorm.service.protocols.text.codec", None, "parse_json", "leave"),
    ("tokenized", "addnorm.service.protocols.text.codec", None, "decode_texts", "leave"),
    ("queued on the batcher", "addnorm.service.batching.batcher", "Batcher", "infer", "enter"),
    ("taken by the inference thread", "addnorm.service.batching.merging", None, "stack", "enter"),
    ("embedded: the embedding graph", "addnorm.service.batching.merging", None, "stack", "leave"),
    ("run: the model", "addnorm.service.backend.engine", "Engine", "run", "leave"),
    ("cut: each request's rows", "addnorm.service.batching.merging", None, "split", "leave"),
    ("the run's end told to the lanes", "addnorm.service.batching.batcher", "Batcher", "_ran", "leave"),
    ("handed to the event loop", "addnorm.service.batching.batcher", "Batcher", "_post", "enter"),
    ("delivered to the request", "addnorm.service.batching.batcher", "Batcher", "_deliver", "enter"),
    ("the batcher's wait returned", "addnorm.service.batching.batcher", "Batcher", "infer", "leave"),
    ("encoded: JSON", "addnorm.service.protocols.text.codec", "TextCodec", "encode", "leave"),
    ("sent: the answer written", "addnorm.service.front.http11", "_Cycle", "send", "leave"),
)
LAST = STEPS[-1][0]  # the one step a request takes twice (the answer's head, then its body): its last counts


def traced(argv: list[str]) -> int:
    """addnorm-serve with ``STEPS`` stamped: (step, time) pairs, written as JSON to $ADDNORM_STUDY_MARKS on SIGUSR1."""
    marks: list[tuple[str, float]] = []
    clock = time.perf_counter
    for step, module, owner, name, when in STEPS:
        where = importlib.import_module(module)
        where = getattr(where, owner) if owner else where
        fn = getattr(where, name)  # a step renamed in the server fails here, by its name

        def stamp(fn=fn, step=step, leave=when == "leave"):
            if asyncio.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def stamped(*args, **kwargs):
                    if not leave:
                        marks.append((step, clock()))
                    try:
                        return await fn(*args, **kwargs)
                    finally:
                        if leave:
                            marks.append((step, clock()))

            else:

                @functools.wraps(fn)
                def stamped(*args, **kwargs):
                    if not leave:
                        marks.append((step, clock()))
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        if leave:
                            marks.append((step, clock()))

            return stamped

        setattr(where, name, stamp())
    path = Path(os.environ[MARKS])

    def write(*_: object) -> None:  # whole or not at all: the client reads it once it exists
        part = path.with_suffix(".part")
        part.write_text(json.dumps(marks))
        part.replace(path)

    signal.signal(signal.SIGUSR1, write)
    from addnorm.service.cli import main

    return main(argv)


def requests_through(
    artifact: Path, texts: list[str], rounds: int, between: Callable[[int], None] = lambda _: None
) -> tuple[list[dict[str, float]], list[float]]:
    """Each request's steps (ms from the client's send; ``LAST`` at its last write, the rest at their first) after the
    warm-up round, and each one's wall time at the client (ms); ``between(r)`` after each round ``r``."""
    name = Manifest.load(artifact).name
    with tempfile.TemporaryDirectory() as tmp:
        marks_path = Path(tmp) / "marks.json"
        srv = ServerProcess(
            ["-m", "bench.studies.lone_request", "--traced", "--artifact", str(artifact)],
            env={MARKS: str(marks_path)},
        )
        with srv:
            conn = http.client.HTTPConnection(HOST, srv.port)
            sends = []
            for r in range(rounds):
                for text in texts:
                    body = json.dumps({"input": text, "model": name}).encode()
                    start = time.perf_counter()
                    conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                    answer = conn.getresponse()
                    if answer.status != 200:
                        raise RuntimeError(
                            f"/v1/embeddings answered {answer.status}: {answer.read()[:300]!r}"
                        )
                    answer.read()
                    sends.append((start, time.perf_counter()))
                between(r)
            conn.close()
            srv.proc.send_signal(signal.SIGUSR1)
            for _ in range(100):
                if marks_path.is_file():
                    break
                time.sleep(0.05)
            marks = json.loads(marks_path.read_text())
    steps: list[dict[str, float]] = []
    walls: list[float] = []
    at = 0
    for start, end in sends:  # each request's marks lie between its send and its answer
        seen: dict[str, float] = {}
        while at < len(marks) and marks[at][1] <= end:
            step, t = marks[at]
            if t >= start and (step == LAST or step not in seen):
                seen[step] = (t - start) * 1e3
            at += 1
        steps.append(seen)
        walls.append((end - start) * 1e3)
    warm = len(texts)
    return steps[warm:], walls[warm:]


class InProcess:
    """The model loaded in this process as addnorm-serve loads it; ``round`` times each step of one sentence at a
    time: tokenize (``decode_texts``), embed (``merging.stack``), run (on the session a run at light load takes:
    ``light``), pool (``sentence_vectors``), and their sum; ``medians`` of the rounds kept (ms)."""

    NAMES = ("tokenize", "embed", "run", "pool", "in all")

    def __init__(self, artifact: Path) -> None:
        from addnorm.service.core.text import TextLimits
        from addnorm.service.models.state import ServiceState, serving_model
        from addnorm.service.settings import Settings

        settings = Settings(artifact=(artifact,))
        self.loop = asyncio.new_event_loop()
        self.model = self.loop.run_until_complete(
            serving_model(ServiceState(settings), artifact.name, artifact)
        )
        self.limits = TextLimits.of(settings)
        self.rows: list[tuple[float, ...]] = []

    def round(self, texts: list[str], keep: bool = True) -> None:
        from addnorm.service.batching import merging
        from addnorm.service.core.text import decode_texts, sentence_vectors

        model, clock = self.model, time.perf_counter
        for text in texts:
            t0 = clock()
            req = decode_texts(model, [text], False, self.limits)
            t1 = clock()
            (part,) = req.parts
            item = merging.Queued(part.tokens, part.batch.mask, None)
            x, mask = merging.stack([item])
            t2 = clock()
            lengths = (item.lengths,) if model.engine.packed else ()
            out = model.engine.run(x, mask, *lengths, light=True)
            t3 = clock()
            sentence_vectors(req, model, out)
            t4 = clock()
            if keep:
                self.rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))

    def medians(self) -> dict[str, float]:
        return {n: statistics.median(row[i] for row in self.rows) * 1e3 for i, n in enumerate(self.NAMES)}

    def close(self) -> None:
        self.loop.run_until_complete(self.model.batcher.stop())
        self.loop.close()


def report(steps: list[dict[str, float]], walls: list[float], reference: dict[str, float]) -> str:
    lines = [f"{'step':40s} {'ms from send':>12s} {'added':>8s}", f"{'sent by the client':40s} {0.0:12.3f}"]
    before = 0.0
    for step, *_ in STEPS:
        at = statistics.median(s[step] for s in steps)
        lines.append(f"{step:40s} {at:12.3f} {at - before:8.3f}")
        before = at
    wall = statistics.median(walls)
    lines.append(f"{'answer read by the client':40s} {wall:12.3f} {wall - before:8.3f}")
    ref = ", ".join(f"{k} {v:.3f}" for k, v in reference.items())
    lines += [
        "",
        f"in process, the same sentences (median ms): {ref}",
        f"the client's wall time {wall:.3f} ms: {wall - reference['in all']:.3f} ms above in process "
        "(issue 77 asks at most 0.3)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--traced"]:  # the server side: python -m bench.studies.lone_request --traced SERVER-ARGS
        return traced(argv[1:])
    p = Parser(prog="python -m bench.studies.lone_request", description=__doc__.split("\n\n")[0])
    text_arguments(p)
    p.add_argument(
        "--rounds", type=int, default=4, help="times each sentence is sent; the first is a warm-up"
    )
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2: the first is a warm-up")
    with text_inputs(args) as (artifact, name, texts):
        local = InProcess(artifact)
        try:  # a round in process after each through the server, the first of each a warm-up
            steps, walls = requests_through(
                artifact, texts, args.rounds, lambda r: local.round(texts, keep=r > 0)
            )
            reference = local.medians()
        finally:
            local.close()
        missing = sorted({step for step, *_ in STEPS} - set.intersection(*(set(s) for s in steps)))
        if missing:  # a step the server no longer takes on this path: the table would not add up
            raise SystemExit(f"some requests went without these steps: {missing}")
    print(
        f"{len(steps)} lone /v1/embeddings requests ({len(texts)} sentences x {args.rounds - 1} rounds after a "
        f"warm-up), one client, {name}; "
        f"CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}"
    )
    print(report(steps, walls, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
