"""What a chat template lets a request set: the variables its source reads that no render sets itself."""

from __future__ import annotations

import json
from pathlib import Path


def template_variables(template: str) -> frozenset[str]:
    """The undeclared variables of a jinja template, less the ones every render sets (messages, tools, jinja's
    and transformers' globals): jinja's own analysis of the source."""
    import jinja2
    from jinja2 import meta
    from jinja2.defaults import DEFAULT_NAMESPACE

    try:
        found = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return frozenset()
    set_by_render = {"messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now"}
    return frozenset(found - set_by_render - set(DEFAULT_NAMESPACE))


def template_variables_in(model_dir: str | Path) -> frozenset[str] | None:
    """``template_variables`` read from a model dir's files, without loading its tokenizer (start-up checks and
    dry runs): less the special tokens its config names, which every render sets. None: no template there."""
    path = Path(model_dir)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one renders chats
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        return None
    return template_variables(template) - {k for k in config if k.endswith("_token")} - {"additional_special_tokens"}
