"""/v1 codec: request bodies -> validated numpy batches, and results -> response bodies.

JSON: ``{"embeddings": [...], "mask": optional, "model": optional}`` where embeddings is [seq, d_model],
[batch, seq, d_model], or a list of sequences of different lengths (padded and masked here; each comes back at its
own length). The model is the JSON's ``"model"`` or the ``?model=`` query (any body), else the server's default;
``d_model`` may be a function of that name (the chosen model's width).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import orjson

from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, OUTPUT_NAMES, positional
from addnorm.model.text import INPUT_IDS
from addnorm.service.batching.merging import Outputs
from addnorm.service.core.inference import work
from addnorm.service.core.text import TextLimits, TextRequest, decode_texts, text_inputs
from addnorm.service.errors import BadInput, NotAcceptable, UnsupportedMediaType, quote
from addnorm.service.protocols.common import Tensors, check_batch, holds_literal, parse_json
from addnorm.service.protocols.v1 import binary
from addnorm.service.protocols.v1.binary import NPY, OCTET

if TYPE_CHECKING:
    from addnorm.service.core.inference import Resolve
    from addnorm.service.models.registry import ServingModel

MODEL = "model"
OUTPUT = "output"  # the query parameter naming the output a binary answer carries
_FIELDS = {EMBEDDINGS, MASK, MODEL, INPUT_IDS}
# (model name, token id lists) -> the request's text step (service/core/text.py), for a model that takes ids
Ids = Callable[[str | None, list], "TextRequest"]
DModel = int | Callable[[str | None], int]  # the model's width, or the width of the model a request names
_LITERALS = (b"true", b"false", b"null")
JSON = "application/json"
MEDIA = (
    JSON,
    OCTET,
    NPY,
)  # what /v1/encode reads (Content-Type) and answers (Accept); its OpenAPI is built from it


@dataclass
class EncodeRequest(Tensors):
    """A decoded /v1 request: a (B, S, E) batch, its mask, and how to shape the answer."""

    embeddings: np.ndarray  # (B, S, E) float32
    mask: np.ndarray | None  # (B, S) bool, true = padding
    lengths: list[int] | None = None  # ragged input: each sequence's own length
    squeeze: bool = False  # input was one [seq, d_model] sequence
    model: str | None = None  # the model it names (None: the default)
    timeout_s: float | None = None  # /v1 has no timeout parameter: ADDNORM_REQUEST_TIMEOUT_S alone
    text: TextRequest | None = None  # token ids in: embedded by the model's own layer, in parts

    def split(self, out: np.ndarray, name: str = ENCODED) -> np.ndarray | list[np.ndarray]:
        """Undo the request's packing: drop the batch dim, or cut each ragged sequence to its length (a pooled
        output has one row per sequence and nothing to cut)."""
        if self.lengths is not None and positional(name):
            return [out[i, :n] for i, n in enumerate(self.lengths)]
        return out[0] if self.squeeze else out


def decode_json(
    body: bytes, d_model: DModel, max_elements: int, model: str | None = None, ids: Ids | None = None
) -> EncodeRequest:
    doc = parse_json(body, max_elements)
    if not isinstance(doc, dict):
        raise BadInput(f"request body must be a JSON object with {EMBEDDINGS!r}, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise BadInput(
            f"unknown field(s) {unknown}; expected {EMBEDDINGS!r} and optional {MASK!r} and {MODEL!r}"
        )
    named = doc.get(MODEL)
    if named is not None:
        if not isinstance(named, str):
            raise BadInput(f"{MODEL!r} must be a model's name (a string), got {quote(named)}")
        if model is not None and model != named:
            raise BadInput(f"the body names model {quote(named)} but the query names {quote(model)}")
        model = named
    if INPUT_IDS in doc:
        return _decode_ids(doc, model, ids)
    width = _width(d_model, model)
    if EMBEDDINGS not in doc:
        raise BadInput(f"missing field {EMBEDDINGS!r} ([seq, d_model] or [batch, seq, d_model] numbers)")
    data, mask_data = doc[EMBEDDINGS], doc.get(MASK)
    if not isinstance(data, list) or not data:
        raise BadInput(
            "embeddings must be a non-empty array of [seq, d_model] or [batch, seq, d_model] numbers"
        )
    # JSON true/false/null in embeddings would pass through numpy as 1/0/object; only the mask may hold them.
    mask = _decode_mask(mask_data)
    allowed = (mask.size if mask is not None else 0) + (1 if MASK in doc and mask_data is None else 0)
    maybe = b"u" in body or b"f" in body  # true and null hold a "u", false an "f"; no number or key here does
    if maybe and sum(body.count(lit) for lit in _LITERALS) > allowed and holds_literal(data):
        raise BadInput("embeddings must hold only numbers (found true, false or null)")
    depth = _depth(data)
    if depth == 2:
        x = _to_array(data, EMBEDDINGS)[None]  # (1, S, E)
        req = EncodeRequest(x, mask[None] if mask is not None and mask.ndim == 1 else mask, squeeze=True)
    elif depth == 3:
        req = _decode_batch(data, mask, width)
    else:
        raise BadInput(
            f"embeddings must be [seq, d_model], [batch, seq, d_model] or a list of [seq_i, d_model] "
            f"sequences; got {depth} level(s) of nesting"
        )
    check_batch(req.embeddings, req.mask, width, max_elements)
    req.model = model
    return req


def _decode_ids(doc: dict, model: str | None, ids: Ids | None) -> EncodeRequest:
    """``{"input_ids": [[...], ...]}``: token id lists of a model that takes ids, answered as ragged sequences."""
    if EMBEDDINGS in doc or MASK in doc:
        raise BadInput(f"give {INPUT_IDS!r} or {EMBEDDINGS!r}, not both (the model embeds the ids itself)")
    rows = doc[INPUT_IDS]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise BadInput(f"{INPUT_IDS!r} must be a non-empty list of token id lists")
    if ids is None:
        raise BadInput(f"this server does not take {INPUT_IDS!r} on /v1/encode")
    text = ids(model, rows)
    return EncodeRequest(text.embeddings, text.mask, lengths=[len(r) for r in rows], model=model, text=text)


def _width(d_model: DModel, model: str | None) -> int:
    return d_model(model) if callable(d_model) else d_model


def _decode_batch(data: list, mask: np.ndarray | None, d_model: int) -> EncodeRequest:
    try:
        arr = np.array(data)
    except ValueError:
        arr = None  # sequences of different lengths, or ragged rows: tell them apart below
    if arr is not None and arr.dtype != object:
        return EncodeRequest(_checked_numeric(arr, EMBEDDINGS), mask)
    seqs = []
    for i, seq in enumerate(data):
        if not isinstance(seq, list) or not seq:
            raise BadInput(f"embeddings[{i}] must be a non-empty [seq, d_model] array")
        s = _to_array(seq, f"embeddings[{i}]")
        if s.ndim != 2:
            raise BadInput(f"embeddings[{i}] must be [seq, d_model], got shape {list(s.shape)}")
        if s.shape[1] != d_model:
            raise BadInput(f"embeddings[{i}] has {s.shape[1]} features but the model's d_model is {d_model}")
        seqs.append(s)
    if mask is not None:
        raise BadInput(
            "mask cannot be given with sequences of different lengths: they are masked automatically"
        )
    lengths = [len(s) for s in seqs]
    x = np.zeros((len(seqs), max(lengths), d_model), dtype=np.float32)
    pad = np.ones((len(seqs), max(lengths)), dtype=bool)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
        pad[i, : len(s)] = False
    return EncodeRequest(x, pad, lengths=lengths)


def _to_array(data: list, what: str) -> np.ndarray:
    try:
        arr = np.array(data)
    except ValueError:
        raise BadInput(f"{what} is ragged: its rows have different lengths") from None
    return _checked_numeric(arr, what)


def _checked_numeric(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.dtype == object:
        raise BadInput(f"{what} is ragged or holds non-numbers")
    if arr.dtype.kind not in "iuf":
        raise BadInput(f"{what} must hold only numbers, found {_kind_name(arr.dtype)}")
    with np.errstate(over="ignore"):
        return arr.astype(np.float32)


def _decode_mask(mask_data: object) -> np.ndarray | None:
    if mask_data is None:
        return None
    if not isinstance(mask_data, list) or not mask_data:
        raise BadInput("mask must be a non-empty array of booleans ([seq] or [batch, seq]; true = padding)")
    try:
        mask = np.array(mask_data)
    except ValueError:
        raise BadInput("mask is ragged: its rows have different lengths") from None
    if mask.dtype != bool:
        raise BadInput("mask must hold only true/false (true = padding)")
    if mask.ndim not in (1, 2):
        raise BadInput(f"mask must be [seq] or [batch, seq], got shape {list(mask.shape)}")
    return mask


# one request's rows of an output: a tensor, or one per ragged sequence
Result = np.ndarray | list[np.ndarray]


def encode_json(results: dict[str, Result], model: str) -> bytes:
    """The /v1 JSON answer: its outputs by name, and the shape of the first (encoded, unless ?output= named
    another; one per ragged sequence).

    orjson writes numpy arrays directly: no Python lists are built.
    """
    first = next(iter(results.values()))
    shape = [list(r.shape) for r in first] if isinstance(first, list) else list(first.shape)
    return orjson.dumps({**results, "shape": shape, "model": model}, option=orjson.OPT_SERIALIZE_NUMPY)


def _depth(data: object) -> int:
    depth = 0
    while isinstance(data, list):
        depth += 1
        data = data[0] if data else None
    return depth


def _kind_name(dtype: np.dtype) -> str:
    return {"b": "booleans", "U": "strings", "S": "bytes"}.get(dtype.kind, f"values of type {dtype}")


def decode(
    content_type: str,
    body: bytes,
    headers: dict[str, str] | None,
    d_model: DModel,
    max_elements: int,
    model: str | None = None,
    ids: Ids | None = None,
) -> EncodeRequest:
    """Decode a /v1 body by its media type (JSON when none is given); ``model``: the name the query gave."""
    media = media_type(content_type)
    headers = headers or {}
    # curl -d sends application/x-www-form-urlencoded unless told otherwise: read it as the JSON it is.
    if media in (JSON, "text/json", "text/plain", "application/x-www-form-urlencoded", ""):
        return decode_json(body, d_model, max_elements, model, ids)
    if media == OCTET:
        x = binary.decode_raw(body, headers.get(binary.SHAPE_HEADER))
    elif media == NPY:
        x = binary.decode_npy(body)
    else:
        raise UnsupportedMediaType(f"unsupported Content-Type {quote(media)}; use {JSON}, {OCTET} or {NPY}")
    squeeze = x.ndim == 2
    if squeeze:
        x = x[None]
    mask = binary.lengths_mask(headers.get(binary.LENGTHS_HEADER), x.shape) if x.ndim == 3 else None
    check_batch(x, mask, _width(d_model, model), max_elements)
    return EncodeRequest(x, mask, squeeze=squeeze, model=model)


def media_type(content_type: str) -> str:
    """A Content-Type's media type, lower case, without parameters (JSON when none is given)."""
    return (content_type or JSON).split(";")[0].strip().lower()


