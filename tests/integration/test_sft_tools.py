"""Tool-calling SFT rows on a real tokenizer: --data.tools_key renders the row's schemas as
apply_chat_template(messages, tools=...) does, assistant tool calls are trained and tool results are not."""

from __future__ import annotations

import json
import logging

import pytest

from services.trainer.sft_data import Tokenized, row_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


@pytest.fixture
def tok(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def _render(tok, ex):
    ids = ex.input_ids.tolist()
    return tok.decode(ids), tok.decode([t for t, m in zip(ids, ex.loss_mask) if m])


@pytest.mark.parametrize("stored", ["list", "json"])
def test_tools_column_is_rendered_as_hf_renders_tools(tok, stored):
    tools = TOOLS if stored == "list" else json.dumps(TOOLS)
    ex, why, _ = Tokenized(tok, 512, "messages", None, tools_key="tools").example({"messages": CHAT, "tools": tools})
    assert why == ""
    text, trained = _render(tok, ex)
    assert text == tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False)
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the schema is in the prompt
    # the call and the final answer are trained; the tool's result, the schemas and the user turn are not
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert trained == call + "<|im_end|>It is sunny.<|im_end|>"


def test_a_parquet_column_renders_each_rows_own_schemas_and_calls(tok, tmp_path):
    """Parquet merges the rows' schemas and call arguments into one struct type, null where a row lacks a key:
    rendered as read, row 0 would offer a parameter 'q' and call with "q": null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from molt.data import read_rows

    other_tool = json.loads(json.dumps(TOOLS).replace("get_weather", "search").replace('"city"', '"q"'))
    other_chat = json.loads(json.dumps(CHAT).replace("get_weather", "search").replace('"city"', '"q"'))
    rows = [{"messages": CHAT, "tools": TOOLS}, {"messages": other_chat, "tools": other_tool}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    read = read_rows(tmp_path / "t.parquet")
    assert read[0]["tools"][0]["function"]["parameters"]["properties"]["q"] is None  # what parquet gives back
    tk = Tokenized(tok, 512, "messages", None, tools_key="tools")
    for row, original in zip(read, rows):
        ex, why, _ = tk.example(row)
        assert _render(tok, ex)[0] == tok.apply_chat_template(
            original["messages"], tools=original["tools"], tokenize=False
        )


def test_schemas_merged_by_a_parquet_column_lose_the_keys_other_rows_added():
    merged = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": None}}]
    merged[0]["function"]["parameters"] = {"type": "object", "properties": {"city": {"type": "string"}, "q": None}}
    assert row_tools({"tools": merged}, "tools") == (TOOLS, "")
    assert row_tools({"tools": None}, "tools") == (None, "")
    assert row_tools({"tools": "[]"}, "tools") == (None, "")
    assert row_tools({"tools": "{not json"}, "tools") == (None, "malformed tools")
    assert row_tools({"tools": [1]}, "tools") == (None, "malformed tools")


def test_bad_tools_are_a_counted_bad_row(tok):
    rows = [{"messages": CHAT, "tools": TOOLS}, {"messages": CHAT, "tools": "{oops"}]
    examples, report = Tokenized(tok, 512, "messages", None, tools_key="tools").build(rows, "--data.dataset")
    assert len(examples) == 1 and report.dropped == {"malformed tools": 1}


def test_tools_column_without_the_flag_is_logged(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="molt.trainer"):
        Tokenized(tok, 512, "messages", None).build([{"messages": CHAT, "tools": TOOLS}], "--data.dataset")
    assert "1 rows hold a 'tools' column that is not rendered into the prompt; pass --data.tools_key tools" in (
        caplog.text
    )


def test_a_template_that_ignores_tools_is_refused(tok):
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tok.chat_template += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    with pytest.raises(ValueError, match=r"^--data.tools_key tools: the chat template renders no tools"):
        Tokenized(tok, 512, "messages", None, tools_key="tools")
