"""Sampling parameters at the gateway's edges, checked with molt.sampling (vLLM's rules) before any pod sees them.

Every wire (OpenAI chat/completions, Anthropic messages, the session's own open and generate) goes through
here, so a value vLLM would refuse, or one that would harm a pod, is a 400 in the wire's error shape that
names the parameter, and never a pod error that counts against the pod's health.
"""

from __future__ import annotations

from typing import Any

from molt.sampling import (
    MAX_TOP_LOGPROBS,
    RULES,
    SESSION_KEYS,
    Rule,
    SamplingError,
    check_logit_bias,
    check_number,
    check_params,
    check_stop,
    check_structured,
    check_token_ids,
)

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Rule",
    "flag",
    "logit_bias",
    "number",
    "session_params",
    "stop",
    "structured",
    "top_logprobs",
]
from services.gateway.chat import bad_request


def number(body: dict, key: str, rule: str | Rule | None = None) -> Any:
    """``body[key]`` checked by ``RULES[rule or key]`` (None when absent)."""
    value = body.get(key)
    if value is None:
        return None
    try:
        return check_number(key, value, RULES[rule or key] if not isinstance(rule, Rule) else rule)
    except SamplingError as exc:
        raise bad_request(str(exc), exc.param) from None


def top_logprobs(body: dict, key: str = "top_logprobs") -> int:
    return number(body, key, Rule(True, 0, MAX_TOP_LOGPROBS)) or 0


def logit_bias(body: dict, key: str = "logit_bias") -> dict[str, float]:
    """``{token id: bias in [-100, 100]}``, as the pod takes it (its ids are checked against the vocabulary there)."""
    try:
        return {str(t): b for t, b in check_logit_bias(body.get(key), key).items()}
    except SamplingError as exc:
        raise bad_request(str(exc), exc.param) from None


def structured(body: dict, key: str = "structured_outputs") -> dict:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object, structural_tag."""
    try:
        return check_structured(body.get(key), key)
    except SamplingError as exc:
        raise bad_request(str(exc), exc.param) from None


def flag(body: dict, key: str) -> bool:
    """An optional boolean field (``stream``, ``logprobs``): a string or a number there is a client's mistake."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false, got {str(value)[:80]!a}", key)
    return bool(value)


def stop(body: dict, key: str = "stop") -> list[str] | None:
    try:
        return check_stop(body.get(key), key) or None
    except SamplingError as exc:
        raise bad_request(str(exc), exc.param) from None


def session_params(sp: Any, vocab_size: int, where: str = "sampling_params", turn: bool = False) -> dict:
    """A session's ``sampling_params`` (at open) or one turn's overrides (``turn``: ``max_tokens`` 0 appends
    without generating): known keys, each in vLLM's range."""
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise bad_request(f"'{where}' must be an object", where)
    # A null param is an absent one (as on the OpenAI wire): the pod's default, never a None it would refuse.
    sp = {k: v for k, v in sp.items() if v is not None}
    if turn and type(sp.get("max_tokens")) is int and sp["max_tokens"] == 0:
        return {
            **session_params({k: v for k, v in sp.items() if k != "max_tokens"}, vocab_size, where),
            "max_tokens": 0,
        }
    unknown = sorted(set(sp) - SESSION_KEYS)
    if unknown:
        raise bad_request(
            f"unknown sampling param(s) {ascii(unknown)[:200]} in '{where}'; known: {sorted(SESSION_KEYS)}",
            f"{where}.{ascii(unknown[0])[1:-1][:80]}",
        )
    try:
        out = check_params(sp, prefix=f"{where}.")
        if sp.get("stop") is not None:
            out["stop"] = check_stop(sp["stop"], f"{where}.stop")
        if sp.get("stop_token_ids") is not None:
            out["stop_token_ids"] = check_token_ids(sp["stop_token_ids"], f"{where}.stop_token_ids", vocab_size)
        if sp.get("logit_bias") is not None:  # string keys, as JSON carries them to the pod and into the handoff
            bias = check_logit_bias(sp["logit_bias"], f"{where}.logit_bias", vocab_size)
            out["logit_bias"] = {str(t): b for t, b in bias.items()}
        if sp.get("structured_outputs") is not None:
            out["structured_outputs"] = check_structured(sp["structured_outputs"], f"{where}.structured_outputs")
    except SamplingError as exc:
        raise bad_request(str(exc), exc.param) from None
    if sp.get("ignore_eos") is not None and not isinstance(sp["ignore_eos"], bool):
        raise bad_request(f"'{where}.ignore_eos' must be true or false", f"{where}.ignore_eos")
    if out.get("n", 1) != 1:
        raise bad_request(f"'{where}.n' must be 1 on a session (each sample is its own session)", f"{where}.n")
    return out
