"""Where addnorm's request core loses against the limit: closed-loop clients of one real sentence a request on the
server's own model in this process (no HTTP), every run recorded as the batcher reports it (issue 77's batcher
goal: the core at >= 0.95x the limit at 32 clients x 1 sentence).

    python -m bench.studies.core_runs [--artifact DIR] [--clients 32] [--rounds 3] [--seconds 4] [--delays 0,1,3]
        [--sentences N]

Each round measures the limit (``bench.text.best_limits``: the same graphs, 16 copies of bench.text's sentences
sorted by length, 8, 16 and 32 sentences in flight, no more than the clients keep, each run one batch at a time on
every thread or as batches side by side, one a thread, as the server's lanes run them: the fastest), then the
core once for each queue delay (``--max-queue-delay-ms``; 0, the default, takes whatever queued while the model
ran), the delays in turn. Per delay, medians over the rounds: tokens/s and against the limit; the share of the
wall the model ran, the share the inference thread spent stacking runs (the embedding graph, padding) and cutting
their answers, and the rest (neither: waiting for work or for the interpreter); padding among the positions the
runs computed; rows per run; the runs' own positions/s while they ran; the requests' p50 and p99. Where the model
runs batches side by side (``--parallel-runs on``, a lane a thread), the shares are of the lanes' time (the wall
times the lanes) and the runs' positions/s are the lanes' together. The core's tokens
/s is about the limit's times the three losses: the model not running, padding, and the runs' own speed (a run's
fixed cost weighs more on a run of fewer rows). docs/benchmarks.md, "What the measurements decided".
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from addnorm.commands import Parser
from addnorm.model.runtime import cpu_flags
from bench.studies import text_arguments, text_inputs

LIMIT_SIZES = (8, 16, 32)  # the limit's batch sizes, up to the sentences in flight
COLUMNS = (
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("vs the limit", "vs_limit", "{:.2f}x"),
    ("model running", "busy", "{:.2f}"),
    ("stacking and cutting", "stacking", "{:.3f}"),
    ("neither", "neither", "{:.3f}"),
    ("padding", "padding", "{:.1%}"),
    ("rows per run", "rows_per_run", "{:.1f}"),
    ("runs' positions/s", "run_positions_per_s", "{:,.0f}"),
    ("p50 ms", "p50_ms", "{:.1f}"),
    ("p99 ms", "p99_ms", "{:.1f}"),
)


class _Recorder:
    """The batcher's observer, kept, and every run it is told of after ``start()``."""

    def __init__(self, observer) -> None:
        self.observer, self.runs, self.on = observer, [], False

    def start(self) -> None:
        self.runs.clear()
        self.on = True

    def batch_done(self, run) -> None:
        if self.on:
            self.runs.append(run)
        if self.observer is not None:
            self.observer.batch_done(run)


