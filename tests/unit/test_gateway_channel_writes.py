"""The generate stream's write coalescing (services/gateway/channel.py ``_Stream.write_line``): the call lines of
one pass of the event loop leave in one write, none waits past ``MAX_HOLD_S``, and each call's send time is
when its line left, not when it was queued."""

from __future__ import annotations

import asyncio
import time

from services.gateway import channel as ch


class Transport:
    def __init__(self) -> None:
        self.writes: list[tuple[float, bytes]] = []

    def write(self, data: bytes) -> None:
        self.writes.append((time.perf_counter(), data))

    def is_closing(self) -> bool:
        return False


def _stream() -> tuple[ch._Stream, Transport]:
    stream = ch._Stream(ch.PodChannel("http://127.0.0.1:1", 1.0, 5.0))
    transport = Transport()
    stream.connection_made(transport)
    transport.writes.clear()  # the request head
    return stream, transport


async def test_lines_of_one_pass_leave_in_one_write_stamped_when_they_left(monkeypatch):
    # A busy machine can pause this test between two write_line calls for longer than the real hold; the
    # hold has its own test below, so here it is long enough that only the end of the pass flushes.
    monkeypatch.setattr(ch, "MAX_HOLD_S", 60.0)
    stream, transport = _stream()
    sent = [stream.write_line(b'{"id":"%d"}\n' % i) for i in range(3)]
    assert transport.writes == [] and sent[0] is sent[2] and sent[0][0] == 0.0
    await asyncio.sleep(0)  # the end of this pass
    [(at, data)] = transport.writes
    assert data == b"".join(b'b\r\n{"id":"%d"}\n\r\n' % i for i in range(3))
    assert sent[0][0] >= at
    later = stream.write_line(b"x\n")  # the next pass starts a new batch with its own send time
    assert later is not sent[0]
    await asyncio.sleep(0)
    assert [d for _, d in transport.writes[1:]] == [b"2\r\nx\n\r\n"]


async def test_no_line_waits_past_the_hold(monkeypatch):
    monkeypatch.setattr(ch, "MAX_HOLD_S", 0.0)  # every line has waited long enough as soon as it is queued
    stream, transport = _stream()
    first = stream.write_line(b"a\n")
    assert len(transport.writes) == 1 and first[0] > 0.0  # written at once, not at the end of the pass
    stream.write_line(b"b\n")
    assert len(transport.writes) == 2
    await asyncio.sleep(0)
    assert len(transport.writes) == 2  # the end of the pass has nothing left to write
