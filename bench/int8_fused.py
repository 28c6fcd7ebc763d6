"""What int8 would gain from fused kernels, on the real checkpoint: a study, not a variant.

    python -m bench.int8_fused [--rounds 5] [--seconds 1] [--include DIR]

Issue 34 asks int8 at onnxruntime's ``quantize_dynamic`` speed. In onnxruntime 1.32's CPU operators int8's
per-row quantization takes about 20 nodes per quantized activation and its float side two per product
(export/int8.py), and ``python -m bench.int8_profile`` shows that this, not the integer products, is the gap. This
study puts the same arithmetic into two custom operators (bench/int8_fused.cc: ``RowQuantize``, a row's centre,
span, zero point, levels and float side in one pass; ``AddSide``, the float side added to the integer product's
output), rewrites the int8 graph to use them (``fuse``), and measures fp32, int8, the fused forms and
``quantize_dynamic`` side by side: each graph's answers on real sentences against transformers, and its time on
``[8,128,384]`` (the graphs taking turns, median of the rounds). The rewritten graphs need the library and are never
exported: what a fused form would be worth decides whether one is built.

The library is compiled (g++, x86-64 with AVX2 and FMA) against onnxruntime's C++ API header: ``--include DIR``,
else ``/usr/include/onnxruntime``, else Debian's ``libonnxruntime-dev`` package fetched from deb.debian.org (a
package registry) into ~/.cache/addnorm. The C API is versioned: an older header's library loads into a newer
runtime.
"""

from __future__ import annotations

import argparse
import lzma
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

