"""A reply's think block: whether the prompt opened it, and the reply split into reasoning and the rest.

A thinking model's template either lets the model open the block (Qwen3's: the reply starts with ``<think>``)
or opens it in the generation prompt itself (Qwen3-Thinking-2507's, DeepSeek-R1 distills', QwQ's: the rendered
prompt ends with ``<think>\\n`` and the reply holds only ``...</think>\\n\\nanswer``). The gateway renders the
prompt, so it reads which from the render rather than from model names. The split is what a client is shown:
the captured tokens are the pod's either way.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def think_opened(prompt: str, prefill: str | None = None) -> bool:
    """Whether the reply to ``prompt`` starts inside a think block: the generation prompt ends with ``<think>``
    (less whitespace) or, for a prefill (``prefill``: the final assistant message the prompt ends with, which the
    reply continues), that message opened a block it did not close. Only the prompt's end counts, so a user's
    message that mentions the tag opens nothing."""
    if prefill is not None:
        return prefill.rfind(OPEN) > prefill.rfind(CLOSE)
    return prompt.rstrip().endswith(OPEN)


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, the rest) of a reply. A reply that opens with a think block, or any reply to a prompt that
    opened one (``opened``), is reasoning up to ``</think>``, and all reasoning where the block never closed (a
    length stop), as vLLM's think parsers read these replies; ("", text) otherwise."""
    head = text.lstrip()
    if head.startswith(OPEN):
        head = head[len(OPEN) :]
    elif not opened:
        return "", text
    reasoning, _, rest = head.partition(CLOSE)
    return reasoning.strip(), rest.lstrip()
