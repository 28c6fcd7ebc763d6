"""What ``/openapi.json`` says, made true to the running server.

FastAPI documents a 422 with its own validation shape on every route with parameters; this server never sends one
(every refusal is a 4xx ``{"error": ...}``, ``errors.CODES``). And a request example is only useful when it runs:
each protocol builds its examples (``examples(model, d_model)``) for the served default model's real d_model.
"""

from __future__ import annotations

import copy

from service import protocols
from service.protocols.common import error_docs
from service.state import READY, KnownModels

_FASTAPI_ONLY = ("HTTPValidationError", "ValidationError")  # the 422 shapes, never sent here


def finish(schema: dict, loaded: KnownModels | None) -> dict:
    """A copy of FastAPI's ``schema`` without 422s (a 400 ``{"error"}`` in their place) and, once the default model
    is loaded, with request examples and the ``{name}`` path parameter's example for it."""
    schema = copy.deepcopy(schema)
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses.update(error_docs({400: "bad request: the error names the field at fault"}))
    components = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_ONLY:
        components.pop(name, None)
    first = next(iter(loaded.models.slots.values()), None) if loaded is not None else None
    if first is not None and first.state == READY and first.serving is not None:
        for (path, method), example in protocols.examples(first.name, first.serving.engine.d_model).items():
            content = schema["paths"][path][method]["requestBody"]["content"]["application/json"]
            content["example"] = example
        for path_item in schema.get("paths", {}).values():  # {name} in a path: the served model's
            for operation in path_item.values():
                for parameter in operation.get("parameters", ()):
                    if parameter.get("in") == "path" and parameter.get("name") == "name":
                        parameter["example"] = first.name
    return schema
