"""What each parity comparison is measured against (export.parity): float32's spread for an fp32 graph, a lossy
scheme's spread for the outputs of a lossy one, and for a lossy graph's Add & Norm steps, its scheme and torch fp32
each given the graph's own previous step ("teacher forcing").

A deep stack amplifies rounding: fp16's scheme on one input lands anywhere between 3e-3 and 2e-2 from fp32 on the
real checkpoint's later layers, and int8's graph (float32) 3.5-5% from its own scheme (float64) once level flips
have cascaded, where a 5% LayerNorm gamma moves it 4-12%: end to end, an implementation verdict either refuses a
faithful graph on a lucky sample or cannot see a wrong layer. Step by step, each layer's own arithmetic is
compared on the same input: a step's distance to its scheme is that step's rounding alone (docs/parity.md).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import numpy as np
import torch

from addnorm.model import reference
from addnorm.model.contract import ENCODED, STEP_OUTPUT
from addnorm.model.encoder import Encoder
from addnorm.model.verdict import worst_row

# A lossy scheme's arithmetic as a module: (encoder, plan=) -> (module, the dtype it computes in, the context it
# computes in), export.variants' Variant.scheme_model
SchemeModel = Callable[..., tuple[Encoder, torch.dtype, contextlib.AbstractContextManager]]


def teacher_forced(
    model: SchemeModel, encoder: Encoder, x: np.ndarray, mask: np.ndarray, graph_steps: list[np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the scheme's steps, torch fp32's steps), by step name, float64: step ``j`` of each computed on the graph's
    step ``j - 1`` (step 0 on the input ``x``, in the graph's layout; steps are batch first). export.parity takes
    the scheme's distance to fp32 at a step as at least its precision's rounding of it."""
    module, dtype, context = model(encoder)
    with context:
        scheme = _steps(module, dtype, x, mask, graph_steps)
    return scheme, _steps(encoder.eval().float(), torch.float32, x, mask, graph_steps)


def _steps(
    encoder: Encoder, dtype: torch.dtype, x: np.ndarray, mask: np.ndarray, graph_steps: list[np.ndarray]
) -> dict[str, np.ndarray]:
    def given(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    first = x if encoder.config.batch_first else x.transpose(1, 0, 2)
    key_mask = torch.from_numpy(mask)
    out = []
    with torch.no_grad():
        positional = encoder.positional(first.shape[1], dtype)  # each layer's score bias and rotary positions
        for i, (layer, (bias, rotary)) in enumerate(zip(encoder.layers, positional, strict=True)):
            step_in = given(first if i == 0 else graph_steps[2 * i - 1])
            out.append(layer.attention_step(step_in, key_mask, bias=bias, rotary=rotary))
            out.append(layer.feed_forward_step(given(graph_steps[2 * i])))
        if encoder.norm is not None:
            out.append(encoder.norm(given(graph_steps[2 * len(encoder.layers) - 1])))
    return {STEP_OUTPUT.format(i): t.double().numpy() for i, t in enumerate(out)}


def one_ulp_away(x: np.ndarray, rng: np.random.Generator, precision: type) -> np.ndarray:
    """``x`` in ``precision`` with every element moved one ulp of it up or down, at random."""
    away = np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(precision)
    return np.nextafter(x.astype(precision), away)


def scheme_spread(
    scheme: Callable[[Encoder, np.ndarray, np.ndarray, bool], dict[str, np.ndarray]],
    encoder: Encoder,
    x: np.ndarray,
    mask: np.ndarray,
    torch_outs: dict[str, np.ndarray],
    real: dict[str, np.ndarray | None],
    with_steps: bool,
    rng: np.random.Generator,
    precision: type,
) -> dict[str, float]:
    """What a lossy scheme's arithmetic does on this input, per output: the worst row's relative RMS vs torch fp32
    (rows ``real`` selects) of the scheme on the input moved one ulp of ``precision`` up or down (half precision's
    for fp16: inputs that are one number to it). One evaluation's distance is luck, as float32's is."""
    moved = one_ulp_away(x, rng, precision).astype(x.dtype)
    outs = scheme(encoder, moved, mask, with_steps)
    return {name: worst_row(out, torch_outs[name], real[name]) for name, out in outs.items() if name in real}


def float32_spread(
    encoder: Encoder,
    weights32: dict[str, np.ndarray],
    x: np.ndarray,
    mask: np.ndarray,
    oracle_outs: dict[str, np.ndarray],
    with_steps: bool,
    rng: np.random.Generator,
) -> dict[str, float]:
    """What float32 can do on this input, per output: the largest error against float64 of two more float32
    evaluations besides torch's: the numpy float32 reference (another summation order; every output), and
    torch on the input with every element moved one ulp up or down (how far float32's own rounding of the input
    moves the answer: grows with depth and length as the block's conditioning does)."""
    moved = torch_outputs(encoder, one_ulp_away(x, rng, np.float32), mask, with_steps)
    spread = {name: _max_err(out, oracle_outs[name]) for name, out in moved.items() if name in oracle_outs}
    steps: list[np.ndarray] = []
    numpy32 = reference.outputs(encoder.config, weights32, x, mask, steps=steps)
    numpy32.update((STEP_OUTPUT.format(i), step) for i, step in enumerate(steps))
    for name, out in numpy32.items():
        if name in spread:
            spread[name] = max(spread[name], _max_err(out, oracle_outs[name]))
    return spread


def float32_yardstick(encoder: Encoder, x: np.ndarray, mask: np.ndarray, seed: int = 0) -> float:
    """float32's spread on the encoded output of one input, measured in full (the gate measures it only where
    torch's own error does not pass a case): the largest error against float64 of torch fp32, the numpy float32
    reference and torch on the input moved one ulp."""
    encoder = encoder.eval().float()
    oracle = torch_outputs(copy.deepcopy(encoder).double(), x.astype(np.float64), mask, False)
    weights32 = {k: v.detach().numpy() for k, v in encoder.state_dict().items()}
    own = _max_err(torch_outputs(encoder, x, mask, False)[ENCODED], oracle[ENCODED])
    spread = float32_spread(encoder, weights32, x, mask, oracle, False, np.random.default_rng(seed))
    return max(own, spread[ENCODED])


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    d = np.abs(np.asarray(a, np.float64) - b)
    return float(d.max()) if d.size and np.isfinite(d).all() else 0.0


def torch_outputs(
    encoder: Encoder, x: np.ndarray, mask: np.ndarray, with_steps: bool
) -> dict[str, np.ndarray]:
    """Every output of the contract by name, and with ``with_steps`` every Add & Norm result (``add_norm_{i}``)."""
    steps: list[torch.Tensor] | None = [] if with_steps else None
    with torch.no_grad():
        named = encoder.outputs(torch.from_numpy(x), torch.from_numpy(mask), steps)
    return {
        **{name: t.numpy() for name, t in named.items()},
        **{STEP_OUTPUT.format(i): t.numpy() for i, t in enumerate(steps or [])},
    }
