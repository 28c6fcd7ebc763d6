"""The inference engine: one onnxruntime session over a verified artifact, with explicit provider choice, and its
golden check at load (``verify_engine``): parity where it is served. The artifact's golden inputs run through this
server's own session, on the provider it serves with, judged by the export gate's rule (model.verdict) under the
variant's tolerance. The sha256 proves the file is the one exported; this proves the runtime here computes what was
checked there (another onnxruntime build, another CPU, the CUDA provider's kernels).

The heaps: glibc's (``trim()`` gives freed memory back; ``limit_arenas()``: under the soak, docs/reliability.md, with
glibc's default of 8 arenas per core resident memory crept up 17% over 150 s at 64 clients, with 2 within 2%;
elsewhere than glibc both do nothing), and Python's (``freeze_heap``: docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort

from addnorm.model import kernels, packing
from addnorm.model.artifact import ArtifactError, Manifest, load_verified, read_verified
from addnorm.model.attention import held_form, score_elements
from addnorm.model.contract import EMBEDDINGS, MASK, positional
from addnorm.model.golden import Verification, load_golden, verify
from addnorm.model.runtime import (
    CPU,
    CUDA,
    VNNI_FLAGS,
    ProviderError,
    cpu_flags,
    resolve_providers,
    session_args,
)
from addnorm.model.verdict import Tolerance
from addnorm.service.backend.cores import default_threads
from addnorm.service.backend.text import TextFront

log = logging.getLogger("addnorm.engine")

# Memory a run's activations need (``Engine.working_bytes``) stays in onnxruntime's arena after the run, for the next.
# Ordinary runs keep it warm: the first run after a shrink pays for regrowing it, 10-36% (docs/reliability.md). A
# run above SHRINK_EACH_ABOVE_BYTES gives it back as it ends (one [1, 4096, 768] decomposed run otherwise leaves
# ~2.5 GB held); after a run above RELEASE_ABOVE_BYTES the arena is given back once the model goes idle
# (``release``, which the batcher calls after RELEASE_IDLE_S without work): a burst of long sequences leaves
# nothing behind, and steady traffic, never idle that long, never pays for regrowing.
SHRINK_EACH_ABOVE_BYTES = 512 * 1024 * 1024
RELEASE_ABOVE_BYTES = 64 * 1024 * 1024
RELEASES = 2


class EngineError(RuntimeError):
    """The engine cannot start: bad artifact, or the requested provider is not usable."""


class Engine:
    """The onnxruntime backend (service.backend.interface.Backend): runs the artifact's graph, ``run(embeddings (B,
    S, E), mask (B, S)) -> {output name: (B, S, ...)}``, or (B, ...) for an output without a sequence axis
    (model.contract.positional)."""

    def __init__(
        self,
        model_dir: str | Path,
        providers: str = "auto",
        intra_op_threads: int = 0,
        kernels_setting: str = "auto",
        spinning: str = "off",  # the server's default is Settings' ("light"); "off" here for the benches and tests
        parallel_runs: bool = False,  # the server's default is Settings' (on); off here for the benches and tests
    ) -> None:
        try:  # the graph onnxruntime gets and the golden data checked are the bytes whose sha256 was checked
            verified = read_verified(model_dir)
        except ArtifactError as exc:
            raise EngineError(str(exc)) from exc
        self.manifest, self.golden = verified.manifest, verified.golden
        self.directory = Path(model_dir)
        try:
            wanted = resolve_providers(providers, ort.get_available_providers())
        except ProviderError as exc:
            raise EngineError(str(exc)) from exc
        if wanted[0] == CUDA and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA and cuDNN from their pip packages (nvidia-*), when installed that way
        threads = intra_op_threads or default_threads()
        uses_kernels = kernels.DOMAIN.encode() in verified.model

        def session(spin: bool, n: int = threads) -> ort.InferenceSession:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = n
            opts.inter_op_num_threads = 1
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.log_severity_level = 3
            # Idle pool threads must not spin: the event loop shares these cores, and a spinning onnxruntime worker
            # takes them from it (measured at 32 concurrent clients: +6% batched, +18% unbatched;
            # docs/benchmarks.md). Spinning within a run (ADDNORM_INTRA_OP_SPINNING): they spin between a run's
            # parallel sections and stop the moment it ends; sleeping between sections costs a one-sentence run
            # ~1 ms of wake-ups.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
            if spin:
                opts.add_session_config_entry("session.force_spinning_stop", "1")
            # int8's operators as one kernel each (model/kernels), where built; else their standard operators. A
            # graph with them (int8's) imports their domain.
            try:
                self.kernels = kernels.register(opts, wanted[0], kernels_setting) if uses_kernels else None
            except kernels.KernelError as exc:
                raise EngineError(str(exc)) from exc
            return ort.InferenceSession(verified.model, opts, **session_args(wanted))

        on_cpu = wanted[0] == CPU
        # Parallel runs (--parallel-runs): up to ``lanes`` runs at once, each on one thread of a session of one
        # thread that they share (onnxruntime's run is thread-safe; a one-thread session runs on its caller's
        # thread), instead of one run at a time across every thread: no run waits at a parallel section's barrier
        # for a thread the HTTP front took from it. A light run (``run(light=True)``: a lone client's, the batcher
        # decides) still has every thread. Only where the CPU runs the model, with two threads or more.
        self.lanes = threads if parallel_runs and on_cpu and threads > 1 else 1
        if self.lanes > 1:
            self.session = session(False, 1)
            # the runs at light load: every thread, spinning within the run (light, in-run) or asleep (off)
            self.light_session = session(spinning != "off")
        else:
            self.session = session(spinning == "in-run")
            # "light": a second session of the same graph whose threads spin within a run, for the runs at light
            # load (``run(light=True)``: few requests waiting), where the HTTP front has little to do on those
            # cores; loaded runs stay on the first, asleep between sections. Only where the CPU runs the model: on
            # CUDA the pool is idle.
            self.light_session = session(True) if spinning == "light" and on_cpu else None
        # Each session prepacks its own copy of the weights.
        self.providers = self.session.get_providers()
        # what its runs do (GET /v1/model): "light" only where there is a second session
        self.spinning = "off" if spinning == "light" and self.light_session is None else spinning
        # an ids artifact's tokenizer and embedding graph (service/backend/text.py), on the providers the block got
        self.text = TextFront(verified, self.providers) if verified.embedding is not None else None
        if self.providers[0] != wanted[0]:
            # onnxruntime drops a provider without an error when its libraries fail to load (CUDA's: CUDA, cuDNN or
            # no GPU); make that loud.
            if providers != "auto":
                raise EngineError(
                    f"{wanted[0]} is installed but failed to initialize (its libraries missing, or no device); "
                    f"session providers are {self.providers}. Refusing to fall back to CPU."
                )
            log.warning("%s is installed but failed to initialize; serving on %s", wanted[0], self.providers)
        self.threads = threads
        spec = self.manifest.input(EMBEDDINGS)
        self.input_dtype = np.dtype(np.float16 if spec.dtype == "float16" else np.float32)
        self.d_model = self.manifest.config.d_model
        self.batch_first = self.manifest.config.batch_first
        self.packed = self.manifest.config.packed  # per-token work on real tokens only (model/packing.py)
        self.output_names = [o.name for o in self.manifest.outputs]
        self.heads = self.manifest.config.nhead
        self.attention = self.manifest.attention
        # the seq x seq tensors its runs hold (model.attention): what the batcher budgets
        config = self.manifest.config
        self.held_attention = held_form(
            self.attention, config.relative_attention_buckets > 0, config.attention_window > 0
        )
        # Releases still due: a run above RELEASE_ABOVE_BYTES makes it RELEASES (what its requests still hold when
        # the first comes, the second gives back).
        self._grown = 0
        self._shrink = ort.RunOptions()
        arenas = ["cpu:0", *(["gpu:0"] if self.providers[0] == CUDA else [])]
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", ";".join(arenas))
        log.info(
            "loaded %s (%s, %s attention, opset %d) from %s on %s with %d intra-op threads%s%s%s",
            self.manifest.name,
            self.manifest.variant,
            self.attention,
            self.manifest.opset,
            model_dir,
            self.providers,
            self.threads,
            ", spinning within a run at light load (a second session)" if self.spinning == "light" else "",
            f", {self.lanes} runs at once under load, one thread each" if self.lanes > 1 else "",
            f", kernels {self.kernels.name} ({kernels.isa(self.kernels)})" if self.kernels else "",
        )

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def on_cpu(self) -> bool:
        return self.providers[0] == CPU

    def verify(self, mode: str) -> Verification:
        return verify_engine(self, mode)

    def working_bytes(self, rows: int, seq: int, padded: bool) -> int:
        """About the activation memory a run of ``rows`` x ``seq`` holds at its peak: per position the block's
        [E]- and [FFN]-wide intermediates (4 E + 2 FFN values: measured 1.1x of this for mha at d768), a sparse
        head's vocabulary-wide logits (2 values a term: measured 1.9x the logits, a [8, 256] run of all-MiniLM-L6-v2
        with a SPLADE head, 519 MB against 55 MB without), plus the attention form's seq x seq tensors
        (model.attention)."""
        c = self.manifest.config
        values = rows * seq * (4 * c.d_model + 2 * c.feed_forward_rows + 2 * c.vocab_size)
        return self.input_dtype.itemsize * (
            values + score_elements(self.held_attention, rows, self.heads, seq, padded)
        )

    def release(self) -> bool:
        """Give the arena and the C heap's free pages back after a run above RELEASE_ABOVE_BYTES (one run of a
        single position with onnxruntime's arena shrink, then ``malloc_trim``); nothing when no such run came
        since the last release. Called on the thread that runs the model. True when it released."""
        if not self._grown:
            return False
        self._grown -= 1
        for session in filter(None, (self.session, self.light_session)):
            session.run(self.output_names, self._feed(np.zeros((1, 1, self.d_model)), None), self._shrink)
        trim()
        return True

    def _feed(
        self, embeddings: np.ndarray, mask: np.ndarray | None, lengths: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """The graph's inputs for a batch-first (B, S, E) batch, in its layout: transposed, or packed."""
        b, s, _ = embeddings.shape
        if mask is None:
            mask = np.zeros((b, s), dtype=bool)
        x = embeddings.astype(self.input_dtype, copy=False)
        if self.packed:
            return packing.feed(x, mask, lengths)
        if not self.batch_first:
            x = x.transpose(1, 0, 2)  # the graph takes (S, B, E)
        return {EMBEDDINGS: np.ascontiguousarray(x), MASK: mask}

    def run(
        self,
        embeddings: np.ndarray,
        mask: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
        light: bool = False,
    ) -> dict[str, np.ndarray]:
        """embeddings (B, S, E) batch-first -> every output by name, batch-first float32 (padding included).
        ``lengths`` (B,): how much of each row to compute, for a packed graph (the rest is padding merging added or
        a request's own trailing padding, answered as zeros); every position when None. A padded graph computes
        every position anyway. ``light``: the run has every thread and the model to itself (spinning within it
        with ``spinning="light"``; the batcher decides: ``Backend.run``); otherwise, with ``lanes`` > 1, it is one
        of up to ``lanes`` runs at once, on one thread."""
        b, s, _ = embeddings.shape
        padded = mask is not None and bool(mask.any())
        working = self.working_bytes(b, s, padded)
        big = working > SHRINK_EACH_ABOVE_BYTES
        if working > RELEASE_ABOVE_BYTES:
            self._grown = RELEASES
        feed = self._feed(embeddings, mask, lengths)
        session = self.light_session if light and self.light_session is not None else self.session
        outs = session.run(self.output_names, feed, self._shrink if big else None)
        if big:
            trim()
        if (
            not self.batch_first
        ):  # positional outputs come (S, B, ...); a pooled one is (B, E) in every layout
            outs = [
                o.swapaxes(0, 1) if positional(n) else o for n, o in zip(self.output_names, outs, strict=True)
            ]
        return {
            name: np.ascontiguousarray(out, dtype=np.float32)
            for name, out in zip(self.output_names, outs, strict=True)
        }

    def describe(self) -> dict:
        """The manifest plus what is running it (for GET /v1/model)."""
        return {
            **self.manifest.to_dict(),
            "providers": self.providers,
            "intra_op_threads": self.threads,
            "intra_op_spinning": self.spinning,
            "parallel_runs": self.lanes,  # runs at once under load (one thread each when more than one)
        }


