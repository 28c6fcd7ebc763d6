"""The graph's contract: input and output names, dtypes and symbolic dims. No torch: the service reads it.

Export writes graphs with exactly these inputs and outputs, the manifest records them, and the service and its
protocols speak them. The names are public API (V2 clients send ``embeddings`` and read ``encoded``); this is
the one place they are spelled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from addnorm.model.config import EncoderConfig

EMBEDDINGS = "embeddings"  # float32 (batch, seq, d_model); (seq, batch, d_model) in a --no-batch-first graph
MASK = "mask"  # bool (batch, seq), true = padding
TEXT = "text"  # V2 BYTES (batch,): texts, for a model exported with its tokenizer (model/text.py)
QUERY = "query"  # V2 BYTES (batch,): beside ``text``, each text's query, the two scored as a pair (a head's model)
ENCODED = "encoded"  # float32, the embeddings' shape
POOLED = "pooled"  # float32 (batch, d_model): the sentence embedding, in graphs exported with a pooling
SCORES = "scores"  # float32 (batch, num_labels): a classification head's logits, in graphs exported with one
SPARSE = (
    "sparse_weights"  # float32 (batch, vocab_size): SPLADE's weight of each vocabulary entry (a sparse head)
)
INPUT_NAMES = (EMBEDDINGS, MASK)
# A packed graph (config.packed) takes sequences of different lengths laid end to end, no padding, in the
# layout of Triton's ragged batching: ``embeddings`` float32 (tokens x d_model,), the tokens concatenated;
# ``mask`` bool (tokens,); and two inputs that say where each sequence lies:
OFFSETS = "offsets"  # int32 (batch + 1,): each sequence's first element of embeddings, then the total, from 0
LONGEST = "longest"  # int32 (the longest sequence's elements,): only its shape is read
PACKED_INPUT_NAMES = (EMBEDDINGS, MASK, OFFSETS, LONGEST)
OUTPUT_NAMES = (
    ENCODED,
    POOLED,
    SCORES,
    SPARSE,
)  # every output a graph may have, in graph order; output_names(config): its own
# What each output is, as the APIs document it (/v1's answer schema, built from these)
OUTPUT_DOCS = {
    ENCODED: "the encoder's output, the embeddings' shape",
    POOLED: "[batch, d_model]: the sentence embeddings of a model exported with a pooling",
    SCORES: "[batch, labels]: the logits of a model exported with a classification head (a cross-encoder's "
    "one label, a classifier's several)",
    SPARSE: "[batch, vocabulary]: the SPLADE weights of a model exported with a sparse head",
}
STEP_OUTPUT = "add_norm_{}"  # debug graphs only: one extra output per Add & Norm step, never served
BATCH, SEQ = "batch", "seq"  # the symbolic dims
# a packed graph's symbolic dims
ELEMENTS, TOKENS, STARTS, LONGEST_ELEMENTS = "elements", "tokens", "starts", "longest_elements"


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output. ``shape`` holds ints for fixed dims and names for symbolic ones."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        return cls(name=data["name"], dtype=data["dtype"], shape=tuple(data["shape"]))


def output_names(config: EncoderConfig) -> tuple[str, ...]:
    """The outputs of the graph exported for ``config``, in graph order."""
    return (
        ENCODED,
        *((POOLED,) if config.pooling != "none" else ()),
        *((SCORES,) if config.head == "classify" else ()),
        *((SPARSE,) if config.head == "sparse" else ()),
    )


def positional(name: str) -> bool:
    """Whether an output has a sequence axis (one row per position, cut and masked per token) or one row per
    sequence (the pooled embedding, a head's scores or sparse weights)."""
    return name not in (POOLED, SCORES, SPARSE)


def input_names(config: EncoderConfig) -> tuple[str, ...]:
    """The inputs of the graph exported for ``config``, in graph order."""
    return PACKED_INPUT_NAMES if config.packed else INPUT_NAMES


def io_specs(config: EncoderConfig) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of the graph exported for ``config``, in graph order. A packed graph's outputs are
    padded (batch, seq, ...), as a padded graph's, with zeros beyond each sequence's length."""
    if config.packed:
        _, outputs = io_specs(EncoderConfig.from_dict({**config.to_dict(), "packed": False}))
        inputs = (
            TensorSpec(EMBEDDINGS, "float32", (ELEMENTS,)),
            TensorSpec(MASK, "bool", (TOKENS,)),
            TensorSpec(OFFSETS, "int32", (STARTS,)),
            TensorSpec(LONGEST, "int32", (LONGEST_ELEMENTS,)),
        )
        return inputs, outputs
    if config.batch_first:
        emb_shape: tuple[int | str, ...] = (BATCH, SEQ, config.d_model)
    else:
        emb_shape = (SEQ, BATCH, config.d_model)
    inputs = (TensorSpec(EMBEDDINGS, "float32", emb_shape), TensorSpec(MASK, "bool", (BATCH, SEQ)))
    outputs = [TensorSpec(ENCODED, "float32", emb_shape)]
    if config.pooling != "none":
        outputs.append(TensorSpec(POOLED, "float32", (BATCH, config.d_model)))
    if config.head == "classify":
        outputs.append(TensorSpec(SCORES, "float32", (BATCH, config.num_labels)))
    if config.head == "sparse":
        outputs.append(TensorSpec(SPARSE, "float32", (BATCH, config.vocab_size)))
    return inputs, tuple(outputs)


def api_specs(config: EncoderConfig) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """What the APIs speak: always batch-first and padded, whatever the graph's layout (the engine transposes or
    packs: model/packing.py)."""
    if config.batch_first and not config.packed:
        return io_specs(config)
    return io_specs(EncoderConfig.from_dict({**config.to_dict(), "batch_first": True, "packed": False}))


# The V2 ``text`` input of a model that takes text: one string a row (Triton's [batch, 1] convention); ``query``
# beside it for a model with a classification head (a cross-encoder: each text scored with its query)
TEXT_SPEC = TensorSpec(TEXT, "bytes", (BATCH, 1))
QUERY_SPEC = TensorSpec(QUERY, "bytes", (BATCH, 1))


def text_specs(config: EncoderConfig, takes_text: bool) -> tuple[TensorSpec, ...]:
    """The BYTES inputs a model takes besides its tensors: none, ``text``, or with a classification head ``text``
    and ``query``."""
    if not takes_text:
        return ()
    return (TEXT_SPEC, QUERY_SPEC) if config.head == "classify" else (TEXT_SPEC,)


@functools.cache
def client_inputs(config: EncoderConfig) -> tuple[str, ...]:
    """The inputs a client may send: the API's, whatever the graph's layout (a packed graph's offsets are the
    server's to compute). Every V2 request asks: worked out once per config."""
    return tuple(s.name for s in api_specs(config)[0])
