"""int8's CPU kernels: an onnxruntime custom-op library for the two operators of export/int8_ops.py.

    python -m addnorm.model.kernels [--include DIR] [--build-dir DIR]     builds it (make serve and make test do)

An int8 artifact's graph holds ``ai.addnorm.RowQuantize`` and ``ai.addnorm.QuantMatMul`` nodes, ONNX functions
whose bodies are standard operators: every runtime can run it. Where this library is registered (the server's
``--kernels``, on the CPU provider) onnxruntime runs int8.cc's kernels for them instead: each activation's rows
quantized in one pass, each product an int8 GEMM (AMX, AVX-512 VNNI or AVX2) that scales its rows and adds its
float side in its last step. On all-MiniLM-L6-v2 that makes int8 as fast as onnxruntime's ``quantize_dynamic``
with int8's accuracy (docs/parity.md, "int8's own kernels"). The library needs x86-64 with AVX2 and FMA.

Built with g++ against onnxruntime's C++ API header, which the onnxruntime wheel does not ship: ``--include DIR``,
else ``/usr/include/onnxruntime`` (Debian's libonnxruntime-dev), else that package fetched once from deb.debian.org
over HTTPS into ~/.cache/addnorm, pinned by its sha256 (a mismatch stops the build). Its file name carries the source's digest, so a library built from another version of
int8.cc is never loaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

DOMAIN = "ai.addnorm"  # the operators' ONNX domain: export/int8_ops.py's functions, int8.cc's kernels
SOURCE = Path(__file__).with_name("int8.cc")
HEADER = "onnxruntime_lite_custom_op.h"
# Debian 13 (trixie)'s libonnxruntime-dev, the first Debian package of onnxruntime's headers (1.21): the build
# compiles against exactly these bytes
HEADER_PACKAGE = (
    "https://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
)
HEADER_PACKAGE_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
SYSTEM_HEADERS = Path("/usr/include/onnxruntime")  # Debian's libonnxruntime-dev, installed with apt
CACHE = Path.home() / ".cache" / "addnorm"
INSTALLED = Path(
    "/usr/local/lib/addnorm"
)  # where the images put it (Dockerfile: python -m addnorm.model.kernels --build-dir)
NEEDS = ("avx2", "fma")
ENV = "ADDNORM_KERNELS"  # the server's setting (--kernels); addnorm-export's gate reads it too
# auto registers the library on every CPU that can run it: int8 on it was measured faster than on onnxruntime's
# standard operators with AMX, with AVX-512 VNNI and with AVX2 only (docs/parity.md, "int8's own kernels").


class KernelError(RuntimeError):
    """The library cannot be built or used here; the message says why."""


def library_path(directory: Path | None = None) -> Path:
    """Where the library of this int8.cc is (or will be) built: beside the source unless ``directory``."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return (directory or SOURCE.parent) / f"libaddnorm_kernels-{digest}.so"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """This CPU's flags (none where /proc/cpuinfo cannot be read)."""
    try:
        with open(cpuinfo) as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_lacks(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The flags the kernels need that this CPU lacks (all of them where /proc/cpuinfo cannot be read)."""
    flags = cpu_flags(cpuinfo)
    return [f for f in NEEDS if f not in flags]


def find(setting: str = "auto", cpuinfo: str = "/proc/cpuinfo") -> Path | None:
    """The library to register for ``setting``: ``off`` none; ``auto`` this source's library, built beside it or in
    INSTALLED, on a CPU that can run it (NEEDS), else none; a path, that file (an error if it is missing or this
    CPU cannot run it)."""
    if setting == "off":
        return None
    flags = cpu_flags(cpuinfo)
    lacks = [f for f in NEEDS if f not in flags]
    if setting == "auto":
        found = [p for p in (library_path(), library_path(INSTALLED)) if p.is_file()]
        return found[0] if found and not lacks else None
    path = Path(setting)
    if not path.is_file():
        raise KernelError(
            f"kernel library {setting} does not exist (build one: python -m addnorm.model.kernels)"
        )
    if lacks:
        raise KernelError(f"kernel library {setting} needs a CPU with {', '.join(lacks)}; this one has none")
    return path


def register(options, provider: str, setting: str = "auto") -> Path | None:
    """Register the library ``find(setting)`` picks on onnxruntime SessionOptions ``options`` for a session on
    ``provider``; returns it, or None (none picked, or not the CPU provider: the CUDA provider inlines the
    functions and runs them on the GPU)."""
    path = find(setting) if provider == "CPUExecutionProvider" else None
    if path is not None:
        options.register_custom_ops_library(str(path))
    return path


def build(include: Path | None = None, directory: Path | None = None) -> Path:
    """Compile int8.cc (once per source digest) and return the library's path."""
    out = library_path(directory)
    if out.is_file():
        return out
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise KernelError(f"no C++ compiler ({compiler}) to build the kernels with; install g++ or set CXX")
    headers = header_dir(include)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # written whole, then moved into place
        part = Path(tmp) / out.name
        command = [compiler, "-O3", "-march=x86-64-v3", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17"]
        done = subprocess.run(
            [*command, f"-I{headers}", str(SOURCE), "-o", str(part)], capture_output=True, text=True
        )
        if done.returncode:
            raise KernelError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr[-4000:]}")
        part.replace(out)
    return out


def isa(path: Path) -> str:
    """The instructions library ``path`` runs on this CPU: ``amx``, ``vnni`` or ``avx2`` (the widest this CPU has
    and Linux grants, at most ADDNORM_KERNELS_ISA; what the server logs at load)."""
    import ctypes  # the library links nothing of onnxruntime's: it loads on its own

    query = ctypes.CDLL(str(path)).AddnormKernelsIsa
    query.restype = ctypes.c_char_p
    return query().decode()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def header_dir(include: Path | None = None) -> Path:
    """Where onnxruntime's C++ API header is: ``include``, the system's, or Debian's package (fetched once)."""
    if include is not None:
        if not (include / HEADER).is_file():
            raise KernelError(f"{include} holds no {HEADER}")
        return include
    if (SYSTEM_HEADERS / HEADER).is_file():
        return SYSTEM_HEADERS
    cache = CACHE / "onnxruntime-dev"
    deb = cache / HEADER_PACKAGE.rsplit("/", 1)[1]
    if (cache / "include" / HEADER).is_file() and deb.is_file() and _sha256(deb) == HEADER_PACKAGE_SHA256:
        return cache / "include"
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching onnxruntime's headers: {HEADER_PACKAGE}", flush=True)
    try:
        with urllib.request.urlopen(HEADER_PACKAGE, timeout=120) as r:
            data = r.read()
    except OSError as exc:
        raise KernelError(f"cannot fetch onnxruntime's headers ({exc}); give --include DIR") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != HEADER_PACKAGE_SHA256:
        raise KernelError(
            f"{HEADER_PACKAGE} has sha256 {digest}, not the pinned {HEADER_PACKAGE_SHA256}: not built against it"
        )
    deb.write_bytes(data)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "root")], check=True)
    (cache / "include").unlink(missing_ok=True)
    (cache / "include").symlink_to(cache / "root/usr/include/onnxruntime")
    return cache / "include"