def check_artifact(model_dir: str | Path) -> Manifest:
    """Fail fast (before binding a port) on a missing or tampered artifact."""
    try:
        manifest, _ = load_verified(model_dir)
    except ArtifactError as exc:
        raise EngineError(str(exc)) from exc
    return manifest


_M_ARENA_MAX = -8  # glibc malloc.h


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc
        return None


_LIBC = _libc()


def limit_arenas(n: int = 2) -> None:
    """At most ``n`` malloc arenas (before the threads that would create more start)."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, n)


def trim() -> None:
    """Give the C heap's free pages back to the OS (glibc keeps them after large buffers are freed)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


# A request body at least this big frees buffers of its size when it is answered: the C heap is trimmed a second later
# (``trim_later``), so memory returns after big refused or accepted bodies as it does after big runs.
TRIM_BODY_BYTES = 4 * 1024 * 1024
_trim_due = False


def trim_later(delay_s: float = 1.0) -> None:
    """``trim`` once, ``delay_s`` from now, in a worker thread (malloc_trim walks the heap); one pending at a time.
    Called on the event loop."""
    global _trim_due
    if _LIBC is None or _trim_due:
        return
    _trim_due = True
    loop = asyncio.get_running_loop()

    def due() -> None:
        global _trim_due
        _trim_due = False
        loop.run_in_executor(None, trim)

    loop.call_later(delay_s, due)


