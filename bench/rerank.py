"""``python -m bench.rerank`` (``python -m bench --rerank``): one query against 100 documents, side by side in one run.

The documents are real text of mixed lengths (``export.sentences.builtin_sentences``: queries, sentences and a
passage, cycled to 100), each scored with the query as a pair by a cross-encoder: all-MiniLM-L6-v2's encoder (the
dev extra's package) with a classification head of one label, as ``docs/tasks.md`` builds it (the head's weights
change no timing). TEI-shaped ``/rerank`` requests of the query and all 100 documents from 1, 8 and 32 closed-loop
keep-alive clients, against:

- the in-process limit: the same graphs run by onnxruntime in this process, tokenization of the pairs included, the
  pairs sorted by token count and run in batches of the size (at most the pairs the row keeps in flight, and 256)
  that goes fastest: what no server can beat with that many pairs to batch;
- addnorm-serve at its defaults, on the model exported with its head (``--from DIR``);
- what a user would write instead: a FastAPI app calling sentence-transformers' ``CrossEncoder.predict``
  (``bench/st_app.py --cross-encoder``), and Infinity's ``/rerank`` where its ``infinity_emb`` command is found.

Servers run one at a time; ``--rounds`` rounds, the medians. Pairs/s, p50 and p99 per cell, and each server's ratio
to the limit.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from addnorm.model.runtime import cpu_flags
from bench.loadgen import build_request
from bench.mixed import cell
from bench.server import HOST, ServerProcess
from bench.text import against_peers_main, minilm, sentences

QUERY = "How do I reset my password if I no longer have access to the email address on my account?"
DOCUMENTS = 100
CLIENTS = (1, 8, 32)
MAX_BATCH = 256  # pairs one run of the limit takes at most (as a server's batch)


def documents() -> list[str]:
    texts = sentences()
    return [texts[i % len(texts)] for i in range(DOCUMENTS)]


def reranker(root: Path) -> tuple[Path, Path]:
    """(model directory, artifact): all-MiniLM-L6-v2's encoder with a new head of one label, exported."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    from addnorm.export import cli

    directory, artifact = root / "reranker-dir", root / "reranker"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(minilm()), num_labels=1)
    model.save_pretrained(str(directory))
    # the tokenizer's files as the checkpoint has them: Infinity's tokenizer reads its length from
    # tokenizer_config.json (without it, its warm-up sent 1,027 positions to a 512-position model and it exited)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm() / name, directory)
    assert cli.main(["--from", str(directory), "--artifact", str(artifact), "--name", "reranker", "-q"]) == 0
    return directory, artifact


