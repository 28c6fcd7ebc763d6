"""Text and token ids in: what the text APIs (/v1/embeddings, TEI's /embed, V2's BYTES ``text``) share between their
JSON and the request core. ``decode_texts`` tokenizes with the model's tokenizer, cuts the request into parts of
at most ``max_batch_tokens`` padded positions (one, in input order, when they fit; else sorted by length, so that
each part pads little): the request runs its parts on the model's batcher side by side (``TextRequest.run``,
``run_parts``), where they merge with other requests by token cost as any tensors do, and a run embeds all its
text with the model's embedding layer at once (``merging.Tokens``). ``vectors`` gives each input's sentence
embedding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from addnorm.model.contract import ENCODED, POOLED, SCORES, SPARSE
from addnorm.model.quantize import CALIBRATED, FLOAT, PRECISIONS, quantize
from addnorm.model.tokenize import Batch, QueryTooLong, TooLong, TooManyChars
from addnorm.service.batching.merging import Outputs, Timings, Tokens
from addnorm.service.core.inference import offload, work
from addnorm.service.errors import BadInput, TooLarge, quote

Inputs = list[str] | list[list[int]]  # texts, or token id lists


@dataclass(frozen=True)
class TextLimits:
    """The server's settings for text requests: most inputs per request, padded positions per part, and whether
    inputs over the model's length are cut rather than refused."""

    max_inputs: int
    max_batch_tokens: int
    auto_truncate: bool
    max_bytes: int | None = None  # a request's embeddings in all (ADDNORM_MAX_QUEUE_BYTES)
    default_prompt_name: str | None = None  # --default-prompt-name
    default_prompt: str | None = None  # --default-prompt

    @classmethod
    def of(cls, settings) -> TextLimits:
        return cls(
            settings.max_client_batch_size,
            settings.max_batch_tokens,
            settings.auto_truncate,
            settings.max_queue_bytes,
            settings.default_prompt_name,
            settings.default_prompt,
        )


@dataclass
class Part:
    """Some of a request's inputs, padded together: their rows in the request, and their ids as they queue
    (``tokens``: embedded by the model's embedding layer when a run takes them, on the inference thread)."""

    rows: np.ndarray  # (b,) indices into the request's inputs
    batch: Batch
    tokens: Tokens


@dataclass
class TextRequest:
    """A decoded text request: a ``core.inference.Decoded`` that runs in parts, its inputs' rows in each;
    ``embeddings`` (its first part's ``Tokens``, shaped as its embeddings) and ``mask`` are what /v1's and V2's
    request types carry beside it."""

    parts: list[Part]
    tokens: int  # real tokens in all, special tokens included (usage.prompt_tokens)
    model: str | None = None
    timeout_s: float | None = None
    options: dict = field(default_factory=dict)  # the protocol's own (normalize, dimensions, encoding)

    @property
    def embeddings(self) -> Tokens:
        return self.parts[0].tokens

    @property
    def mask(self) -> np.ndarray:
        return self.parts[0].batch.mask

    @property
    def rows(self) -> int:
        return sum(len(p.rows) for p in self.parts)

    async def run(self, infer, timeout: float, timer) -> tuple[Outputs, Timings]:
        """Its parts on the model (``infer``: ServingModel.infer) within ``timeout``: ``run_parts``."""
        return await run_parts(infer, self, timeout, timer)


