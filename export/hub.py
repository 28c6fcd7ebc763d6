"""``addnorm-export --from ORG/NAME[@REVISION]``: a model id resolved to a model directory through ``huggingface_hub``
(its cache and settings as the user has them: ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``,
``HF_TOKEN``), and where it came from for the manifest: the repository, the revision asked, the commit it resolved
to and each file's sha256.

Only what an export reads is fetched (config and weights in safetensors or PyTorch's format, the tokenizer,
sentence-transformers' pipeline files); other frameworks' weights and exports (onnx/, openvino/, TensorFlow, Flax)
are skipped.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from addnorm.model.artifact import sha256_file
from addnorm.model.config import ConfigError

# ORG/NAME[@REVISION]: Hugging Face's repository id (org and name of letters, digits, - _ .), and a branch, tag or
# commit
MODEL_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
IGNORED = [
    "onnx/*",
    "openvino/*",
    "*.onnx",
    "*.h5",
    "*.msgpack",
    "*.ot",
    "tf_model*",
    "flax_model*",
    "rust_model*",
    "coreml/*",
    "*.tflite",
]


def _ignored(name: str) -> bool:
    """Whether a snapshot's file is one the export never reads (what a download skips; a cache may hold it)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in IGNORED)


def is_model_id(value: str | Path) -> bool:
    """Whether ``--from``'s value names a model on the Hub rather than a path: ORG/NAME[@REVISION] where no such
    path exists."""
    text = str(value)
    return not Path(text).exists() and MODEL_ID.match(text) is not None


def resolve(value: str | Path) -> tuple[Path, dict]:
    """(the snapshot directory of ``value``'s model id, where it came from: ``{"repository", "revision",
    "commit", "files": {path: sha256}}``); ConfigError naming the id when it cannot be had (offline and not
    cached, unknown, gated)."""
    match = MODEL_ID.match(str(value))
    if match is None:
        raise ConfigError(f"--from {value}: neither a path nor a model id ORG/NAME[@REVISION]")
    repo, revision = match["repo"], match["revision"]
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(
            f"--from {value}: a model id needs huggingface_hub (pip install huggingface_hub), or give a model "
            "directory"
        ) from None
    try:
        directory = Path(snapshot_download(repo, revision=revision, ignore_patterns=IGNORED))
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"--from {value}: not in the Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE, or no "
            "network); download it once where the network is, or give a model directory"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"--from {value}: {type(exc).__name__}: {exc}") from None
    files = {}
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if path.is_file() and not name.startswith(".cache/") and not _ignored(name):
            files[name] = sha256_file(path)
    source = {"repository": repo, "revision": revision or "main", "commit": directory.name, "files": files}
    return directory, source
