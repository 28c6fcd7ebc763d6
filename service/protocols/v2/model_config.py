"""Triton's model configuration (model_config.proto's ``ModelConfig``) for a model: one builder for what a running
server reports (``GET /v2/models/{name}/config``, gRPC ModelConfig: what perf_analyzer and tritonclient's
``get_model_config`` read) and what ``addnorm-triton`` writes as ``config.pbtxt``, so the two cannot disagree.

The dict is the configuration's JSON form as Triton serves it: the proto's field names, enums by name, integers
as numbers. ``as_message`` turns it into the gRPC message, ``as_pbtxt`` into a repository's text file.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from google.protobuf import json_format, text_format

from addnorm.model.artifact import Manifest
from addnorm.model.contract import EMBEDDINGS, LONGEST, MASK, OFFSETS, TensorSpec, api_specs, text_specs
from addnorm.service.protocols.v2 import inference_pb2 as pb

PLATFORM, BACKEND = "onnxruntime_onnx", "onnxruntime"
# model_config.proto's DataType for each dtype a manifest names
TRITON_TYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "float64": "TYPE_FP64",
    "bool": "TYPE_BOOL",
    "bytes": "TYPE_STRING",
}


# A packed graph (model/packing.py) under Triton's ragged batching: its tokens arrive concatenated and flat, and
# Triton computes the two inputs that say where each request's sequence lies (one sequence per request).
RAGGED = (EMBEDDINGS, MASK)
PACKED_BATCH_INPUTS = [
    {
        "kind": "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
        "target_name": [OFFSETS],
        "data_type": "TYPE_INT32",
        "source_input": [EMBEDDINGS],
    },
    {
        "kind": "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
        "target_name": [LONGEST],
        "data_type": "TYPE_INT32",
        "source_input": [EMBEDDINGS],
    },
]


def _dims(spec: TensorSpec, batched: bool) -> list[int]:
    """Triton dims: -1 for each symbolic dim; without the leading batch dim when the model batches."""
    shape = spec.shape[1:] if batched else spec.shape
    return [d if isinstance(d, int) else -1 for d in shape]


def _data_type(spec: TensorSpec) -> str:
    try:
        return TRITON_TYPES[spec.dtype]
    except KeyError:
        raise ValueError(f"{spec.name}: dtype {spec.dtype} has no Triton data type") from None


def build(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    max_batch_size: int,
    instances: int = 1,
    kind: str = "KIND_CPU",
    optional: Collection[str] = (),
    dynamic_batching: dict | None = None,
    ragged: bool = False,
) -> dict:
    """The configuration; ``max_batch_size`` 0 means the model does not batch (dims are then whole),
    ``optional`` names the inputs a request may leave out, and ``ragged`` declares Triton's ragged batching of a
    packed graph (``RAGGED`` inputs, ``PACKED_BATCH_INPUTS``)."""
    batched = max_batch_size > 0
    config: dict = {
        "name": name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": {"specific": {"versions": [1]}},  # addnorm serves one version, "1"
        "max_batch_size": max_batch_size,
        "input": [
            {
                "name": s.name,
                "data_type": _data_type(s),
                "format": "FORMAT_NONE",
                "dims": _dims(s, batched),
                "optional": s.name in optional,
                **({"allow_ragged_batch": True} if ragged and s.name in RAGGED else {}),
            }
            for s in inputs
        ],
        "output": [{"name": s.name, "data_type": _data_type(s), "dims": _dims(s, batched)} for s in outputs],
        "instance_group": [{"name": f"{name}_0", "kind": kind, "count": instances}],
        "default_model_filename": "model.onnx",
    }
    if batched and dynamic_batching is not None:
        config["dynamic_batching"] = dynamic_batching
    if ragged:
        config["batch_input"] = PACKED_BATCH_INPUTS
    return config


def served(
    manifest: Manifest, max_batch_size: int, max_queue_delay_s: float, max_queue_size: int, gpu: bool
) -> dict:
    """What a running addnorm-serve does with a model: its API's tensors (batch-first whatever the graph's
    layout), the batcher's real limits, the mask optional (a request without one has no padding)."""
    inputs, outputs = api_specs(manifest.config)
    optional: tuple[str, ...] = (MASK,)
    if manifest.text is not None:  # texts, or embeddings: either
        texts = text_specs(manifest.config, True)
        inputs, optional = (*inputs, *texts), (MASK, EMBEDDINGS, *(s.name for s in texts))
    return build(
        manifest.name,
        inputs,
        outputs,
        max_batch_size=max_batch_size,
        kind="KIND_GPU" if gpu else "KIND_CPU",
        optional=optional,
        dynamic_batching={
            "max_queue_delay_microseconds": round(max_queue_delay_s * 1e6),
            "default_queue_policy": {"max_queue_size": max_queue_size},
        },
    )


def as_message(config: dict) -> pb.ModelConfig:
    return json_format.ParseDict(config, pb.ModelConfig())


def as_pbtxt(config: dict) -> str:
    """The configuration in protobuf text format, as a repository's config.pbtxt holds it."""
    return text_format.MessageToString(as_message(config))