def negotiate(accept: str | None) -> str:
    """The response media type for an Accept header (JSON unless a binary type is asked for)."""
    if not accept:
        return JSON
    for part in accept.split(","):
        media = part.split(";")[0].strip().lower()
        if media in MEDIA:
            return media
        if media in ("*/*", "application/*"):
            return JSON
    raise NotAcceptable(f"cannot answer with Accept {quote(accept)}; acceptable: {', '.join(MEDIA)}")


def output_param(value: str | None) -> str | None:
    """``?output=NAME``: the one output the answer carries (None: JSON carries every output, binary encoded)."""
    if value is not None and value not in OUTPUT_NAMES:
        raise BadInput(f"?{OUTPUT}= must be one of {list(OUTPUT_NAMES)}, got {quote(value)}")
    return value


def encode(
    req: EncodeRequest, outputs: Outputs, media: str, model: str, output: str | None = None
) -> tuple[bytes, dict[str, str]]:
    """The answer in the negotiated media type, and its headers: ``output`` alone when named (binary answers
    carry one output: encoded unless named), else every output in JSON."""
    if output is not None and output not in outputs:
        raise BadInput(f"model {quote(model)} has no output {output!r}; it has {sorted(outputs)}")
    if media == JSON:
        chosen = outputs if output is None else {output: outputs[output]}
        return encode_json({name: req.split(out, name) for name, out in chosen.items()}, model), {}
    output = output or ENCODED
    chosen = outputs[output]
    result = req.split(chosen, output)
    tensor = result if isinstance(result, np.ndarray) else chosen  # ragged: padded tensor + lengths
    headers = {"X-Shape": ",".join(map(str, tensor.shape))}
    if req.lengths is not None and positional(output):
        headers["X-Lengths"] = ",".join(map(str, req.lengths))
    return binary.encode(tensor, media), headers