def text_inputs(value: object, where: str, max_inputs: int) -> Inputs:
    """A JSON ``input``: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadInput(f"{where} must be a string, a list of strings or a list of token id lists (non-empty)")
    if len(value) > max_inputs:
        raise TooLarge(
            f"{where} holds {len(value)} inputs, more than this server's {max_inputs} (ADDNORM_MAX_CLIENT_BATCH_SIZE)"
        )
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]  # one input as token ids
    if all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            if not v:
                raise BadInput(f"{where}[{i}] is an empty string")
        return value
    if isinstance(value[0], str):  # strings, then something else: the first that is not one is at fault
        i = next(i for i, v in enumerate(value) if not isinstance(v, str))
        raise BadInput(
            f"{where}[{i}] must be a string as {where}[0] is (every input of one kind); got {quote(value[i])}"
        )
    for i, v in enumerate(value):
        if (
            not isinstance(v, list)
            or not v
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        ):
            raise BadInput(
                f"{where}[{i}] must be a string or a non-empty list of token ids (integers), and every input "
                f"of one kind; got {quote(v)}"
            )
    return value


# Parts of one request queued at a time: their embeddings (each at most max_batch_tokens positions) exist only
# while they run, and its queued parts count as theirs against the queue's bytes, so a request of many inputs holds
# two parts' worth, not all of them. Two keep
# the model busy (the next part waits in the queue while one runs) and let another client's request wait behind
# at most one queued part of it, besides the run in progress (python -m bench --stall).
PARTS_IN_FLIGHT = 2


# What each task's model answers, and the routes that ask it (a request for another task names them)
TASK_ROUTES = {
    "embed": "/v1/embeddings, /embed, /embed_all, /similarity, /pooling or V2's infer",
    "rerank": "/rerank, /v1/rerank, /v2/rerank, /score or /predict",
    "classify": "/predict, /classify or /pooling",
    "sparse": "/embed_sparse or V2's infer",
}


def prompt_text(front, name: str | None, literal: str | None, limits: TextLimits) -> str:
    """What goes before each text: the request's ``prompt_name`` (one of the model's prompts) or ``prompt`` (a text
    of its own), else the server's --default-prompt, or its --default-prompt-name where the model has that prompt,
    else the model's own ``default_prompt_name`` (sentence-transformers'); else nothing."""
    prompts = front.config.prompts
    if name is not None and literal is not None:
        raise BadInput("give prompt_name or prompt, not both")
    if literal is not None:
        return literal
    if name is not None:
        if name not in prompts:
            raise BadInput(f"prompt_name {quote(name)} is not one of this model's prompts {sorted(prompts)}")
        return prompts[name]
    if limits.default_prompt is not None:
        return limits.default_prompt
    default = limits.default_prompt_name
    default = default if default in prompts else front.config.default_prompt_name
    return prompts[default] if default is not None else ""


# What a sentence vector may be answered as: float32, or one of sentence-transformers' quantized forms
EMBEDDING_TYPES = (FLOAT, *PRECISIONS)
PRECISION = "precision"  # (a text request's options: the form of its answer's vectors)


def embedding_type(value: object, where: str) -> str:
    """A request's form of its vectors (``EMBEDDING_TYPES``; None: float)."""
    if value is None:
        return FLOAT
    if not isinstance(value, str) or value not in EMBEDDING_TYPES:
        raise BadInput(f"{where} must be one of {list(EMBEDDING_TYPES)}, got {quote(value)}")
    return value


def need_precision(model, precision: str, where: str) -> None:
    """BadInput when ``model`` cannot answer vectors in ``precision``: int8 and uint8 need the ranges its export
    calibrated; only a model that answers sentence vectors answers them quantized."""
    if precision == FLOAT:
        return
    config = model.engine.manifest.config
    if config.task != "embed":
        raise BadInput(
            f"{where} {precision} quantizes sentence vectors; model {quote(model.name)} is a {config.task} model"
        )
    front = model.engine.text
    if precision in CALIBRATED and (front is None or front.calibration is None):
        raise BadInput(
            f"{where} {precision} needs the int8 and uint8 ranges an export calibrates; model {quote(model.name)} "
            "was exported without them (re-export it with addnorm-export), or ask for binary or ubinary"
        )


def quantized(
    model, vectors: np.ndarray, precision: str, dimensions: int | None, normalized: bool
) -> np.ndarray:
    """Sentence ``vectors`` (cut to ``dimensions``, ``normalized`` or not) in ``precision``: themselves for float,
    else sentence-transformers' quantized form against the model's calibration (model/quantize.py)."""
    if precision == FLOAT:
        return vectors
    front = model.engine.text
    return quantize(
        vectors, precision, front.ranges(dimensions, normalized) if precision in CALIBRATED else None
    )


def need_task(model, tasks: tuple[str, ...], route: str) -> None:
    """BadInput unless ``model``'s task (EncoderConfig.task) is one of ``tasks``: naming its task and its routes."""
    task = model.engine.manifest.config.task
    if task not in tasks:
        raise BadInput(
            f"model {quote(model.name)} is a{'n' if task[0] in 'ae' else ''} {task} model; {route} needs "
            f"{' or '.join(tasks)}: ask it on {TASK_ROUTES[task]}"
        )


