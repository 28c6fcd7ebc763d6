"""``/docs`` (Swagger UI) and ``/redoc`` from assets installed with the server, so the pages render on a host
with no internet: FastAPI's own pages load their scripts from a CDN and are blank offline. The assets are
fastapi-offline's copies of Swagger UI and ReDoc (a pinned dependency), served under ``/docs/assets/``.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from service.errors import NotFound, quote
from service.responses import from_error

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
