"""The reference of what people write by hand: FastAPI + pydantic + torch, JSON lists in and out.

Run: ADDNORM_BENCH_ARTIFACT=artifacts/default uvicorn bench.naive_app:app --port 8100
"""

from __future__ import annotations

import os

import torch
from fastapi import FastAPI
from pydantic import BaseModel

from addnorm.commands import DEFAULT_ARTIFACT
from addnorm.export.weights import load_weights
from addnorm.model.artifact import Manifest
from addnorm.model.encoder import Encoder

_dir = os.environ.get("ADDNORM_BENCH_ARTIFACT", str(DEFAULT_ARTIFACT))
_model = load_weights(Encoder(Manifest.load(_dir).config), f"{_dir}/weights.safetensors").eval()
app = FastAPI()


class EncodeRequest(BaseModel):
    embeddings: list[list[list[float]]]


class EncodeResponse(BaseModel):
    encoded: list[list[list[float]]]


@app.post("/encode", response_model=EncodeResponse)
def encode(req: EncodeRequest) -> EncodeResponse:
    with torch.no_grad():
        out = _model(torch.tensor(req.embeddings))
    return EncodeResponse(encoded=out.tolist())
