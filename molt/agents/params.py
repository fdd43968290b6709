"""``SamplingParams``: the object agents read sampling settings from, with vLLM's attribute names.

Molt hands an agent a vLLM ``SamplingParams`` (``ctx.sampling_params.max_tokens``,
``state["sampling_params"].temperature``) and accepts one back in ``Result(sampling_params=...)``.
Env workers here do not import vLLM, so this is a plain object with the same attribute names and
defaults; ``from_any`` also takes a real vLLM ``SamplingParams`` (read by attribute) or a dict of
the same names. ``wire()`` is what travels to the gateway: the fields that were given or differ
from vLLM's defaults, so the gateway's own defaults fill only what nobody set.

Every vLLM field is carried, read only, or refused. Carried: ``WIRE_FIELDS``, what the gateway's token-level
session API applies. Read only: ``n``, ``logprobs``, ``skip_special_tokens``, ``include_stop_str_in_output``
and ``IGNORED``, which change only what vLLM returns (the gateway records every logprob and decodes the text
itself). Refused when set: ``REFUSED``, each with the reason; a dropped field would change the distribution
the rollout samples from without a word, and the run would train on that.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from molt.sampling import SESSION_KEYS, SamplingError, check_logit_bias, check_structured


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
    include_stop_str_in_output: bool = False
    """Not sent: an action's text comes back cut before its stop string, as vLLM's default (True with stop
    strings is refused)."""
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: Any = None
    extra_args: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    trace_decode_token_ids: list[int] | None = None
    watermarking: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: int | None = None
    _given: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    @classmethod
    def from_any(cls, value: Any, where: str = "sampling_params") -> SamplingParams:
        """A copy of ``value``: this class, an object with vLLM's attribute names, a dict of them, or None.
        ValueError naming the field for one that is set and cannot be honoured (``REFUSED``)."""
        if value is None:
            return cls()
        if isinstance(value, cls):  # Molt's pattern: the state's copy, edited, handed back (keeps what was given)
            out = copy.deepcopy(value)
            out._check(where)
            return out
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
            _check_unknown(value, set(names), where)
        given = {k: _plain(v) for k, v in given.items()}
        for k, v in given.items():
            if isinstance(v, float) and not math.isfinite(v):  # else an opaque JSON error on the way to the gateway
                raise ValueError(f"{where}.{k} must be a finite number, got {v}")
        out = cls(**given)
        out._given = frozenset(k for k, v in given.items() if v is not None)
        out._check(where)
        return out

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``), keeping which fields were given."""
        return copy.deepcopy(self)

    def wire(self) -> dict[str, Any]:
        """The gateway's sampling_params: the fields given or changed from the defaults (None, [] and {} = unset)."""
        self._check("sampling_params")
        out = {}
        for f in dataclasses.fields(self):
            if f.name not in WIRE_FIELDS:
                continue
            value = getattr(self, f.name)
            if f.name == "structured_outputs":
                value = structured_spec(value)
            if not _unset(value) and (f.name in self._given or value != f.default):
                out[f.name] = value
        return out

    def _check(self, where: str) -> None:
        try:  # here, not only at the gateway: the agent's traceback then names its own line
            if self.logit_bias is not None:
                check_logit_bias(self.logit_bias, f"{where}.logit_bias")
            structured_spec(self.structured_outputs, f"{where}.structured_outputs")
        except SamplingError as exc:
            raise ValueError(str(exc)) from None
        for name, why in REFUSED.items():
            value = getattr(self, name)
            if not _unset(value):
                raise ValueError(
                    f"{where}.{name} = {str(value)[:80]}: {why}. Refused rather than dropped: the rollout would "
                    "sample from another distribution than the one asked for, and the run would train on it"
                )
        if self.include_stop_str_in_output and self.stop:
            raise ValueError(
                f"{where}.include_stop_str_in_output: the gateway returns an action's text cut before its stop "
                "string (its tokens keep it), as vLLM's default; unset it, or unset stop and look for the string "
                "in the text yourself"
            )


