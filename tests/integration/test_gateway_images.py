"""Images through the gateway to a real rollout pod (vLLM, the tiny VLM) and into the trajectory stream.

OpenAI ``image_url`` data URLs and Anthropic base64 ``image`` blocks, driven by the real SDKs. The captured
segment holds each image's tokens expanded exactly as the model saw them and the image files by sha256, so a
trainer running transformers on the recorded tokens and files reproduces the pod's logprobs (< 1e-4, fp32).
Bad images are a 400 in the wire's shape and nothing reaches the stream.
"""

from __future__ import annotations

import base64
import hashlib
import json

import anthropic
import httpx
import openai
import pytest
from vl_testlib import data_url, hf_sequence_logprobs, image_bytes

from molt.models.tiny_vl import IMAGE_SEQ_LEN
from tests.gateway_testlib import file_server, pod_and_gateway, read_trajectories, start_gateway, stop

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.timeout(300)]
TOL = 1e-4
POD_CONTEXT = 1024  # the test pod's --vllm.max_model_len (tests/gateway_testlib.py)


@pytest.fixture(scope="module")
def stack(tiny_idefics3, redis_url, tmp_path_factory):
    limits = ["--rollout.max_images_per_prompt", "3", "--rollout.max_image_pixels", str(200 * 200)]
    logs = tmp_path_factory.mktemp("gw-images")
    with pod_and_gateway(tiny_idefics3, logs, redis_url, "gateway-images", max_length=512, pod={"extra": limits}) as (
        url,
        pod_url,
        stream,
    ):
        yield {
            "url": url,
            "pod": pod_url,
            "redis": redis_url,
            "stream": stream,
            "model": tiny_idefics3,
            "image_token": json.loads((tiny_idefics3 / "config.json").read_text())["image_token_id"],
        }


def _open(stack) -> dict:
    r = httpx.post(stack["url"] + "/v1/sessions", json={"sampling_params": {"temperature": 1.0, "seed": 7}})
    assert r.status_code == 201, r.text
    return r.json()


def _finish(stack, sid: str) -> dict:
    r = httpx.post(f"{stack['url']}/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert r.status_code == 200, r.text
    return r.json()


def _trajectory(stack, sid: str):
    found = [t for t in read_trajectories(stack["redis"], stack["stream"]) if t.trajectory_id == sid]
    assert len(found) <= 1
    return found[0] if found else None


def _check_reproducible(stack, traj, image_files: list[bytes]) -> None:
    """The trainer's view: transformers on the recorded tokens + image files gives the recorded logprobs."""
    [seg] = traj.segments
    digests = [hashlib.sha256(b).hexdigest() for b in image_files]
    assert seg.images == digests and set(traj.images) == set(digests)
    assert all(traj.images[d] == b for d, b in zip(digests, image_files))
    ids = seg.token_ids.tolist()
    image_token = json.loads((stack["model"] / "config.json").read_text())["image_token_id"]
    assert ids.count(image_token) == IMAGE_SEQ_LEN * len(image_files)
    hf = hf_sequence_logprobs(stack["model"], ids, [traj.images[d] for d in seg.images])
    recorded = seg.token_logprobs().tolist()
    mask = seg.action_mask().tolist()
    diffs = [abs(hf[i - 1] - recorded[i]) for i in range(1, len(ids)) if mask[i]]
    assert diffs and max(diffs) < TOL, max(diffs)


def test_openai_multi_turn_with_images_in_two_turns_is_token_exact(stack):
    a, b = image_bytes(1), image_bytes(2, fmt="JPEG")
    session = _open(stack)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key="x")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(a)}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this one?"},
                {"type": "image_url", "image_url": {"url": data_url(b, "image/jpeg")}},
            ],
        },
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    messages += [
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "Compare them."},
    ]
    client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    assert _finish(stack, session["session_id"])["written"] is True
    traj = _trajectory(stack, session["session_id"])
    assert len(traj.segments) == 1 and len(traj.segments[0].action_spans) == 3  # every turn extended one segment
    _check_reproducible(stack, traj, [a, b])


def test_anthropic_base64_image_block(stack):
    a = image_bytes(3)
    session = _open(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="x")
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(a).decode()},
    }
    client.messages.create(
        model="m",
        max_tokens=5,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]}],
    )
    assert _finish(stack, session["session_id"])["written"] is True
    _check_reproducible(stack, _trajectory(stack, session["session_id"]), [a])


