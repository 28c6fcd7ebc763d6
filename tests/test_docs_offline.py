"""/docs and /redoc render with no network (issue 27): FastAPI's pages load Swagger UI and ReDoc from a CDN and
were blank on an air-gapped host. Headless Chromium (Debian's ``chromium``; .ci/run installs it) loads each page
from a real server with every host but 127.0.0.1 unresolvable, and the test reads the DOM the scripts drew: an
operation per route, not a screenshot."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")


def _dom(url: str) -> str:
    """The page's DOM after its scripts ran, in a browser that can reach nothing but loopback."""
    r = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # as root in CI containers
            "--disable-gpu",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--virtual-time-budget=15000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_swagger_ui_draws_every_operation_offline(server):
    html = httpx.get(f"{server}/docs").text
    assert "cdn." not in html and "https://" not in html  # every asset from the server itself
    drawn = set(re.findall(r'class="opblock-summary-path" data-path="([^"]+)"', _dom(f"{server}/docs")))
    assert {"/v1/encode", "/v2/models/{name}/infer", "/health/ready", "/v2/repository/index"} <= drawn, drawn
    assert len(drawn) >= 20


def test_redoc_draws_the_operations_offline(server):
    html = httpx.get(f"{server}/redoc").text
    assert "cdn." not in html and "fonts.googleapis" not in html
    dom = _dom(f"{server}/redoc")
    sections = set(re.findall(r'data-section-id="operation/([^"]+)"', dom))
    assert any("encode" in s for s in sections) and len(sections) >= 20, sections


def test_an_unknown_asset_is_a_json_404(server):
    r = httpx.get(f"{server}/docs/assets/nope.js")
    assert r.status_code == 404 and "no documentation asset 'nope.js'" in r.json()["error"]
    assert httpx.get(f"{server}/docs/assets/swagger-ui.css").headers["content-type"].startswith("text/css")
