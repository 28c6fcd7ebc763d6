"""The embedding layer: built from a model directory (``text_export``), its graph (``embedding.onnx``): export,
checks and its parity gate.

``input_ids`` [, ``token_type_ids``] int64 (batch, seq) -> ``embeddings`` float32 (batch, seq, d_model), the
block's input. One Add & Norm: Gather of each table, Add, ONNX's native ``LayerNormalization``. It stays float32
in every variant (a table lookup and one norm: nothing for a lossy variant to save). Gated like the block: the
graph against the torch module and the float64 oracle, on ids drawn over the whole vocabulary at several lengths
(padding included), within float32's floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from addnorm.export.model_dir import ModelDir, text_limits
from addnorm.export.onnx_export import ExportError, export_module, load_checked
from addnorm.export.parity import make_session
from addnorm.model.config import ConfigError
from addnorm.model.contract import BATCH, EMBEDDINGS, SEQ
from addnorm.model.embedding import EmbeddingAddNorm
from addnorm.model.text import TOKENIZER_FILE, TextConfig
from addnorm.model.verdict import FP32_ATOL, float32_floor

# (batch, seq) of the gate's id cases: a single token, short, padded, and the longest the artifact accepts
GATE_SHAPES = ((1, 1), (2, 7), (4, 33), (1, None))


@dataclass(frozen=True)
class EmbeddingGate:
    """The embedding graph against float64 (and torch float32) on ``cases`` id batches of ``tokens`` in all."""

    max_abs: float
    floor: float
    torch_max_abs: float
    cases: int
    tokens: int
    passed: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def export_embedding(module: EmbeddingAddNorm, path: Path, opset: int) -> onnx.ModelProto:
    """torch.onnx.export of the embedding layer; the graph must hold one LayerNormalization."""
    names = list(module.text.input_names)
    batch, seq = torch.export.Dim(BATCH), torch.export.Dim(SEQ)
    example = tuple(torch.ones(2, 5, dtype=torch.int64) for _ in names)
    dims = tuple({0: batch, 1: seq} for _ in names)
    export_module(module.eval(), example, path, (names, [EMBEDDINGS]), dims, opset)
    model = load_checked(path, opset)
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    if len(norms) != 1:
        raise ExportError(f"the embedding graph holds {len(norms)} LayerNormalization nodes, not 1")
    return model


def id_cases(module: EmbeddingAddNorm, seed: int = 1234) -> list[dict[str, np.ndarray]]:
    """Feeds of random ids over the whole vocabulary, padded (the padding id) at the end of some rows."""
    text = module.text
    rng = np.random.default_rng(seed)
    cases = []
    for batch, seq in GATE_SHAPES:
        seq = seq or text.max_length
        ids = rng.integers(0, text.vocab_size, (batch, seq), dtype=np.int64)
        if text.positions == "after_padding":
            ids[ids == text.pad_token_id] = (text.pad_token_id + 1) % text.vocab_size
        if batch > 1:  # the last row padded for its second half
            ids[-1, seq // 2 + 1 :] = text.pad_token_id
        feed = {"input_ids": ids}
        if text.type_vocab_size:
            feed["token_type_ids"] = rng.integers(0, text.type_vocab_size, (batch, seq), dtype=np.int64)
        cases.append(feed)
    return cases


def embed_sentences(
    module: EmbeddingAddNorm, tokenizer_json: bytes, sentences
) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings (N, S, E) float32, mask (N, S) bool) of ``sentences``: tokenized as the server tokenizes them
    (cut to the model's length) and embedded by the model's own embedding layer: what the block receives."""
    from addnorm.model.tokenize import TextTokenizer

    batch = TextTokenizer(tokenizer_json, module.text).encode(list(sentences), truncate=True)
    feed = [torch.from_numpy(batch.input_ids)]
    if module.text.type_vocab_size:
        feed.append(torch.from_numpy(batch.token_type_ids))
    with torch.no_grad():
        return module(*feed).numpy(), batch.mask


def write_embedding_golden(module: EmbeddingAddNorm, path: Path) -> None:
    """Two of the gate's id cases (a padded batch, and one at the longest length) with the float64 oracle's
    embeddings of them: every server runs them through its own session at load (service/backend/text.py)."""
    from safetensors.numpy import save_file

    arrays = {}
    for i, feed in enumerate(id_cases(module)[1::2]):
        for name, value in feed.items():
            arrays[f"{i}/{name}"] = value
        arrays[f"{i}/{EMBEDDINGS}"] = module.oracle(feed["input_ids"], feed.get("token_type_ids"))
    save_file(arrays, str(path))


def gate_embedding(module: EmbeddingAddNorm, path: Path) -> EmbeddingGate:
    session = make_session(path)
    worst, floor, worst_torch, tokens, passed = 0.0, 0.0, 0.0, 0, True
    cases = id_cases(module)
    for feed in cases:
        got = session.run([EMBEDDINGS], feed)[0]
        want = module.oracle(feed["input_ids"], feed.get("token_type_ids"))
        with torch.no_grad():
            ours = module(*(torch.from_numpy(v) for v in feed.values())).numpy()
        err = float(np.abs(got - want).max())
        bound = max(float32_floor(want), FP32_ATOL)
        passed = passed and err <= bound
        worst, floor = max(worst, err), max(floor, bound)
        worst_torch = max(worst_torch, float(np.abs(ours - want).max()))
        tokens += feed["input_ids"].size
    return EmbeddingGate(worst, floor, worst_torch, len(cases), tokens, passed)


@dataclass(frozen=True)
class TextExport:
    """What an artifact that takes token ids carries besides the block (``--inputs ids``): the embedding layer
    with its weights, and the model directory's tokenizer.json."""

    module: EmbeddingAddNorm
    tokenizer: Path
    sentences: tuple[str, ...] = ()  # the quantized vectors' calibration (export/quantized.py); () built-in

    @property
    def config(self) -> TextConfig:
        return self.module.text


def text_export(where: ModelDir, state: dict[str, torch.Tensor], d_model: int) -> TextExport:
    """The model directory's embedding layer (its family's names and config.json's sizes, with the
    sentence-transformers files' longest input and prompts) with the checkpoint's weights, and its tokenizer."""
    family = where.family
    layer = family.text(where.config)
    fields = {
        "family": where.config.get("model_type", "bert"),
        **layer,
        **text_limits(where.directory, layer),
    }
    text = TextConfig.from_dict(fields)
    module = EmbeddingAddNorm(text, d_model)
    weights = family.embedding_state(state)
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if wrong := [
        f"{k}: {tuple(v.shape)} vs {shapes.get(k)}"
        for k, v in weights.items()
        if tuple(v.shape) != shapes.get(k)
    ]:
        raise ConfigError(f"the embedding layer's weights do not fit config.json: {', '.join(wrong)}")
    module.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return TextExport(module.eval(), where.directory / TOKENIZER_FILE)
