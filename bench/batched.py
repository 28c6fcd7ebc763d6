"""python -m bench.batched: requests as a client's tokenizer batches them, against the unpadded limit.

A client that embeds its documents N at a time sends each batch padded to its longest sentence with a mask (a
tokenizer's ``padding=True``: padding on the right), or to a fixed length (``padding="max_length"``, ``--pad-to``:
what clients of servers that batch only equal shapes do). Here each request is ``--sentences`` sentences whose
lengths are drawn like real text (``bench.mixed.draw``), ``[N, longest, E]`` with the mask ``[N, longest]`` as a BOOL
input over V2 binary (HTTP), from each ``--clients`` count of closed-loop clients. Servers, one at a time: the
artifact (padded graph, merging by cost), its packed twin (``bench.mixed.packed_twin``), and with ``--before
DIR`` the artifact served by another checkout (``PYTHONPATH`` = DIR: ``git worktree add DIR <commit>``), the
unpadded limit measured in-process between rounds. Printed per server and client count, medians of ``--rounds``:
real tokens per second, against the limit (every sentence alone in-process: its tokens over their summed time)
and against the padded graph, p50/p99 latency, and the share of computed positions (the server's
``addnorm_batch_positions``, merging's and the client's padding alike) that were not real tokens.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT, Parser
from addnorm.model.artifact import Manifest
from bench.ab import started
from bench.measure import v2_request
from bench.mixed import REQUESTS, cell, draw, http_load, packed_twin, padding_counts, unpadded_limit
from bench.report import artifact_given, save
from bench.server import ROOT


def batches(
    e: int, sentences: int, seed: int = 1, pad_to: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """REQUESTS sentence lengths in requests of ``sentences``, each padded to its longest (or to ``pad_to``, the
    longer ones cut to it, as a tokenizer's truncation does): (x, mask) pairs."""
    lengths, rng = draw(REQUESTS), np.random.default_rng(seed)
    if pad_to is not None:
        lengths = np.minimum(lengths, pad_to)
    out = []
    for first in range(0, len(lengths) - sentences + 1, sentences):
        own = lengths[first : first + sentences]
        seq = int(own.max()) if pad_to is None else pad_to
        mask = np.arange(seq)[None, :] >= own[:, None]  # (N, seq), true = padding
        x = rng.standard_normal((sentences, seq, e)).astype(np.float32) * ~mask[..., None]
        out.append((x, mask))
    return out


def measure(
    artifact: Path,
    sentences: int,
    clients: tuple[int, ...],
    rounds: int,
    seconds: float,
    before: Path | None,
    pad_to: int | None = None,
) -> dict:
    """Every server x client count, ``rounds`` times, servers one at a time; per cell the median row."""
    manifest = Manifest.load(artifact)
    requests = batches(manifest.config.d_model, sentences, pad_to=pad_to)
    real = [int((~m).sum()) for _, m in requests]  # each request's real tokens
    alone = [x[i : i + 1, : int((~m[i]).sum())] for x, m in requests for i in range(sentences)]
    twin = packed_twin(artifact).resolve()
    servers = {"padded": (artifact.resolve(), ROOT), "packed": (twin, ROOT)}
    if before is not None:
        servers["padded before"] = (artifact.resolve(), before.resolve())
    cells: dict[str, list[dict]] = {}
    limits = []
    for r in range(rounds):
        limits.append(unpadded_limit(artifact, alone))
        for name, (served, tree) in servers.items():
            with started(tree, served, {}) as port:  # served by its own checkout's code
                load = [
                    (n, v2_request(port, manifest.name, x, m))
                    for n, (x, m) in zip(real, requests, strict=True)
                ]
                for c in clients:
                    http_load(port, load, c, 1.0)  # warm-up, not counted: the window's positions are its own
                    counted = padding_counts(port)
                    row, tokens = cell(port, load, c, seconds, name, warmup=0)
                    computed = sum(padding_counts(port)) - sum(counted)
                    row["not_real_share"] = 1.0 - min(1.0, tokens / max(computed, 1.0))
                    cells.setdefault(f"{name}/{c}", []).append(row)
            print(f"  round {r + 1}: {name} done", file=sys.stderr, flush=True)
    positions = sum(m.size for _, m in requests)
    return {
        "sentences": sentences,
        "pad_to": pad_to,
        "client_padding_share": 1 - sum(real) / positions,
        "unpadded_limit_tokens_per_s": statistics.median(limits),
        "unpadded_limits": limits,
        "cells": medians(cells),
        "rounds": rounds,
    }


def medians(cells: dict[str, list[dict]]) -> dict[str, dict]:
    """Each cell's rows (one per round) as one row: every field's median."""
    return {k: {f: statistics.median(row[f] for row in v) for f in v[0]} for k, v in cells.items()}


def table(res: dict) -> str:
    limit = res["unpadded_limit_tokens_per_s"]
    lines = [
        f"{res['sentences']} sentences per request, padded to {_padded_to(res)}: {res['client_padding_share']:.0%} of "
        f"the positions sent are padding; the unpadded limit {limit:,.0f} tokens/s (rounds: "
        f"{', '.join(f'{v:,.0f}' for v in res['unpadded_limits'])})",
        "",
        f"{'server':<14} {'clients':>7} {'tokens/s':>10} {'vs limit':>9} {'vs padded':>10} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'not real':>9}",
    ]
    for key, row in res["cells"].items():
        name, clients = key.split("/")
        base = res["cells"][f"padded/{clients}"]["tokens_per_s"]
        lines.append(
            f"{name:<14} {clients:>7} {row['tokens_per_s']:>10,.0f} {row['tokens_per_s'] / limit:>8.2f}x "
            f"{row['tokens_per_s'] / base:>9.2f}x {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
            f"{row['not_real_share']:>9.0%}"
        )
    return "\n".join(lines)


def _padded_to(res: dict) -> str:
    return "their longest" if res.get("pad_to") is None else f"{res['pad_to']} positions"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.batched", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="an exported artifact")
    p.add_argument("--sentences", type=int, default=8, help="sentences per request (default 8)")
    p.add_argument(
        "--pad-to",
        type=int,
        help="pad every request to this many positions (default: to its longest sentence)",
    )
    p.add_argument("--clients", type=int, nargs="+", default=[8, 32], help="client counts (default 8 32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, medians reported (default 3)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per load (default 4)")
    p.add_argument("--before", type=Path, help="another checkout: its server on the artifact too")
    p.add_argument("--results", type=Path, default=Path("bench/results"), help="where batched.json goes")
    args = p.parse_args(argv)
    artifact_given(p, args.artifact)
    if args.pad_to is not None and args.pad_to < 1:
        p.error("--pad-to must be at least 1")
    res = measure(
        args.artifact,
        args.sentences,
        tuple(args.clients),
        args.rounds,
        args.seconds,
        args.before,
        args.pad_to,
    )
    save(res, args.results, "batched.json")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
