"""free_port picks below the kernel's ephemeral range, where no outgoing connection takes a restarted service's
port."""

from __future__ import annotations

import socket

import pytest

from molt import net


def test_a_picked_port_is_below_the_ephemeral_range_and_bindable():
    low = net._ephemeral_port_low()
    if low < net._LOWEST_PICKED_PORT + 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    for _ in range(20):
        port = net.free_port()
        assert net._LOWEST_PICKED_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_where_the_range_cannot_be_read_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(net, "_ephemeral_port_low", lambda: 0)
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            spare = probe.getsockname()[1]
        picks = iter([taken, taken, spare])
        monkeypatch.setattr(net, "_ephemeral_port_low", lambda: 65535)
        monkeypatch.setattr(net.random, "randrange", lambda a, b: next(picks))
        assert net.free_port() == spare


def test_a_port_is_not_handed_out_twice(monkeypatch):
    # the soak picks every service's port before any binds one: a repeat put the gateway on the pod's port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        spare = probe.getsockname()[1]
    first = net.free_port()
    picks = iter([first, first, spare])
    monkeypatch.setattr(net, "_ephemeral_port_low", lambda: 65535)
    monkeypatch.setattr(net.random, "randrange", lambda a, b: next(picks))
    assert net.free_port() == spare
