"""The front proxy's configuration (service/front/nginx_conf.py): the deployed file is its output, nginx accepts it, and
it passes on every header field the app reads."""

import shutil
import subprocess
from pathlib import Path

import pytest

from addnorm.service.front.nginx_conf import passed_headers, render
from addnorm.service.settings import Settings
from tests.conftest import ROOT

DEPLOYED = ROOT / "deploy" / "nginx" / "nginx.conf"


def test_the_deployed_configuration_is_the_renderers_output():
    """deploy/nginx/nginx.conf (an upstream named api, as docker-compose names the server): `python -m addnorm.service.front.nginx_conf --listen 8080
    --upstream api:8000 > deploy/nginx/nginx.conf` writes it again after a change of the renderer or a default."""
    assert DEPLOYED.read_text() == render(Settings(_env_file=None), "8080", "api:8000")


def test_nginx_accepts_it(tmp_path: Path):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx is not installed (apt-get install nginx)")
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(Settings(max_connections=8), "127.0.0.1:1", "127.0.0.1:2", str(tmp_path)))
    done = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_header_the_app_reads_is_passed_on():
    """Only the listed fields reach the app: each protocol's documented headers and the common ones."""
    from addnorm.service.protocols.v1 import schema as v1
    from addnorm.service.protocols.v2 import schema as v2

    conf = render(Settings(), "8080", "api:8000")
    for header in {*v1.HEADERS, *v2.HEADERS, "authorization", "content-type", "x-request-id", "traceparent"}:
        assert header in passed_headers() and f"proxy_set_header {header} " in conf, header
