"""Issue 77's goals, in one place: each bench section that measures one of them prints, under its table, what this
run measured against it, met or missed by how much, with the CPU a request beside it (``verdict``, ``section``).
docs/benchmarks.md, "Issue 77's goals on one machine", gathers them from one machine.
"""

from __future__ import annotations

import operator

# python -m bench --text (bench/text.py). /v1/embeddings at 32 clients against the in-process limit: with the load
# generator on the model's cores; with a core left to the front and the load generator (the fewer-threads rows)
LIMIT_AT_MOST_CLIENTS, LIMIT_WITH_A_CORE_LEFT = 0.85, 0.9
PEER_EVERY_ROW, PEER_FROM_8_CLIENTS = 1.0, 2.0  # addnorm-serve / the best peer: every row; from 8 clients on
# one client, one sentence: a request at most this many ms longer than the limit's one sentence
ONE_CLIENT_MS = 0.3
LOOP_MS = 0.15  # the event loop's CPU a small request: one sentence over /v1/embeddings, a tiny V2 binary one
CORE_AT_MOST_CLIENTS = 0.95  # the request core in process at 32 clients x 1 sentence, vs the limit
# the server's whole CPU a sentence at 32 clients / the limit's, by sentences a request
CPU_PER_SENTENCE = {"1": 1.1, "8": 1.05}

# python -m bench --limits (bench/limits.py): 32 clients of tiny V2 binary requests / the perfect-batching limit
TINY_V2_VS_PERFECT = 0.9
# python -m bench.ab d7419ed HEAD (bench/ab.py): the tree before the hot routes moved to FastAPI. Tiny V2 binary at
# 32 clients at least its requests/s; big requests "unchanged", read as within the machines' 5% of drift
BASE = "d7419ed"
TINY_V2_VS_BASE, BIG_VS_BASE = 1.0, 0.95
# python -m bench --lengths real (bench/mixed.py): the default merge over HTTP at 32 clients / the unpadded limit
MIXED_VS_UNPADDED = 0.95
# python -m bench --ray (bench/scaleout.py): one replica behind the documented HAProxy / plain, small requests
RAY_VS_PLAIN = 0.8

_MEETS = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def verdict(got: float, op: str, goal: float, unit: str) -> str:
    """``goal OP GOAL: met``, or ``missed by`` the distance to it."""
    met = _MEETS[op](got, goal)
    return f"goal {op} {goal:g}{unit}: " + ("met" if met else f"missed by {abs(goal - got):.2f}{unit}")


def section(lines: list[str]) -> list[str]:
    """The goal lines under a table, with their heading, a blank line either side of it (so that in a markdown
    block the lines are drawn as a list, not as the heading's paragraph); nothing where the run measured none."""
    return ["", "Issue 77's goals, as this run measured them:", "", *lines] if lines else []