def limits(artifact: Path, docs: list[str], sizes: tuple[int, ...], repeat: int = 3) -> dict[int, float]:
    """Pairs/s of the graphs in process by batch size: the pairs (``QUERY``, each of ``docs``) tokenized (cut in
    the document, as the server cuts) and run in length-sorted batches of each size, the best of ``repeat``; the
    batches one at a time on every thread or side by side on one thread each (``--parallel-runs on``, the
    server's way under load), whichever is faster."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.measure import limit_engines

    engines = limit_engines(artifact)
    tok = engines[0].text.tokenizer
    lengths = [len(r) for r in tok.ids([QUERY] * len(docs), True, docs)[0]]
    order = [docs[i] for i in np.argsort(lengths, kind="stable")]
    rates = dict.fromkeys(sizes, 0.0)
    for engine in engines:
        front = engine.text

        def one(b: list[str], engine=engine, front=front) -> None:
            batch = tok.encode([QUERY] * len(b), True, b)
            engine.run(front.embed(batch), batch.mask)

        with ThreadPoolExecutor(engine.lanes) as lanes:
            for size in sizes:
                batches = [order[i : i + size] for i in range(0, len(order), size)]
                best = float("inf")
                for r in range(repeat + 1):
                    start = time.perf_counter()
                    list(lanes.map(one, batches))
                    if r:  # the first pass warms up
                        best = min(best, time.perf_counter() - start)
                rates[size] = max(rates[size], len(order) / best)
    return rates


def requests(port: int, path: str, docs: list[str], field: str = "texts") -> list[tuple[int, bytes]]:
    """One request of the query and every document (its count: pairs, what a cell's rate counts): TEI's body, or
    with ``field`` "documents" Infinity's (Cohere's)."""
    body = orjson.dumps({"query": QUERY, field: docs, **({"truncate": True} if field == "texts" else {})})
    return [(len(docs), build_request(HOST, port, path, body, {"Content-Type": "application/json"}))]


def server_cells(
    port: int, docs: list[str], seconds: float, what: str, field: str = "texts"
) -> dict[int, dict]:
    out = {}
    for clients in CLIENTS:
        row, _ = cell(port, requests(port, "/rerank", docs, field), clients, seconds, what, warmup=1)
        out[clients] = row
    return out


def in_flight(clients: int) -> int:
    return min(clients * DOCUMENTS, MAX_BATCH)


def measure(rounds: int, seconds: float, infinity_cmd: str | None, peers: str | None = None) -> dict:
    docs = documents()
    sizes = (8, 16, 32, 64, 100, 128, 256)
    cells: dict[str, list[dict]] = {}
    by_size: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory, artifact = reranker(Path(tmp))
        from addnorm.model.artifact import Manifest
        from addnorm.model.tokenize import TextTokenizer

        tok = TextTokenizer((artifact / "tokenizer.json").read_bytes(), Manifest.load(artifact).text)
        pair_tokens = float(np.mean([len(r) for r in tok.ids([QUERY] * len(docs), True, docs)[0]]))
        for _ in range(rounds):
            for size, rate in limits(artifact, docs, sizes).items():
                by_size.setdefault(size, []).append(rate)
            with ServerProcess(["-m", "addnorm.service", "--artifact", str(artifact)], capture=False) as srv:
                for c, row in server_cells(srv.port, docs, seconds, "addnorm").items():
                    cells.setdefault(f"addnorm-serve|{c}", []).append(row)
            print("  addnorm done", file=sys.stderr, flush=True)
            name = "FastAPI + sentence-transformers CrossEncoder"
            with ServerProcess(["-m", "bench.st_app", "--model", str(directory), "--cross-encoder"]) as srv:
                for c, row in server_cells(srv.port, docs, seconds, name).items():
                    cells.setdefault(f"{name}|{c}", []).append(row)
            print(f"  {name} done", file=sys.stderr, flush=True)
            if infinity_cmd is not None:
                from bench.text import infinity

                with infinity(infinity_cmd, directory) as port:
                    for c, row in server_cells(port, docs, seconds, "infinity", "documents").items():
                        cells.setdefault(f"Infinity|{c}", []).append(row)
    return {
        "cpu_flags": sorted(cpu_flags()),
        "documents": len(docs),
        "mean_pair_tokens": pair_tokens,
        "limit_pairs_per_s": {str(k): statistics.median(v) for k, v in by_size.items()},
        "cells": {
            k: {m: statistics.median(r[m] for r in rows) for m in ("tokens_per_s", "p50_ms", "p99_ms")}
            for k, rows in cells.items()
        },
        "infinity": infinity_cmd or "not installed (pip install 'infinity-emb[server]')",
    }


def best_limit(lims: dict[str, float], pairs: int) -> float:
    return max(v for k, v in lims.items() if int(k) <= pairs)


def table(res: dict) -> str:
    lims = res["limit_pairs_per_s"]
    lines = [
        f"CPU flags: {' '.join(res['cpu_flags'])}; one query against {res['documents']} documents of real text, "
        f"{res['mean_pair_tokens']:.1f} tokens a pair on average; the in-process limit by batch size (one batch at a time or side by side, the faster): "
        + ", ".join(f"{k}: {v:,.0f} pairs/s" for k, v in lims.items())
        + f"; Infinity: {res['infinity']}",
        "",
        "| server | clients | pairs/s | p50 ms | p99 ms | vs the limit at its pairs in flight |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in res["cells"].items():
        name, clients = key.split("|")
        lim = best_limit(lims, in_flight(int(clients)))
        lines.append(
            f"| {name} | {clients} | {row['tokens_per_s']:,.0f} | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} | "
            f"{row['tokens_per_s'] / lim:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return against_peers_main("bench.rerank", __doc__, measure, table, "rerank.json", argv)


if __name__ == "__main__":
    sys.exit(main())
