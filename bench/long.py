"""ModernBERT at real lengths: addnorm against sentence-transformers on torch, and short queries among long documents.

``python -m bench.long [--layers 6] [--rounds 3]``. No ModernBERT checkpoint ships in a package here, so the model is
ModernBERT-base's shape (768 wide, 12 heads, a gated 1,152-wide feed-forward, global attention every third layer
and a 128-token window on the others, 8,192 positions) with random weights (``transformers.ModernBertModel``, seed
0) and ``--layers`` of its 22 layers; speed does not depend on the weights' values. Its tokenizer is
all-MiniLM-L6-v2's (the dev extra's), its pooling the mean.

1. **Throughput**, each side in a process of its own (its peak resident memory its alone), on the same threads:
   real queries (the built-in sentences, 32 a batch) and documents of 512, 2,048 and 8,192 tokens (this
   repository's guides, joined), addnorm's artifact through the serving ``Engine`` (tokenize, embedding graph,
   block, pooled) against ``SentenceTransformer.encode`` on the same directory (torch eager), and the same batches
   through addnorm-serve's /v1/embeddings from one client (its time against the in-process side's, its process's
   peak memory). Medians of ``--rounds``. ``longest``: the 8,192-token row alone, for ``--cost-curve``.
2. **Short among long**: addnorm-serve on the artifact; one client sends one query at a time for ``--seconds``,
   alone, then while a second client sends 2,048-token documents back to back: the queries' latency (p50, p99)
   both ways, and a document's own time. The batcher's express lane runs small requests beside a long run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from addnorm.model.runtime import cpu_flags
from bench.server import ROOT, ServerProcess

SIDES = ("addnorm", SERVED := "addnorm-serve", "sentence-transformers")
KINDS = {"queries": (None, 32), "512": (512, 4), "2048": (2048, 1), "8192": (8192, 1)}  # tokens, a batch
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def model_dir(out: Path, layers: int) -> Path:
    """A ModernBERT-base-shaped sentence embedder with random weights, ``layers`` deep, in ``out``."""
    import torch
    import transformers

    from bench.text import minilm

    config = transformers.ModernBertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_attention_heads=12,
        intermediate_size=1152,
        num_hidden_layers=layers,
        max_position_embeddings=8192,
        local_attention=128,
        global_attn_every_n_layers=3,
        pad_token_id=0,
        cls_token_id=101,
        sep_token_id=102,
        bos_token_id=101,
        eos_token_id=102,
    )
    torch.manual_seed(0)
    transformers.ModernBertModel(config).eval().save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (minilm() / name).is_file():
            shutil.copyfile(minilm() / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 8192}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True})
    )
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    return out


def export(directory: Path, out: Path) -> Path:
    from addnorm.export import cli

    assert cli.main(["--from", str(directory), "--artifact", str(out), "--name", "modern", "-q"]) == 0
    return out


def texts(kind: str, directory: Path) -> list[str]:
    """The inputs of one row: real queries, or documents of the row's tokens (whole sentences of the guides, then
    cut to the length by the tokenizer's count)."""
    from addnorm.export.sentences import calibration_sentences
    from bench.quantized import sentences

    tokens, batch = KINDS[kind]
    if tokens is None:
        return calibration_sentences()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_truncation()  # (the file's own limit is the source model's 128)
    pool, docs, current = sentences(), [], []
    for s in pool * 8:
        current.append(s)
        ids = tok.encode(" ".join(current)).ids
        if len(ids) >= tokens:
            docs.append(
                tok.decode(ids[1 : tokens - 1])
            )  # tokens - 2 of text: with [CLS] and [SEP], the length
            current = []
            if len(docs) == 2 * batch:
                return docs
    return docs


def point(side: str, kind: str, directory: Path, artifact: Path, threads: int) -> dict:
    """One row on one side, in this process: tokens/s of a warm run over the row's inputs, and its peak memory."""
    from bench.cost import peak_rss_mb

    inputs = texts(kind, directory)
    batch = KINDS[kind][1]
    if side == SERVED:
        return served_point(inputs, batch, artifact, threads)
    if side == "addnorm":
        from addnorm.service.backend.engine import Engine

        engine = Engine(artifact, "cpu", threads)
        front = engine.text

        def run(chunk: list[str]) -> None:
            b = front.tokenizer.encode(chunk, truncate=True)
            engine.run(front.embed(b), b.mask)
    else:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        model = SentenceTransformer(str(directory), device="cpu")

        def run(chunk: list[str]) -> None:
            with torch.inference_mode():
                model.encode(chunk, batch_size=batch)

    chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    run(chunks[0])  # warm-up
    t = time.perf_counter()
    for chunk in chunks:
        run(chunk)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "texts": len(inputs), "peak_rss_mb": peak_rss_mb()}


