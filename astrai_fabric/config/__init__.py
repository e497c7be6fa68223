"""Typed configuration: the model's ``config.json`` (AstrAI's schema)."""

from astrai_fabric.config.model import ModelConfig

__all__ = ["ModelConfig"]
