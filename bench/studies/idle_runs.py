"""What a one-sentence run costs after the process has been idle a while: the share of a lone request's gap to the
in-process limit that no server code can take back (issue 77's one-client goal: a request within 0.3 ms of the
limit's one sentence, which the limit measures back to back).

    python -m bench.studies.idle_runs [--artifact DIR] [--idle 0,0.5,1,2,5] [--rounds 6] [--runs 120]
        [--sentences N]

The server's own model (``Engine``, as addnorm-serve loads it) runs bench.text's sentences one at a time, each run
after the process slept ``--idle`` ms (the inference thread asleep on its condition, as between one client's
requests), on the spinning session (``--intra-op-spinning light``'s lone run, the default) and on the sleeping one,
every idle time in turn within each round. Per setting: the median of the rounds' median run times, the rounds'
range, and the extra over the back-to-back runs (idle 0). The embedding graph is timed with the run (a served run
embeds its text on the inference thread too); tokenizing is not (a server tokenizes on the event loop while the model
is idle).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from addnorm.commands import Parser
from addnorm.model.runtime import cpu_flags
from bench.studies import text_arguments, text_inputs

SESSIONS = (("spinning", True), ("asleep", False))  # (label, Engine.run's light=)


def measure(artifact: Path, texts: list[str], idle_ms: list[float], rounds: int, runs: int) -> dict:
    """{(label, idle ms): [each round's median run, s]}, the idle times and sessions in turn within a round."""
    from addnorm.service.backend.engine import Engine

    engine = Engine(artifact, "cpu", spinning="light")
    front = engine.text
    batches = [front.tokenizer.encode([t], truncate=True) for t in texts]
    out: dict = {(label, idle): [] for label, _ in SESSIONS for idle in idle_ms}
    for b in batches:  # warm both sessions up
        for _, light in SESSIONS:
            engine.run(front.embed(b), b.mask, light=light)
    for _ in range(rounds):
        for label, light in SESSIONS:
            for idle in idle_ms:
                times = []
                for i in range(runs):
                    if idle:
                        time.sleep(idle / 1e3)
                    b = batches[i % len(batches)]
                    start = time.perf_counter()
                    engine.run(front.embed(b), b.mask, light=light)
                    times.append(time.perf_counter() - start)
                out[(label, idle)].append(statistics.median(times))
    return out


def table(res: dict, idle_ms: list[float]) -> str:
    lines = [
        "| session | idle before each run, ms | run, ms (median of rounds) | rounds' range, ms | over back to back, ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, _ in SESSIONS:
        base = statistics.median(res[(label, idle_ms[0])])
        for idle in idle_ms:
            got = res[(label, idle)]
            mid = statistics.median(got)
            lines.append(
                f"| {label} | {idle:g} | {mid * 1e3:.2f} | {min(got) * 1e3:.2f}-{max(got) * 1e3:.2f} | "
                f"{(mid - base) * 1e3:+.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.studies.idle_runs", description=__doc__.split("\n\n")[0])
    text_arguments(p)
    p.add_argument(
        "--idle",
        default="0,0.5,1,2,5",
        help="comma-separated ms the process sleeps before each run, the first the baseline (default: 0,0.5,1,2,5)",
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds; each figure is their median")
    p.add_argument(
        "--runs", type=int, default=120, help="runs per setting in a round (their median is the round's)"
    )
    args = p.parse_args(argv)
    try:
        idle_ms = [float(v) for v in args.idle.split(",")]
    except ValueError:
        p.error(f"--idle takes comma-separated numbers of ms, got {args.idle!r}")
    if args.rounds < 1 or args.runs < 1 or any(v < 0 for v in idle_ms):
        p.error("--rounds and --runs must be at least 1, and each idle time 0 or more")
    with text_inputs(args) as (artifact, name, texts):
        res = measure(artifact, texts, idle_ms, args.rounds, args.runs)
    print(
        f"one sentence a run after the process idled, {name}, {len(texts)} sentence(s) in turn, medians of "
        f"{args.rounds} round(s) of {args.runs} runs; CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}"
    )
    print(table(res, idle_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
