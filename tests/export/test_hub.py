"""``addnorm-export --from ORG/NAME[@REVISION]``: a model id resolved through huggingface_hub's cache, as a user's
HF_HOME holds it after a download, with the Hub out of reach (HF_HUB_OFFLINE: nothing is fetched here). The
manifest records the repository, the revision, the commit and each file's sha256; an id the cache lacks is a clear
error, exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from addnorm.model.artifact import Manifest
from tests.text_models import make_model_dir

pytestmark = pytest.mark.export
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[2]


def _cache(home: Path, repo: str, model: Path) -> Path:
    """``model``'s files as huggingface_hub's cache holds a download of ``repo`` at COMMIT (blobs by their hash,
    the snapshot's files linked to them, refs/main naming the commit)."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


def _export(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "addnorm.export", *args, "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def test_a_model_id_exports_from_the_cache_and_the_manifest_says_where_it_came_from(
    tmp_path, monkeypatch, capsys
):
    import huggingface_hub

    from addnorm.export import cli, hub

    model = make_model_dir("bert", tmp_path / "model", seed=3)
    (model / "onnx").mkdir()
    (model / "onnx" / "model.onnx").write_bytes(b"another export: never read")
    home = tmp_path / "hf"
    snapshot = _cache(home, "addnorm-tests/tiny-bert", model)
    out = tmp_path / "artifact"
    r = _export(
        home, "--from", "addnorm-tests/tiny-bert", "--artifact", str(out)
    )  # the command, as a user runs it
    assert r.returncode == 0, r.stderr[-3000:]
    source = Manifest.load(out).source
    files = {
        str(p.relative_to(model)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in model.rglob("*")
        if p.is_file() and "onnx" not in p.parts
    }
    assert source == {
        "repository": "addnorm-tests/tiny-bert",
        "revision": "main",
        "commit": COMMIT,
        "files": files,
    }
    assert json.loads((out / "manifest.json").read_text())["source"]["commit"] == COMMIT
    # the same resolution in process (huggingface_hub reads its settings at import: set here as the env set them)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for spec, revision in (
        (f"addnorm-tests/tiny-bert@{COMMIT}", COMMIT),
        ("addnorm-tests/tiny-bert@main", "main"),
    ):
        directory, source = hub.resolve(spec)
        assert directory == snapshot and (source["revision"], source["commit"]) == (revision, COMMIT)
    assert hub.is_model_id("addnorm-tests/tiny-bert") and not hub.is_model_id(str(model))
    shutil.rmtree(snapshot.parent)  # the download gone: the id can no longer be had offline
    for spec, words in (
        ("addnorm-tests/tiny-bert", "not in the Hugging Face cache"),
        ("no-such-org/no-such-model", "--from no-such-org/no-such-model"),
        ("not/a/model/id", "not/a/model/id"),
    ):
        assert cli.main(["--from", spec, "--artifact", str(tmp_path / "none"), "-q"]) == 2
        assert words in capsys.readouterr().err
