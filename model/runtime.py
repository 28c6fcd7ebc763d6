"""onnxruntime provider settings that parity depends on, shared by export's parity checks and the service: which
providers ``--providers auto|cpu|cuda`` means here (resolve_providers), their options, the rewrites left out.

No torch, no onnxruntime import: plain names and options.
"""

from __future__ import annotations

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# onnxruntime's CUDA provider computes float32 MatMuls in TF32 unless told otherwise (10-bit mantissa): measured on
# an H100 with onnxruntime-gpu 1.31.1, that puts the fp32 graph 4e-4 from torch's float32 result, 40x the fp32 gate.
# An fp32 artifact computes in fp32 on CUDA too; fp16 and int8 graphs are unaffected by this switch.
CUDA_OPTIONS = {"use_tf32": "0"}


def with_options(providers: list[str]) -> list[str | tuple[str, dict[str, str]]]:
    """``providers`` as onnxruntime takes them, CUDA with CUDA_OPTIONS."""
    return [(p, dict(CUDA_OPTIONS)) if p == CUDA else p for p in providers]


class ProviderError(ValueError):
    """The providers asked for cannot be had here (``--providers cuda`` without CUDA, an unknown name)."""


def resolve_providers(requested: str, available: list[str]) -> list[str]:
    """Map ``auto|cpu|cuda`` to an onnxruntime provider list. ``cuda`` never falls back silently."""
    if requested == "cpu":
        return [CPU]
    if requested == "cuda":
        if CUDA not in available:
            raise ProviderError(
                f"--providers cuda: CUDAExecutionProvider is not available (onnxruntime offers {available}). "
                "Install the GPU build (pip install '.[gpu]' from the addnorm checkout, then remove the CPU 'onnxruntime' package, "
                "which shadows it) on a machine with an NVIDIA driver, or use --providers cpu/auto."
            )
        return [CUDA, CPU]
    if requested == "auto":
        return [CUDA, CPU] if CUDA in available else [CPU]
    raise ProviderError(f"unknown providers setting {requested!r}; use auto, cpu or cuda")


# onnxruntime's optimizer rewrites each Add + LayerNormalization into its SkipLayerNormalization, whose CPU kernel is
# slower than the two operators it replaces, with the same answers to float32 rounding (bench/studies/fusions.py;
# docs/benchmarks.md, "What the measurements decided"). The server, the export gate and the benchmarks make CPU
# sessions without it; CUDA sessions keep it.
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def disabled_optimizers(provider: str) -> list[str]:
    """The graph rewrites (onnxruntime's optimizer names) a session whose first provider is ``provider`` is made
    without."""
    return list(CPU_DISABLED_OPTIMIZERS) if provider == CPU else []


def session_args(providers: list[str]) -> dict:
    """``InferenceSession(model, opts, **session_args(providers))``: a session made as the server makes it, its
    providers with their options (with_options) and the rewrites left out (disabled_optimizers)."""
    return {"providers": with_options(providers), "disabled_optimizers": disabled_optimizers(providers[0])}


# CPU kinds, as /proc/cpuinfo names their features: what a verdict or a figure is reported against.
SIMD_FLAGS = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8"})
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})  # int8 dot products without int16 intermediate sums


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's SIMD_FLAGS (empty where /proc/cpuinfo cannot be read: not Linux, or not x86)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) & SIMD_FLAGS
    except OSError:
        pass
    return frozenset()
