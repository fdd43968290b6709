"""Sampling parameters as vLLM accepts them: one set of rules for every edge that takes them.

A rollout pod and the gateway's OpenAI, Anthropic and session wires all take sampling parameters from
clients. Each edge checks them here, before anything reaches an engine, so a bad value costs its
caller a 400 that names the parameter and never costs the pod its engine. The bounds are vLLM's own
(``SamplingParams._verify_args`` and the int64 seed of its OpenAI server): a seed outside 64 bits passes
``SamplingParams`` and then kills the engine in its first step (torch's ``manual_seed``), and a NaN passes
every comparison, so "finite" is checked before any range. The pod builds vLLM's ``SamplingParams`` from
the checked values as well, so a rule vLLM adds later still gives a 400 there; a unit test keeps these
rules in step with vLLM's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_LOGPROBS = 20
"""vLLM's default ``--max-logprobs`` and OpenAI's bound on ``top_logprobs``."""


class SamplingError(ValueError):
    """A sampling parameter vLLM would refuse, or that would harm the engine; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Rule:
    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is refused

    def describe(self) -> str:
        lo = "-inf" if self.lo is None else f"{self.lo:g}" if not self.integer else str(self.lo)
        hi = "inf" if self.hi is None else f"{self.hi:g}" if not self.integer else str(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi is None else ']'}"


SESSION_KEYS = frozenset(
    {
        "n",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logit_bias",
        "structured_outputs",
    }
)
"""What a session's ``sampling_params`` may hold: a pod's /v1/generate params, plus ``stop`` strings (the gateway
applies those itself), less ``logprobs``: every captured token needs its logprob. ``structured_outputs`` is one
of ``STRUCTURED_KINDS`` (OpenAI's wire spells it ``response_format``)."""


RULES: dict[str, Rule] = {
    "n": Rule(True, 1, 16384),  # vLLM's VLLM_MAX_N_SEQUENCES default; a pod's --rollout.max_n is lower
    "max_tokens": Rule(True, 1),
    "min_tokens": Rule(True, 0),
    "temperature": Rule(False, 0.0, 2.0),
    "top_p": Rule(False, 0.0, 1.0, lo_open=True),
    "top_k": Rule(True, -1),  # -1 and 0 both turn it off (vLLM); above the vocabulary it keeps every token
    "min_p": Rule(False, 0.0, 1.0),
    "presence_penalty": Rule(False, -2.0, 2.0),
    "frequency_penalty": Rule(False, -2.0, 2.0),
    "repetition_penalty": Rule(False, 0.0, None, lo_open=True),
    "seed": Rule(True, INT64_MIN, INT64_MAX),  # -1 means "no seed" to vLLM
}


def check_number(name: str, value: Any, rule: Rule, param: str | None = None) -> int | float:
    """``value`` as an int (integer rules) or a finite float, inside the rule's bounds; else SamplingError."""
    param = param or name
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (rule.integer and not isinstance(value, int)):
        kind = "an integer" if rule.integer else "a number"
        raise SamplingError(f"'{name}' must be {kind}, got {_show(value)}", param)
    if not rule.integer:
        try:
            value = float(value)
        except OverflowError:  # an integer past the float range
            value = math.inf
        if not math.isfinite(value):
            raise SamplingError(f"'{name}' must be a finite number, got {value}", param)
    low_bad = rule.lo is not None and (value <= rule.lo if rule.lo_open else value < rule.lo)
    if low_bad or (rule.hi is not None and value > rule.hi):
        raise SamplingError(f"'{name}' must be in {rule.describe()}, got {_show(value)}", param)
    return value


def check_params(params: dict, prefix: str = "") -> dict:
    """The known numeric params of ``params`` checked (others untouched) and ``min_tokens <= max_tokens``.

    ``prefix`` is put before each name in ``SamplingError.param`` (e.g. ``"sampling_params."``).
    """
    out = dict(params)
    for name, rule in RULES.items():
        if params.get(name) is not None:
            out[name] = check_number(name, params[name], rule, prefix + name)
    lo, hi = out.get("min_tokens"), out.get("max_tokens")
    if lo is not None and hi is not None and lo > hi:
        raise SamplingError(f"'min_tokens' ({lo}) must be <= 'max_tokens' ({hi})", prefix + "min_tokens")
    return out


