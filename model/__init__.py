"""What the model is: its config and artifact format (no torch), and the torch modules (model.encoder)."""

from addnorm.model.config import ConfigError, EncoderConfig

__all__ = ["ConfigError", "EncoderConfig"]