def freeze_heap() -> None:
    """What a server process built before serving (modules, the app) lives as long as it: out of the cyclic collector's
    passes (each had stalled the event loop 45-70 ms). Models load later: a swapped one is freed as before."""
    gc.collect()
    gc.freeze()


def verify_engine(engine: Engine, mode: str) -> Verification:
    """``mode`` strict or warn: run the check (the caller decides what a failure means); off: skip it."""
    provider = engine.providers[0]
    if mode == "off":
        return Verification("skipped", provider, "verification at load is off (ADDNORM_VERIFY_ON_LOAD=off)")
    if not engine.manifest.golden_sha256:
        why = "the artifact has no golden data (exported before addnorm stored it); re-export it to verify at load"
        return Verification("unverifiable", provider, why)
    golden = load_golden(engine.golden)  # the bytes whose sha256 the engine checked, read once
    tol = Tolerance(**engine.manifest.parity["tolerance"])
    result = verify(engine.run, golden, tol, provider)
    if result.status == "failed" and engine.manifest.variant == "int8" and provider == CPU:
        result = dataclasses.replace(result, message=result.message + int8_cpu_hint(cpu_flags()))
    text = engine.text.verify() if engine.text is not None else None
    if text is not None:  # the embedding layer's own golden cases: one verdict for the artifact
        ok, worst, bound, cases = text
        what = f"embedding layer: {cases} golden cases, max abs err {worst:.3e} against float64 (bound {bound:.3e})"
        status = result.status if ok else "failed"
        result = dataclasses.replace(result, status=status, message=f"{result.message}; {what}")
    return result