def decode_texts(
    model,
    inputs: Inputs,
    truncate: bool | None,
    limits: TextLimits,
    where: str | Callable[[int], str] = "input",
    prompt: str | None = None,
    seconds: list[str] | None = None,
    literal: str | None = None,
    direction: str = "right",
    max_tokens: int | None = None,
) -> TextRequest:
    """Tokenize (or check the ids of) ``inputs`` (``text_inputs``'s) with ``model``'s text front, behind its prompt
    ``prompt``, in parts of at most ``limits.max_batch_tokens`` positions (embedded when they run). Cut to the
    model's length when ``truncate``, or where it is None (the request does not say) ``limits.auto_truncate``;
    refused when its embeddings could never fit the queue (``limits.max_bytes``). ``seconds``: each text's second, tokenized as a pair (a query and a document;
    cut in the second only). ``max_tokens``: the request's own limit on each text's tokens (Cohere's), below the
    model's; cut to it as to the model's length, or refused; of a pair, on its second text's own tokens (cut).
    ``where``: what the API calls its inputs in errors (``input`` -> ``input[3]``), or each input's name by index."""
    at = where if callable(where) else lambda i: f"{where}[{i}]"  # an input's name in an error (``where``)
    front = model.engine.text
    if front is None:
        raise BadInput(
            f"model {quote(model.name)} takes embeddings, not text or token ids: export it from a model directory "
            "with --inputs ids"
        )
    # TEI's rule: the request's own truncate, else the server's --auto-truncate
    truncate = limits.auto_truncate if truncate is None else truncate
    max_batch_tokens = model.engine.manifest.config.run_tokens(limits.max_batch_tokens)
    max_bytes = limits.max_bytes
    if isinstance(inputs[0], str) and seconds is None:  # a pair (a query and a document) has no prompt
        prefix = prompt_text(front, prompt, literal, limits)
        inputs = [prefix + text for text in inputs] if prefix else inputs
    limit = front.config.max_length
    specials = front.tokenizer.specials
    if max_tokens is not None and seconds is None and isinstance(inputs[0], str) and max_tokens <= specials:
        raise BadInput(
            f"a limit of {max_tokens} tokens a text leaves none for the text: model {quote(model.name)} adds "
            f"{specials} special tokens to each; ask for more than {specials} (max_tokens, truncate_prompt_tokens)"
        )
    if isinstance(inputs[0], str):
        try:
            rows, types = front.tokenizer.ids(inputs, truncate, seconds, direction, max_tokens)
        except QueryTooLong as exc:
            raise TooLarge(
                f"{at(exc.index)}'s query alone takes more than this model's {exc.limit} tokens: only documents "
                "are cut; shorten the query"
            ) from None
        except TooLong as exc:
            whose = "max_tokens" if exc.asked else "this model's"
            raise TooLarge(
                f"{at(exc.index)} has {exc.tokens} tokens, more than {whose} {exc.limit}: shorten it, or "
                "send truncate: true"
            ) from None
        except TooManyChars as exc:
            hint = "split it" if exc.truncated else "shorten it, or send truncate: true"
            raise TooLarge(f"{at(exc.index)} has {exc.chars} characters, {exc.reason}: {hint}") from None
        types_held = front.config.type_vocab_size
        if seconds is not None and types_held and max(max(row) for row in types) >= types_held:
            raise BadInput(  # the artifact's tokenizer marks a pair's second text with a type its embeddings lack
                f"model {quote(model.name)} does not take pairs: its tokenizer gives a pair's second text a token "
                f"type its embedding layer does not have ({types_held} type(s))"
            )
    else:
        vocab = front.config.vocab_size
        rows, types = [], None
        for i, ids in enumerate(inputs):
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise BadInput(
                    f"{at(i)} holds token id {bad[0]}, outside this model's vocabulary [0, {vocab})"
                )
            if len(ids) > limit:
                if not truncate:
                    raise TooLarge(
                        f"{at(i)} has {len(ids)} tokens, more than this model's {limit}: shorten it, or "
                        "send truncate: true"
                    )
                ids = ids[:limit]
            if max_tokens is not None and len(ids) > max_tokens:  # token ids as given: cut as they are
                if not truncate:
                    raise TooLarge(
                        f"{at(i)} has {len(ids)} tokens, more than max_tokens {max_tokens}: shorten it, or "
                        "send truncate: true"
                    )
                ids = ids[:max_tokens] if direction == "right" else ids[-max_tokens:]
            rows.append(ids)
    width = model.engine.d_model
    if max_bytes is not None and (need := sum(map(len, rows)) * width * 4) > max_bytes:
        raise TooLarge(
            f"{where if isinstance(where, str) else 'the inputs'} holds {sum(map(len, rows))} tokens: {need} bytes of "
            "embeddings, above this server's queue of "
            f"{max_bytes} bytes (ADDNORM_MAX_QUEUE_BYTES); split the request"
        )
    lengths = [len(r) for r in rows]
    parts, embed = [], front.embed_ids
    for picked in parts_of(lengths, max_batch_tokens):
        batch = front.tokenizer.pad(
            [rows[i] for i in picked], None if types is None else [types[i] for i in picked]
        )
        parts.append(Part(picked, batch, Tokens(batch.input_ids, batch.token_type_ids, embed, width)))
    return TextRequest(parts, sum(lengths))


