"""What an artifact that takes text carries besides the encoder block: the embedding layer's shape and the
tokenizer's limits. No torch: the service reads it.

An encoder's embedding layer is itself an Add & Norm: the token's, its position's (and its token type's) embeddings
added, then LayerNorm. Export writes it as its own graph (``embedding.onnx``: ``input_ids`` [, ``token_type_ids``]
int64 (batch, seq) -> ``embeddings`` float32 (batch, seq, d_model), the block's input), gated like the block; the
server tokenizes with the artifact's ``tokenizer.json`` (Hugging Face ``tokenizers``), runs it, then the block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from addnorm.model.config import ConfigError
from addnorm.model.contract import EMBEDDINGS

EMBEDDING_FILE = "embedding.onnx"
TOKENIZER_FILE = "tokenizer.json"
# ids with the float64 oracle's embeddings of them, checked by every server at load (service/backend/text.py)
EMBEDDING_GOLDEN_FILE = "embedding_golden.safetensors"
INPUT_IDS, TOKEN_TYPE_IDS, ATTENTION_MASK = "input_ids", "token_type_ids", "attention_mask"
# How positions are numbered: 0, 1, 2, ... (BERT, DistilBERT), or after the padding index, padding tokens at it
# (RoBERTa, XLM-RoBERTa: fairseq's make_positions).
POSITIONS = ("absolute", "after_padding", "none")  # none: no position table (rotary positions in the block)
IDS = "ids"
INPUTS = (EMBEDDINGS, IDS)  # what an artifact takes: the block's embeddings only, or token ids (and text)


@dataclass(frozen=True)
class TextConfig:
    """The embedding layer and the tokenizer's limits of an artifact exported with ``--inputs ids``.

    ``family``: the encoder family (export/families), ``config.json``'s ``model_type``. ``max_length``: the most
    tokens one input may have, special tokens included (sentence-transformers' ``max_seq_length`` where the model
    directory has one, else what the position table holds); longer inputs are refused, or cut when asked.
    ``prompts``: sentence-transformers' named prompts (``config_sentence_transformers.json``), by name.
    ``default_prompt_name``: the prompt sentence-transformers puts before a text when none is asked for.
    ``positions``: ``absolute`` (0..), ``after_padding`` (RoBERTa's numbering) or ``none`` (no position table:
    ModernBERT's positions are rotary, in the block); ``norm_bias`` false: the norm has no bias (ModernBERT).
    ``clean_up_spaces``: transformers' ``clean_up_tokenization_spaces`` (``tokenizer_config.json``): its decode
    joins " ." and " 's" after the tokenizer's own decoder (vLLM's /detokenize answers that).
    """

    family: str
    vocab_size: int
    max_positions: int
    type_vocab_size: int  # 0: the family has no token types (DistilBERT)
    pad_token_id: int
    positions: str
    layer_norm_eps: float
    max_length: int
    prompts: dict[str, str] = field(default_factory=dict)
    norm_bias: bool = True
    default_prompt_name: str | None = None  # the prompt put before a text when a request names none
    clean_up_spaces: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_positions", "max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"text.{name} must be a positive integer, got {value!r}")
        for name in ("type_vocab_size", "pad_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"text.{name} must be a non-negative integer, got {value!r}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"text.positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.max_length > self.max_positions - self.position_offset:
            raise ConfigError(
                f"text.max_length {self.max_length} is more than the {self.max_positions - self.position_offset} "
                "positions the embedding layer has"
            )
        if not isinstance(self.clean_up_spaces, bool):
            raise ConfigError(f"text.clean_up_spaces must be true or false, got {self.clean_up_spaces!r}")
        if not isinstance(self.prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.prompts.items()
        ):
            raise ConfigError("text.prompts must map names to strings")
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise ConfigError(
                f"text.default_prompt_name {self.default_prompt_name!r} is not one of its prompts {sorted(self.prompts)}"
            )

    @property
    def position_offset(self) -> int:
        """The first real token's position index."""
        return self.pad_token_id + 1 if self.positions == "after_padding" else 0

    @property
    def input_names(self) -> tuple[str, ...]:
        """The embedding graph's inputs, in order."""
        return (INPUT_IDS, TOKEN_TYPE_IDS) if self.type_vocab_size else (INPUT_IDS,)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TextConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"text must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ConfigError(f"unknown text field(s) {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a field missing
            raise ConfigError(f"text: {exc}") from None