HERE = Path(__file__).resolve().parent
HEADER = "onnxruntime_lite_custom_op.h"
DEBIAN = "http://deb.debian.org/debian"
SUITE = "trixie"  # the first Debian release with onnxruntime's headers (1.21)
DOMAIN = "ai.addnorm"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.int8_fused", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds of the graphs taking turns (default 5)")
    p.add_argument("--seconds", type=float, default=1.0, help="time per graph per round (default 1)")
    p.add_argument("--include", type=Path, help=f"a directory holding onnxruntime's {HEADER}")
    args = p.parse_args(argv)

    import onnxruntime as ort

    from bench.real import MORE, alternate, real_model, three_graphs
    from export import hf
    from model.contract import EMBEDDINGS, ENCODED, MASK
    from model.runtime import cpu_flags

    flags = cpu_flags()
    if "avx2" not in flags or not _has_fma():
        p.error(f"the kernels need AVX2 and FMA; this CPU's flags: {' '.join(sorted(flags)) or 'unknown'}")
    config, encoder, reference = real_model()
    x, mask = reference.embed([*hf.SENTENCES, *MORE])
    want = reference.encode(x, mask)
    print(f"all-MiniLM-L6-v2, {len(x)} sentences; CPU flags {' '.join(sorted(flags))}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        library = compile_kernels(header_dir(args.include), tmp)
        paths = three_graphs(encoder, x, mask, tmp)
        int8 = onnx.load(paths["int8"])
        graphs = {
            "fp32": onnx.load(paths["fp32"]),
            "int8": int8,
            "int8, RowQuantize": fuse(int8, side=False),
            "int8, RowQuantize + AddSide": fuse(int8, side=True),
            "quantize_dynamic": onnx.load(paths["quantize_dynamic"]),
        }
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the server runs
        opts.register_custom_ops_library(str(library))
        sessions = {
            name: ort.InferenceSession(g.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            for name, g in graphs.items()
        }
        bench_x = np.random.default_rng(0).standard_normal((8, 128, config.d_model)).astype(np.float32)
        times = alternate(
            sessions, {EMBEDDINGS: bench_x, MASK: np.zeros((8, 128), bool)}, args.rounds, args.seconds
        )
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"\n{'graph':<30} {'nodes':>5} {'max err vs transformers':>24} {'least cosine':>13} {'Spearman':>9} "
            f"{'[8,128,384] ms':>15} {'vs fp32':>8} {'vs quantize_dynamic':>20}"
        )
        for name, session in sessions.items():
            agree = hf.agreement(session.run([ENCODED], {EMBEDDINGS: x, MASK: mask})[0], want, mask)
            print(
                f"{name:<30} {len(graphs[name].graph.node):5d} {agree.max_abs:24.2e} "
                f"{agree.min_sentence_cosine:13.6f} {agree.spearman:9.4f} {ms[name]:15.2f} "
                f"{ms['fp32'] / ms[name]:7.2f}x {ms['quantize_dynamic'] / ms[name]:19.2f}x"
            )
        print(
            f"(medians of {args.rounds} rounds; each round's ms: "
            + "; ".join(f"{name} {', '.join(f'{t:.1f}' for t in times[name])}" for name in sessions)
            + ")"
        )
    return 0


def fuse(model: onnx.ModelProto, side: bool) -> onnx.ModelProto:
    """A copy of export/int8.py's graph with each row group (the nodes writing ``{p}_*`` for a quantized
    activation ``p``, from its float channels' MatMul to the float side's Concat) one RowQuantize, and with
    ``side``, each product's float side (its MatMul and the Add after the integer product) one AddSide."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups = [
        o.removesuffix("_side")
        for n in graph.node
        if n.op_type == "Concat"
        for o in n.output
        if "_rows" in o and o.endswith("_side")
    ]
    made = {o for n in graph.node for o in n.output}
    if not groups or any(f"{g}_float" not in made or f"{g}_zp" not in made for g in groups):
        raise ValueError("not export/int8.py's graph of 'minmax' rows, which the kernels compute")
    nodes = []
    for node in graph.node:
        group = next((g for g in groups if any(o.startswith(g + "_") for o in node.output)), None)
        if group is None:
            nodes.append(node)
        elif node.output[0] == f"{group}_float":  # the group's first node reads the activation
            pick = numpy_helper.to_array(inits[f"{group}_pick"])  # one-hot columns, then the mean's
            channels = np.argmax(pick[:, :-1], axis=0).astype(np.int64)
            graph.initializer.append(numpy_helper.from_array(channels, f"{group}_channels"))
            outputs = [f"{group}_q", f"{group}_scale", f"{group}_side"]
            nodes.append(
                helper.make_node("RowQuantize", [node.input[0], f"{group}_channels"], outputs, domain=DOMAIN)
            )
    if side:
        offsets = {
            n.output[0]: n for n in nodes if n.op_type == "MatMul" and n.output[0].endswith("_int8_offset")
        }
        fused = []
        for node in nodes:
            if node.op_type == "Add" and node.input[1] in offsets:
                product = offsets[node.input[1]]
                inputs = [node.input[0], product.input[0], product.input[1]]
                fused.append(helper.make_node("AddSide", inputs, list(node.output), domain=DOMAIN))
            elif node.output[0] not in offsets:
                fused.append(node)
        nodes = fused
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def header_dir(include: Path | None) -> Path:
    """Where onnxruntime's C++ API header is: ``include``, the system's, or Debian's package (fetched once)."""
    if include is not None:
        if not (include / HEADER).is_file():
            raise SystemExit(f"error: {include} holds no {HEADER}")
        return include
    cache = Path.home() / ".cache/addnorm/onnxruntime-dev"
    for candidate in (Path("/usr/include/onnxruntime"), cache / "include"):
        if (candidate / HEADER).is_file():
            return candidate
    cache.mkdir(parents=True, exist_ok=True)
    index = f"{DEBIAN}/dists/{SUITE}/main/binary-amd64/Packages.xz"
    print(f"fetching onnxruntime's headers: Debian {SUITE}'s libonnxruntime-dev ({index})", flush=True)
    with urllib.request.urlopen(index, timeout=120) as r:
        packages = lzma.decompress(r.read()).decode()
    entry = next((e for e in packages.split("\n\n") if e.startswith("Package: libonnxruntime-dev\n")), None)
    if entry is None:
        raise SystemExit(f"error: Debian {SUITE} lists no libonnxruntime-dev; give --include DIR")
    fields = dict(line.split(": ", 1) for line in entry.splitlines() if ": " in line)
    deb = cache / Path(fields["Filename"]).name
    urllib.request.urlretrieve(f"{DEBIAN}/{fields['Filename']}", deb)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "root")], check=True)
    (cache / "include").unlink(missing_ok=True)
    (cache / "include").symlink_to(cache / "root/usr/include/onnxruntime")
    return cache / "include"


def _has_fma(cpuinfo: str = "/proc/cpuinfo") -> bool:
    with open(cpuinfo) as f:
        return any(line.startswith("flags") and "fma" in line.split(":", 1)[1].split() for line in f)


def compile_kernels(include: Path, out: Path) -> Path:
    """bench/int8_fused.cc as a shared library in ``out``."""
    library = out / "libaddnorm_int8_fused.so"
    command = ["g++", "-O3", "-march=x86-64-v3", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17"]
    subprocess.run([*command, f"-I{include}", str(HERE / "int8_fused.cc"), "-o", str(library)], check=True)
    return library


if __name__ == "__main__":
    raise SystemExit(main())
