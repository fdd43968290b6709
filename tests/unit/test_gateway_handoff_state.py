"""A parked session (services/gateway/handoff.py) comes back whole: every field of Session, Capture, the chat
state and the last answer survives ``parked_state`` / ``session_from_state``, so a field added later and not
carried fails here rather than as a quietly different trajectory after a replica restart."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from services.gateway.capture import Capture, ChatState, SegmentState
from services.gateway.handoff import parked_state, session_from_state
from services.gateway.session import Session, TurnResult

NOT_CARRIED = {
    "lock": "a new lock per process",
    "last_used": "carried as idle seconds, a monotonic time here",
    "owner": "the API key is not stored, only its hash; the adopting request's key is set",
    "state": "only open sessions are parked",
    "result": "only open sessions are parked",
    "closed_at": "only open sessions are parked",
}


def _session() -> Session:
    segments = [
        SegmentState([1, 2, 3, 4], [(2, 4)], [-0.5, -0.25], [3, 3], truncated=True, reason="first"),
        SegmentState([5, 6, 7], [(1, 3)], [-1.0, -2.0], [4, 4], reason="history_rewrite"),
    ]
    chat = ChatState(
        [{"role": "user", "content": "hi"}],
        [{"type": "function", "function": {"name": "f"}}],
        "<render>",
        {"role": "assistant", "content": "yo"},
        "yo<|im_end|>",
    )
    capture = Capture(
        max_length=128,
        segments=segments,
        chat=chat,
        completion_text="abc",
        events=[{"kind": "pod", "pod": "http://p:1", "at_token": 0}],
        image_data={"ab12": "aGk="},
    )
    last = TurnResult([6, 7], [-1.0, -2.0], "stop", 4, "yo", "yo<|im_end|>", "yo", [], 5, 3, 125, 0.01, False)
    return Session(
        id="s1",
        owner="key",
        group_id="g",
        sample_index=2,
        label={"answer": [1, 2]},
        env_name="env",
        env_version="v2",
        sampling_params={"temperature": 0.7, "nan": math.nan},
        metadata={"m": 1},
        capture=capture,
        created_at=123.5,
        pod="http://p:1",
        turns=3,
        last_key="k",
        last_result=last,
    )


def test_every_field_survives_parking():
    s = _session()
    s.last_used = time.monotonic() - 30
    parked = parked_state(s)
    back = session_from_state(parked["state"], parked["segments"], owner="key")
    for f in dataclasses.fields(Session):
        if f.name in NOT_CARRIED:
            continue
        a, b = getattr(s, f.name), getattr(back, f.name)
        if f.name == "sampling_params":  # NaN != NaN: compared by repr
            assert repr(a) == repr(b)
        else:
            assert a == b, f.name
    assert back.owner == "key" and back.state == "open" and isinstance(back.lock, asyncio.Lock)
    assert 29 < time.monotonic() - back.last_used < 40  # idle time carries over, so the TTL still applies
    assert all(isinstance(span, tuple) for seg in back.capture.segments for span in seg.spans)
    carried = {"max_length", "segments", "chat", "completion_text", "events", "image_data"}
    assert {f.name for f in dataclasses.fields(Capture)} == carried, "a new Capture field: carry it in parked_state"


def test_a_state_of_another_format_is_refused_not_misread():
    import json

    import pytest

    parked = parked_state(_session())
    state = json.loads(parked["state"])
    for damaged, segments in (
        (dict(state, format=2), parked["segments"]),
        ({k: v for k, v in state.items() if k != "capture"}, parked["segments"]),
        (state, b"[1, 2]"),
        (state, b"not json"),
        ("[1, 2]", parked["segments"]),
    ):
        raw = damaged.encode() if isinstance(damaged, str) else json.dumps(damaged).encode()
        with pytest.raises(ValueError, match="unreadable parked session"):
            session_from_state(raw, segments, owner=None)


def test_moe_routing_survives_parking_as_int16():
    import json

    import numpy as np

    s = _session()
    routed = np.arange(4 * 2 * 2, dtype=np.int16).reshape(4, 2, 2) % 8
    s.capture.segments[0].routed_experts = routed
    parked = parked_state(s)
    back = session_from_state(parked["state"], parked["segments"], owner="key").capture.segments
    assert back[0].routed_experts.dtype == np.int16
    np.testing.assert_array_equal(back[0].routed_experts, routed)
    assert back[1].routed_experts is None
    assert "routed_experts" not in json.loads(parked["segments"])[1]  # absent, not null: older replicas read it
