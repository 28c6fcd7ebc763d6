"""The int8 kernels' build fetches onnxruntime's header package over HTTPS, pinned by sha256: other bytes stop the
build with one line, and the pinned bytes are kept (model/kernels)."""

from __future__ import annotations

import hashlib
import io

import pytest

from addnorm.model import kernels


class _Answer(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_other_bytes_than_the_pinned_ones_stop_the_build(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(kernels, "CACHE", tmp_path)
    monkeypatch.setattr(kernels, "SYSTEM_HEADERS", tmp_path / "no-system-headers")

    def urlopen(url, timeout):
        seen.append(url)
        return _Answer(b"not the package")

    monkeypatch.setattr(kernels.urllib.request, "urlopen", urlopen)
    with pytest.raises(kernels.KernelError) as caught:
        kernels.header_dir()
    message = str(caught.value)
    assert "\n" not in message and f"not the pinned {kernels.HEADER_PACKAGE_SHA256}" in message
    assert hashlib.sha256(b"not the package").hexdigest() in message
    assert seen == [kernels.HEADER_PACKAGE] and seen[0].startswith("https://")
    assert not list(tmp_path.rglob("*.deb"))  # nothing unverified is kept


def test_an_unreachable_source_says_how_to_build_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CACHE", tmp_path)
    monkeypatch.setattr(kernels, "SYSTEM_HEADERS", tmp_path / "no-system-headers")

    def urlopen(url, timeout):
        raise OSError("no route to host")

    monkeypatch.setattr(kernels.urllib.request, "urlopen", urlopen)
    with pytest.raises(kernels.KernelError, match=r"no route to host.*give --include DIR"):
        kernels.header_dir()