def test_anthropic_tool_result_with_a_screenshot(stack):
    """A tool that answers with an image (a screenshot, as computer-use agents' tools do): the tool_result's
    text and image blocks reach the model in their order and the trajectory reproduces."""
    a = image_bytes(4)
    session = _open(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="x")
    shot = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(a).decode()},
    }
    messages = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Here:"}, shot]}
            ],
        },
    ]
    tools = [{"name": "screenshot", "description": "Capture the screen.", "input_schema": {"type": "object"}}]
    client.messages.create(model="m", max_tokens=5, messages=messages, tools=tools)
    assert _finish(stack, session["session_id"])["written"] is True
    _check_reproducible(stack, _trajectory(stack, session["session_id"]), [a])


def test_responses_input_image_through_the_openai_sdk(stack):
    a = image_bytes(4)
    session = _open(stack)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key="x")
    content = [{"type": "input_image", "image_url": data_url(a)}, {"type": "input_text", "text": "What is it?"}]
    client.responses.create(model="m", max_output_tokens=5, input=[{"role": "user", "content": content}])
    assert _finish(stack, session["session_id"])["written"] is True
    _check_reproducible(stack, _trajectory(stack, session["session_id"]), [a])

    session = _open(stack)
    bad = [{"type": "input_image", "file_id": "file-123"}, {"type": "input_text", "text": "hi"}]
    body = {"model": "m", "max_output_tokens": 3, "input": [{"role": "user", "content": bad}]}
    r = httpx.post(session["openai_base_url"] + "/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].file_id", r.text
    assert _finish(stack, session["session_id"])["written"] is False


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BAD = [  # (parts, what the message says, the pod's error code when the pod is the one that refuses)
    (
        [_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())],
        "not a decodable image",
        "invalid_image",
    ),
    ([_part(data_url(image_bytes(0, fmt="BMP")))], "BMP", "unsupported_image_format"),
    ([_part(data_url(image_bytes(0), "image/bmp"))], "unsupported image media type", None),
    ([_part("data:image/png;base64,@@@")], "not valid base64", None),
    ([_part("https://example.com/cat.png")], "not fetched", None),
    ([_part(data_url(image_bytes(0, size=(300, 300))))], "pixels", "image_too_large"),
    ([_part(data_url(image_bytes(i))) for i in range(4)], "at most 3", "too_many_images"),
]


@pytest.mark.parametrize("parts, problem, pod_code", BAD, ids=[p for _, p, _ in BAD])
def test_bad_images_are_a_400_and_nothing_is_written(stack, parts, problem, pod_code):
    session = _open(stack)
    body = {
        "model": "m",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
    }
    r = httpx.post(session["openai_base_url"] + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert problem in r.json()["error"]["message"], r.json()
    if pod_code is not None:  # the pod's code comes through, and the field is the client's: its messages
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (pod_code, "messages"), r.json()
    assert _finish(stack, session["session_id"])["written"] is False
    assert _trajectory(stack, session["session_id"]) is None


def test_anthropic_url_image_source_is_a_400(stack):
    session = _open(stack)
    body = {
        "model": "m",
        "max_tokens": 3,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}],
            }
        ],
    }
    r = httpx.post(session["anthropic_base_url"] + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "image source type 'url'" in r.json()["error"]["message"]


def test_session_less_chat_with_an_image(stack):
    body = {
        "model": "m",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [_part(data_url(image_bytes(5))), {"type": "text", "text": "hi"}]}],
    }
    r = httpx.post(stack["url"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0


@pytest.fixture(scope="module")
def image_server():
    """A loopback HTTP server with one PNG, one JPEG and a text file; anything else is a 404."""
    files = {"/cat.png": image_bytes(5), "/dog.jpg": image_bytes(6, fmt="JPEG"), "/notes.txt": b"not an image"}
    with file_server(lambda path: (200, {}, files[path]) if path in files else (404, {}, b"")) as url:
        yield url, files


@pytest.fixture(scope="module")
def fetching(stack, tmp_path_factory):
    """A second gateway on the same pod and stream, with --gateway.fetch_images."""
    args = ["--model", str(stack["model"]), "--rollout.urls", stack["pod"], "--redis.url", stack["redis"]]
    args += ["--redis.stream", stack["stream"], "--session.max_length", "512", "--gateway.fetch_images"]
    args += ["--gateway.fetch_allow_hosts", "127.0.0.1"]  # the image server is on loopback, refused by default
    gw, url = start_gateway(args, tmp_path_factory.mktemp("gw-fetch") / "gateway.log")
    try:
        yield {**stack, "url": url}
    finally:
        stop(gw)


def test_with_fetch_images_url_images_are_fetched_and_recorded_on_both_wires(fetching, image_server):
    base, files = image_server
    session = _open(fetching)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key="x")
    content = [_part(f"{base}/cat.png"), {"type": "text", "text": "and"}, _part(f"{base}/dog.jpg")]
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=5)
    assert _finish(fetching, session["session_id"])["written"] is True
    _check_reproducible(fetching, _trajectory(fetching, session["session_id"]), [files["/cat.png"], files["/dog.jpg"]])

    session = _open(fetching)
    block = {"type": "image", "source": {"type": "url", "url": f"{base}/cat.png"}}
    anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="x").messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": [block, {"type": "text", "text": "Hi."}]}]
    )
    assert _finish(fetching, session["session_id"])["written"] is True
    _check_reproducible(fetching, _trajectory(fetching, session["session_id"]), [files["/cat.png"]])

    session = _open(fetching)
    content = [{"type": "input_image", "image_url": f"{base}/dog.jpg"}, {"type": "input_text", "text": "Hi."}]
    openai.OpenAI(base_url=session["openai_base_url"], api_key="x").responses.create(
        model="m", max_output_tokens=5, input=[{"role": "user", "content": content}]
    )
    assert _finish(fetching, session["session_id"])["written"] is True
    _check_reproducible(fetching, _trajectory(fetching, session["session_id"]), [files["/dog.jpg"]])


