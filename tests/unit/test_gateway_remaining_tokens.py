"""The gateway's token-level turn (POST /v1/sessions/{id}/generate) answers "remaining_tokens": the session's
max_length less the tokens its segment holds so far, after the first turn and after a later one
(docs/contracts.md, "Token-level turn").

Driven on the real gateway app over ASGI, its pods a scripted fake (tests/gateway_testlib.py).
"""

from __future__ import annotations

from tests.unit.gateway_app_testlib import open_session, scripted_env

MAX_LENGTH = 200


async def test_remaining_tokens_is_max_length_less_the_tokens_so_far_on_every_turn(chat_model):
    # Env workers budget their next observation from this field (they hold no tokenizer), so it must track the
    # segment exactly: the rendered prompt plus what was generated, then plus the appended feedback too.
    _, _, replies, http = scripted_env(chat_model)()
    sid = (await open_session(http, max_length=MAX_LENGTH))["session_id"]
    replies.queue.append("Hello there.<|im_end|>")
    first = await http.post(
        f"/v1/sessions/{sid}/generate",
        json={"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 8}},
    )
    assert first.status_code == 200, first.text
    one = first.json()
    assert "remaining_tokens" in one
    assert one["remaining_tokens"] == MAX_LENGTH - one["num_tokens"]
    second = await http.post(
        f"/v1/sessions/{sid}/generate", json={"append_text": "\nagain", "sampling_params": {"max_tokens": 8}}
    )
    assert second.status_code == 200, second.text
    two = second.json()
    assert two["num_tokens"] > one["num_tokens"]
    assert two["remaining_tokens"] == MAX_LENGTH - two["num_tokens"]
    # the max_length the arithmetic above used is the one the session holds
    state = (await http.get(f"/v1/sessions/{sid}")).json()
    assert state["max_length"] == MAX_LENGTH


async def test_a_turn_that_fills_the_session_answers_no_tokens_remaining(chat_model):
    # When the context is used up the field reaches 0 (and the turn stops with "length"), the worker's cue to end
    # the episode rather than append more.
    _, _, replies, http = scripted_env(chat_model)()
    replies.queue.append("word " * 100)
    sid = (await open_session(http, max_length=40))["session_id"]
    r = await http.post(f"/v1/sessions/{sid}/generate", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and body["num_tokens"] == 40 and body["remaining_tokens"] == 0
