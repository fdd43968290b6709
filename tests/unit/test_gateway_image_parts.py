"""Image parts on the gateway's wires (services/gateway/chat.py, anthropic_wire.py) and the text-only refusal."""

from __future__ import annotations

import base64
import hashlib

import pytest

from services.gateway.anthropic_wire import parse_messages
from services.gateway.capture import Capture
from services.gateway.chat import canonical_messages, message_images
from services.gateway.errors import GatewayError

PNG = b"\x89PNG\r\n\x1a\n fake bytes, checked by the pod"
B64 = base64.b64encode(PNG).decode()
SHA = hashlib.sha256(PNG).hexdigest()


def _error(fn) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        fn()
    assert err.value.status == 400
    return err.value


def test_openai_image_url_parts_become_ordered_image_parts():
    [msg] = canonical_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "text", "text": "b"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
                    {"type": "text", "text": "c"},
                ],
            }
        ]
    )
    assert msg["content"] == [
        {"type": "text", "text": "ab"},
        {"type": "image", "sha256": SHA, "data": B64},
        {"type": "text", "text": "c"},
    ]
    assert message_images([msg]) == [msg["content"][1]]
    [plain] = canonical_messages([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert plain["content"] == "x"  # text-only content stays a string: text sessions are unchanged


def test_anthropic_base64_image_blocks():
    req = parse_messages(
        {
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": B64}},
                        {"type": "text", "text": "what?"},
                    ],
                }
            ],
        }
    )
    assert req.messages == [
        {"role": "user", "content": [{"type": "image", "sha256": SHA, "data": B64}, {"type": "text", "text": "what?"}]}
    ]


@pytest.mark.parametrize(
    "url, problem",
    [
        ("https://example.com/a.png", "not fetched"),
        ("http://example.com/a.png", "not fetched"),
        ("data:image/bmp;base64," + B64, "unsupported image media type"),
        ("data:image/png," + B64, "base64 data URL"),
        ("data:image/png;base64,@@", "not valid base64"),
        ("data:image/png;base64,", "empty"),
        (None, "expected"),
    ],
)
def test_bad_image_urls(url, problem):
    err = _error(
        lambda: canonical_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    )
    assert problem in str(err) and err.param == "messages[0].content[0].image_url"


def test_anthropic_url_source_is_refused():
    err = _error(
        lambda: parse_messages(
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
                    }
                ],
            }
        )
    )
    assert "image source type 'url'" in str(err)


def test_images_to_a_text_only_model_are_refused(chat_model):
    assert chat_model.image_token_id is None
    messages = canonical_messages(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}}]}]
    )
    for plan in (
        lambda: Capture(max_length=64).plan_chat(chat_model, messages, None),
        lambda: Capture(max_length=64).plan_tokens(chat_model, messages, None, None),  # an Env's first turn
    ):
        err = _error(plan)
        assert err.code == "images_unsupported" and "text-only" in str(err)


def test_token_turn_images_pair_with_the_image_tokens_of_the_appended_input(tiny_idefics3, chat_model):
    """An Env's feedback images (``images`` beside ``append_text``): one per image token, in order; an append-only
    turn drops both (no pod expands them); a text-only model refuses them."""
    from services.gateway.chat import ChatModel

    model = ChatModel(tiny_idefics3)
    part = {"type": "image", "sha256": SHA, "data": B64}
    cap = Capture(max_length=512)
    first = cap.plan_tokens(model, None, "hi <image> there", None, [part])
    assert first.new_images == 1 and first.images == [part] and first.prompt_ids.count(model.image_token_id) == 1
    for text, images in (("two <image><image>", [part]), ("none", [part]), ("one <image>", [])):
        err = _error(lambda: Capture(max_length=512).plan_tokens(model, None, text, None, images))  # noqa: B023
        assert err.code == "image_placeholder_mismatch" and err.param == "images"
    dropped = Capture(max_length=512).plan_tokens(model, None, "end <image>", None, [part], append_only=True)
    assert dropped.images == [] and model.image_token_id not in dropped.prompt_ids
    err = _error(lambda: Capture(max_length=512).plan_tokens(chat_model, None, "x", None, [part]))
    assert err.code == "images_unsupported"