def int8_cpu_hint(flags: frozenset[str]) -> str:
    """Why an int8 graph can fail on this CPU kind ("" where it has VNNI): appended to a failed check's message."""
    if flags & VNNI_FLAGS:
        return ""
    return (
        f"; this CPU has no VNNI ({', '.join(sorted(flags)) or 'no AVX2'}), where onnxruntime's u8 x s8 "
        "kernels add pairs of products in int16 and saturate on 8-bit weights: re-export it with this "
        "addnorm (addnorm-export --variant int8 writes 7-bit weights, exact on every CPU kind)"
    )


def accept(v: Verification, mode: str, name: str) -> bool:
    """Log the load-time check (``verify_engine``) in one line; False when it failed under strict (the model is
    not served)."""
    if v.status == "passed":
        log.info(
            "golden check passed for %s on %s: max abs err %.3e (%d cases, %.2f s)%s",
            name,
            v.provider,
            v.max_abs_err,
            v.cases,
            v.seconds,
            "".join(f"; {part}" for part in v.message.split("; ")[1:]),  # the embedding layer's, if any
        )
        return True
    if v.status == "failed" and mode == "strict":
        log.error(
            "golden check FAILED for %s, refusing to serve (ADDNORM_VERIFY_ON_LOAD=strict): %s",
            name,
            v.message,
        )
        return False
    log.warning("golden check %s for %s: %s", v.status.upper(), name, v.message)
    return True
