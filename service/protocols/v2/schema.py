"""The Open Inference Protocol's REST request and response (their JSON, the header of a binary body), as this server
reads and writes them, declared once: the OpenAPI document is built from them (routes.py), and
tests/service/test_schemas.py holds the codec to them (every field declared is read or written, and nothing else
is)."""

from addnorm.model.contract import INPUT_NAMES
from addnorm.service.protocols.v2.codec import DTYPES

_TENSOR_PARAMS = {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}}
REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {
            "type": "object",
            "properties": {
                "timeout": {"type": "integer", "minimum": 1, "description": "microseconds"},
                "binary_data_output": {"type": "boolean"},
            },
        },
        "inputs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string", "enum": list(INPUT_NAMES)},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "datatype": {"type": "string", "enum": sorted(DTYPES)},
                    "parameters": _TENSOR_PARAMS,
                    "data": {"type": "array", "description": "row-major, flat or nested"},
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}},
                },
            },
        },
    },
}
ANSWER = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "datatype", "shape"],
                "properties": {
                    "name": {"type": "string"},
                    "datatype": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "data": {"type": "array", "items": {"type": "number"}},
                    "parameters": _TENSOR_PARAMS,
                },
            },
        },
    },
}

PARAMETERS = [
    {
        "name": "Inference-Header-Content-Length",
        "in": "header",
        "required": False,
        "schema": {"type": "integer", "minimum": 1},
        "description": "binary tensor extension: the length of the body's JSON header, before the raw tensors",
    }
]
HEADERS = {p["name"].lower() for p in PARAMETERS if p["in"] == "header"}
