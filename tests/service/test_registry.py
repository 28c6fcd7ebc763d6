"""service/models/registry.py: every change of a served model's state, in-process, with a stand-in for what a load builds
(the real loads are tests/test_model_control.py's and tests/service/test_models.py's)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from addnorm.service.errors import NotFound, NotReady
from addnorm.service.models.registry import (
    READY,
    UNAVAILABLE,
    LoadFailed,
    Registry,
    ServingModel,
    Slot,
    version_of,
)

pytestmark = pytest.mark.unit


class FakeBuild:
    """``build`` for the registry: a ServingModel whose engine is named as asked (``names`` can lie, as a
    manifest changed between scan and load does) and whose batcher records its drain and stop; ``fail``: directories that
    do not load."""

    def __init__(self) -> None:
        self.fail: set[Path] = set()
        self.names: dict[Path, str] = {}
        self.stopped: list[tuple[str, str]] = []
        self.drained: list[tuple[str, str]] = []  # told no more requests will come (before the last ends)

    async def __call__(self, name: str, directory: Path, version: str) -> ServingModel:
        if directory in self.fail:
            raise LoadFailed(f"{directory} is broken")
        served = self.names.get(directory, name)
        stopped, drained = self.stopped, self.drained

        class Batcher:
            def drain(self) -> None:
                drained.append((served, version))

            async def stop(self) -> None:
                stopped.append((served, version))

        return ServingModel(SimpleNamespace(name=served), Batcher(), None, None, version)


def test_the_first_load_leaves_each_model_ready_or_unavailable_with_its_reason(tmp_path):
    build = FakeBuild()
    build.fail.add(tmp_path / "b")
    models = Registry([Slot("a", tmp_path / "a"), Slot("b", tmp_path / "b")], build)
    asyncio.run(models.load_all())
    assert models.get("a").name == "a" and models.default.name == "a"
    with pytest.raises(NotReady, match="model 'b' failed to load: .*broken"):
        models.get("b")
    with pytest.raises(NotFound, match="unknown model 'c'"):
        models.get("c")
    assert models.not_ready_reason() == f"model 'b' failed to load: {tmp_path / 'b'} is broken"


def test_a_swap_serves_the_new_version_at_once_and_stops_the_old_after_its_last_request(tmp_path):
    async def scenario() -> None:
        build = FakeBuild()
        models = Registry([Slot("a", tmp_path / "a" / "1", version="1")], build)
        await models.load_all()
        old = models.get("a")
        with old.inflight:  # a request on version 1 while version 2 loads
            await models.load("a", tmp_path / "a" / "2")
            assert models.get("a").version == "2" and models.slot("a").state == READY
            await asyncio.sleep(0.05)
            assert build.stopped == []  # version 1 still answers its request
            assert build.drained == [("a", "1")]  # what it has queued runs without waiting for company
        await asyncio.sleep(0.05)
        assert build.stopped == [("a", "1")]
        await models.close()
        assert build.stopped == [("a", "1"), ("a", "2")]

    asyncio.run(scenario())


def test_a_version_that_fails_to_load_never_takes_traffic_and_the_index_says_why(tmp_path):
    async def scenario() -> None:
        build = FakeBuild()
        build.fail.add(tmp_path / "a" / "3")
        build.names[tmp_path / "a" / "4"] = "renamed"
        models = Registry([Slot("a", tmp_path / "a" / "2", version="2")], build)
        await models.load_all()
        with pytest.raises(LoadFailed, match="version 3 .* was not loaded"):
            await models.load("a", tmp_path / "a" / "3")
        slot = models.slot("a")
        assert models.get("a").version == "2" and slot.state == READY
        assert "version 2 still serves" in slot.reason
        with pytest.raises(LoadFailed, match="now holds model 'renamed', not 'a'"):
            await models.load("a", tmp_path / "a" / "4")
        assert build.stopped == [("renamed", "4")] and models.get("a").version == "2"

    asyncio.run(scenario())


def test_unready_and_unload_take_a_model_out_with_their_reasons(tmp_path):
    async def scenario() -> None:
        models = Registry(
            [Slot("a", tmp_path / "a"), Slot("b", tmp_path / "b")], FakeBuild(), allow_empty=True
        )
        await models.load_all()
        models.mark_unready("a", "live parity failed")
        with pytest.raises(NotReady, match="model 'a' is unavailable: live parity failed"):
            models.get("a")
        await models.unload("b")
        slot = models.slot("b")
        assert slot.state == UNAVAILABLE and slot.serving is None
        with pytest.raises(NotReady, match="model 'b' is unloaded"):
            models.get("b")
        assert (
            models.not_ready_reason() == "model 'a' is unavailable: live parity failed"
        )  # unloaded: asked for
        with pytest.raises(NotFound):
            await models.unload("c")

    asyncio.run(scenario())


def test_a_version_is_its_numbered_directory():
    assert version_of(Path("repo/a/12")) == "12" and version_of(Path("repo/a")) == "1"


def test_a_repository_entry_that_links_outside_it_is_skipped_unless_links_are_allowed(
    tmp_path, tiny_artifact
):
    """A symbolic link in the repository to an artifact elsewhere loaded and served before; now it is skipped with
    its reason (and a load that names it is refused saying why), unless --follow-symlinks."""
    import shutil

    from fastapi.testclient import TestClient

    from addnorm.service import create_app
    from addnorm.service.models.registry import artifact_dirs, repository_models
    from addnorm.service.settings import Settings
    from tests.helpers import wait_until_ready

    repo = tmp_path / "repo"
    shutil.copytree(tiny_artifact, repo / "inside")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_artifact, elsewhere)
    manifest = (elsewhere / "manifest.json").read_text().replace('"name": "encoder"', '"name": "outside"')
    (elsewhere / "manifest.json").write_text(manifest)
    (repo / "outside").symlink_to(elsewhere, target_is_directory=True)
    assert artifact_dirs(Settings(model_repository=repo)) == (repo / "inside",)
    refused: dict = {}
    assert list(repository_models(repo, refused)) == ["encoder"]
    assert "links outside the repository" in refused[repo / "outside"]
    assert artifact_dirs(Settings(model_repository=repo, follow_symlinks=True)) == (
        repo / "inside",
        repo / "outside",
    )
    settings = Settings(model_repository=repo, model_control_mode="explicit", load_model=("encoder",))
    with TestClient(create_app(settings)) as c:
        wait_until_ready(c)
        r = c.post("/v2/repository/models/outside/load", json={})
        assert r.status_code == 400 and "links outside the repository" in r.json()["error"], r.text
        assert {m["name"] for m in c.post("/v2/repository/index", json={}).json()} == {"encoder"}
