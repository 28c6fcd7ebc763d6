"""How much retrieval each quantized form of a model's vectors keeps (model/quantize.py): real text, ranked by
float32 cosine and by each form's own similarity, and how far the rankings agree.

``python -m bench.quantized [--artifact DIR]`` (default: all-MiniLM-L6-v2 from the dev extra, exported once into a
temporary directory). The text is this repository's guides (docs/*.md), cut into sentences (the first --sentences,
2,000 by default): none of them is among the export's calibration sentences, so the int8 and uint8 ranges are judged
out of sample. Each of the first --queries sentences is a query against all the others. Per form: recall@10 (how
many of float32's ten nearest it also ranks in its ten), the Spearman correlation of the whole ranking, and bytes per
vector. Similarities: float32 cosine; int8 and uint8 the integer dot product (uint8 centred on 128 first); binary and
ubinary the Hamming distance, as sentence-transformers' ``semantic_search_*`` helpers and vector databases score them.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import numpy as np

from addnorm.model import quantize
from addnorm.model.contract import POOLED
from addnorm.model.runtime import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
TOP = 10
CORPUS = 2000  # sentences at most (the guides hold more)


def sentences(limit: int = CORPUS) -> list[str]:
    """Prose sentences of docs/*.md (no code, tables or headings), 40-300 characters, each once: the first ``limit``."""
    out: dict[str, None] = {}
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", " ", path.read_text(encoding="utf-8"), flags=re.S)
        for line in text.splitlines():
            if line.startswith(("#", "|", "    ", ">")) or not line.strip():
                continue
            for s in re.split(r"(?<=[.!?])\s+", re.sub(r"`([^`]*)`", r"\1", line.strip())):
                if 40 <= len(s) <= 300:
                    out[s] = None
    return list(out)[:limit]


def vectors(artifact: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray, bool]:
    """The served model's float32 vectors of ``texts`` (in process, as the server runs it), its calibration, and
    whether it normalizes."""
    from addnorm.service.backend.engine import Engine

    engine = Engine(artifact, "cpu")
    front = engine.text
    out = []
    for start in range(0, len(texts), 32):
        batch = front.tokenizer.encode(texts[start : start + 32], truncate=True)
        out.append(engine.run(front.embed(batch), batch.mask)[POOLED])
    return np.concatenate(out), front.calibration, engine.manifest.config.normalize_pooled


def similarities(forms: np.ndarray, precision: str) -> np.ndarray:
    """All-pairs similarity of vectors in one form (higher is nearer)."""
    if precision == quantize.FLOAT:
        v = forms / np.linalg.norm(forms, axis=1, keepdims=True)
        return v @ v.T
    if precision in ("binary", "ubinary"):
        bits = np.unpackbits(forms.view(np.uint8), axis=1).astype(np.int32)
        return -(bits @ (1 - bits).T + (1 - bits) @ bits.T)  # minus the Hamming distance
    ints = forms.astype(np.int32) - (128 if precision == "uint8" else 0)
    return ints @ ints.T


def agreement(reference: np.ndarray, other: np.ndarray, queries: int) -> tuple[float, float]:
    """Mean recall@10 and mean Spearman correlation of ``other``'s rankings against ``reference``'s, per query
    (each query's own row left out)."""
    recalls, rhos = [], []
    for q in range(queries):
        keep = np.arange(reference.shape[1]) != q
        a, b = reference[q, keep], other[q, keep]
        top_a = set(np.argsort(-a, kind="stable")[:TOP])
        top_b = set(np.argsort(-b, kind="stable")[:TOP])
        recalls.append(len(top_a & top_b) / TOP)
        ra, rb = np.argsort(np.argsort(-a)), np.argsort(np.argsort(-b))
        rhos.append(np.corrcoef(ra, rb)[0, 1])
    return float(np.mean(recalls)), float(np.mean(rhos))


def table(artifact: Path, texts: list[str], queries: int) -> list[dict]:
    """Each form's recall@10 and Spearman against float32's rankings: the first ``queries`` of ``texts`` each a
    query against all of them."""
    floats, calibration, normalized = vectors(artifact, texts)
    bounds = quantize.ranges(calibration, None, normalized) if calibration is not None else None
    reference = similarities(floats, quantize.FLOAT)
    rows = []
    for precision in (quantize.FLOAT, *quantize.PRECISIONS):
        if precision == quantize.FLOAT:
            forms = floats
        elif precision in quantize.CALIBRATED and bounds is None:
            continue
        else:
            forms = quantize.quantize(floats, precision, bounds)
        recall, rho = agreement(reference, similarities(forms, precision), min(queries, len(texts)))
        rows.append({"form": precision, "bytes": forms[0].nbytes, "recall@10": recall, "spearman": rho})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, help="an exported text model (default: all-MiniLM-L6-v2)")
    parser.add_argument("--queries", type=int, default=200, help="sentences used as queries (default 200)")
    parser.add_argument(
        "--sentences",
        type=int,
        default=CORPUS,
        help=f"the guides' first N sentences are the corpus (default {CORPUS})",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact
        if artifact is None:
            from bench.text import export_minilm

            artifact = export_minilm(Path(tmp) / "minilm")
        texts = sentences(args.sentences)
        flags = " ".join(sorted(cpu_flags()))
        print(
            f"{len(texts)} sentences of docs/*.md, {min(args.queries, len(texts))} as queries; CPU flags {flags}"
        )
        print(f"{'form':<8} {'bytes':>6} {'recall@10':>10} {'spearman':>9}")
        for row in table(artifact, texts, args.queries):
            print(f"{row['form']:<8} {row['bytes']:>6} {row['recall@10']:>10.3f} {row['spearman']:>9.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
