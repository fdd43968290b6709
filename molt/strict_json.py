"""Strict JSON for the metrics files other programs read (``steps.jsonl``, ``eval.jsonl``, ``summary.json``).

Python writes a NaN or an infinity as the bare words ``NaN`` / ``Infinity``, which are not JSON: jq, JavaScript,
Go and several pandas engines refuse the whole file. A metric a step did not have (``mismatch_kl_fresh`` with no
fresh tokens) is written as ``null`` instead, what those readers take as a missing value.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) inside dicts, lists and tuples replaced by None."""
    if isinstance(value, float):  # numpy's float64 too (a subclass)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` with non-finite floats as null. ``allow_nan=False`` after that: a NaN that still
    reaches the encoder (a float dict key, a ``default=`` hook's result) raises instead of writing invalid JSON."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
