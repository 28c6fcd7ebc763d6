"""Hugging Face BERT model directories as users have them (``config.json`` + ``model.safetensors``, a tokenizer),
and transformers' own ``BertModel`` as a reference for the exported layers.

``read_model_dir`` reads the weights and what ``config.json`` says of the encoder layers; transformers is needed
only for ``Reference`` (real sentences through the model's own tokenizer and embedding layer, and its encoder's
output on them) and is imported there, from the local directory only: nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from addnorm.export.families import Family, family_of
from addnorm.export.parity import make_session
from addnorm.export.weights import CheckpointError, read_state_dict
from addnorm.model.config import ConfigError
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, POOLED, output_names
from addnorm.model.reference import pool as reference_pool
from addnorm.model.verdict import FP32_ATOL, FP32_RTOL

log = logging.getLogger("addnorm.export")

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
# Sentences for the reference check when no --calibration is given: short queries and a few passages, the
# lengths sentence-embedding users send.
SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a white horse on an enclosed ground.",
    "A woman is playing violin.",
    "Someone in a gorilla costume is playing a set of drums.",
    "How do I reset my password if I no longer have access to the email address on my account?",
    "What is the boiling point of water at high altitude?",
    "The quarterly report shows revenue grew eight percent while operating costs fell, driven mostly by lower "
    "energy prices and a smaller workforce in the European division.",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a "
    "by-product; it takes place in the chloroplasts of plant cells, mostly in the leaves.",
)

# More real text of mixed lengths (the benchmarks' and the built-in calibration's), and a long passage.
MORE = (
    "A cheetah is running behind its prey.",
    "The new movie is awesome.",
    "The new movie is so great.",
    "The cat sits outside.",
    "The dog plays in the garden.",
    "I love pasta.",
    "Do you like pizza?",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "A man is playing a flute.",
    "A woman is slicing an onion.",
    "Stock markets fell sharply after the central bank raised interest rates again.",
)
PASSAGE = (
    "The committee met on Tuesday to review the proposed changes to the city's zoning rules, which would allow "
    "taller residential buildings near the new light rail stations and reduce parking minimums. "
)


@dataclass(frozen=True)
class ModelDir:
    """A BERT checkpoint: its weights file, and its directory when that holds a config.json."""

    weights: Path
    directory: Path | None  # holds config.json (and usually the tokenizer)

    @property
    def family(self) -> Family:
        """Its encoder family, by config.json's model_type (BERT for a bare weights file)."""
        config = self.config
        return family_of(config, str(self.directory / CONFIG_FILE) if config is not None else CONFIG_FILE)

    @property
    def config(self) -> dict | None:
        if self.directory is None:
            return None
        try:
            return json.loads((self.directory / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {self.directory / CONFIG_FILE}: {exc}") from None


def locate(path: str | Path) -> ModelDir:
    """``path``: a model directory (config.json + model.safetensors or pytorch_model.bin), or a weights file
    (whose directory's config.json, if any, is read too)."""
    path = Path(path)
    if path.is_dir():
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            raise CheckpointError(f"model directory {path} holds none of {', '.join(WEIGHT_FILES)}")
        if not (path / CONFIG_FILE).is_file():
            raise CheckpointError(f"model directory {path} has no {CONFIG_FILE}")
        return ModelDir(weights, path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (give a model directory or a weights file)")
    return ModelDir(path, path.parent if (path.parent / CONFIG_FILE).is_file() else None)


def config_fields(config: dict, source: str = CONFIG_FILE) -> dict:
    """What a Hugging Face config.json says of the encoder layers, as EncoderConfig fields (its family's reading:
    export/families)."""
    return family_of(config, source).fields(config)


def read_model_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, ModelDir]:
    """(state_dict, config.json's EncoderConfig fields ({} without one), where it came from)."""
    where = locate(path)
    config = where.config
    fields = config_fields(config, str(where.directory / CONFIG_FILE)) if config is not None else {}
    return read_state_dict(where.weights), fields, where


# sentence-transformers' Pooling modes this graph computes (1_Pooling/config.json's keys), as --pooling values
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def sentence_pooling(directory: Path | None) -> dict:
    """What a sentence-transformers model directory's pipeline (modules.json: Pooling, then Normalize) makes of the
    encoder's output, as EncoderConfig fields (``pooling``, ``normalize_pooled``); {} for a plain BERT directory
    or a pooling this graph does not compute (max, weighted mean: logged, and no pooled output)."""
    if directory is None or not (directory / "modules.json").is_file():
        return {}
    try:
        modules = json.loads((directory / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        pooling = next(m for m in modules if m["type"].endswith(".Pooling"))
        config = json.loads((directory / pooling.get("path", "") / CONFIG_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return {}
    modes = [mode for key, mode in _ST_POOLING.items() if config.get(key)]
    others = sorted(
        k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_POOLING
    )
    if len(modes) != 1 or others:
        what = ", ".join(others) or "several modes at once"
        log.warning(
            "%s pools with %s: the graph computes mean or cls pooling only: no pooled output", directory, what
        )
        return {}
    return {"pooling": modes[0], "normalize_pooled": "Normalize" in kinds[kinds.index("Pooling") + 1 :]}


def contradictions(from_config: dict, given: dict, flags: bool = True) -> list[str]:
    """Values that say otherwise than config.json, as '--flag X (config.json: Y)' (``flags``) or 'field X (...)'."""
    return [
        f"{'--' + name.replace('_', '-') if flags else name} {given[name]} (config.json: {value})"
        for name, value in from_config.items()
        if given.get(name) is not None and given[name] != value
    ]


class Reference:
    """transformers' BertModel from a local model directory: real sentences' embeddings (its tokenizer and
    embedding layer: what a user POSTs) and its encoder's output on given embeddings, in float32."""

    def __init__(self, directory: str | Path, max_length: int = 512) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a hub: the directory is the model
        try:
            from transformers import AutoTokenizer, BertModel
        except ImportError:
            raise ConfigError(
                "--reference transformers needs transformers (pip install transformers); "
                "or give --reference none"
            ) from None
        self.directory = Path(directory)
        self.model = BertModel.from_pretrained(
            str(self.directory), local_files_only=True, attn_implementation="eager"
        ).eval()
        self._auto_tokenizer = AutoTokenizer
        self.max_length = max_length

    def embed(self, sentences: list[str] | tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings (N, S, E) float32, mask (N, S) bool, true = padding) of ``sentences``."""
        if not any((self.directory / f).is_file() for f in TOKENIZER_FILES):
            # transformers would build an empty vocabulary (every word [UNK]) rather than say so
            raise ConfigError(f"{self.directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
        try:
            tokenizer = self._auto_tokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{self.directory} has no usable tokenizer ({type(exc).__name__})") from None
        batch = tokenizer(
            list(sentences), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        with torch.no_grad():
            x = self.model.embeddings(
                input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids")
            )
        return x.numpy().astype(np.float32), ~batch["attention_mask"].bool().numpy()

    def encode(self, embeddings: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The encoder layers' output (N, S, E) float32, as BertModel computes it after its embedding layer."""
        keep = torch.from_numpy(~mask)[:, None, None, :]
        additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        with torch.no_grad():
            out = self.model.encoder(torch.from_numpy(embeddings), attention_mask=additive)
        return out.last_hidden_state.numpy()


def pooled(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over each sequence's real tokens (sentence-transformers' mean pooling), (N, E) float64."""
    keep = (~mask)[..., None].astype(np.float64)
    return (x.astype(np.float64) * keep).sum(1) / np.maximum(keep.sum(1), 1.0)


def sentence_cosines(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Cosine of each sequence's mean-pooled embedding in ``a`` with its own in ``b``."""
    pa, pb = pooled(a, mask), pooled(b, mask)
    return (pa * pb).sum(1) / np.maximum(np.linalg.norm(pa, axis=1) * np.linalg.norm(pb, axis=1), 1e-300)


def ranking_spearman(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """Spearman correlation of the pairwise cosine similarities of the sentences under ``a`` and under ``b``:
    1.0 when every pair ranks the same (what retrieval users need to hold)."""

    def similarities(x: np.ndarray) -> np.ndarray:
        p = pooled(x, mask)
        p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-300)
        return (p @ p.T)[np.triu_indices(len(p), 1)]

    sa, sb = similarities(a), similarities(b)
    if sa.size < 2:
        return 1.0
    ra, rb = np.argsort(np.argsort(sa)), np.argsort(np.argsort(sb))
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclass(frozen=True)
class Agreement:
    """How one encoder's output on real tokens compares with transformers'."""

    max_abs: float  # over real (unpadded) tokens
    min_sentence_cosine: float
    spearman: float
    sentences: int
    tokens: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def agreement(out: np.ndarray, want: np.ndarray, mask: np.ndarray) -> Agreement:
    keep = ~mask
    diff = np.abs(out.astype(np.float64) - want.astype(np.float64))[keep]
    return Agreement(
        max_abs=float(diff.max()) if diff.size else 0.0,
        min_sentence_cosine=float(sentence_cosines(out, want, mask).min()),
        spearman=ranking_spearman(out, want, mask),
        sentences=int(out.shape[0]),
        tokens=int(keep.sum()),
    )


def reference_check(encoder, reference: Reference, given: list, config):
    """First: the converted torch encoder must compute what transformers' BertModel does on real inputs (fp32
    tolerance), else the conversion is wrong (a head count, an eps) and nothing is exported. Returns the
    pipeline's ``check``: the gated graph's agreement with BertModel, printed and kept in the manifest."""
    if given:
        x, mask = _stacked(given)
        source = f"the gate's {len(x)} real sequences"
    else:
        try:
            x, mask = reference.embed(SENTENCES)
            source = f"{len(x)} built-in sentences"
        except (
            ConfigError
        ) as exc:  # a directory without a tokenizer: seeded embeddings still check the mapping
            log.warning("%s; comparing on random embeddings instead", exc)
            x = np.random.default_rng(0).standard_normal((4, 16, config.d_model)).astype(np.float32)
            mask = np.zeros((4, 16), bool)
            mask[1, 9:] = True
            source = "4 random embeddings (no tokenizer in the model directory)"
    want = reference.encode(x, mask)
    graph_x = x if config.batch_first else np.ascontiguousarray(x.transpose(1, 0, 2))
    with torch.no_grad():
        ours = encoder.eval()(torch.from_numpy(graph_x), torch.from_numpy(mask)).numpy()
    if not config.batch_first:
        ours = ours.transpose(1, 0, 2)
    keep = ~mask
    excess = np.abs(ours - want) - (FP32_ATOL + FP32_RTOL * np.abs(want))
    if (excess[keep] > 0).any():
        worst = float(np.abs(ours - want)[keep].max())
        raise ConfigError(
            f"the converted encoder does not compute what transformers' BertModel computes on {source} (max abs "
            f"err {worst:.3e} on real tokens): the checkpoint and the configuration disagree (head count, eps, "
            "activation?); check the flags against the model's config.json"
        )
    torch_agrees = agreement(ours, want, mask)

    def check(model_path: Path) -> dict:
        names = list(output_names(config))
        outs = dict(
            zip(names, make_session(model_path).run(names, {EMBEDDINGS: graph_x, MASK: mask}), strict=True)
        )
        got = outs[ENCODED]
        graph = agreement(got if config.batch_first else got.transpose(1, 0, 2), want, mask)
        result = {"model": "transformers BertModel", "inputs": source, "torch": torch_agrees.to_dict()}
        result["graph"] = graph.to_dict()
        pooled_err = ""
        if POOLED in outs:  # against sentence-transformers' pooling of BertModel's output, in float64
            err = float(np.abs(outs[POOLED] - reference_pool(config, want.astype(np.float64), mask)).max())
            result["graph"]["pooled_max_abs"] = err
            pooled_err = f"; {config.pooling} pooled output max abs err {err:.2e}"
        log.info(
            "reference: transformers BertModel on %s (%d real tokens): torch encoder max abs err %.2e; graph max "
            "abs err %.2e, least sentence cosine %.6f, pairwise ranking Spearman %.4f%s",
            source,
            graph.tokens,
            torch_agrees.max_abs,
            graph.max_abs,
            graph.min_sentence_cosine,
            graph.spearman,
            pooled_err,
        )
        return result

    return check


def _stacked(cases: list) -> tuple[np.ndarray, np.ndarray]:
    """Given cases as one batch, each padded (and masked) to the longest."""
    seq = max(c.seq for c in cases)
    x = [np.pad(c.embeddings, ((0, 0), (0, seq - c.seq), (0, 0))) for c in cases]
    mask = [np.pad(c.mask, ((0, 0), (0, seq - c.seq)), constant_values=True) for c in cases]
    return np.concatenate(x), np.concatenate(mask)


def builtin_sentences() -> list[str]:
    """The built-in real text a model that takes text is judged on without --calibration: queries, sentences and
    passages of mixed lengths, one past 128 tokens."""
    return [*SENTENCES, *MORE, PASSAGE * 3]


def text_limits(directory: Path, text_fields: dict) -> dict:
    """What a model directory says of its inputs: ``max_length`` (sentence-transformers' ``max_seq_length``
    where it has one, within the positions the embedding layer has) and ``prompts``."""
    offset = text_fields["pad_token_id"] + 1 if text_fields["positions"] == "after_padding" else 0
    positions = text_fields["max_positions"] - offset
    limits: dict = {"max_length": positions, "prompts": {}}
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        try:
            value = json.loads((directory / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and value > 0:
            limits["max_length"] = min(value, positions)
            break
    try:
        prompts = (
            json.loads((directory / "config_sentence_transformers.json").read_text()).get("prompts") or {}
        )
        limits["prompts"] = {str(k): str(v) for k, v in prompts.items()}
    except (OSError, ValueError, AttributeError):
        pass
    return limits


def run_ids(model_dir: Path, config, batch) -> dict[str, np.ndarray]:
    """The artifact being written in ``model_dir`` run on a tokenized ``batch``: the embedding graph, then the block
    (float32 outputs by name, batch-first)."""
    from addnorm.model.text import EMBEDDING_FILE

    emb = make_session(model_dir / EMBEDDING_FILE)
    feed = {"input_ids": batch.input_ids}
    if "token_type_ids" in {i.name for i in emb.get_inputs()}:
        feed["token_type_ids"] = batch.token_type_ids
    x = emb.run([EMBEDDINGS], feed)[0]
    graph_x = x if config.batch_first else np.ascontiguousarray(x.transpose(1, 0, 2))
    names = list(output_names(config))
    outs = dict(
        zip(
            names,
            make_session(model_dir / "model.onnx").run(names, {EMBEDDINGS: graph_x, MASK: batch.mask}),
            strict=True,
        )
    )
    if not config.batch_first:
        outs[ENCODED] = outs[ENCODED].transpose(1, 0, 2)
    return outs


# The least per-sentence cosine with transformers an ids export may have: far below any variant's own tolerance,
# far above what a wrong family mapping (positions, token types, a missing layer) gives.
IDS_MIN_COSINE = 0.99


def ids_check(directory: Path, text, config):
    """The pipeline's ``check`` for an ids artifact: built-in sentences (one past 128 tokens) tokenized as the
    server tokenizes them, through the embedding graph and the block, against transformers' ``AutoModel`` on the
    same ids (its ``last_hidden_state``, and sentence-transformers' pooling of it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModel
    except ImportError:
        raise ConfigError("--reference transformers needs transformers (pip install transformers)") from None
    from addnorm.model.text import TOKENIZER_FILE
    from addnorm.model.tokenize import TextTokenizer

    model = AutoModel.from_pretrained(
        str(directory), local_files_only=True, attn_implementation="eager"
    ).eval()
    tokenizer = TextTokenizer((directory / TOKENIZER_FILE).read_bytes(), text)
    sentences = [*SENTENCES, " ".join(SENTENCES)]
    batch = tokenizer.encode(sentences, truncate=True)
    feed = {
        "input_ids": torch.from_numpy(batch.input_ids),
        "attention_mask": torch.from_numpy(~batch.mask).long(),
    }
    if text.type_vocab_size:
        feed["token_type_ids"] = torch.from_numpy(batch.token_type_ids)
    with torch.no_grad():
        want = model(**feed).last_hidden_state.numpy()
    source = f"{len(sentences)} built-in sentences ({min(batch.lengths)}-{max(batch.lengths)} tokens)"

    def check(model_path: Path) -> dict:
        outs = run_ids(model_path.parent, config, batch)
        graph = agreement(outs[ENCODED], want, batch.mask)
        result = {
            "ids": {
                "model": f"transformers {type(model).__name__}",
                "inputs": source,
                "graph": graph.to_dict(),
            }
        }
        if POOLED in outs:
            err = float(
                np.abs(outs[POOLED] - reference_pool(config, want.astype(np.float64), batch.mask)).max()
            )
            result["ids"]["graph"]["pooled_max_abs"] = err
        if graph.min_sentence_cosine < IDS_MIN_COSINE:
            raise ConfigError(
                f"text through the exported graphs does not match transformers' {type(model).__name__} on {source}: "
                f"least sentence cosine {graph.min_sentence_cosine:.4f}; the family's mapping is wrong"
            )
        log.info(
            "reference (token ids): transformers %s on %s: max abs err %.2e, least sentence cosine %.6f",
            type(model).__name__,
            source,
            graph.max_abs,
            graph.min_sentence_cosine,
        )
        return result

    return check
