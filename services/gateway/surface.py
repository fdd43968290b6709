"""Every request parameter of the gateway's OpenAI and Anthropic wires, and what happens to it.

Each parameter is *honoured* end to end (it reaches the pod's sampler, the template or the answer),
*informational* (accepted, it does not change what is generated: ``user``, ``metadata``), or *refused* with
a 400 in the wire's shape that names it. A parameter honoured for some values only (``tool_choice: "auto"``)
refuses the others the same way, and a parameter not in the table is refused as unknown. Nothing is
accepted and ignored: a client that asks for JSON mode or a forced tool call learns at once that it does not
get it. A parameter sent as ``null`` is absent, as both APIs read it: SDKs and frameworks that serialise every
field of their request type send nulls for what they do not set, and a null asks for nothing. docs/gateway.md
has the same table ("Parameters"); tests/unit/test_gateway_surface.py walks it.
"""

from __future__ import annotations

from typing import Any

from molt.sampling import SESSION_KEYS
from services.gateway.errors import GatewayError

HONOURED, INFORMATIONAL, REFUSED = "honoured", "informational", "refused"

# A session's sampling params (what reaches the pod's sampler, stop strings included), plus streaming.
_SAMPLER = (*sorted(SESSION_KEYS), "stream")

CHAT: dict[str, str] = {
    **dict.fromkeys(_SAMPLER, HONOURED),
    **dict.fromkeys(
        (
            "messages",
            "tools",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "stream_options",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "logit_bias",
            "chat_template_kwargs",
            "reasoning_effort",
            "add_generation_prompt",
            "continue_final_message",
        ),
        HONOURED,
    ),
    **dict.fromkeys(
        ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"), INFORMATIONAL
    ),
    # OpenAI's default, which some clients send explicitly; audio output is refused with it.
    "modalities": HONOURED + " for ['text'] only",
    **dict.fromkeys(
        (
            "audio",
            "prediction",
            "web_search_options",
            "functions",
            "function_call",
            "verbosity",
        ),
        REFUSED,
    ),
}

COMPLETIONS: dict[str, str] = {
    **dict.fromkeys(_SAMPLER, HONOURED),
    **dict.fromkeys(("prompt", "echo", "stream_options", "logprobs", "logit_bias"), HONOURED),
    "best_of": HONOURED + " for 1 only",
    **dict.fromkeys(("model", "user"), INFORMATIONAL),
    **dict.fromkeys(("suffix",), REFUSED),
}

MESSAGES: dict[str, str] = {
    **dict.fromkeys(
        ("messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", "tools"),
        HONOURED,
    ),
    "tool_choice": HONOURED,
    "thinking": HONOURED,
    "output_config": HONOURED,
    "output_format": HONOURED,
    **dict.fromkeys(("model", "metadata", "service_tier"), INFORMATIONAL),
    **dict.fromkeys(("container", "mcp_servers", "context_management"), REFUSED),
}

TABLES = {"chat": CHAT, "completions": COMPLETIONS, "messages": MESSAGES}


def _partly(wire: str, key: str, value: Any) -> bool:
    """Whether ``value`` is one the gateway honours for a parameter it honours in part (None: absent)."""
    if value is None:
        return True
    if (wire, key) == ("chat", "modalities"):
        return value == ["text"]
    assert (wire, key) == ("completions", "best_of"), f"{wire}.{key} is not honoured in part"
    return value == 1 and not isinstance(value, bool)


def check(body: dict, wire: str) -> None:
    """Refuse (400, naming it) any parameter of ``body`` the ``wire`` ("chat", "completions", "messages") does not
    honour, or honours for other values only; one whose value is null is absent."""
    table = TABLES[wire]
    for key, value in body.items():
        if value is None:
            continue
        what = table.get(key)
        if what is None:
            raise GatewayError(
                400,
                f"unknown parameter '{str(key)[:80]}' for this endpoint; this gateway takes "
                f"{sorted(k for k, v in table.items() if v != REFUSED)}",
                code="unknown_parameter",
                param=str(key)[:80],
            )
        if what == REFUSED:
            raise GatewayError(
                400,
                f"'{key}' is not supported by this gateway (it would be ignored): remove it",
                code="unsupported_parameter",
                param=key,
            )
        if what != HONOURED and what != INFORMATIONAL and not _partly(wire, key, value):
            raise GatewayError(
                400,
                f"'{key}' is {what} by this gateway, got {str(value)[:120]}",
                code="unsupported_parameter",
                param=key,
            )
