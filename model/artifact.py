"""The artifact directory on disk: manifest.json, model.onnx and its sha256. One schema, one place.

Layout (what export writes and serve reads)::

    model.onnx            the graph, self-contained (no external data file)
    weights.safetensors   the exact weights exported, so parity can be re-run later
    manifest.json         this module's Manifest
    golden.safetensors    inputs with their oracle outputs, checked by every server at load
    embedding.onnx        --inputs ids: the embedding layer's Add & Norm (model/text.py)
    embedding_golden.safetensors  ids and the float64 oracle's embeddings of them, checked at load
    tokenizer.json        --inputs ids: the model directory's tokenizer (Hugging Face tokenizers)

No torch import: the service reads manifests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from addnorm.model.config import ConfigError, EncoderConfig
from addnorm.model.contract import TensorSpec
from addnorm.model.quantize import CALIBRATION_FILE
from addnorm.model.schemes import Form
from addnorm.model.text import EMBEDDING_FILE, EMBEDDING_GOLDEN_FILE, TOKENIZER_FILE, TextConfig

FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.safetensors"
GOLDEN_FILE = "golden.safetensors"  # model.golden: inputs with their oracle outputs, checked at load
MANIFEST_FILE = "manifest.json"


class ArtifactError(RuntimeError):
    """An artifact directory is missing, incomplete, or does not match its manifest."""


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what the artifact is and how it was checked."""

    name: str
    config: EncoderConfig
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: int
    model_sha256: str
    variant: str = "fp32"
    versions: dict[str, str] = field(default_factory=dict)
    parity: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    golden_sha256: str = ""  # sha256 of golden.safetensors; "" for artifacts exported before golden data
    attention: str = "decomposed"  # how attention is spelled: mha, onnx or decomposed (export/attention.py)
    scheme: dict[str, Any] = field(default_factory=dict)  # a lossy scheme's parameters (int8: float channels)
    weights_sha256: str = (
        ""  # sha256 of weights.safetensors (live parity's oracle reads it); "" before it was kept
    )
    # --inputs ids: the embedding layer's graph and the tokenizer (model/text.py), each checked by its sha256
    text: TextConfig | None = None
    embedding_sha256: str = ""
    tokenizer_sha256: str = ""
    embedding_golden_sha256: str = ""
    calibration_sha256: str = ""  # the quantized vectors' calibration (model/quantize.py); "" for none
    labels: tuple[str, ...] = ()  # a classification head's label names by index; () for none, or unnamed
    # where the model came from when --from named a model id: repository, revision, commit, each file's sha256
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.labels and len(self.labels) != self.config.num_labels:
            raise ArtifactError(
                f"manifest labels name {len(self.labels)} label(s) but the head has {self.config.num_labels}"
            )

    @property
    def label_names(self) -> tuple[str, ...]:
        """The head's label names by index: the manifest's, else LABEL_0, LABEL_1, ... (transformers' defaults)."""
        return self.labels or tuple(f"LABEL_{i}" for i in range(self.config.num_labels))

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "variant": self.variant,
            "attention": self.attention,
            "config": self.config.to_dict(),
            "opset": self.opset,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "files": {
                "model": MODEL_FILE,
                "weights": WEIGHTS_FILE,
                **({"golden": GOLDEN_FILE} if self.golden_sha256 else {}),
                **({"embedding": EMBEDDING_FILE, "tokenizer": TOKENIZER_FILE} if self.text else {}),
                **({"embedding_golden": EMBEDDING_GOLDEN_FILE} if self.embedding_golden_sha256 else {}),
                **({"calibration": CALIBRATION_FILE} if self.calibration_sha256 else {}),
            },
            "model_sha256": self.model_sha256,
            **({"golden_sha256": self.golden_sha256} if self.golden_sha256 else {}),
            **({"weights_sha256": self.weights_sha256} if self.weights_sha256 else {}),
            "versions": dict(self.versions),
            **({"scheme": self.scheme} if self.scheme else {}),
            **(
                {
                    "inputs_kind": "ids",
                    "text": self.text.to_dict(),
                    "embedding_sha256": self.embedding_sha256,
                    "tokenizer_sha256": self.tokenizer_sha256,
                    **(
                        {"embedding_golden_sha256": self.embedding_golden_sha256}
                        if self.embedding_golden_sha256
                        else {}
                    ),
                    **({"calibration_sha256": self.calibration_sha256} if self.calibration_sha256 else {}),
                }
                if self.text
                else {}
            ),
            **({"labels": list(self.labels)} if self.labels else {}),
            **({"source": self.source} if self.source else {}),
            "parity": self.parity,
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        try:
            version = data.get("format_version")
            if version != FORMAT_VERSION:
                raise ArtifactError(
                    f"manifest format_version {version!r} is not supported (expected {FORMAT_VERSION})"
                )
            variant = data.get("variant", "fp32")
            if not isinstance(variant, str) or not variant:  # the names live in export's registry
                raise ArtifactError(f"manifest variant must be a non-empty string, got {variant!r}")
            return cls(
                name=str(data["name"]),
                config=EncoderConfig.from_dict(data["config"]),
                inputs=tuple(TensorSpec.from_dict(s) for s in data["inputs"]),
                outputs=tuple(TensorSpec.from_dict(s) for s in data["outputs"]),
                opset=int(data["opset"]),
                model_sha256=str(data["model_sha256"]),
                variant=variant,
                versions=dict(data.get("versions", {})),
                parity=dict(data.get("parity", {})),
                created_at=str(data.get("created_at", "")),
                golden_sha256=str(data.get("golden_sha256", "")),
                weights_sha256=str(data.get("weights_sha256", "")),
                attention=str(data.get("attention", "decomposed")),  # older artifacts spelled it out
                scheme=_scheme(data.get("scheme", {})),
                text=TextConfig.from_dict(data["text"]) if data.get("text") is not None else None,
                embedding_sha256=str(data.get("embedding_sha256", "")),
                tokenizer_sha256=str(data.get("tokenizer_sha256", "")),
                embedding_golden_sha256=str(data.get("embedding_golden_sha256", "")),
                calibration_sha256=str(data.get("calibration_sha256", "")),
                labels=_labels(data.get("labels", [])),
                source=dict(data.get("source", {})),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            if isinstance(exc, ArtifactError):
                raise
            raise ArtifactError(f"manifest is malformed: {type(exc).__name__}: {exc}") from exc

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise ArtifactError(
                f"no {MANIFEST_FILE} in {directory}: export an artifact there first (addnorm-export --artifact DIR)"
            )
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ArtifactError(f"cannot read {path}: {exc}") from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text: bytes | str, path: Path | str = MANIFEST_FILE) -> Manifest:
        """A manifest from the bytes of its file (``path`` names it in errors)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ArtifactError(f"{path} must hold a JSON object")
        return cls.from_dict(data)


def _labels(data: Any) -> tuple[str, ...]:
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise ArtifactError(f"manifest labels must be a list of names, got {data!r}")
    return tuple(data)


def _scheme(data: Any) -> dict[str, Any]:
    """The manifest's ``scheme``: an object; int8's ``float_channels`` maps weight names to channel indices, its
    ``weights`` and ``rows`` name a known form (model.schemes.Form)."""
    if not isinstance(data, dict):
        raise ArtifactError(f"manifest scheme must be an object, got {type(data).__name__}")
    channels = data.get("float_channels", {})
    if not isinstance(channels, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)
        for k, v in channels.items()
    ):
        raise ArtifactError(
            "manifest scheme.float_channels must map weight names to lists of channel indices"
        )
    try:
        Form.of(data)
    except ValueError as exc:
        raise ArtifactError(f"manifest scheme: {exc}") from None
    return dict(data)


def sha256_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Verified:
    """An artifact as read once: its manifest, and the bytes of its graph and golden data that matched the manifest's
    sha256 (what the engine hands to onnxruntime and the golden check runs: the file on disk may change after)."""

    directory: Path
    manifest: Manifest
    model: bytes
    golden: bytes | None  # None for artifacts exported before golden data
    embedding: bytes | None = None  # --inputs ids: the embedding layer's graph
    tokenizer: bytes | None = None  # and tokenizer.json
    embedding_golden: bytes | None = None  # and its golden data
    calibration: bytes | None = None  # and the quantized vectors' calibration


def read_verified(directory: str | Path) -> Verified:
    """Read the manifest, then model.onnx and golden.safetensors once each, and check those very bytes against the
    manifest's sha256. A directory swapped or half-written while it is read fails here (ArtifactError): never a
    manifest of one version with the graph of another."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist")
    manifest = Manifest.load(directory)
    model = _read_checked(directory / MODEL_FILE, manifest.model_sha256, "the graph")
    golden = None
    if manifest.golden_sha256:
        golden = _read_checked(directory / GOLDEN_FILE, manifest.golden_sha256, "the golden data")
    embedding = tokenizer = None
    if manifest.text is not None:
        embedding = _read_checked(
            directory / EMBEDDING_FILE, manifest.embedding_sha256, "the embedding graph"
        )
        tokenizer = _read_checked(directory / TOKENIZER_FILE, manifest.tokenizer_sha256, "the tokenizer")
    embedding_golden = None
    if manifest.embedding_golden_sha256:
        embedding_golden = _read_checked(
            directory / EMBEDDING_GOLDEN_FILE,
            manifest.embedding_golden_sha256,
            "the embedding layer's golden data",
        )
    calibration = None
    if manifest.calibration_sha256:
        calibration = _read_checked(
            directory / CALIBRATION_FILE, manifest.calibration_sha256, "the quantized vectors' calibration"
        )
    return Verified(directory, manifest, model, golden, embedding, tokenizer, embedding_golden, calibration)


