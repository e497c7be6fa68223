"""astrai_fabric: train AstrAI decoder-only language models on Lightning Fabric."""

__version__ = "0.1.0"
