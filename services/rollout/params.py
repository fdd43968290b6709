"""Request validation: wire sampling params -> vLLM SamplingParams, with errors that name the limit.

Everything a client can get wrong is checked here, before the request reaches the engine, so a bad
request costs a 400 and never an engine error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from molt.sampling import (
    INT64_MAX,
    MAX_TOP_LOGPROBS,
    RULES,
    Rule,
    SamplingError,
    check_logit_bias,
    check_number,
    check_params,
    check_structured,
    check_token_ids,
)


class RolloutInputError(ValueError):
    """A request the pod refuses: maps to HTTP 400 with the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_n: int
    max_prompt_tokens: int | None = None
    max_logprobs: int = MAX_TOP_LOGPROBS


# Wire name -> (type, default). Anything else in sampling_params is an error.
SAMPLING_FIELDS: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "n": (int, 1),
    "max_tokens": (int, 16),
    "min_tokens": (int, 0),
    "temperature": ((int, float), 1.0),
    "top_p": ((int, float), 1.0),
    "top_k": (int, -1),
    "min_p": ((int, float), 0.0),
    "presence_penalty": ((int, float), 0.0),
    "frequency_penalty": ((int, float), 0.0),
    "repetition_penalty": ((int, float), 1.0),
    "stop_token_ids": (list, None),
    "seed": (int, None),
    "ignore_eos": (bool, False),
    "logprobs": (bool, True),
    "top_logprobs": (int, 0),
    "logit_bias": (dict, None),
    "structured_outputs": (dict, None),
}
"""``top_logprobs``: the k most likely tokens at each step, besides the sampled one's logprob (needs
``logprobs``). ``logit_bias``: token id -> bias added to its logit. ``structured_outputs``: one of vLLM's
constraints (``{"json": schema}``, ``{"json_object": true}``, ``{"regex"}``, ``{"choice"}``, ``{"grammar"}``,
``{"structural_tag"}``); the tokens returned are the ones sampled under it."""


def _bad(msg: str, param: str, code: str = "invalid_value") -> RolloutInputError:
    return RolloutInputError(msg, param=param, code=code)


def check_prompt(prompt_token_ids: Any, limits: Limits, param: str = "prompt_token_ids") -> list[int]:
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise _bad("prompt_token_ids must be a non-empty list of token ids", param)
    try:
        check_token_ids(prompt_token_ids, "prompt_token_ids", limits.vocab_size)
    except SamplingError as exc:
        code = "token_id_out_of_range" if "outside the vocabulary" in str(exc) else "invalid_value"
        raise _bad(str(exc), param, code) from None
    if limits.max_prompt_tokens is not None and len(prompt_token_ids) > limits.max_prompt_tokens:
        raise _bad(
            f"prompt has {len(prompt_token_ids)} tokens; this pod accepts at most {limits.max_prompt_tokens}",
            param,
            "context_length_exceeded",
        )
    return prompt_token_ids


