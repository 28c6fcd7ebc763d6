"""The Open Inference Protocol's gRPC messages to and from what the service works with.

Inputs arrive as ``raw_input_contents`` (one little-endian buffer per input, what tritonclient.grpc sends) or as
typed ``contents``; both end in the HTTP codec's checks (``codec.tensor_type``, ``codec.from_bytes``,
``codec.to_batch``), so a tensor is refused the same way whichever transport carried it. Outputs go back as
``raw_output_contents``, as Triton answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from addnorm.model.artifact import Manifest
from addnorm.service.batching.merging import Outputs
from addnorm.service.core.inference import work
from addnorm.service.core.text import TextLimits
from addnorm.service.errors import BadInput
from addnorm.service.protocols.common import timeout_param
from addnorm.service.protocols.v2 import codec
from addnorm.service.protocols.v2 import inference_pb2 as pb

if TYPE_CHECKING:
    from addnorm.service.core.inference import Resolve
    from addnorm.service.models.registry import ServingModel

# datatype -> the typed contents field that carries it (FP16 has none: it travels raw)
_TYPED = {
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BOOL": "bool_contents",
    "BYTES": "bytes_contents",
}


def decode_infer(
    req: pb.ModelInferRequest, manifest: Manifest, max_elements: int, texts: codec.Texts = None
) -> codec.InferRequest:
    if not req.inputs:
        raise BadInput("inference request needs at least one input")
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise BadInput(
            f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs; send one per input"
        )
    known = codec.inputs_of(manifest)
    tensors: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(req.inputs):
        name = codec.checked_name(tensor.name, "input", known, tensors)
        shape = list(tensor.shape)
        dtype, count = codec.tensor_type(name, shape, tensor.datatype, max_elements)
        if raw:
            if tensor.HasField("contents"):
                raise BadInput(f"input {name!r} has both contents and raw_input_contents")
            tensors[name] = codec.from_bytes(name, raw[i], shape, dtype, count)
        else:
            tensors[name] = _typed(name, tensor, shape, dtype, count)
    names = [s.name for s in manifest.outputs]
    chosen: list[str] = []
    for out in req.outputs:
        chosen.append(codec.checked_name(out.name, "output", names, chosen))
    timeout_s = _timeout(req)
    # the request's parameters as HTTP's JSON has them (a text input's truncate, prompt_name, embedding_type...)
    params = {name: _parameter(req, name) for name in req.parameters}
    x, mask, text = codec.to_batch(tensors, manifest, max_elements, texts, params)
    outputs = [codec.RequestedOutput(n, True) for n in chosen or names]
    return codec.InferRequest(req.id or None, x, mask, outputs, timeout_s, params, text)


def _parameter(req: pb.ModelInferRequest, name: str) -> object:
    param = req.parameters[name]
    return getattr(param, param.WhichOneof("parameter_choice") or "bool_param")


def _typed(name: str, tensor: pb.ModelInferRequest.InferInputTensor, shape: list[int], dtype, count: int):
    field = _TYPED.get(tensor.datatype)
    if field is None:
        raise BadInput(
            f"input {name!r}: {tensor.datatype} has no typed contents; send it in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadInput(
            f"input {name!r}: contents has {len(values)} element(s) but shape {shape} needs {count}"
        )
    if dtype.kind == "O":
        arr = np.empty(count, object)
        arr[:] = list(values)
        return arr.reshape(shape)
    return np.fromiter(values, dtype=dtype, count=count).reshape(shape)


def _timeout(req: pb.ModelInferRequest) -> float | None:
    """tritonclient's ``timeout`` parameter, in microseconds (the call's own gRPC deadline also applies)."""
    if "timeout" not in req.parameters:
        return None
    param = req.parameters["timeout"]
    return timeout_param(getattr(param, param.WhichOneof("parameter_choice") or "int64_param"))


# ModelInferResponse's field 6, raw_output_contents (repeated bytes): its tag, length-delimited wire type
RAW_OUTPUT_TAG = bytes([6 << 3 | 2])


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def encode_infer(req: codec.InferRequest, model: str, results: Outputs, version: str = "1") -> bytes:
    """The ModelInferResponse, serialized: its other fields by protobuf, then each output tensor's bytes as a
    raw_output_contents field written here (a message's fields may come in any order on the wire). Each tensor is
    copied once, into the answer, where tobytes, the message and its serialization copied it three times
    (3 MB per [8,128,768] answer)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=req.id or "")
    tensors = []
    for out in req.outputs:
        tensor = codec.wire(results[out.name])
        response.outputs.add(name=out.name, datatype=codec.v2_name(tensor.dtype), shape=tensor.shape)
        tensors.append(tensor)
    parts: list = [response.SerializeToString()]
    for tensor in tensors:
        parts += [RAW_OUTPUT_TAG, varint(tensor.nbytes), memoryview(tensor).cast("B")]
    return b"".join(parts)


def from_dict(doc: dict, message: type[Message]) -> Message:
    """A JSON-shaped answer the HTTP routes also give (metadata, statistics, index) as its gRPC message."""
    return json_format.ParseDict(doc, message(), ignore_unknown_fields=True)


@dataclass(frozen=True)
class GrpcInferCodec:
    """ModelInfer's codec for one call (service.core.inference.Codec): the model its request names; the answer is the
    response message's serialized bytes."""

    name: str
    max_elements: int
    limits: TextLimits | None = None

    def decode_work(self, request: pb.ModelInferRequest) -> int:
        # typed contents (fp32_contents...) count as text: they are read element by element
        raw = sum(map(len, request.raw_input_contents))
        return work(request.ByteSize() - raw, raw)

    def encode_work(self, req: codec.InferRequest, nbytes: int) -> int:
        return work(raw=nbytes)

    def decode(self, request: pb.ModelInferRequest, resolve: Resolve) -> codec.InferRequest:
        model = resolve(self.name)
        texts = codec.text_step(model, self.limits) if self.limits is not None else None
        return decode_infer(request, model.engine.manifest, self.max_elements, texts)

    def encode(self, req: codec.InferRequest, model: ServingModel, outputs: Outputs) -> bytes:
        return encode_infer(req, model.name, codec.answered(req, model, outputs), model.version)
