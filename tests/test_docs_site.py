"""The guides as a site (issue 66): ``mkdocs build --strict`` (as ``make lint`` runs it) builds every page with no
broken link or anchor, and headless Chromium (tests/test_docs_offline.py's) draws each built page from a loopback
server: its title, the navigation to every other page, its tables and code blocks, read from the DOM the browser
built."""

from __future__ import annotations

import functools
import http.server
import re
import subprocess
import sys
import threading

import pytest
import yaml

from bench.server import free_port
from tests.conftest import ROOT
from tests.test_docs_offline import CHROMIUM, _dom

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")


def _pages(nav: list) -> list[tuple[str, str]]:
    """(title, file) of every page in mkdocs.yml's nav, nested sections flattened."""
    found = []
    for entry in nav:
        for title, value in entry.items():
            found += _pages(value) if isinstance(value, list) else [(title, value)]
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_every_page_of_the_nav_is_a_file_and_every_guide_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    files = [file for _, file in _pages(config["nav"])]
    assert sorted(files) == sorted(p.name for p in (ROOT / "docs").glob("*.md")), files


def test_the_browser_draws_every_page_with_its_navigation(site):
    pages = _pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    for title, file in pages:
        path = "" if file == "index.md" else file.removesuffix(".md") + "/"
        dom = _dom(f"{site}/{path}")
        assert f"<title>{title} - addnorm</title>" in dom or (
            file == "index.md" and "<title>addnorm</title>" in dom
        ), file
        headings = re.findall(r"<h1[^>]*>(.*?)</h1>", dom, re.S)
        assert headings, f"{file}: no h1 drawn"
        linked = set(re.findall(r'href="(?:\.\./)*([\w-]+)/"', dom))
        assert {p.removesuffix(".md") for _, p in pages if p != "index.md"} <= linked | {path.strip("/")}, (
            file
        )
        source = (ROOT / "docs" / file).read_text()
        # every table a table of its own (one written right under another is drawn as its rows) ...
        prose = re.sub(r"^```.*?^```", "", source, flags=re.S | re.M)  # not the code blocks' pipes and dashes
        tables = len(re.findall(r"^[ \t]*\|\s*:?-{3,}", prose, re.M))
        page = dom.split('id="mkdocs_keyboard_modal"')[0]  # not the theme's table of shortcuts
        drawn = page.count("<table")
        assert drawn == tables, f"{file}: {tables} tables written, {drawn} drawn"
        # ... and every list a list (one written right under a paragraph's line is drawn as that paragraph's text)
        lists_as_text = [p[:80] for p in re.findall(r"<p>(.*?)</p>", dom, re.S) if re.search(r"\n- ", p)]
        assert not lists_as_text, f"{file}: lists drawn as a paragraph's text: {lists_as_text}"
        if "\n```" in source:
            assert "<pre" in dom and "<code" in dom, f"{file}: its code blocks were not drawn"
