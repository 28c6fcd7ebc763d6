"""The server's documentation: its pages and the OpenAPI document they show.

``/docs`` (Swagger UI) and ``/redoc`` come from assets installed with the server, so the pages render on a host
with no internet: FastAPI's own pages load their scripts from a CDN and are blank offline. The assets are
fastapi-offline's copies of Swagger UI and ReDoc (a pinned dependency), served under ``/docs/assets/``.

``/openapi.json`` is made true to the running server (``finish``). FastAPI documents a 422 with its own validation shape on every route with parameters; this server never sends one
(every refusal is a 4xx ``{"error": ...}``, ``errors.CODES``). And a request example is only useful when it runs:
each protocol builds its examples (``examples(model, d_model)``) for the served default model's real d_model.
"""

from __future__ import annotations

import copy
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from addnorm.service import protocols
from addnorm.service.errors import NotFound, from_error, quote
from addnorm.service.models.registry import READY
from addnorm.service.models.state import KnownModels
from addnorm.service.protocols.common import error_docs

ASSETS = files("fastapi_offline") / "static"
MEDIA = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
PREFIX = "/docs/assets"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
router = APIRouter(include_in_schema=False)


def _asset(request: Request, name: str) -> str:
    return f"{request.scope.get('root_path', '')}{PREFIX}/{name}"


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=_asset(request, "swagger-ui-bundle.js"),
        swagger_css_url=_asset(request, "swagger-ui.css"),
        swagger_favicon_url=_asset(request, "favicon.png"),
        oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT}",
    )


@router.get(OAUTH2_REDIRECT)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=_asset(request, "redoc.standalone.js"),
        redoc_favicon_url=_asset(request, "favicon.png"),
        with_google_fonts=False,  # fonts from Google are one more thing offline hosts cannot fetch
    )


@router.get(PREFIX + "/{name}")
async def asset(name: str) -> Response:
    if name not in MEDIA:
        return from_error(NotFound(f"no documentation asset {quote(name)}; there are {sorted(MEDIA)}"))
    return FileResponse(
        str(ASSETS / name), media_type=MEDIA[name], headers={"cache-control": "public, max-age=86400"}
    )


_FASTAPI_ONLY = ("HTTPValidationError", "ValidationError")  # the 422 shapes, never sent here


def finish(schema: dict, known: KnownModels | None) -> dict:
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
    first = next(iter(known.models.slots.values()), None) if known is not None else None
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
