"""onnxruntime provider settings that parity depends on, shared by export's parity checks and the service.

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
