"""One torch trace per graph: the served graph and the gate's debug graph from the same export; and the gate's
torch-side results, once per model and input (``remembered``).

``torch.onnx.export`` (dynamo) takes most of an export's time: 4-5 s for a one-layer block, about 25 s for a
6-layer BERT on a 2-core AVX2 machine, and an export traces twice (the served graph, then the debug graph with
every Add & Norm result as an extra output). Within ``reusing()``, ``export.onnx_export.export_onnx`` traces
with the step outputs once per (weights, module, dtype, opset, attention form) and writes the served graph as
that trace with the step outputs removed (``without_steps``): the same nodes, so the debug graph checks step by
step the very arithmetic that is served.

A scope, not a global cache: a module changed in place between two exports (its code patched, say) is a different
model with the same key. ``export_artifact`` opens one per export; a caller exporting one encoder in several
variants may open one around them all.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

# What a scope keeps of the gate's torch-side results (remembered): a 512-token case of a 6-layer, 384-wide model
# with every step's output is about 60 MB in float64.
RESULTS_BYTES = 1 << 30


@dataclass
class _Scope:
    graphs: dict[Hashable, bytes] = field(default_factory=dict)  # trace key -> graph with its step outputs
    results: dict[Hashable, dict[str, Any]] = field(default_factory=dict)  # remembered()
    result_bytes: int = 0


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("traces", default=None)


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """Within this block, each encoder is traced once per (dtype, opset, attention form); nested blocks share
    the outermost one's traces."""
    if _scope.get() is not None:
        yield
        return
    token = _scope.set(_Scope())
    try:
        yield
    finally:
        _scope.reset(token)


def cache() -> dict[Hashable, bytes] | None:
    """The open scope's traces (key -> serialized graph with its step outputs), None outside ``reusing()``."""
    scope = _scope.get()
    return None if scope is None else scope.graphs


def remembered(key: Hashable, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``compute()`` once per ``key`` within a scope (outside one, or once the scope keeps RESULTS_BYTES, each
    time). For what the gate computes from a module and an input alone, never from the graph under test: torch
    fp32's outputs, the float64 oracles', float32's spread. An export's gate and a re-check of its artifact, or one
    model exported in several variants, then compute them once. Arrays kept are made read-only."""
    scope = _scope.get()
    if scope is None:
        return compute()
    if key in scope.results:
        return scope.results[key]
    out = compute()
    size = sum(a.nbytes for a in out.values() if isinstance(a, np.ndarray))
    if scope.result_bytes + size <= RESULTS_BYTES:
        for a in out.values():
            if isinstance(a, np.ndarray):
                a.setflags(write=False)
        scope.results[key] = out
        scope.result_bytes += size
    return out


def digest(*arrays: np.ndarray) -> str:
    """A short hash of arrays' shapes, dtypes and bytes (an input's part of a ``remembered`` key)."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(f"{a.shape}:{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def key(module: nn.Module, *extra: Hashable) -> tuple:
    """What a trace depends on: every parameter and buffer's bytes, each submodule's type and plain attributes
    (a replaced activation function has another repr), and ``extra`` (opset, attention form, ...)."""
    digest = hashlib.blake2b(digest_size=20)
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    for name, sub in module.named_modules():
        attrs = sorted(
            (k, repr(v))
            for k, v in vars(sub).items()
            if not k.startswith("_") and not isinstance(v, nn.Module | nn.Parameter)
        )
        digest.update(f"{name}:{type(sub).__qualname__}:{attrs}".encode())
    return (digest.hexdigest(), *extra)


def without_steps(model: onnx.ModelProto, keep: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` with only the outputs named in ``keep`` (in that order), and the nodes, initializers
    and value infos nothing left reads removed."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    kept = [outputs[name] for name in keep]
    del graph.output[:]
    graph.output.extend(kept)
    needed = set(keep)
    live = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output if out):
            live.append(node)
            needed |= reads(node)
    live.reverse()
    _fold_identities(live, set(keep))
    del graph.node[:]
    graph.node.extend(live)
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    infos = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return model


def _fold_identities(nodes: list[onnx.NodeProto], outputs: set[str]) -> None:
    """Drop an Identity that only renames a value for an output (the trace's copy of a step that is also the final
    result): its producer writes the output itself, as a trace without step outputs does."""
    producer = {out: node for node in nodes for out in node.output if out}
    readers: dict[str, int] = {}
    for node in nodes:
        for name in reads(node):
            readers[name] = readers.get(name, 0) + 1
    for node in list(nodes):
        if node.op_type != "Identity" or node.output[0] not in outputs:
            continue
        source = node.input[0]
        if source in producer and source not in outputs and readers.get(source) == 1:
            outs = producer[source].output
            outs[list(outs).index(source)] = node.output[0]
            nodes.remove(node)


def reads(node: onnx.NodeProto) -> set[str]:
    """Every value ``node`` reads, those its subgraphs (an If's branches) read from the enclosing graph included."""
    names = {n for n in node.input if n}
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for inner in sub.node:
                names |= reads(inner)
    return names
