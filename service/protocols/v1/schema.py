"""What /v1/encode reads and writes, declared once: its JSON bodies, its query and header parameters. The OpenAPI
document is built from them (routes.py), and tests/service/test_schemas.py holds the codec to them (every field and
header declared is read or written, and nothing else is)."""

from addnorm.model.contract import EMBEDDINGS, MASK, OUTPUT_DOCS, OUTPUT_NAMES, positional
from addnorm.model.text import INPUT_IDS
from addnorm.service.protocols.v1.codec import MODEL, OUTPUT

REQUEST = {
    "type": "object",
    "description": f"{EMBEDDINGS} (and optionally {MASK}), or {INPUT_IDS} for a model exported with its embedding layer",
    "properties": {
        INPUT_IDS: {
            "description": "token id lists (a model exported with --inputs ids): embedded by the model's own "
            "layer, answered as ragged sequences",
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}},
        },
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

# The answer carries the model's outputs by name: every one it has, or the one ``?output=`` names (a cross-encoder
# asked for its scores answers no ``encoded``), so at least one of them, and the shape of the first.
ANSWER = {
    "type": "object",
    "required": ["shape", "model"],
    "anyOf": [{"required": [name]} for name in OUTPUT_NAMES],
    "properties": {
        **{
            name: {
                "type": "array",
                "description": OUTPUT_DOCS[name]
                + ("; one per ragged sequence" if positional(name) else "; one sequence: its row alone"),
            }
            for name in OUTPUT_NAMES
        },
        "shape": {
            "type": "array",
            "description": "the shape of the first output answered (encoded, unless ?output= names another), "
            "or one per sequence",
        },
        "model": {"type": "string"},
    },
}

PARAMETERS = [
    {
        "name": MODEL,
        "in": "query",
        "required": False,
        "schema": {"type": "string"},
        "description": "the model to run, for any body (default: the server's first model)",
    },
    {
        "name": OUTPUT,
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": list(OUTPUT_NAMES)},
        "description": "the one output the answer carries, one of the model's (pooled, scores, sparse_weights: "
        "the answer's fields); without it JSON answers carry every output, binary ones encoded",
    },
    {
        "name": "X-Shape",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": "^[0-9]+(,[0-9]+){1,2}$"},
        "description": "application/octet-stream bodies: their [batch,] seq, d_model, e.g. 2,128,768",
    },
    {
        "name": "X-Lengths",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"},
        "description": "binary bodies: each row's own length; positions past it are padding",
    },
]
HEADERS = {p["name"].lower() for p in PARAMETERS if p["in"] == "header"}  # as the codec reads them