def read_weights(directory: str | Path, manifest: Manifest) -> bytes:
    """weights.safetensors, read once and checked against the manifest's sha256 where it records one."""
    path = Path(directory) / WEIGHTS_FILE
    if manifest.weights_sha256:
        return _read_checked(path, manifest.weights_sha256, "the weights")
    return path.read_bytes()


def _read_checked(path: Path, sha256: str, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing (the manifest records its sha256)") from None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from None
    if (actual := hashlib.sha256(data).hexdigest()) != sha256:
        raise ArtifactError(
            f"sha256 of {path} is {actual} but the manifest says {sha256}: {what} was changed after export (or is "
            "being replaced right now); re-export it or restore the original file"
        )
    return data


def load_verified(directory: str | Path) -> tuple[Manifest, Path]:
    """Read the manifest and check that model.onnx is the file it describes. Returns (manifest, model path)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist")
    manifest = Manifest.load(directory)
    model_path = directory / MODEL_FILE
    if not model_path.is_file():
        raise ArtifactError(f"{model_path} is missing")
    actual = sha256_file(model_path)
    if actual != manifest.model_sha256:
        raise ArtifactError(
            f"sha256 of {model_path} is {actual} but the manifest says {manifest.model_sha256}: "
            "the graph was changed after export; re-export it or restore the original file"
        )
    if manifest.golden_sha256:
        golden = directory / GOLDEN_FILE
        if not golden.is_file():
            raise ArtifactError(f"{golden} is missing (the manifest records its sha256)")
        if (actual := sha256_file(golden)) != manifest.golden_sha256:
            raise ArtifactError(
                f"sha256 of {golden} is {actual} but the manifest says {manifest.golden_sha256}: "
                "the golden data was changed after export; re-export or restore it"
            )
    return manifest, model_path
