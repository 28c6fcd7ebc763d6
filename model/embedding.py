"""The embedding layer of a text encoder in PyTorch: an Add & Norm of the token's, its position's and its token
type's embeddings (``LayerNorm(word [+ position] [+ token_type])``: ModernBERT has neither), exported as its own graph with ONNX's native
``LayerNormalization`` (export/embedding.py). Parameter names follow transformers' ``BertEmbeddings``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from addnorm.model.text import TextConfig


class EmbeddingAddNorm(nn.Module):
    """``input_ids`` (B, S) int64 [, ``token_type_ids`` (B, S) int64] -> (B, S, E) float32."""

    def __init__(self, text: TextConfig, d_model: int) -> None:
        super().__init__()
        self.text = text
        self.word_embeddings = nn.Embedding(text.vocab_size, d_model)
        self.position_embeddings = (
            nn.Embedding(text.max_positions, d_model) if text.positions != "none" else None
        )
        self.token_type_embeddings = (
            nn.Embedding(text.type_vocab_size, d_model) if text.type_vocab_size else None
        )
        self.LayerNorm = nn.LayerNorm(d_model, eps=text.layer_norm_eps, bias=text.norm_bias)

    def positions(self, input_ids: Tensor) -> Tensor:
        """(B, S) position indices: 0.. (absolute), or fairseq's numbering after the padding index, where a padding
        token sits at the padding index (as transformers' RoBERTa computes it from the ids)."""
        if self.text.positions == "absolute":
            return torch.arange(input_ids.shape[1], dtype=torch.int64).unsqueeze(0).expand_as(input_ids)
        real = input_ids.ne(self.text.pad_token_id).to(torch.int64)
        return torch.cumsum(real, dim=1) * real + self.text.pad_token_id

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(self.positions(input_ids))
        if self.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_type_embeddings(types)
        return self.LayerNorm(x)

    def oracle(self, input_ids, token_type_ids=None):
        """The same arithmetic in float64 numpy: the gate's reference."""
        import numpy as np

        def table(m: nn.Embedding) -> np.ndarray:
            return m.weight.detach().double().numpy()

        ids = np.asarray(input_ids)
        x = table(self.word_embeddings)[ids]
        if self.position_embeddings is not None:
            x = x + table(self.position_embeddings)[self.positions(torch.from_numpy(ids)).numpy()]
        if self.token_type_embeddings is not None:
            types = np.zeros_like(ids) if token_type_ids is None else np.asarray(token_type_ids)
            x = x + table(self.token_type_embeddings)[types]
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        gamma = self.LayerNorm.weight.detach().double().numpy()
        beta = 0.0 if self.LayerNorm.bias is None else self.LayerNorm.bias.detach().double().numpy()
        return (x - mean) / np.sqrt(var + self.text.layer_norm_eps) * gamma + beta
