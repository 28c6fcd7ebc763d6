"""The quantized vectors' calibration, made once at export (model/quantize.py): real sentences through the graphs
just written, as the server runs them, their pooled vectors kept unnormalized in ``calibration.safetensors``; a
served int8 or uint8 vector is measured against their ranges."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from addnorm.export.hf import run_ids
from addnorm.export.sentences import calibration_sentences
from addnorm.model import quantize
from addnorm.model.config import EncoderConfig
from addnorm.model.contract import ENCODED
from addnorm.model.reference import pool
from addnorm.model.text import TOKENIZER_FILE, TextConfig
from addnorm.model.tokenize import TextTokenizer

log = logging.getLogger(__name__)
BATCH = 16  # sentences a run


def calibrated(config: EncoderConfig) -> bool:
    """Whether an artifact of ``config`` answers sentence vectors (the quantized forms' subject)."""
    return config.task == "embed" and config.pooling != "none"


def write_calibration(
    staging: Path, config: EncoderConfig, text: TextConfig, sentences: list[str] | None = None
) -> int:
    """``sentences`` (None: the built-in calibration) through the artifact in ``staging``, tokenized as the
    server tokenizes them (cut at the model's length), their pooled vectors written unnormalized to
    ``staging``/calibration.safetensors; how many sentences."""
    sentences = list(sentences) if sentences else calibration_sentences()
    tokenizer = TextTokenizer((staging / TOKENIZER_FILE).read_bytes(), text)
    raw = dataclasses.replace(config, normalize_pooled=False)
    vectors = []
    for start in range(0, len(sentences), BATCH):
        batch = tokenizer.encode(sentences[start : start + BATCH], truncate=True)
        encoded = run_ids(staging, config, batch)[ENCODED]
        vectors.append(pool(raw, encoded, batch.mask).astype(np.float32))
    quantize.save(staging / quantize.CALIBRATION_FILE, np.concatenate(vectors), len(sentences))
    log.info("quantized vectors: int8 and uint8 ranges calibrated on %d sentences", len(sentences))
    return len(sentences)
