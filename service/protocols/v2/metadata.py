"""What V2 says about the models, over HTTP and gRPC alike: each one's metadata and configuration (Triton's
ModelConfig, from model_config.py), the version check of a versioned path, the repository index and the statistics
extension's answer. The tensors themselves are codec.py's.
"""

from __future__ import annotations

from addnorm.model.artifact import Manifest
from addnorm.model.contract import api_specs, text_specs
from addnorm.service.errors import NotFound, quote
from addnorm.service.models.registry import READY, Registry, ServingModel
from addnorm.service.protocols.v2 import model_config
from addnorm.service.protocols.v2.codec import NUMPY_TO_V2


def model_metadata(manifest: Manifest, version: str = "1") -> dict:
    """Inputs and outputs as the API speaks them (batch-first, whatever the graph's layout); -1 = variable."""

    def tensor(spec) -> dict:
        return {
            "name": spec.name,
            "datatype": NUMPY_TO_V2.get(spec.dtype, spec.dtype.upper()),
            "shape": [d if isinstance(d, int) else -1 for d in spec.shape],
        }

    inputs, outputs = api_specs(manifest.config)
    inputs = (*inputs, *text_specs(manifest.config, manifest.text is not None))
    return {
        "name": manifest.name,
        "versions": [version],
        "platform": model_config.PLATFORM,
        "inputs": [tensor(s) for s in inputs],
        "outputs": [tensor(s) for s in outputs],
    }


def model_configuration(model: ServingModel) -> dict:
    """Triton's ModelConfig for a served model (GET .../config, gRPC ModelConfig): its batcher's real limits."""
    b = model.batcher
    gpu = not model.engine.on_cpu
    return model_config.served(
        model.engine.manifest, b.limits.max_batch_size, b.max_delay, b.max_queue_size, gpu
    )


def check_version(models: Registry, name: str, version: str | None) -> None:
    """404 for an unknown model, or any version but the one it serves (empty or absent means that one)."""
    served = models.slot(name).version
    if version not in (None, "", served):
        raise NotFound(f"unknown version {quote(version)} of model {quote(name)}; available: [{served!r}]")


def repository_index(models: Registry, ready_only: bool = False) -> list[dict]:
    """Every configured model with its state (READY, LOADING, UNAVAILABLE) and, when not ready, why."""
    return [
        {"name": s.name, "version": s.version, "state": s.state, "reason": s.reason}
        for s in models.slots.values()
        if s.state == READY or not ready_only
    ]


def statistics(models: Registry, name: str | None, version: str | None, live_parity: bool = False) -> dict:
    """The statistics extension's answer: one model's (404 unknown, 503 not loaded), or every loaded model's;
    with ``live_parity`` (over HTTP: its message has no field for them), each carries its live parity counts (an
    extra field Triton's clients ignore)."""
    if name:
        check_version(models, name, version)
        chosen = [models.get(name)]
    else:
        chosen = list(models)
    docs = [m.statistics.to_dict() for m in chosen]
    for doc, m in zip(docs, chosen, strict=True):
        if live_parity and (counts := m.live_parity()) is not None:
            doc["live_parity"] = counts
    return {"model_stats": docs}
