"""The JSON bodies /v1/encode reads and writes, declared once: the OpenAPI document is built from them (routes.py),
and tests/service/test_schemas.py holds the codec to them (every field declared is read or written, and nothing
else is)."""

from model.contract import EMBEDDINGS, ENCODED, MASK, POOLED

REQUEST = {
    "type": "object",
    "required": [EMBEDDINGS],
    "properties": {
        EMBEDDINGS: {
            "description": "[seq, d_model], [batch, seq, d_model], or a list of [seq_i, d_model] "
            "sequences of different lengths (padded and masked by the server)",
            "type": "array",
            "items": {"type": "array"},
        },
        "model": {
            "type": "string",
            "description": "the model to run (default: the server's first); or ?model=NAME",
        },
        MASK: {
            "description": "optional [seq] or [batch, seq] booleans, true = padding",
            "type": "array",
            "items": {
                "anyOf": [
                    {"type": "boolean"},
                    {"type": "array", "items": {"type": "boolean"}},
                ]
            },
        },
    },
}

ANSWER = {
    "type": "object",
    "required": [ENCODED, "shape", "model"],
    "properties": {
        ENCODED: {
            "type": "array",
            "description": "like embeddings; one per ragged sequence",
        },
        "shape": {
            "type": "array",
            "description": "the encoded shape, or one per sequence",
        },
        "model": {"type": "string"},
        POOLED: {
            "type": "array",
            "description": "[batch, d_model] (one sequence: [d_model]): the sentence embeddings "
            "of a model exported with --pooling",
        },
    },
}
