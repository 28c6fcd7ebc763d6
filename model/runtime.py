"""onnxruntime provider settings that parity depends on, shared by export's parity checks and the service: the
execution providers addnorm runs on (``PROVIDERS``, the one table: a new provider is a row), what ``--providers``
means here (resolve_providers), their options, the rewrites left out.

No torch, no onnxruntime import: plain names and options.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Provider:
    """One execution provider: its ``--providers`` value, onnxruntime's name for it, the options every session on
    it is made with, and how to install it where onnxruntime does not offer it. Each one but the CPU's runs with
    the CPU's behind it (for the operators it lacks)."""

    setting: str
    name: str
    install: str
    options: dict[str, str] = field(default_factory=dict)


CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# In ``--providers auto``'s order of preference, the CPU's last.
PROVIDERS = (
    # onnxruntime's CUDA provider computes float32 MatMuls in TF32 unless told otherwise (10-bit mantissa): that put
    # the fp32 graph 40x the fp32 gate from torch's float32 result (docs/deployment.md, the GPU check). An fp32
    # artifact computes in fp32 on CUDA too; fp16 and int8 graphs are unaffected by this switch.
    Provider(
        "cuda",
        CUDA,
        "install the GPU build (pip install '.[gpu]' from the addnorm checkout, then remove the CPU 'onnxruntime' "
        "package, which shadows it) on a machine with an NVIDIA driver",
        {"use_tf32": "0"},
    ),
    Provider("cpu", CPU, "pip install onnxruntime"),
)
BY_SETTING = {p.setting: p for p in PROVIDERS}
BY_NAME = {p.name: p for p in PROVIDERS}
SETTINGS = ("auto", *BY_SETTING)  # what --providers takes


def with_options(providers: list[str]) -> list[str | tuple[str, dict[str, str]]]:
    """``providers`` as onnxruntime takes them, each with its options (``Provider.options``)."""
    return [(p, dict(BY_NAME[p].options)) if p in BY_NAME and BY_NAME[p].options else p for p in providers]


class ProviderError(ValueError):
    """The providers asked for cannot be had here (``--providers cuda`` without CUDA, an unknown name)."""


def resolve_providers(
    requested: str, available: list[str], table: tuple[Provider, ...] = PROVIDERS
) -> list[str]:
    """Map a ``--providers`` value (``SETTINGS``) to an onnxruntime provider list: ``auto``, the first of ``table``
    onnxruntime offers here, the CPU's behind it; a named one, it or an error (never a silent fall back to CPU)."""
    if requested == "auto":
        first = next(p.name for p in table if p.name in available or p.name == CPU)
        return [first] if first == CPU else [first, CPU]
    provider = next((p for p in table if p.setting == requested), None)
    if provider is None:
        settings = ", ".join(("auto", *(p.setting for p in table)))
        raise ProviderError(f"unknown providers setting {requested!r}; use {settings}")
    if provider.name == CPU:
        return [CPU]
    if provider.name not in available:
        raise ProviderError(
            f"--providers {requested}: {provider.name} is not available (onnxruntime offers {available}). "
            f"To have it, {provider.install}; or use --providers cpu/auto."
        )
    return [provider.name, CPU]


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