def parts_of(lengths: list[int], max_batch_tokens: int) -> list[np.ndarray]:
    """A request's inputs (their token counts) as parts of at most ``max_batch_tokens`` padded positions each. All
    of them in one when they fit, in input order: the batcher queues a part as pieces of near lengths anyway
    (``Batcher.infer``), and its answer then needs no reordering. Else sorted by length, the longest run of inputs
    that fits in each part, shortest first, so that each pads little."""
    if len(lengths) * max(lengths) <= max_batch_tokens:
        return [np.arange(len(lengths))]
    order = np.argsort(lengths, kind="stable")
    parts, start = [], 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * lengths[order[stop]] <= max_batch_tokens:
            stop += 1
        parts.append(order[start:stop])
        start = stop
    return parts


async def run_parts(infer, req: TextRequest, limit: float, timer) -> tuple[Outputs, Timings]:
    """Each part on the model's batcher side by side (``infer``: ServingModel.infer), answers back in input order:
    positional outputs padded to the longest part's length."""
    gate = asyncio.Semaphore(PARTS_IN_FLIGHT)

    async def one(part: Part):
        async with gate:
            return await infer(part.tokens, part.batch.padding, limit, timer)

    # One part holds the inputs in input order (``parts_of``): its answer is the request's.
    if len(req.parts) == 1:
        return await infer(req.parts[0].tokens, req.parts[0].batch.padding, limit, timer)
    answers = await asyncio.gather(*(one(p) for p in req.parts))
    # Several parts hold more than max_batch_tokens positions, megabytes of outputs: joining them copies every output
    # (the largest request's, hundreds of MB) in a worker, where numpy's copies leave the interpreter to the event loop
    # (docs/reliability.md, "One big request, and the others"); a small limit's join stays on the loop, by offload's
    # rule (a copy counts as raw bytes: core.inference.work).
    nbytes = sum(out.nbytes for outputs, _ in answers for out in outputs.values())
    return await offload(work(raw=nbytes), _joined, req, answers)


def _joined(req: TextRequest, answers: list[tuple[Outputs, Timings]]) -> tuple[Outputs, Timings]:
    """The parts' answers as the request's, in input order: positional outputs padded to the longest part's
    length."""
    outputs: Outputs = {}
    for name in answers[0][0]:
        pieces = [out[name] for out, _ in answers]
        shape = list(pieces[0].shape[1:])
        if pieces[0].ndim == 3:  # (b, s, E): each part's positions, zeros past them
            shape[0] = max(p.shape[1] for p in pieces)
        whole = np.zeros((req.rows, *shape), np.float32)
        for part, piece in zip(req.parts, pieces, strict=True):
            if piece.ndim == 3:
                whole[part.rows, : piece.shape[1]] = piece
            else:
                whole[part.rows] = piece
        outputs[name] = whole
    return outputs, max((t for _, t in answers), key=lambda t: t.queue_s + t.infer_s)