WIRE_FIELDS = SESSION_KEYS - {"n"}
"""What ``wire()`` sends: the sampling params the gateway's session API (open and generate) takes, less ``n``
(a session is one sample)."""

REFUSED = {
    "allowed_token_ids": "the rollout pods take no token allow-list",
    "bad_words": "the rollout pods take no banned words",
    "extra_args": "only custom vLLM sampling plugins read it, and the rollout pods run none",
    "thinking_token_budget": "the rollout pods take no thinking budget",
    "repetition_detection": "the rollout pods do not stop on repetition",
    "trace_decode_token_ids": "the rollout pods sample every token and replay none",
    "watermarking": "the rollout pods do not watermark",
    "logits_processors": "a Python logits processor cannot travel to the rollout pods",
    "truncate_prompt_tokens": "a session's prompt is the episode so far and is never cut per turn",
}
"""Fields refused when set (not None or empty), with the reason."""

IGNORED = frozenset(
    {
        "detokenize",
        "spaces_between_special_tokens",
        "prompt_logprobs",
        "prompt_logprob_token_ids",
        "prompt_logprob_start",
        "logprob_token_ids",
        "flat_logprobs",
        "output_kind",
        "stream_interval",
        "skip_clone",
        "skip_reading_prefix_cache",
        "routed_experts_prompt_start",
        "output_text_buffer_length",
    }
)
"""Fields of a vLLM ``SamplingParams`` not read: they shape only what vLLM returns, streams or caches, and an
agent here gets the gateway's answer instead (``_``-prefixed ones, vLLM's internals, are skipped too)."""


STRUCTURED_OPTIONS = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}
"""Options of vLLM's ``StructuredOutputsParams`` beside its constraint, at their defaults: the pods build the
grammar from the constraint alone, so one set otherwise is refused (it would change what may be sampled)."""


def structured_spec(value: Any, where: str = "structured_outputs") -> dict | None:
    """A vLLM ``StructuredOutputsParams`` (or a dict of its fields) as the session API's ``structured_outputs``:
    the one constraint it holds (``molt.sampling.STRUCTURED_KINDS``); None when unset. SamplingError naming the
    field for anything else."""
    if value is None:
        return None
    if isinstance(value, dict):
        fields = dict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if not f.name.startswith("_")}
    else:
        raise SamplingError(f"'{where}' must be vLLM's StructuredOutputsParams or a dict of its fields", where)
    for name, default in STRUCTURED_OPTIONS.items():
        if fields.pop(name, default) != default:
            raise SamplingError(f"'{where}.{name}' is set: the rollout pods apply the constraint alone", where)
    # vLLM leaves the kinds it was not given at None (json_object at None or False).
    return check_structured({k: v for k, v in fields.items() if v is not None and v is not False}, where)


def _check_unknown(value: Any, known: set[str], where: str) -> None:
    """A vLLM ``SamplingParams`` (a msgspec struct, which lists its fields) with a field neither known nor
    ``IGNORED`` set off its default: a vLLM release's new field, refused until it is classified here."""
    names = getattr(type(value), "__struct_fields__", ())
    defaults = getattr(type(value), "__struct_defaults__", ())
    default_of = dict(zip(names[len(names) - len(defaults) :], defaults))
    for name in names:
        if name.startswith("_") or name in known or name in IGNORED:
            continue
        default = default_of.get(name)
        factory = getattr(default, "factory", None)  # msgspec's default_factory
        if callable(factory):
            default = factory()
        current = getattr(value, name, None)
        if not (_unset(current) and _unset(default)) and current != default:
            raise ValueError(
                f"{where}.{name} = {str(current)[:80]}: a vLLM sampling field these agents' params do not know; "
                "refused rather than dropped (it may change what is sampled)"
            )


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, list | tuple | set | dict) and not value)


def _plain(value: Any) -> Any:
    """vLLM keeps some fields as sets or tuples; JSON wants lists. A numpy / torch scalar (a temperature computed
    with numpy) becomes its Python number: JSON cannot encode it, and comparing it with [] is ambiguous."""
    if isinstance(value, (set, tuple)):
        return list(value)
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value
