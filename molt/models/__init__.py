"""Local models, built offline: tiny random-init models and SmolLM2-135M-Instruct from a registry wheel."""

from pathlib import Path

from molt.models import tiny, tiny_vl


def build_tiny(
    out: str | Path,
    arch: tiny.Arch = "qwen3",
    seed: int = 0,
    vocab_size: int = 1024,
    hidden: int = 128,
    layers: int = 2,
    tie: bool = True,
) -> Path:
    """A tiny random-init model dir of ``arch`` (text: tiny.py; the vision-language idefics3: tiny_vl.py)."""
    if arch == "idefics3":
        return tiny_vl.build_tiny_vl(out, seed, vocab_size, hidden, layers, tie)
    return tiny.build_tiny(out, arch, seed, vocab_size, hidden, layers, tie)


__all__ = ["build_tiny"]