def served_point(inputs: list[str], batch: int, artifact: Path, threads: int) -> dict:
    """The row's inputs through addnorm-serve's /v1/embeddings, a batch a request from one client: seconds over the
    same chunks as in process, and the server process's peak memory."""
    import httpx

    from bench.cost import process_peak_mb

    chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    args = ["-m", "addnorm.service", "--artifact", str(artifact), "--intra-op-threads", str(threads)]
    with ServerProcess(args) as srv, httpx.Client(timeout=600) as client:

        def run(chunk: list[str]) -> None:
            client.post(f"{srv.base}/v1/embeddings", json={"input": chunk}).raise_for_status()

        run(chunks[0])  # warm-up
        t = time.perf_counter()
        for chunk in chunks:
            run(chunk)
        seconds = time.perf_counter() - t
        peak = process_peak_mb(srv.proc.pid)
    return {"seconds": seconds, "texts": len(inputs), "peak_rss_mb": peak}


def measure_point(side: str, kind: str, directory: Path, artifact: Path, threads: int) -> dict:
    cmd = [sys.executable, "-m", "bench.long", "--point", side, kind, str(directory), str(artifact)]
    out = subprocess.run([*cmd, "--threads", str(threads)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{side} {kind} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def latencies(base: str, query: str, seconds: float, stop: threading.Event) -> list[float]:
    import httpx

    out = []
    with httpx.Client(timeout=120) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            t = time.perf_counter()
            r = client.post(f"{base}/v1/embeddings", json={"input": query})
            r.raise_for_status()
            out.append(time.perf_counter() - t)
    return out


def short_among_long(artifact: Path, directory: Path, seconds: float) -> dict:
    import httpx

    query = "How do I reset my password if I no longer have access to the email address on my account?"
    document = texts("2048", directory)[0]
    with ServerProcess(["-m", "addnorm.service", "--artifact", str(artifact)]) as srv:
        latencies(srv.base, query, 2, threading.Event())  # warm-up
        alone = latencies(srv.base, query, seconds, threading.Event())
        doc_times: list[float] = []
        stop = threading.Event()

        def documents() -> None:
            with httpx.Client(timeout=300) as client:
                while not stop.is_set():
                    t = time.perf_counter()
                    client.post(f"{srv.base}/v1/embeddings", json={"input": document}).raise_for_status()
                    doc_times.append(time.perf_counter() - t)

        worker = threading.Thread(target=documents)
        worker.start()
        time.sleep(1.0)
        among = latencies(srv.base, query, seconds, threading.Event())
        stop.set()
        worker.join()
    ms = lambda xs, q: float(np.percentile(xs, q) * 1000)  # noqa: E731
    return {
        "alone_p50_ms": ms(alone, 50),
        "alone_p99_ms": ms(alone, 99),
        "among_p50_ms": ms(among, 50),
        "among_p99_ms": ms(among, 99),
        "document_ms": statistics.median(doc_times) * 1000 if doc_times else float("nan"),
        "queries_alone": len(alone),
        "queries_among": len(among),
    }


def measure(layers: int, rounds: int, seconds: float) -> dict:
    from addnorm.service.backend.cores import default_threads

    threads = default_threads()
    rows: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(Path(tmp) / "model", layers)
        artifact = export(directory, Path(tmp) / "artifact")
        print("  exported", file=sys.stderr, flush=True)
        for _ in range(rounds):
            for kind in KINDS:
                for side in SIDES:
                    got = measure_point(side, kind, directory, artifact, threads)
                    rows.setdefault(kind, {}).setdefault(side, []).append(got)
                print(f"  {kind} done", file=sys.stderr, flush=True)
        mixed = [short_among_long(artifact, directory, seconds) for _ in range(rounds)]
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    return {
        "cpu_flags": sorted(cpu_flags()),
        "layers": layers,
        "threads": threads,
        "rows": {
            kind: {
                side: {
                    "seconds": med(v, "seconds"),
                    "peak_rss_mb": med(v, "peak_rss_mb"),
                    "texts": v[0]["texts"],
                }
                for side, v in sides.items()
            }
            | {
                "ratio": statistics.median(
                    a["seconds"] / b["seconds"]
                    for a, b in zip(sides["sentence-transformers"], sides["addnorm"], strict=True)
                ),
                "served_ratio": statistics.median(  # the server against the same graphs in process: the limit
                    a["seconds"] / b["seconds"] for a, b in zip(sides["addnorm"], sides[SERVED], strict=True)
                ),
            }
            for kind, sides in rows.items()
        },
        "short_among_long": {k: statistics.median(m[k] for m in mixed) for k in mixed[0]},
    }


def longest(threads: int, rounds: int = 3, layers: int = 6) -> dict:
    """The cost curve's long-context row (``python -m bench --cost-curve``): one 8,192-token text, addnorm's
    artifact in process against sentence-transformers on torch eager, side by side in fresh processes, alternating
    which goes first; medians of ``rounds``."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(Path(tmp) / "model", layers)
        artifact = export(directory, Path(tmp) / "artifact")
        for r in range(rounds):
            sides = ("addnorm", "sentence-transformers")[:: 1 if r % 2 == 0 else -1]
            runs.append({side: measure_point(side, "8192", directory, artifact, threads) for side in sides})
    med = lambda side, k: statistics.median(run[side][k] / run[side]["texts"] for run in runs)  # noqa: E731
    ours, theirs = "addnorm", "sentence-transformers"
    return {
        "layers": layers,
        "seconds": {side: med(side, "seconds") for side in (ours, theirs)},
        "peak_rss_mb": {
            side: statistics.median(run[side]["peak_rss_mb"] for run in runs) for side in (ours, theirs)
        },
        "time_ratio": statistics.median(run[theirs]["seconds"] / run[ours]["seconds"] for run in runs),
        "memory_ratio": statistics.median(
            run[theirs]["peak_rss_mb"] / run[ours]["peak_rss_mb"] for run in runs
        ),
    }


def table(res: dict) -> str:
    lines = [
        f"CPU flags: {' '.join(res['cpu_flags'])}; ModernBERT-base's shape, {res['layers']} layers, random weights; "
        f"{res['threads']} threads each side; medians of the rounds",
        "",
        "| inputs | texts | addnorm s | sentence-transformers s | addnorm / sentence-transformers speed | peak memory "
        "MB (addnorm / s-t) | addnorm-serve s (vs in process) | addnorm-serve peak MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in res["rows"].items():
        a, s, v = row["addnorm"], row["sentence-transformers"], row[SERVED]
        name = "real queries" if kind == "queries" else f"documents of {kind} tokens"
        lines.append(
            f"| {name} | {a['texts']} | {a['seconds']:.2f} | {s['seconds']:.2f} | {row['ratio']:.2f}x | "
            f"{a['peak_rss_mb']:,.0f} / {s['peak_rss_mb']:,.0f} | {v['seconds']:.2f} ({row['served_ratio']:.2f}x) | "
            f"{v['peak_rss_mb']:,.0f} |"
        )
    m = res["short_among_long"]
    lines += [
        "",
        f"One query at a time through /v1/embeddings: alone p50 {m['alone_p50_ms']:.1f} ms, p99 {m['alone_p99_ms']:.1f} "
        f"ms; while 2,048-token documents run back to back (each {m['document_ms']:.0f} ms): p50 "
        f"{m['among_p50_ms']:.1f} ms, p99 {m['among_p99_ms']:.1f} ms",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.long", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6, help="of ModernBERT-base's 22 (default 6)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0, help="each latency run's length")
    p.add_argument("--point", nargs=4, metavar=("SIDE", "KIND", "DIR", "ARTIFACT"), help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.point:
        side, kind, directory, artifact = args.point
        print(json.dumps(point(side, kind, Path(directory), Path(artifact), args.threads)))
        return 0
    res = measure(args.layers, args.rounds, args.seconds)
    print(table(res))
    (ROOT / "bench" / "results" / "long.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
