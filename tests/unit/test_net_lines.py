"""NDJSON framing shared by both ends of the generate stream."""

from __future__ import annotations

from molt.net import LineSplitter


def test_lines_split_across_pieces_come_out_whole_and_in_order():
    s = LineSplitter()
    assert s.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert s.pending_bytes == 4
    assert s.feed(b":2") == [] and s.pending_bytes == 6
    assert s.feed(b'}\n\n  \n{"c":3}\n{"d"') == [b'{"b":2}', b'{"c":3}']  # blank lines dropped
    assert s.rest() == b'{"d"' and s.pending_bytes == 4
    assert s.feed(b"") == [] and s.rest() == b'{"d"'


def test_a_long_line_that_trickles_in_is_counted_and_joined_once():
    s = LineSplitter()
    for _ in range(1000):
        assert s.feed(b"x" * 10) == []
    assert s.pending_bytes == 10_000
    assert s.feed(b"y\nz") == [b"x" * 10_000 + b"y"]
    assert s.rest() == b"z" and s.pending_bytes == 1