def test_images_count_expanded_in_the_room_and_no_segment_outgrows_max_length(tiny_idefics3):
    """The pod expands each image token into the image's run; the gateway learns the run's length from the pod's
    answers. The room check counts the segment's images expanded and new ones by what was learned, and whatever an
    estimate lets past ``max_length`` is cut (finish "length"); a prompt that alone fills it is not recorded."""
    from services.gateway.chat import ChatModel
    from services.gateway.pods import Generation

    model = ChatModel(tiny_idefics3)
    token, run = model.image_token_id, 7  # each image token becomes 7 tokens here (a fake pod's expansion)

    def answer(prompt: list[int], n_new: int) -> Generation:
        seen = [t for tok in prompt for t in ([tok] * run if tok == token else [tok])]
        return Generation([5] * n_new, [-0.5] * n_new, "stop", 1, "pod", extra={"prompt_token_ids": seen})

    part = {"type": "image", "sha256": SHA, "data": B64}
    cap = Capture(max_length=64)
    first = cap.plan_tokens(model, None, "look <image>", None, [part])
    assert first.image_tokens == 0  # nothing learned yet: one token per image
    gen = cap.fit(model, first, answer(first.prompt_ids, 100), hard=False)  # 100 tokens would pass max_length
    assert model.image_expansion.extra_per_image == run - 1
    assert gen is not None and gen.finish_reason == "length" and len(gen.token_ids) == 64 - len(first.prompt_ids) - 6
    seg = cap.commit(first, gen, [])
    assert len(seg.token_ids) == 64 and len(seg.sent_ids) == 64 - (run - 1)

    cap = Capture(max_length=64)
    first = cap.plan_tokens(model, None, "look <image>", None, [part])
    assert first.image_tokens == run - 1 and first.num_tokens == len(first.prompt_ids) + run - 1  # learned
    cap.commit(first, cap.fit(model, first, answer(first.prompt_ids, 3), hard=False), [])
    used = len(cap.current.token_ids)
    text = "x" * (64 - used - 2)  # fits with its image as one token, not expanded
    feedback = cap.plan_tokens(model, None, text + "<image>", None, [part])
    assert feedback.image_tokens == 2 * (run - 1) and cap.check_room(feedback, hard=False) <= 0

    model.image_expansion.extra_per_image = 0  # a larger image than any seen: the estimate falls short
    feedback = cap.plan_tokens(model, None, text + "<image>", None, [part])
    assert cap.check_room(feedback, hard=False) > 0
    assert cap.fit(model, feedback, answer(feedback.prompt_ids, 1), hard=False) is None  # the caller decides
    assert len(cap.current.token_ids) == used and not cap.current.truncated  # nothing recorded
    with pytest.raises(GatewayError) as err:
        cap.fit(model, feedback, answer(feedback.prompt_ids, 1), hard=True)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    dropped = cap.plan_tokens(model, None, text + "<image>", None, [part], drop_images=True)
    assert dropped.new_images == 0 and token not in dropped.delta_ids and cap.check_room(dropped, hard=False) > 0


def _sessionless(b64: str) -> dict[str, dict]:
    """One image and a question, session-less, on each wire."""
    url = f"data:image/png;base64,{b64}"
    return {
        "/v1/chat/completions": {
            "model": "policy",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, _openai_image(url)]}],
        },
        "/v1/responses": {
            "model": "policy",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": url}],
                }
            ],
        },
        "/v1/messages": {
            "model": "policy",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                    ],
                }
            ],
        },
    }


def _openai_image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_sessionless_requests_on_every_wire_carry_their_images_or_are_refused_by_name(tiny_idefics3, chat_model):
    from services.gateway.chat import ChatModel
    from tests.gateway_testlib import scripted_gateway

    vl = ChatModel(tiny_idefics3)
    _, pods, http = scripted_gateway(vl, lambda prompt, sp: vl.encode("ok"), ["http://pod:1"])
    for path, body in _sessionless(B64).items():
        r = await http.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert pods.pods["http://pod:1"].images[-1] == [{"data": B64}], path
        assert pods.pods["http://pod:1"].calls[-1][0].count(vl.image_token_id) >= 1, path
    _, _, http = scripted_gateway(chat_model, lambda prompt, sp: chat_model.encode("ok"), ["http://pod:1"])
    for path, body in _sessionless(B64).items():
        r = await http.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and "text-only" in error["message"], (path, r.text)
        assert error.get("code", error.get("type")) in ("images_unsupported", "invalid_request_error"), path
