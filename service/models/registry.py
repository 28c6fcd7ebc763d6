"""The models a server serves, and the one owner of their life.

``Registry`` holds a ``Slot`` per model (its state, the version and directory it serves, and once READY its
``ServingModel``), answers the lookup every request makes once (``get``: 404 for an unknown name, 503 for a model
not ready), and makes every change of a model's state: the first load, a verified swap to another version, marking
one unavailable, unloading, and draining a replaced or unloaded model after its last request in flight. Where models
come from is read here too (``artifact_dirs``, ``read_manifests``, ``repository_models``). What a load builds is
service/models/state.py's ``serving_model`` (the registry's ``build``), which also decides when to load and unload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from addnorm.commands import DEFAULT_ARTIFACT
from addnorm.model.artifact import MANIFEST_FILE, ArtifactError, Manifest
from addnorm.model.golden import Verification
from addnorm.service.backend.interface import Backend
from addnorm.service.batching.batcher import Batcher
from addnorm.service.batching.merging import Outputs, Timings, Tokens
from addnorm.service.errors import NotFound, NotReady, quote
from addnorm.service.metrics import ModelStatistics, RequestTimer
from addnorm.service.models.live_parity import LiveParity
from addnorm.service.settings import Settings

log = logging.getLogger("addnorm.service")
LOADING, READY, UNAVAILABLE = "LOADING", "READY", "UNAVAILABLE"  # the repository index's states
UNLOADED = "unloaded"  # the reason of a model model control unloaded


class InFlight:
    """The requests using a model right now (``ServingModel.request`` in the request core), so that a model
    being replaced or unloaded is stopped only once the last of them is answered (``idle``)."""

    __slots__ = ("count", "_idle")

    def __init__(self) -> None:
        self.count = 0
        self._idle: asyncio.Event | None = None

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    async def idle(self) -> None:
        while self.count:
            self._idle = asyncio.Event()
            await self._idle.wait()


@dataclass(frozen=True)
class ServingModel:
    """One loaded model: its engine, the batcher in front of it, its load-time check, its statistics, the
    version it serves (its numbered directory in a repository, else "1") and the server's live parity sampler
    (service/models/live_parity.py; None in bare tests), which every answer it gives is offered to."""

    engine: Backend
    batcher: Batcher
    verification: Verification  # the load-time golden check (its backend's ``verify``)
    statistics: ModelStatistics
    version: str = "1"
    inflight: InFlight = field(default_factory=InFlight, compare=False)
    live: LiveParity | None = field(default=None, compare=False)

    @contextlib.contextmanager
    def request(self, started: float) -> Iterator[RequestTimer]:
        """One request on this model, from its lookup to its answer: counted in flight (a replaced or unloaded
        model stops after its last) and timed in its statistics (a failed decode counts against it)."""
        with self.inflight, self.statistics.request(started) as timer:
            yield timer

    async def infer(
        self, x: np.ndarray | Tokens, mask: np.ndarray | None, timeout: float, timer: RequestTimer
    ) -> tuple[Outputs, Timings]:
        """A decoded (B, S, E) batch (or a text part's ``Tokens``) through the batcher within ``timeout`` seconds, its run in the statistics; a
        sample of answers is recomputed in float64 by live parity, off the request path."""
        outputs, timings = await self.batcher.infer(x, mask, timeout)
        timer.inferred(timings, x.shape[0])
        if self.live is not None:
            self.live.offer(self, x, mask, outputs)
        return outputs, timings

    def live_parity(self) -> dict | None:
        """Its live parity counts (None without a sampler)."""
        return None if self.live is None else self.live.counts[self.name].to_dict()

    def describe(self) -> dict:
        """The manifest, what runs it, and how it verified (GET /v1/model)."""
        return {**self.engine.describe(), "verification": self.verification.to_dict()}

    @property
    def name(self) -> str:
        return self.engine.name


@dataclass
class Slot:
    """One model the server was told to serve, from the moment its manifest is read: its state, and the
    ServingModel once it is READY. ``reason`` says why it is UNAVAILABLE. Only the registry changes it."""

    name: str
    directory: Path
    state: str = LOADING
    reason: str = ""
    serving: ServingModel | None = None
    version: str = "1"  # the version it serves, or is loading


class LoadFailed(Exception):
    """A model could not be loaded: the reason, in words."""


Build = Callable[[str, Path, str], Awaitable[ServingModel]]  # (name, directory, version) -> a verified model


class Registry:
    """The configured models by name, in the order given; the first is the default. ``build`` makes a verified
    ServingModel (service.models.state.serving_model) or raises LoadFailed."""

    def __init__(self, slots: list[Slot], build: Build | None = None, allow_empty: bool = False) -> None:
        if not slots and not allow_empty:
            raise ValueError("a server needs at least one model")
        self.slots = {s.name: s for s in slots}
        self._build = build
        self._locks: dict[str, asyncio.Lock] = {}  # loads and unloads of one name run one at a time
        self._retiring: set[asyncio.Task] = set()

    def slot(self, name: str) -> Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise NotFound(f"unknown model {quote(name)}; this server serves {sorted(self.slots)}") from None

    def get(self, name: str | None = None) -> ServingModel:
        """The named model (the default for None), loaded; NotFound or NotReady otherwise."""
        if name is None:
            if not self.slots:
                raise NotReady(
                    "no model is loaded (model control: load one with POST /v2/repository/models/NAME/load)"
                )
            slot = next(iter(self.slots.values()))
        else:
            slot = self.slot(name)
        if slot.serving is None or slot.state != READY:  # (live parity may have made a loaded one unready)
            raise NotReady(_why(slot))
        return slot.serving

    @property
    def default(self) -> ServingModel:
        return self.get()

    def __iter__(self) -> Iterator[ServingModel]:
        """The loaded models."""
        return (s.serving for s in self.slots.values() if s.serving is not None)

    def not_ready_reason(self) -> str | None:
        """None when every model is READY (an unloaded one aside); otherwise each other model's state."""
        waiting = [_why(s) for s in self.slots.values() if s.state != READY and s.reason != UNLOADED]
        return "; ".join(waiting) or None

    async def load_all(self) -> None:
        """The first load of every slot, in parallel; each ends READY or UNAVAILABLE with its reason."""

        async def first(slot: Slot) -> None:
            try:
                slot.serving = await self._build(slot.name, slot.directory, slot.version)
                slot.state = READY
            except LoadFailed as exc:
                slot.state, slot.reason = UNAVAILABLE, str(exc)
                log.error("model %s failed to load: %s", slot.name, exc)

        await asyncio.gather(*(first(slot) for slot in self.slots.values()))

    async def load(self, name: str, directory: Path) -> None:
        """A verified swap: ``directory``'s model loads and passes its checks beside the one serving ``name`` (if
        any), then takes its traffic; the old one drains in the background. Raises LoadFailed: the old one keeps
        serving and the slot's reason says why."""
        version = version_of(directory)
        async with self._locks.setdefault(name, asyncio.Lock()):
            slot = self.slots.setdefault(name, Slot(name, directory, version=version))
            if slot.serving is None:
                slot.state, slot.reason, slot.directory, slot.version = LOADING, "", directory, version
            try:
                new = await self._build(name, directory, version)
                if new.name != name:  # the manifest changed name between the scan and the load
                    await new.batcher.stop()
                    raise LoadFailed(f"{directory} now holds model {quote(new.name)}, not {quote(name)}")
            except LoadFailed as exc:
                why = f"version {version} ({directory}) was not loaded: {exc}"
                if slot.serving is not None:  # the old one keeps serving; the index says why
                    slot.reason = f"{why}; version {slot.version} still serves"
                else:
                    slot.state, slot.reason = UNAVAILABLE, str(exc)
                log.error("model %s: %s", name, why)
                raise LoadFailed(why) from None
            old = slot.serving
            slot.serving, slot.state, slot.reason = new, READY, ""
            slot.directory, slot.version = directory, version
            log.info("model %s: version %s from %s now serves", name, version, directory)
            if old is not None:
                task = asyncio.get_running_loop().create_task(self._drain(old))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` (NotFound if unknown) once its requests in flight are answered."""
        slot = self.slot(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            old, slot.serving = slot.serving, None
            slot.state, slot.reason = UNAVAILABLE, UNLOADED
            if old is not None:
                log.info("model %s: unloading after its %d request(s) in flight", name, old.inflight.count)
                await self._drain(old)

    def mark_unready(self, name: str, reason: str) -> None:
        """Live parity's action ``unready`` (on the event loop): the model answers 503 with the reason, and the
        index, /health/ready and gRPC ModelReady say so, until it is loaded again."""
        slot = self.slots.get(name)
        if slot is not None and slot.state == READY:
            slot.state, slot.reason = UNAVAILABLE, reason
            log.error("model %s is now UNAVAILABLE: %s", name, reason)

    async def close(self) -> None:
        """Shutdown: let replaced models finish draining, then stop every batcher."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
        for model in self:
            await model.batcher.stop()

    @staticmethod
    async def _drain(model: ServingModel) -> None:
        model.batcher.drain()  # no traffic reaches it any more: its queue runs without waiting for company
        await model.inflight.idle()
        await model.batcher.stop()


def _why(slot: Slot) -> str:
    if slot.state == UNAVAILABLE:
        if slot.reason == UNLOADED:
            return f"model {slot.name!r} is unloaded"
        if slot.serving is not None:  # loaded, then taken out of service (live parity)
            return f"model {slot.name!r} is unavailable: {slot.reason}"
        return f"model {slot.name!r} failed to load: {slot.reason}"
    return f"model {slot.name!r} is loading"


def artifact_dirs(settings: Settings) -> tuple[Path, ...]:
    """Every artifact directory to serve, in order: --artifact's, then the repository's (each of its directories
    holding a manifest, or numbered version directories (Triton's ``name/1/``, ``name/2/``) of which the highest
    holding one is served; by name; hidden ones skipped; one already given is not repeated). Raises ValueError for
    a repository that is not a directory or holds no artifact."""
    dirs = list(settings.artifact)
    if settings.model_repository is not None:
        repo = settings.model_repository
        if not repo.is_dir():
            raise ValueError(f"model repository {repo} is not a directory")
        found = sorted(repository_entries(repo, settings.follow_symlinks))
        if not found:
            raise ValueError(
                f"model repository {repo} holds no artifact directory (none has {MANIFEST_FILE})"
            )
        given = {d.resolve() for d in dirs}
        dirs += [d for d in found if d.resolve() not in given]  # one directory named both ways: once
    return tuple(dirs) or (DEFAULT_ARTIFACT,)


def read_manifests(settings: Settings) -> list[Slot]:
    """Every model to serve, named by its manifest, in order. Raises ValueError (with every directory involved)
    for an unreadable manifest, a missing repository or two models of one name."""
    slots: list[Slot] = []
    for directory in artifact_dirs(settings):
        try:
            name = Manifest.load(directory).name
        except (ArtifactError, OSError) as exc:
            raise ValueError(str(exc) if str(directory) in str(exc) else f"{directory}: {exc}") from None
        same = [s.directory for s in slots if s.name == name]
        if same:
            raise ValueError(
                f"two models are named {name!r}: {same[0]} and {directory}; give one another name "
                "(addnorm-export --name) or serve them from different servers"
            )
        slots.append(Slot(name, Path(directory), version=version_of(Path(directory))))
    return slots


def repository_models(
    repo: Path | None, unreadable: dict[Path, str] | None = None, follow_symlinks: bool = False
) -> dict[str, tuple[Path, Manifest]]:
    """The repository's models by manifest name: each entry's artifact (or its latest numbered version) and its
    manifest, read once (an empty or missing repository has none). ``unreadable``, if given, gets each artifact
    directory whose manifest could not be read, with the reason (a load that names it says so)."""
    found: dict[str, tuple[Path, Manifest]] = {}
    for directory in repository_entries(repo, follow_symlinks, unreadable):
        try:
            manifest = Manifest.load(directory)
        except (ArtifactError, OSError) as exc:
            log.warning("skipping %s: %s", directory, exc)
            if unreadable is not None:
                unreadable[directory] = str(exc)
            continue
        found.setdefault(manifest.name, (directory, manifest))
    return found


def repository_entries(
    repo: Path | None, follow_symlinks: bool = False, refused: dict[Path, str] | None = None
) -> list[Path]:
    """The repository's artifact directories (``latest_version`` of each entry), by name. One that resolves outside
    the repository (a symbolic link, at any level) is skipped, said in the log and in ``refused``, unless
    ``follow_symlinks`` (--follow-symlinks): the repository is what its directory holds, not what it points to."""
    if repo is None or not repo.is_dir():
        return []
    root, out = repo.resolve(), []
    for directory in filter(None, map(latest_version, sorted(repo.iterdir()))):
        if not follow_symlinks and not directory.resolve().is_relative_to(root):
            why = f"it links outside the repository, to {directory.resolve()} (--follow-symlinks allows it)"
            log.warning("skipping %s: %s", directory, why)
            if refused is not None:
                refused[directory] = why
            continue
        out.append(directory)
    return out


def latest_version(entry: Path) -> Path | None:
    """A repository entry's artifact: the entry itself when it holds a manifest, else its highest numbered
    version directory that does (the version policy: latest); None for anything else (hidden, a file)."""
    if entry.name.startswith(".") or not entry.is_dir():
        return None
    if (entry / MANIFEST_FILE).is_file():
        return entry
    versions = [d for d in entry.iterdir() if d.name.isdigit() and (d / MANIFEST_FILE).is_file()]
    return max(versions, key=lambda d: int(d.name), default=None)


def version_of(directory: Path) -> str:
    """The version an artifact directory serves: its name when it is a numbered version directory, else 1."""
    return str(int(directory.name)) if directory.name.isdigit() else "1"