@pytest.mark.parametrize(
    "path, problem",
    [("/missing.png", "answered HTTP 404"), ("/notes.txt", "is not a PNG, JPEG, WEBP, GIF image")],
)
def test_a_url_image_that_cannot_be_used_is_a_400_naming_the_part_and_nothing_is_written(
    fetching, image_server, path, problem
):
    session = _open(fetching)
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [_part(image_server[0] + path)]}]}
    r = httpx.post(session["openai_base_url"] + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url"
    assert _finish(fetching, session["session_id"])["written"] is False


def test_feedback_images_that_do_not_fit_once_expanded_are_dropped_and_their_text_kept(stack):
    """An Env's feedback with an image (a token-level turn) whose text fits the session's max_length while the
    image, expanded by the pod, does not: as Molt does, the image and its token are dropped and the feedback's
    text is kept and answered. Feedback whose text alone fills the context finishes "length" with no tokens and
    nothing recorded. No segment is ever longer than max_length."""
    max_length = 48
    r = httpx.post(
        stack["url"] + "/v1/sessions",
        json={"max_length": max_length, "sampling_params": {"temperature": 1.0, "seed": 3, "max_tokens": 2}},
    )
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    turn = f"{stack['url']}/v1/sessions/{sid}/generate"
    first_image = image_bytes(4)
    first = httpx.post(turn, json={"append_text": "look <image>", "images": [data_url(first_image)]}).json()
    assert first["num_tokens"] < max_length - IMAGE_SEQ_LEN
    room = max_length - first["num_tokens"]
    filler = [100] * (room - 4)  # fits with the image as its one placeholder token, not once expanded
    feedback = {"append_token_ids": filler, "append_text": "<image>", "images": [data_url(image_bytes(5))]}
    r = httpx.post(turn, json=feedback)
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["token_ids"] and second["num_tokens"] <= max_length, second
    r = httpx.post(turn, json={"append_token_ids": [100] * room})  # the text alone does not fit
    assert r.status_code == 200 and r.json()["finish_reason"] == "length" and r.json()["token_ids"] == [], r.text
    assert _finish(stack, sid)["written"] is True
    traj = _trajectory(stack, sid)
    [seg] = traj.segments
    assert len(seg.token_ids) == second["num_tokens"] <= max_length and traj.status == "truncated"
    assert seg.images == [hashlib.sha256(first_image).hexdigest()]  # the dropped image is not in the record
    ids = seg.token_ids.tolist()
    assert ids.count(stack["image_token"]) == IMAGE_SEQ_LEN and ids[first["num_tokens"] :][: len(filler)] == filler


def test_a_chat_agents_new_images_that_do_not_fit_are_dropped_and_its_text_answered(stack):
    """A session opened as env workers open a ChatAgent's (``context_full: "length"``): a turn whose new message's
    images do not fit the context once expanded is answered without them (Molt's rule for feedback images), the
    record holds its text and not the images, and the client's next turn, which repeats them in its history,
    still extends the same segment."""
    a, b, c = image_bytes(6), image_bytes(7), image_bytes(8)
    sp = {"temperature": 1.0, "seed": 11}

    def chat(max_length: int):
        r = httpx.post(
            stack["url"] + "/v1/sessions",
            json={"max_length": max_length, "context_full": "length", "sampling_params": sp},
        )
        assert r.status_code == 201, r.text
        session = r.json()
        client = openai.OpenAI(base_url=session["openai_base_url"], api_key="x", max_retries=0)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(a)}}]}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": data_url(b)}},
                    {"type": "image_url", "image_url": {"url": data_url(c)}},
                ],
            },
        ]
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
        return session["session_id"], client, messages, second

    probe_sid, _, _, probe = chat(512)  # the second turn's prompt with its images expanded
    httpx.delete(f"{stack['url']}/v1/sessions/{probe_sid}")
    with_images = probe.usage.prompt_tokens
    sid, client, messages, second = chat(with_images)  # its text fits, its images once expanded do not
    run = IMAGE_SEQ_LEN + 3  # each image's tokens once expanded
    assert second.usage.prompt_tokens == with_images - 2 * run and second.usage.completion_tokens == 1
    messages += [{"role": "assistant", "content": second.choices[0].message.content}, {"role": "user", "content": "?"}]
    third = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert third.usage.completion_tokens == 1
    assert _finish(stack, sid)["written"] is True
    [seg] = _trajectory(stack, sid).segments  # one segment: every turn extended it
    assert seg.images == [hashlib.sha256(a).hexdigest()] and len(seg.action_spans) == 3
    assert list(seg.token_ids).count(stack["image_token"]) == IMAGE_SEQ_LEN and len(seg.token_ids) <= with_images