def vectors(
    req: TextRequest,
    outputs: Outputs,
    pooling: str,
    normalized: bool,
    normalize: bool | None = None,
    dimensions: int | None = None,
) -> np.ndarray:
    """(N, D) sentence embeddings in input order: the graph's pooled output (``pooling``, L2-normalized when
    ``normalized``), or the tokens pooled here the same way when the graph has none or the client asks for raw
    vectors of a normalizing model; normalized when ``normalize`` (None: as the model does), after being cut to
    their first ``dimensions`` (Matryoshka)."""
    wanted = normalized if normalize is None else normalize
    if POOLED in outputs and (wanted or not normalized):
        out = outputs[POOLED].astype(np.float32, copy=True)
        if normalized and dimensions is None:  # normalized by the graph already (and gated so)
            return out
    else:
        encoded = outputs[ENCODED]
        if pooling == "cls":
            out = encoded[:, 0].copy()
        else:
            keep = (~_mask(req, encoded.shape[1]))[..., None].astype(np.float32)
            out = (encoded * keep).sum(1) / np.maximum(keep.sum(1), 1e-9)
    return _cut(out, dimensions, wanted)


def _cut(out: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Vectors (the last axis) cut to their first ``dimensions`` (Matryoshka), then L2-normalized when
    ``normalize``, in place: ``out`` is the caller's own copy."""
    if dimensions is not None:
        if dimensions > out.shape[-1]:
            raise BadInput(f"dimensions {dimensions} is more than this model's {out.shape[-1]}")
        out = np.ascontiguousarray(out[..., :dimensions])
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out


def sentence_vectors(
    req: TextRequest,
    model,
    outputs: Outputs,
    normalize: bool | None = None,
    dimensions: int | None = None,
    precision: str | None = None,
) -> np.ndarray:
    """The request's sentence vectors as its answer has them (``vectors``: pooled as the model pools, normalized
    when ``normalize``, None: as the model does, cut to ``dimensions``), in ``precision`` (None: the request's;
    float32, or a quantized form: ``quantized``)."""
    config = model.engine.manifest.config
    pooled_by = config.pooling if config.pooling != "none" else "mean"
    out = vectors(req, outputs, pooled_by, config.normalize_pooled, normalize, dimensions)
    wanted = config.normalize_pooled if normalize is None else normalize
    precision = req.options.get(PRECISION, FLOAT) if precision is None else precision
    return quantized(model, out, precision, dimensions, wanted)


def token_vectors(
    req: TextRequest, outputs: Outputs, dimensions: int | None = None, normalize: bool = False
) -> list[np.ndarray]:
    """Each input's token vectors in input order, (its tokens, E): the encoder's last hidden state of its real
    tokens, special tokens included (text-embeddings-inference's /embed_all); each cut to ``dimensions`` and
    normalized when ``normalize`` (vLLM's token_embed)."""
    encoded = outputs[ENCODED]
    keep = ~_mask(req, encoded.shape[1])
    return [_cut(row[k], dimensions, normalize) for row, k in zip(encoded, keep, strict=True)]


def scores(outputs: Outputs, raw: bool) -> np.ndarray:
    """(N, labels) a classification head's scores in input order: its logits when ``raw``, else as
    text-embeddings-inference and sentence-transformers' CrossEncoder give them: one label through a sigmoid (a
    relevance in (0, 1)), several through a softmax (probabilities)."""
    logits = outputs[SCORES].astype(np.float64)
    if raw:
        return logits
    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def sparse_rows(outputs: Outputs) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each input's SPLADE weights in input order as (indices, values) of its non-zero entries, indices ascending
    (text-embeddings-inference's /embed_sparse; the terms a sparse index stores)."""
    out = []
    for row in outputs[SPARSE]:
        (index,) = np.nonzero(row)
        out.append((index, row[index]))
    return out


def _mask(req: TextRequest, seq: int) -> np.ndarray:
    mask = np.ones((req.rows, seq), bool)
    for part in req.parts:
        m = part.batch.mask
        mask[part.rows, : m.shape[1]] = m
    return mask