@dataclass(frozen=True)
class EncodeCodec:
    """/v1/encode's codec for one request (service.core.inference.Codec): its body's Content-Type and headers, the
    model ``?model=`` names (or None), the media type Accept chose and the output ``?output=`` names."""

    content_type: str
    headers: Mapping[str, str]
    named: str | None
    media: str
    output: str | None
    max_elements: int
    limits: TextLimits | None = None

    def decode_work(self, body: bytes) -> int:
        return work(raw=len(body)) if media_type(self.content_type) in (OCTET, NPY) else work(len(body))

    def encode_work(self, req: EncodeRequest, nbytes: int) -> int:
        return work(nbytes) if self.media == JSON else work(raw=nbytes)

    def decode(self, body: bytes, resolve: Resolve) -> EncodeRequest:
        d_model = lambda name: resolve(name).engine.d_model  # noqa: E731
        ids = None
        if self.limits is not None:
            limits = self.limits

            def ids(name: str | None, rows: list) -> TextRequest:
                inputs = text_inputs(rows, INPUT_IDS, limits.max_inputs)
                return decode_texts(resolve(name), inputs, False, limits, INPUT_IDS)

        return decode(self.content_type, body, self.headers, d_model, self.max_elements, self.named, ids)

    def encode(
        self, req: EncodeRequest, model: ServingModel, outputs: Outputs
    ) -> tuple[bytes, dict[str, str]]:
        return encode(req, outputs, self.media, model.name, self.output)
