"""Model control (Triton's model repository extension): load, unload and reload the repository's models while
serving, on every transport (HTTP ``POST /v2/repository/models/{name}/load|unload``, gRPC RepositoryModelLoad /
RepositoryModelUnload) and by watching the repository (``--model-control-mode poll``).

A verified swap: a new or changed model is loaded beside the one serving, passes its sha256 and its golden check
on this provider (``loading.serving_model``) and only then takes the name's traffic; requests already on the old
one finish on it (``ServingModel.inflight``), then its batcher stops. A version that fails never takes traffic: the
old one keeps serving, and the repository index says why (the slot's ``reason``). Loads and unloads of one name
run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from model.artifact import ArtifactError, Manifest
from service.errors import BadInput, ControlOff, LoadRefused, NotFound, ServiceError, quote
from service.loading import LoadFailed, serving_model
from service.settings import latest_version, version_of
from service.state import LOADING, READY, UNAVAILABLE, UNLOADED, ServiceState, ServingModel, Slot

log = logging.getLogger("addnorm.control")


def repository_models(state: ServiceState) -> dict[str, tuple[Path, Manifest]]:
    """The repository's models by manifest name: each entry's artifact (or its latest numbered version) and its
    manifest, read once (an empty or missing repository has none)."""
    found: dict[str, tuple[Path, Manifest]] = {}
    repo = state.settings.model_repository
    entries = sorted(repo.iterdir()) if repo is not None and repo.is_dir() else []
    for directory in filter(None, map(latest_version, entries)):
        try:
            manifest = Manifest.load(directory)
        except (ArtifactError, OSError) as exc:
            log.warning("skipping %s: %s", directory, exc)
            continue
        found.setdefault(manifest.name, (directory, manifest))
    return found


class ModelControl:
    """What the load/unload routes, the gRPC methods and the poller call; one per server (``state.control``)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.mode = state.settings.model_control_mode
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task] = set()
        self._refused: dict[str, tuple[Path, str]] = {}  # name -> (directory, model sha256) not to retry

    def _allowed(self) -> None:
        if self.mode != "explicit":
            how = "--model-control-mode explicit" if self.mode == "none" else "the poller (mode poll) does it"
            raise ControlOff(f"explicit model load / unload is not allowed here: {how}")

    async def load(self, name: str) -> None:
        """Load (or reload) ``name`` from the repository; raises NotFound, LoadRefused or ControlOff."""
        self._allowed()
        await self._load(name)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` once its requests in flight are answered; raises NotFound or ControlOff."""
        self._allowed()
        await self._unload(name)

    async def _load(self, name: str) -> None:
        entry = repository_models(self.state).get(name)
        if entry is None:
            raise NotFound(f"no model {quote(name)} in the repository {self.state.settings.model_repository}")
        directory, manifest = entry
        loaded = self.state.loaded
        if loaded is None:
            raise ControlOff("the server is still reading its models' manifests")
        version = version_of(directory)
        async with self._locks.setdefault(name, asyncio.Lock()):
            slot = loaded.models.add(Slot(name, directory, version=version))
            if slot.serving is None:
                slot.state, slot.reason, slot.directory, slot.version = LOADING, "", directory, version
            try:
                new = await serving_model(self.state, name, directory, version)
            except LoadFailed as exc:
                why = f"version {version} ({directory}) was not loaded: {exc}"
                self._refused[name] = (directory, manifest.model_sha256)
                if slot.serving is not None:  # the old one keeps serving; the index says why
                    slot.reason = f"{why}; version {slot.version} still serves"
                else:
                    slot.state, slot.reason = UNAVAILABLE, str(exc)
                log.error("model %s: %s", name, why)
                raise LoadRefused(f"model {quote(name)}: {why}") from None
            if new.engine.name != name:  # the manifest changed name between the scan and the load
                await new.batcher.stop()
                raise LoadRefused(f"{directory} now holds model {quote(new.engine.name)}, not {quote(name)}")
            old = slot.serving
            slot.serving, slot.state, slot.reason = new, READY, ""
            slot.directory, slot.version = directory, version
            self._refused.pop(name, None)
            log.info("model %s: version %s from %s now serves", name, version, directory)
            if old is not None:
                self._retire(old)

    async def _unload(self, name: str) -> None:
        loaded = self.state.loaded
        if loaded is None:
            raise ControlOff("the server is still reading its models' manifests")
        slot = loaded.models.slot(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            old, slot.serving = slot.serving, None
            slot.state, slot.reason = UNAVAILABLE, UNLOADED
            if old is not None:
                log.info(
                    "model %s: unloading once its %d request(s) in flight are answered",
                    name,
                    old.inflight.count,
                )
                await self._drain(old)

    def _retire(self, model: ServingModel) -> None:
        """Stop a replaced model once its requests in flight are answered, without holding up the load."""
        task = asyncio.get_running_loop().create_task(self._drain(model))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _drain(self, model: ServingModel) -> None:
        await model.inflight.idle()
        await model.batcher.stop()

    async def poll(self) -> None:
        """One look at the repository (mode poll): load what is new or changed, unload what is gone."""
        loaded = self.state.loaded
        if loaded is None:
            return
        found = repository_models(self.state)
        for name, (directory, manifest) in found.items():
            slot = loaded.models.slots.get(name)
            sha = manifest.model_sha256
            if self._refused.get(name) == (directory, sha):
                continue  # refused as it is: tried again once it changes
            serving = slot.serving if slot is not None else None
            if (
                serving is not None
                and slot.directory == directory
                and serving.engine.manifest.model_sha256 == sha
            ):
                continue
            with contextlib.suppress(ServiceError):  # refusals are logged and in the index
                await self._load(name)
        repo = self.state.settings.model_repository
        for name, slot in list(loaded.models.slots.items()):
            from_repo = repo is not None and slot.directory.is_relative_to(repo)  # not a --model-dir's
            if name not in found and from_repo and slot.serving is not None:
                await self._unload(name)

    async def watch(self) -> None:
        """The poller: every ``--repository-poll-secs`` until cancelled."""
        while True:
            await asyncio.sleep(self.state.settings.repository_poll_secs)
            try:
                await self.poll()
            except Exception:  # never the poller
                log.exception("reading the model repository failed")

    async def close(self) -> None:
        """Let replaced models finish draining (server shutdown)."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)


def check_parameters(names: list[str], unload: bool = False) -> None:
    """A load's or unload's parameters. Triton's ``config`` override and ``file:`` uploads are not taken (the
    repository on disk is what loads, verified); an unload's ``unload_dependents`` (which tritonclient always
    sends) is accepted, as no model here depends on another; anything else is refused rather than ignored."""
    unknown = sorted(set(names) - ({"unload_dependents"} if unload else set()))
    if unknown:
        raise BadInput(
            f"{'unload' if unload else 'load'} parameters {quote(unknown, 200)} are not supported here: put the "
            "model's files in the repository and load it by name"
        )
