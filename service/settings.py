"""Service settings: ADDNORM_* environment variables (pydantic-settings), mirrored by addnorm-serve's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every field reads from ``ADDNORM_<FIELD>`` (e.g. ``ADDNORM_MODEL_DIR``); flags of addnorm-serve win."""

    model_config = SettingsConfigDict(env_prefix="ADDNORM_", extra="ignore", protected_namespaces=())

    model_dir: Path = Field(
        Path("artifacts/default"), description="artifact directory (manifest.json, model.onnx)"
    )
    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    providers: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="execution provider: auto (CUDA when available, else CPU), cpu, or cuda (fail if absent)",
    )
    intra_op_threads: int = Field(
        0, ge=0, description="onnxruntime intra-op threads; 0 = physical cores / workers"
    )
    workers: int = Field(1, ge=1, description="uvicorn worker processes (each loads its own session)")
    max_elements: int = Field(8 * 512 * 768, gt=0, description="largest accepted request, in tensor elements")
    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0, description="largest accepted request body, in bytes")
    max_batch_size: int = Field(
        32, ge=1, description="dynamic batching: most requests merged into one run; 1 = off"
    )
    max_batch_tokens: int = Field(
        8192, ge=1, description="dynamic batching: most batch x seq positions per run"
    )
    max_queue_delay_ms: float = Field(
        0.0,
        ge=0,
        description="dynamic batching: extra wait for more requests; 0 = merge what queued while busy",
    )
    max_queue_size: int = Field(
        256, ge=1, description="requests waiting beyond this get 429 with Retry-After"
    )
    request_timeout_s: float = Field(30.0, gt=0, description="a request not answered in this time gets 504")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_json: bool = Field(False, description="one JSON object per log line")
