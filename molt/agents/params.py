"""``SamplingParams``: the object agents read sampling settings from, with vLLM's attribute names.

Molt hands an agent a vLLM ``SamplingParams`` (``ctx.sampling_params.max_tokens``,
``state["sampling_params"].temperature``) and accepts one back in ``Result(sampling_params=...)``.
Env workers here do not import vLLM, so this is a plain object with the same attribute names and
defaults; ``from_any`` also takes a real vLLM ``SamplingParams`` (read by attribute) or a dict of
the same names. ``wire()`` is what travels to the gateway: the fields that were given or differ
from vLLM's defaults, so the gateway's own defaults fill only what nobody set.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = None
    """Per-turn token cap; None: the rest of the episode's context budget."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    """Kept for Molt's code that reads it; the gateway records every action token's logprob anyway."""
    skip_special_tokens: bool = False
    """Rollouts decode with special tokens kept (Molt's setting); not sent (the gateway decodes)."""
    _given: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    @classmethod
    def from_any(cls, value: Any, where: str = "sampling_params") -> SamplingParams:
        """A copy of ``value``: this class, an object with vLLM's attribute names, a dict of them, or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):  # Molt's pattern: the state's copy, edited, handed back (keeps what was given)
            return copy.deepcopy(value)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"{where}: unknown sampling param(s) {unknown}; known: {names}")
            given = value
        else:
            given = {k: getattr(value, k) for k in names if hasattr(value, k)}
            if not given:
                raise TypeError(
                    f"{where} must be a SamplingParams (vLLM attribute names) or a dict, got {type(value).__name__}"
                )
        given = {k: _plain(v) for k, v in given.items()}
        for k, v in given.items():
            if isinstance(v, float) and not math.isfinite(v):  # else an opaque JSON error on the way to the gateway
                raise ValueError(f"{where}.{k} must be a finite number, got {v}")
        out = cls(**given)
        out._given = frozenset(k for k, v in given.items() if v is not None)
        return out

    def wire(self) -> dict[str, Any]:
        """The gateway's sampling_params: the fields given or changed from the defaults (None and [] = unset)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in _NOT_SENT:
                continue
            value = getattr(self, f.name)
            if value not in (None, []) and (f.name in self._given or value != f.default):
                out[f.name] = value
        return out


_NOT_SENT = {"n", "logprobs", "skip_special_tokens", "_given"}


def _plain(value: Any) -> Any:
    """vLLM keeps some fields as sets or tuples; JSON wants lists. A numpy / torch scalar (a temperature computed
    with numpy) becomes its Python number: JSON cannot encode it, and comparing it with [] is ambiguous."""
    if isinstance(value, (set, tuple)):
        return list(value)
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value
