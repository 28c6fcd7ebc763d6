"""transformers' own models as the export's references, read from the local model directory only (nothing is
fetched from a hub): ``Reference`` (BERT: real sentences through its tokenizer and embedding layer, and its
encoder's output on given embeddings) and ``reference_check`` for --inputs embeddings, ``ids_check`` (any family:
``AutoModel`` on the ids the server's tokenizer makes) for --inputs ids. transformers is imported where it is used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from addnorm.export.agreement import agreement, scores_agreement, sparse_agreement, splade
from addnorm.export.model_dir import TOKENIZER_FILES
from addnorm.export.parity import make_session
from addnorm.export.sentences import MORE, SENTENCES
from addnorm.model.config import ConfigError
from addnorm.model.contract import EMBEDDINGS, ENCODED, MASK, POOLED, SCORES, SPARSE, output_names
from addnorm.model.reference import pool as reference_pool
from addnorm.model.verdict import FP32_ATOL, FP32_RTOL

log = logging.getLogger("addnorm.export")


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


def _pairs_reference(model, tokenizer, text) -> tuple:
    """A cross-encoder's reference on pairs: a built-in query with each built-in sentence (tokenized as the server
    pairs them, cut in the document), transformers' logits on those ids: (batch, logits, what they are)."""
    query, documents = SENTENCES[6], [*SENTENCES, *MORE]
    batch = tokenizer.encode([query] * len(documents), truncate=True, seconds=documents)
    with torch.no_grad():
        logits = model(**feed(batch, text)).logits.numpy()
    return batch, logits, f"a built-in query with {len(documents)} built-in sentences as pairs"


def feed(batch, text) -> dict:
    """A tokenized batch as transformers' model takes it (token types where the embedding layer has them)."""
    feed = {
        "input_ids": torch.from_numpy(batch.input_ids),
        "attention_mask": torch.from_numpy(~batch.mask).long(),
    }
    if text.type_vocab_size:
        feed["token_type_ids"] = torch.from_numpy(batch.token_type_ids)
    return feed


def _stacked(cases: list) -> tuple[np.ndarray, np.ndarray]:
    """Given cases as one batch, each padded (and masked) to the longest."""
    seq = max(c.seq for c in cases)
    x = [np.pad(c.embeddings, ((0, 0), (0, seq - c.seq), (0, 0))) for c in cases]
    mask = [np.pad(c.mask, ((0, 0), (0, seq - c.seq)), constant_values=True) for c in cases]
    return np.concatenate(x), np.concatenate(mask)


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


# The least per-sentence cosine with transformers an ids export may have (and the least cosine of a head's scores
# about their mean): far below any variant's own tolerance, far above what a wrong family mapping (positions, token
# types, a missing layer, a head's activation) gives.
IDS_MIN_COSINE = 0.99


def ids_check(directory: Path, text, config):
    """The pipeline's ``check`` for an ids artifact: built-in sentences (one past 128 tokens) tokenized as the
    server tokenizes them, through the embedding graph and the block, against transformers' ``AutoModel`` on the
    same ids (its ``last_hidden_state``, and sentence-transformers' pooling of it); with a classification head,
    ``AutoModelForSequenceClassification``'s last hidden state and logits; with a sparse head,
    ``AutoModelForMaskedLM``'s, its logits through SpladePooling."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification
    except ImportError:
        raise ConfigError("--reference transformers needs transformers (pip install transformers)") from None
    from addnorm.model.text import TOKENIZER_FILE
    from addnorm.model.tokenize import TextTokenizer

    head = config.head != "none"
    kind = {"classify": AutoModelForSequenceClassification, "sparse": AutoModelForMaskedLM}.get(config.head)
    model = (
        (kind or AutoModel)
        .from_pretrained(str(directory), local_files_only=True, attn_implementation="eager")
        .eval()
    )
    tokenizer = TextTokenizer((directory / TOKENIZER_FILE).read_bytes(), text)
    sentences = [*SENTENCES, " ".join(SENTENCES)]
    batch = tokenizer.encode(sentences, truncate=True)
    with torch.no_grad():
        answer = model(**feed(batch, text), output_hidden_states=head)
    want = (answer.hidden_states[-1] if head else answer.last_hidden_state).numpy()
    want_scores = answer.logits.numpy() if config.head == "classify" else None
    want_sparse = None
    if config.head == "sparse":
        logits = answer.logits.double().numpy()
        want_sparse = splade(logits, batch.mask, config.sparse_pooling, config.sparse_activation)
    pairs = _pairs_reference(model, tokenizer, text) if config.task == "rerank" else None
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
        heads = (
            # the scores' cosine about each label's mean: a wrong head's common offset cannot pass it
            (
                want_scores,
                SCORES,
                scores_agreement,
                "scores_centered_cosine",
                "classification head's scores",
                "head",
            ),
            (
                want_sparse,
                SPARSE,
                sparse_agreement,
                "sparse_min_cosine",
                "sparse head's weights",
                "masked-LM head",
            ),
        )
        for wanted, name, agree, cosine, what, mapping in heads:
            if wanted is None:
                continue
            result["ids"]["graph"].update(agree(outs[name], wanted))
            if (found := result["ids"]["graph"][cosine]) < IDS_MIN_COSINE:
                raise ConfigError(
                    f"the {what} do not match transformers' {type(model).__name__} on {source}: "
                    f"{cosine.replace('_', ' ')} {found:.4f}; the family's {mapping} mapping is wrong"
                )
        if pairs is not None:  # a cross-encoder's ranking of documents for a query, as its users read it
            pair_batch, pair_scores, pair_source = pairs
            ranked = scores_agreement(run_ids(model_path.parent, config, pair_batch)[SCORES], pair_scores)
            result["ids"]["pairs"] = {"inputs": pair_source, **ranked}
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
