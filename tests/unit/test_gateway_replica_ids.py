"""Session ids that name their replica: signed, verified, and ignored when forged or single-replica."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from services.gateway.config import GatewaySettings
from services.gateway.replicas import Replicas, session_of

A, B = "http://10.0.0.7:8080", "https://gw-1.example:443"
KEYS = ["k1", "k2"]


def test_ids_name_their_replica_and_only_signed_ones_are_followed():
    a, b = Replicas(A, KEYS), Replicas(B, list(reversed(KEYS)))  # key order does not matter
    sid = a.new_session_id()
    assert sid.count(".") == 2 and len(sid.split(".")[0]) == 32
    assert a.owner(sid) is None  # its own session: answered here
    assert b.owner(sid) == A
    assert a.owner(b.new_session_id()) == B
    uid, encoded, sig = sid.split(".")
    other_keys = Replicas(B, ["k3"])
    assert other_keys.owner(sid) is None  # signed with keys this replica does not share
    forged = Replicas("http://169.254.169.254", ["guess"]).new_session_id()
    assert b.owner(forged) is None and b.owner(f"{uid}.{forged.split('.', 1)[1]}") is None
    assert b.owner(f"{uid}.{encoded}.{'0' * 16}") is None
    assert b.owner(uid) is None and b.owner(None) is None and b.owner("a.b") is None


def test_single_replica_ids_are_plain_and_never_forwarded():
    single = Replicas("", [])
    sid = single.new_session_id()
    assert "." not in sid and len(sid) == 32
    assert single.owner(Replicas(A, KEYS).new_session_id()) is None


@pytest.mark.parametrize(
    "path, sid",
    [
        ("/s/abc/v1/chat/completions", "abc"),
        ("/s/abc.d.e/v1/messages", "abc.d.e"),
        ("/v1/sessions/x1", "x1"),
        ("/v1/sessions/x1/finish", "x1"),
        ("/v1/sessions", None),
        ("/v1/episodes", None),
        ("/s//v1", None),
    ],
)
def test_session_of_paths(path, sid):
    assert session_of(path) == sid


def test_public_url_needs_keys_and_a_url():
    base = {"model": {"path": "m"}, "server": {"host": "127.0.0.1"}}
    with pytest.raises(ValueError, match="needs --auth.api_keys"):
        GatewaySettings.model_validate({**base, "replica": {"public_url": A}})
    with pytest.raises(ValueError, match="not an http"):
        GatewaySettings.model_validate(
            {**base, "replica": {"public_url": "10.0.0.7:8080"}, "auth": {"api_keys": KEYS}}
        )
    ok = GatewaySettings.model_validate({**base, "replica": {"public_url": A + "/"}, "auth": {"api_keys": KEYS}})
    assert ok.replica.public_url == A


@pytest.mark.parametrize(
    "given, kept",
    [
        ("http://fd00::7:8080", "http://[fd00::7]:8080"),  # the chart's http://$(POD_IP):PORT on an IPv6 cluster
        ("http://2001:db8::1:80/gw", "http://[2001:db8::1]:80/gw"),
        ("http://[fd00::7]:8080", "http://[fd00::7]:8080"),
        ("http://10.0.0.7:8080", "http://10.0.0.7:8080"),
        ("https://gw-0.gw.ns.svc:443", "https://gw-0.gw.ns.svc:443"),
    ],
)
def test_public_url_brackets_a_bare_ipv6_address(given, kept):
    base = {"model": {"path": "m"}, "server": {"host": "127.0.0.1"}, "auth": {"api_keys": KEYS}}
    url = GatewaySettings.model_validate({**base, "replica": {"public_url": given}}).replica.public_url
    assert url == kept
    me, peer = Replicas(url, KEYS), Replicas("http://peer:1", KEYS)
    assert peer.owner(me.new_session_id()) == url  # and the id names it so that a peer can reach it
    assert urlsplit(url).port in (8080, 80, 443)


def test_public_url_with_a_malformed_colon_host_says_how_to_write_it():
    base = {"model": {"path": "m"}, "server": {"host": "127.0.0.1"}, "auth": {"api_keys": KEYS}}
    with pytest.raises(ValueError, match=r"in brackets, e.g. http://\[fd00::7\]:8080"):
        GatewaySettings.model_validate({**base, "replica": {"public_url": "http://a:b:8080"}})


def test_server_timing_durations():
    from services.gateway.replicas import _duration

    header = "gateway;dur=0.412, pod;dur=12.500"
    assert _duration(header, "pod") == 12.5 and _duration(header, "gateway") == 0.412
    assert (
        _duration(header, "owner") is None and _duration("", "pod") is None and _duration("pod;dur=x", "pod") is None
    )


def test_target_relays_once_and_never_a_head():
    a, b = Replicas(A, KEYS), Replicas(B, KEYS)
    sid = a.new_session_id()

    def scope(method="POST", path=f"/s/{sid}/v1/chat/completions", headers=()):
        return {"method": method, "path": path, "headers": list(headers)}

    assert b.target(scope()) == A and b.target(scope("GET", f"/v1/sessions/{sid}")) == A
    a.holds = {sid}.__contains__
    assert a.target(scope()) is None  # its own session, held here
    a.holds = lambda s: False
    assert a.target(scope()) == ""  # its own id, not held here (parked, or adopted elsewhere): looked up
    assert a.target(scope(headers=[(b"x-molt-forwarded-by", B.encode())])) == ""  # forwarded to it, likewise
    b.holds = {sid}.__contains__
    assert b.target(scope()) is None  # adopted by b: answered there, whatever the id names
    b.holds = lambda s: False
    b.remember_move(sid, "http://10.0.0.9:8080")
    assert b.target(scope()) == "http://10.0.0.9:8080"  # followed to the replica that adopted it
    b.moved.clear()
    assert a.target(scope(path="/s/0123456789abcdef/v1/chat/completions")) is None  # no replica's id: here
    assert b.target(scope("HEAD", f"/v1/sessions/{sid}")) is None
    assert b.target(scope(headers=[(b"x-molt-forwarded-by", A.encode())])) is None  # already relayed once
    assert b.target(scope(path="/v1/episodes")) is None and Replicas("", []).target(scope()) is None