def test_feedback_images_the_pod_finds_past_its_context_are_dropped(stack, tmp_path):
    """A gateway that has not seen an image yet counts each as its one token; where the session's max_length is the
    pod's whole context, the pod itself finds the expanded prompt too long. It says so (with the expanded length),
    and the gateway treats it as any image that does not fit: feedback is answered without it."""
    gw, url = start_gateway(
        [
            *("--model", str(stack["model"]), "--rollout.urls", stack["pod"], "--redis.url", stack["redis"]),
            *("--redis.stream", stack["stream"], "--session.max_length", str(POD_CONTEXT)),
        ],
        tmp_path / "gateway.log",
    )
    try:
        r = httpx.post(
            url + "/v1/sessions", json={"sampling_params": {"temperature": 1.0, "seed": 5, "max_tokens": 2}}
        )
        assert r.status_code == 201 and r.json()["max_length"] == POD_CONTEXT, r.text
        sid = r.json()["session_id"]
        turn = f"{url}/v1/sessions/{sid}/generate"
        first = httpx.post(turn, json={"append_text": "look"}, timeout=60).json()
        filler = [100] * (POD_CONTEXT - first["num_tokens"] - 4)  # leaves room for the image's one token, not its run
        feedback = {"append_token_ids": filler, "append_text": "<image>", "images": [data_url(image_bytes(9))]}
        r = httpx.post(turn, json=feedback, timeout=120)
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["token_ids"] and second["num_tokens"] <= POD_CONTEXT
        r = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0}, timeout=60)
        assert r.status_code == 200 and r.json()["written"], r.text
    finally:
        stop(gw)
    [seg] = _trajectory(stack, sid).segments
    assert seg.images == [] and stack["image_token"] not in seg.token_ids.tolist()
    assert len(seg.token_ids) == second["num_tokens"]


def test_the_images_bench_runs_against_this_pod_and_reports_both_sides(stack):
    """``bench/gateway_images.py`` end to end on a few image turns (the benchmark itself, not its figures)."""
    from bench import gateway_images

    argv = ["--model", str(stack["model"]), "--pod-url", stack["pod"], "--requests", "4", "--rounds", "1"]
    rows = gateway_images.main([*argv, "--concurrency", "1", "2"])
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["requests"] >= 4 and r["direct_rps"] > 0 and r["gateway_rps"] > 0
        assert r["ratio"] == pytest.approx(r["gateway_rps"] / r["direct_rps"], rel=0.02)
        assert 0 <= r["added_p50_ms"] <= r["added_p99_ms"]