def check_stop(stop: Any, name: str = "stop") -> list[str] | None:
    """A stop string or list of them, as a list (None when absent); empty strings are refused, as vLLM does."""
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise SamplingError(f"'{name}' must be a string or a list of strings, got {_show(stop)}", name)
    if any(not s for s in stop):
        raise SamplingError(f"'{name}' cannot contain an empty string", name)
    return stop


def check_token_ids(ids: Any, name: str, vocab_size: int | None = None) -> list[int]:
    """A list of integer token ids (inside ``[0, vocab_size)`` when given)."""
    if not isinstance(ids, list):
        raise SamplingError(f"'{name}' must be a list of token ids, got {_show(ids)}", name)
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise SamplingError(f"{name}[{i}] is {_show(tok)}, not an integer token id", name)
        if vocab_size is not None and not 0 <= tok < vocab_size:
            raise SamplingError(f"{name}[{i}] = {tok} is outside the vocabulary [0, {vocab_size})", name)
    return ids


LOGIT_BIAS_RANGE = 100.0
"""OpenAI's bound on a ``logit_bias`` value: -100 bans a token in effect, 100 all but forces it."""

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
"""What vLLM's ``StructuredOutputsParams`` constrains to; a request names exactly one."""


def check_logit_bias(bias: Any, name: str = "logit_bias", vocab_size: int | None = None) -> dict[int, float]:
    """``{token id (int or its decimal string, as JSON keys are): bias in [-100, 100]}`` as ``{int: float}``."""
    if not isinstance(bias, dict):
        raise SamplingError(f"'{name}' must be an object of token id -> bias, got {_show(bias)}", name)
    out: dict[int, float] = {}
    for key, value in bias.items():
        tok = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12:
            tok = int(key)
        if tok is None or (vocab_size is not None and not 0 <= tok < vocab_size):
            where = f"inside the vocabulary [0, {vocab_size})" if vocab_size is not None else "a token id"
            raise SamplingError(f"'{name}' key {_show(key)} is not {where}", name)
        rule = Rule(False, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        out[tok] = float(check_number(f"{name}[{key}]", value, rule, name))
    return out


def check_structured(spec: Any, name: str = "structured_outputs") -> dict:
    """A structured-outputs request: exactly one of ``STRUCTURED_KINDS``, each of the type vLLM takes (a JSON
    schema or structural tag as an object or its JSON text). Whether a schema or grammar compiles is the
    pod's to say (vLLM's grammar backend checks it when the request is added)."""
    if not isinstance(spec, dict):
        raise SamplingError(f"'{name}' must be an object with one of {list(STRUCTURED_KINDS)}", name)
    unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
    kinds = [k for k in STRUCTURED_KINDS if spec.get(k) is not None]
    if unknown or len(kinds) != 1:
        got = f"unknown key(s) {_show(unknown)}" if unknown else f"{len(kinds)} of them"
        raise SamplingError(f"'{name}' must hold exactly one of {list(STRUCTURED_KINDS)}, got {got}", name)
    kind = kinds[0]
    value = spec[kind]
    ok = {
        "json": isinstance(value, (dict, str)) and not isinstance(value, bool),
        "json_object": value is True,
        "regex": isinstance(value, str) and bool(value),
        "grammar": isinstance(value, str) and bool(value),
        "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
        "structural_tag": isinstance(value, (dict, str)),
    }[kind]
    if not ok:
        want = {
            "json": "a JSON schema (an object or its JSON text)",
            "json_object": "true",
            "choice": "a non-empty list of strings",
            "structural_tag": "a structural tag (an object or its JSON text)",
        }.get(kind, "a non-empty string")
        raise SamplingError(f"'{name}.{kind}' must be {want}, got {_show(value)}", f"{name}.{kind}")
    return {kind: value}


def _show(value: Any) -> str:
    """A short, ASCII-safe rendering of a client's value for an error message."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's int-to-str digit limit
        text = f"<an integer of {value.bit_length()} bits>"
    return ascii(text[:80] + ("..." if len(text) > 80 else ""))[1:-1]
