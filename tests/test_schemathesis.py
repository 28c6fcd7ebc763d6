"""schemathesis against the served OpenAPI document: generated requests for every operation, no answer >= 500."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))


def test_schemathesis_finds_no_server_error(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text('[parameters]\n"path.name" = "encoder"\n"path.version" = "1"\n')  # reach the real model
    cmd = [SCHEMATHESIS, "--config-file", str(config), "run", f"{server}/openapi.json",
           "--checks", "not_a_server_error", "--max-examples", "20", "--seed", "1", "--no-color"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    generated = int(re.search(r"(\d+) generated", r.stdout)[1])
    assert generated >= 300 and re.search(rf"{generated} passed", r.stdout), r.stdout[-2000:]