def core_runs(artifact: Path, texts: list[str], clients: int, seconds: float, delay_ms: float) -> dict:
    """One measurement of the core at ``clients`` x 1 sentence with ``delay_ms`` of queue delay: ``COLUMNS``' figures
    but the limit's."""
    from addnorm.service.core.text import TextLimits
    from addnorm.service.models.state import ServiceState, serving_model
    from addnorm.service.settings import Settings
    from bench.text import core_loop, groups

    async def main() -> dict:
        settings = Settings(artifact=(artifact,), max_queue_delay_ms=delay_ms)
        model = await serving_model(ServiceState(settings), artifact.name, artifact)
        recorder = _Recorder(model.batcher.observer)
        model.batcher.observer = recorder
        latencies: list[float] = []
        started = [0.0]

        def start() -> None:
            recorder.start()
            started[0] = time.perf_counter()

        try:
            rate = await core_loop(
                model, TextLimits.of(settings), groups(texts, 1), clients, seconds, latencies, start
            )
            wall = time.perf_counter() - started[0]  # every measured request answered: its runs are recorded
            recorder.on = False
        finally:
            await model.batcher.stop()
        runs = recorder.runs
        # the lanes' time: with --parallel-runs, runs side by side, each on its own inference thread
        lanes = model.engine.lanes
        running = sum(r.seconds for r in runs) / lanes
        stacking = sum(r.merge_s + r.split_s for r in runs) / lanes / wall
        positions = sum(r.positions for r in runs)
        ms = sorted(t * 1e3 for t in latencies)
        return {
            "tokens_per_s": rate,
            "busy": running / wall,
            "stacking": stacking,
            "neither": 1.0 - running / wall - stacking,
            "padding": 1.0 - sum(r.requested for r in runs) / positions if positions else 0.0,
            "rows_per_run": statistics.mean(r.rows for r in runs) if runs else 0.0,
            "run_positions_per_s": positions / running if running else 0.0,
            "p50_ms": ms[len(ms) // 2] if ms else 0.0,
            "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))] if ms else 0.0,
        }

    return asyncio.run(main())


def measure(artifact: Path, texts: list[str], clients: int, rounds: int, seconds: float, delays: list[float]):
    """(the limit: its tokens/s and sentences in flight, medians over the rounds, and its batches side by side, 1
    where most rounds' best ran one at a time; each delay's figures, medians over the rounds), the delays taking
    turns within each round."""
    from addnorm.service.backend.cores import default_threads
    from bench.text import best_limits

    sizes = tuple(sorted({min(clients, s) for s in LIMIT_SIZES}))
    limit_rates: list[tuple[float, int, bool]] = []
    got: dict[float, list[dict]] = {d: [] for d in delays}
    threads = default_threads()
    for r in range(rounds):
        limit = best_limits(artifact, texts, sizes, threads)
        rates = limit.rates
        size = max(rates, key=rates.__getitem__)
        limit_rates.append((rates[size], size, size in limit.side_by_side))
        for d in delays:
            row = core_runs(artifact, texts, clients, seconds, d)
            row["vs_limit"] = row["tokens_per_s"] / rates[size]
            got[d].append(row)
        print(f"  round {r + 1} of {rounds} done", file=sys.stderr, flush=True)
    limit = statistics.median(rate for rate, _, _ in limit_rates)
    size = statistics.median_low(size for _, size, _ in limit_rates)
    side = sum(way for _, _, way in limit_rates) > len(limit_rates) / 2  # the way most rounds' best took
    return (limit, size, threads if side else 1), {
        d: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for d, rows in got.items()
    }


def table(limit: tuple[float, int, int], rows: dict[float, dict]) -> str:
    """``limit``: (tokens/s, sentences in flight, batches side by side: 1 for one at a time)."""
    rate, size, lanes = limit
    way = "one at a time" if lanes == 1 else f"{lanes} side by side of {size // lanes} each, one a thread"
    head = ["queue delay ms", *(name for name, _, _ in COLUMNS)]
    lines = [
        f"the limit: {rate:,.0f} tokens/s (batches of {size} sentences in flight, {way}; tokenization included)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    for delay, row in rows.items():
        cells = [f"{delay:g}", *(fmt.format(row[key]) for _, key, fmt in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.studies.core_runs", description=__doc__.split("\n\n")[0])
    text_arguments(p)
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients, one sentence a request")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each figure is their median")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds each delay is measured in a round")
    p.add_argument(
        "--delays",
        default="0",
        help="comma-separated queue delays in ms (--max-queue-delay-ms), measured in turn (default: 0, the default)",
    )
    args = p.parse_args(argv)
    try:
        delays = [float(d) for d in args.delays.split(",")]
    except ValueError:
        p.error(f"--delays takes comma-separated numbers of ms, got {args.delays!r}")
    if args.clients < 1 or args.rounds < 1 or args.seconds <= 0 or any(d < 0 for d in delays):
        p.error("--clients and --rounds must be at least 1, --seconds above 0, and each delay 0 or more")
    with text_inputs(args) as (artifact, name, texts):
        limit, rows = measure(artifact, texts, args.clients, args.rounds, args.seconds, delays)
    print(
        f"addnorm's request core in process, {args.clients} clients x 1 sentence, {name}, medians of {args.rounds} "
        f"round(s) of {args.seconds:g} s; CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}"
    )
    print(table(limit, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
