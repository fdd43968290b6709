"""Request validation: wire sampling params -> vLLM SamplingParams, with errors that name the limit.

Everything a client can get wrong is checked here, before the request reaches the engine, so a bad
request costs a 400 and never an engine error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
}


def _bad(msg: str, param: str, code: str = "invalid_value") -> RolloutInputError:
    return RolloutInputError(msg, param=param, code=code)


def check_prompt(prompt_token_ids: Any, limits: Limits, param: str = "prompt_token_ids") -> list[int]:
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise _bad("prompt_token_ids must be a non-empty list of token ids", param)
    for i, tok in enumerate(prompt_token_ids):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise _bad(f"prompt_token_ids[{i}] is {tok!r}, not an integer token id", param)
        if not 0 <= tok < limits.vocab_size:
            raise _bad(f"prompt_token_ids[{i}] = {tok} is outside the vocabulary [0, {limits.vocab_size})", param,
                       "token_id_out_of_range")
    if limits.max_prompt_tokens is not None and len(prompt_token_ids) > limits.max_prompt_tokens:
        raise _bad(f"prompt has {len(prompt_token_ids)} tokens; this pod accepts at most {limits.max_prompt_tokens}",
                   param, "context_length_exceeded")
    return prompt_token_ids


def check_sampling(params: Any, prompt_len: int, limits: Limits) -> dict[str, Any]:
    """Validated wire params with defaults filled in."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise _bad("sampling_params must be an object", "sampling_params")
    unknown = sorted(set(params) - set(SAMPLING_FIELDS))
    if unknown:
        raise _bad(f"unknown sampling param(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}",
                   f"sampling_params.{unknown[0]}", "unknown_parameter")
    out: dict[str, Any] = {}
    for name, (typ, default) in SAMPLING_FIELDS.items():
        value = params.get(name, default)
        if value is None:
            out[name] = None
            continue
        bad_bool = isinstance(value, bool) and typ is not bool
        if bad_bool or not isinstance(value, typ):
            raise _bad(f"{name} must be of type {getattr(typ, '__name__', typ)}, got {value!r}",
                       f"sampling_params.{name}")
        out[name] = value
    n, max_tokens = out["n"], out["max_tokens"]
    if not 1 <= n <= limits.max_n:
        raise _bad(f"n = {n} is outside [1, {limits.max_n}] (the pod's --rollout.max_n)", "sampling_params.n")
    if max_tokens < 1:
        raise _bad(f"max_tokens = {max_tokens} must be >= 1", "sampling_params.max_tokens")
    if prompt_len + max_tokens > limits.max_model_len:
        raise _bad(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds the "
                   f"context length {limits.max_model_len}; lower max_tokens to <= "
                   f"{limits.max_model_len - prompt_len}",
                   "sampling_params.max_tokens", "context_length_exceeded")
    if not 0 <= out["min_tokens"] <= max_tokens:
        raise _bad(f"min_tokens = {out['min_tokens']} must be in [0, max_tokens={max_tokens}]",
                   "sampling_params.min_tokens")
    if out["temperature"] < 0:
        raise _bad("temperature must be >= 0", "sampling_params.temperature")
    if not 0 < out["top_p"] <= 1:
        raise _bad("top_p must be in (0, 1]", "sampling_params.top_p")
    if out["top_k"] == 0 or out["top_k"] < -1:
        raise _bad("top_k must be -1 (off) or >= 1", "sampling_params.top_k")
    stops = out["stop_token_ids"] or []
    for tok in stops:
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < limits.vocab_size:
            raise _bad(f"stop_token_ids entry {tok!r} is not a token id in [0, {limits.vocab_size})",
                       "sampling_params.stop_token_ids", "token_id_out_of_range")
    out["stop_token_ids"] = stops
    return out


def to_vllm(params: dict[str, Any], index: int, prompt_logprobs: bool = False):
    """One vLLM SamplingParams per sample (n is fanned out by the engine, seed + index like vLLM does)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    seed = None if params["seed"] is None else params["seed"] + index
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
        logprobs=0 if params["logprobs"] else None,
        prompt_logprobs=0 if prompt_logprobs else None,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )
