"""onnxruntime + FastAPI serving of an addnorm artifact. Never imports torch, nor export/."""

from service.app import create_app
from service.settings import Settings

__all__ = ["Settings", "create_app"]
