"""One place that maps gateway errors to each wire's error body and HTTP status."""

from __future__ import annotations

from typing import Literal

Wire = Literal["openai", "anthropic"]

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "authentication_error"),
    403: ("invalid_request_error", "permission_error"),
    404: ("invalid_request_error", "not_found_error"),
    409: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    502: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class GatewayError(Exception):
    """An error with an HTTP status; ``code`` is a stable machine-readable reason."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "error",
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


class ContextLengthExceeded(GatewayError):
    """A 400 ``context_length_exceeded``: the prompt of ``needed`` tokens leaves no room under ``limit``. Its message
    is worded as each wire's own server words it (OpenAI and vLLM: "This model's maximum context length is ...";
    Anthropic: "prompt is too long: N tokens > M maximum"), since that wording is what clients match to tell an
    overflow, which they answer by compacting the history, from any other 400: LiteLLM's
    ContextWindowExceededError, pydantic-ai's ModelContextWindowExceededError, CrewAI's context-window handling,
    Claude Code's compaction."""

    def __init__(self, needed: int, limit: int, what: str, fix: str) -> None:
        super().__init__(
            400,
            f"This model's maximum context length is {limit} tokens ({what}). However, this turn needs {needed} "
            f"tokens: {fix}",
            code="context_length_exceeded",
            param="messages",
        )
        self.anthropic_message = f"prompt is too long: {needed} tokens > {limit} maximum ({what}): {fix}"


class PodUnavailable(GatewayError):
    """No healthy rollout pod could serve the request (all failed or none configured)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="no_rollout_pod", retry_after_s=1)


def _utf8(text: str | None) -> str | None:
    """A message or param that quotes a client's lone surrogate, made encodable (as a \\udXXX escape)."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(err: GatewayError, wire: Wire) -> dict:
    default = ("invalid_request_error", "invalid_request_error") if err.status < 500 else ("server_error", "api_error")
    oa_type, an_type = _TYPES.get(err.status, default)
    if wire == "anthropic":
        message = err.anthropic_message if isinstance(err, ContextLengthExceeded) else err.message
        return {"type": "error", "error": {"type": an_type, "message": _utf8(message)}}
    return {"error": {"message": _utf8(err.message), "type": oa_type, "param": _utf8(err.param), "code": err.code}}


def error_headers(err: GatewayError) -> dict[str, str]:
    headers = {"retry-after": str(err.retry_after_s)} if err.retry_after_s is not None else {}
    if err.status in (408, 413):  # the rest of the body is not read: end the connection rather than drain it
        headers["connection"] = "close"
    return headers


def wire_of_path(path: str) -> Wire:
    return "anthropic" if path.endswith("/messages") or path.endswith("/messages/count_tokens") else "openai"


class UnreadableParkedSession(ValueError):
    """A parked session (handoff.py) of another format (a replica of another version parked it), or damaged."""
