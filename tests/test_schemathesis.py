"""schemathesis against the served OpenAPI document: generated requests for every operation, no answer >= 500, and
every answer as documented (its status code, content type, headers and body schema): the document and the codecs
cannot drift apart unnoticed."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",  # found /v1/model's 404 and V2 infer's 408 undocumented
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
    )
)
SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))


def run_schemathesis(base: str, model: str, tmp_path: Path, examples: int = 20, least: int = 300) -> str:
    """schemathesis against ``base``'s /openapi.json, its path parameters naming ``model``: every check passes,
    and at least ``least`` requests were generated; its report."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f'[parameters]\n"path.name" = "{model}"\n"path.version" = "1"\n'
    )  # reach the real model
    cmd = [SCHEMATHESIS, "--config-file", str(config), "run", f"{base}/openapi.json",
           "--checks", CHECKS, "--max-examples", str(examples), "--seed", "1", "--no-color"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    generated = int(re.search(r"(\d+) generated", r.stdout)[1])
    assert generated >= least and re.search(rf"{generated} passed", r.stdout), r.stdout[-2000:]
    return r.stdout


def test_schemathesis_finds_no_server_error_and_every_answer_is_documented(server, tmp_path):
    run_schemathesis(server, "encoder", tmp_path)
