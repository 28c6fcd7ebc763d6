"""Model control (Triton's model repository extension): load, unload and reload the repository's models while
serving, on every transport (HTTP ``POST /v2/repository/models/{name}/load|unload``, gRPC RepositoryModelLoad /
RepositoryModelUnload) and by watching the repository (``--model-control-mode poll``). ``ModelControl`` decides
when (the mode, what a poll finds changed, a refused version not retried until it changes); the registry does it:
a verified swap, where a new or changed model loads beside the one serving, passes its sha256 and golden check on
this provider and only then takes the name's traffic, the old one draining; a version that fails never takes
traffic, the index saying why. Loads and unloads of one name run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from addnorm.service.errors import BadInput, ControlOff, LoadRefused, NotFound, ServiceError, quote
from addnorm.service.models.registry import LoadFailed, Registry, repository_models
from addnorm.service.settings import Settings

log = logging.getLogger("addnorm.service")


class ModelControl:
    """What the load/unload routes, the gRPC methods and the poller call; one per server (``state.control``)."""

    def __init__(self, settings: Settings, models: Callable[[], Registry | None]) -> None:
        self.settings = settings
        self.models = models  # the registry, None until the manifests are read
        self.mode = settings.model_control_mode
        self._refused: dict[str, tuple[Path, str]] = {}  # name -> (directory, model sha256) not to retry

    def _allowed(self) -> None:
        if self.mode != "explicit":
            how = "--model-control-mode explicit" if self.mode == "none" else "the poller (mode poll) does it"
            raise ControlOff(f"explicit model load / unload is not allowed here: {how}")

    def _models(self) -> Registry:
        models = self.models()
        if models is None:
            raise ControlOff("the server is still reading its models' manifests")
        return models

    async def load(self, name: str) -> None:
        """Load (or reload) ``name`` from the repository; raises NotFound, LoadRefused or ControlOff."""
        self._allowed()
        await self._load(name)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` once its requests in flight are answered; raises NotFound or ControlOff."""
        self._allowed()
        await self._models().unload(name)

    async def _load(self, name: str) -> None:
        repo, unreadable = self.settings.model_repository, {}
        entry = repository_models(repo, unreadable, self.settings.follow_symlinks).get(name)
        if entry is None:
            # A model whose manifest cannot be read has no name to find it by: its repository entry (Triton's
            # layout, repository/NAME/[VERSION/]) is named after it, and the refusal says why it cannot load.
            named = [
                (d, why)
                for d, why in unreadable.items()
                if repo is not None and d.relative_to(repo).parts[0] == name
            ]
            if named:
                directory, why = named[0]
                raise LoadRefused(f"model {quote(name)}: {directory} cannot be loaded: {why}")
            raise NotFound(f"no model {quote(name)} in the repository {repo}")
        directory, manifest = entry
        try:
            await self._models().load(name, directory)
        except LoadFailed as exc:
            self._refused[name] = (directory, manifest.model_sha256)
            raise LoadRefused(f"model {quote(name)}: {exc}") from None
        self._refused.pop(name, None)

    async def poll(self) -> None:
        """One look at the repository (mode poll): load what is new or changed, unload what is gone."""
        models = self.models()
        if models is None:
            return
        repo = self.settings.model_repository
        found = repository_models(repo, follow_symlinks=self.settings.follow_symlinks)
        for name, (directory, manifest) in found.items():
            slot = models.slots.get(name)
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
        for name, slot in list(models.slots.items()):
            from_repo = repo is not None and slot.directory.is_relative_to(repo)  # not a --artifact's
            if name not in found and from_repo and slot.serving is not None:
                await models.unload(name)

    async def watch(self) -> None:
        """The poller: every ``--repository-poll-secs`` until cancelled."""
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.poll()
            except Exception:  # never the poller
                log.exception("reading the model repository failed")


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
