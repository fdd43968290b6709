"""Local models, built offline: tiny random-init models and SmolLM2-135M-Instruct from a registry wheel."""

from molt.models.tiny import build_tiny

__all__ = ["build_tiny"]
