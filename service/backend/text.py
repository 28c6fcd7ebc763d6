"""An ids artifact's way in for text (model/text.py): its tokenizer and its embedding layer's graph, beside the
block's engine. ``embed(batch)``: padded token ids -> the block's input embeddings."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from addnorm.model import quantize
from addnorm.model.artifact import ArtifactError, Verified
from addnorm.model.contract import EMBEDDINGS
from addnorm.model.runtime import session_args
from addnorm.model.text import INPUT_IDS, TOKEN_TYPE_IDS
from addnorm.model.tokenize import Batch, TextTokenizer
from addnorm.model.verdict import FP32_ATOL, float32_floor

RANGES_KEPT = 16  # the quantized forms' ranges kept, by (dimensions, normalized)


class TextFront:
    """The tokenizer (tokenizer.json, checked by its sha256) and the embedding graph on the block's providers. One
    intra-op thread: a table lookup and one norm per token, run per request (the block's run is batched)."""

    def __init__(self, verified: Verified, providers: list[str]) -> None:
        manifest = verified.manifest
        assert manifest.text is not None and verified.embedding is not None and verified.tokenizer is not None
        self.config = manifest.text
        self.tokenizer = TextTokenizer(verified.tokenizer, self.config)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # No arena: a lookup, an add and a LayerNormalization gain nothing from one, and an arena keeps the largest
        # part's buffers (tens of MB) for good after one big text request.
        opts.enable_cpu_mem_arena = False
        self.session = ort.InferenceSession(verified.embedding, opts, **session_args(providers))
        self.golden = verified.embedding_golden
        # the quantized vectors' calibration (model/quantize.py): None for an artifact without one
        self.calibration = None
        if verified.calibration is not None:
            try:
                self.calibration = quantize.load(verified.calibration)
            except ValueError as exc:
                raise ArtifactError(f"{quantize.CALIBRATION_FILE}: {exc}") from None
            if self.calibration.shape[1] != manifest.config.d_model:
                raise ArtifactError(
                    f"{quantize.CALIBRATION_FILE} holds vectors of {self.calibration.shape[1]} values; the model's "
                    f"have {manifest.config.d_model}"
                )
        self._ranges: dict[tuple, np.ndarray] = {}

    def ranges(self, dimensions: int | None, normalized: bool) -> np.ndarray | None:
        """The int8 and uint8 ranges of vectors cut to ``dimensions`` and ``normalized`` or not (quantize.ranges),
        made once each; None without a calibration."""
        if self.calibration is None:
            return None
        key = (dimensions, normalized)
        bounds = self._ranges.get(key)
        if bounds is None:
            if (
                len(self._ranges) >= RANGES_KEPT
            ):  # clients choose dimensions: the memory they can hold is bounded
                self._ranges.clear()
            bounds = self._ranges[key] = quantize.ranges(self.calibration, dimensions, normalized)
        return bounds

    def verify(self) -> tuple[bool, float, float, int] | None:
        """The embedding layer's golden cases through this session against the float64 oracle's embeddings:
        (passed, max abs err, bound, cases); None for an artifact without them. The bound is float32's floor
        of the output's scale (the export gate's)."""
        if self.golden is None:
            return None
        from safetensors.numpy import load

        arrays = load(self.golden)
        worst, bound, cases = 0.0, 0.0, 0
        for key in sorted(k for k in arrays if k.endswith("/" + INPUT_IDS)):
            case = key.rsplit("/", 1)[0]
            feed = {INPUT_IDS: arrays[key]}
            if self.config.type_vocab_size:
                feed[TOKEN_TYPE_IDS] = arrays[f"{case}/{TOKEN_TYPE_IDS}"]
            want = arrays[f"{case}/{EMBEDDINGS}"]
            got = self.session.run([EMBEDDINGS], feed)[0]
            worst = max(worst, float(np.abs(got - want).max()))
            bound = max(bound, float32_floor(want), FP32_ATOL)
            cases += 1
        return worst <= bound, worst, bound, cases

    def embed(self, batch: Batch) -> np.ndarray:
        """(B, S) ids -> (B, S, E) float32."""
        return self.embed_ids(batch.input_ids, batch.token_type_ids)

    def embed_ids(self, ids: np.ndarray, types: np.ndarray) -> np.ndarray:
        """(B, S) int64 ids and token types -> (B, S, E) float32 (the types read only by a model that has them)."""
        feed = {INPUT_IDS: ids}
        if self.config.type_vocab_size:
            feed[TOKEN_TYPE_IDS] = types
        return self.session.run([EMBEDDINGS], feed)[0]

    def describe(self) -> dict:
        return {"text": self.config.to_dict()}