def check_sampling(params: Any, prompt_len: int, limits: Limits) -> dict[str, Any]:
    """Validated wire params with defaults filled in: molt.sampling's bounds (vLLM's), then this pod's own."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise _bad("sampling_params must be an object", "sampling_params")
    unknown = sorted(set(params) - set(SAMPLING_FIELDS))
    if unknown:
        raise _bad(
            f"unknown sampling param(s) {ascii(unknown)[:200]}; known: {sorted(SAMPLING_FIELDS)}",
            "sampling_params." + ascii(unknown[0])[1:-1][:80],
            "unknown_parameter",
        )
    out: dict[str, Any] = {}
    for name, (typ, default) in SAMPLING_FIELDS.items():
        value = params.get(name, default)
        if value is not None and name not in RULES:  # the numbers are typed by check_params below
            bad_bool = isinstance(value, bool) and typ is not bool
            if bad_bool or not isinstance(value, typ):
                raise _bad(
                    f"{name} must be of type {getattr(typ, '__name__', typ)}, got {value!r}"[:300],
                    f"sampling_params.{name}",
                )
        out[name] = value
    n = out["n"]
    if type(n) is int and n > limits.max_n:  # this pod's bound is the one to name (vLLM's own is far higher)
        raise _bad(f"n = {n} is outside [1, {limits.max_n}] (the pod's --rollout.max_n)", "sampling_params.n")
    try:
        out = check_params(out, prefix="sampling_params.")
        out["stop_token_ids"] = check_token_ids(out["stop_token_ids"] or [], "stop_token_ids", limits.vocab_size)
        k = check_number("top_logprobs", out["top_logprobs"], Rule(True, 0, None), "top_logprobs")
        if k and k > limits.max_logprobs:
            raise SamplingError(
                f"top_logprobs = {k} is above this pod's bound {limits.max_logprobs} (its --vllm.max_logprobs)",
                "top_logprobs",
            )
        if k and not out["logprobs"]:
            raise SamplingError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if out["logit_bias"] is not None:
            out["logit_bias"] = check_logit_bias(out["logit_bias"], "logit_bias", limits.vocab_size)
        if out["structured_outputs"] is not None:
            out["structured_outputs"] = check_structured(out["structured_outputs"])
    except SamplingError as exc:
        code = "token_id_out_of_range" if "outside the vocabulary" in str(exc) else "invalid_value"
        raise _bad(
            str(exc), exc.param if exc.param.startswith("sampling_params.") else f"sampling_params.{exc.param}", code
        ) from None
    n, max_tokens = out["n"], out["max_tokens"]
    if prompt_len + max_tokens > limits.max_model_len:
        raise _bad(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds the "
            f"context length {limits.max_model_len}; lower max_tokens to <= "
            f"{max(limits.max_model_len - prompt_len, 0)}",
            "sampling_params.max_tokens",
            "context_length_exceeded",
        )
    if out["seed"] == -1:  # vLLM's spelling of "unseeded": every sample unseeded, not -1 + i from the second on
        out["seed"] = None
    seed = out["seed"]
    if seed is not None and seed + n - 1 > INT64_MAX:  # sample i is seeded with seed + i
        raise _bad(
            f"seed + n - 1 = {seed + n - 1} is over the 64-bit seed range; use a seed <= {INT64_MAX - n + 1}",
            "sampling_params.seed",
        )
    return out


def vllm_params(params: dict[str, Any], prompt_logprobs: bool = False) -> list:
    """One vLLM SamplingParams per sample, built here, at the edge: vLLM's own checks (``_verify_args``)
    refuse a bad value with a 400 before anything reaches the engine thread."""
    from vllm.exceptions import VLLMClientError

    try:
        return [to_vllm(params, i, prompt_logprobs) for i in range(params["n"])]
    except (VLLMClientError, ValueError, TypeError, OverflowError) as exc:
        param = getattr(exc, "parameter", None)
        raise _bad(
            f"vLLM refused the sampling params: {exc}", f"sampling_params.{param}" if param else "sampling_params"
        ) from None


def to_vllm(params: dict[str, Any], index: int, prompt_logprobs: bool = False):
    """One vLLM SamplingParams per sample (n is fanned out by the engine, seed + index like vLLM does)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    seed = None if params["seed"] is None else params["seed"] + index
    structured = None
    if params.get("structured_outputs"):
        from vllm.sampling_params import StructuredOutputsParams

        ((kind, value),) = params["structured_outputs"].items()
        if kind in ("json", "structural_tag") and isinstance(value, dict):
            value = json.dumps(value)  # vLLM takes a structural tag as JSON text only
        structured = StructuredOutputsParams(**{kind: value})
    return SamplingParams(
        n=1,
        max_tokens=params["max_tokens"],
        min_tokens=params["min_tokens"],
        temperature=float(params["temperature"]),
        top_p=float(params["top_p"]),
        top_k=params["top_k"],
        min_p=float(params["min_p"]),
        presence_penalty=float(params["presence_penalty"]),
        frequency_penalty=float(params["frequency_penalty"]),
        repetition_penalty=float(params["repetition_penalty"]),
        stop_token_ids=list(params["stop_token_ids"]),
        seed=seed,
        ignore_eos=params["ignore_eos"],
        logprobs=params.get("top_logprobs", 0) if params["logprobs"] else None,
        logit_bias=params.get("logit_bias"),
        structured_outputs=structured,
        prompt_logprobs=0 if prompt_logprobs else None,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )
