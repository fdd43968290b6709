"""Molt's ``molt.utils`` helpers that agent modules import, so a Molt agent runs here unchanged.

``vlm_utils``: ``load_images``, ``split_image_placeholder``, ``should_expand_image_placeholder``.
``logging_utils``: ``init_logger``. Molt's trainer-side helpers (the tokenizer and strategy factories, the
processor and tensor plumbing, the W&B and TensorBoard loggers) are not here: importing one raises an
ImportError that says what takes its place.
"""

from __future__ import annotations

from typing import NoReturn

LEFT_OUT = {
    "get_strategy": "the trainer service builds its own strategy (molt train-rl)",
    "get_tokenizer": "load one with transformers.AutoTokenizer.from_pretrained",
}


def left_out(module: str, name: str, why: dict[str, str]) -> NoReturn:
    """A module ``__getattr__``: ImportError saying why Molt's ``module.name`` is not provided (the message
    reaches ``from module import name``, where an AttributeError's would not), else AttributeError."""
    if name in why:
        raise ImportError(f"{module}.{name} is Molt trainer code, not provided to agents here: {why[name]}", name=name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str) -> NoReturn:
    left_out(__name__, name, LEFT_OUT)
