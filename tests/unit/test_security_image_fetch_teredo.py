"""--gateway.fetch_images judges a Teredo address (2001::/32) by the client IPv4 it embeds, as it does NAT64 and
6to4 forms (docs/multimodal.md: "an IPv6 address that embeds an IPv4 one (NAT64, 6to4, Teredo) judged by that
address").

Teredo stores the client address obfuscated (each bit inverted): 127.0.0.1 is written 80ff:fffe.
"""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from services.gateway.config import FetchConfig
from services.gateway.errors import GatewayError
from services.gateway.image_fetch import ImageFetcher, _not_public

SERVER = "4136:e378"  # 65.54.227.120, a public Teredo server
TEREDO_LOOPBACK = f"2001:0:{SERVER}:8000:63bf:80ff:fffe"  # client 127.0.0.1
TEREDO_METADATA = f"2001:0:{SERVER}:8000:63bf:5601:5601"  # client 169.254.169.254
TEREDO_PUBLIC = f"2001:0:{SERVER}:8000:63bf:f7f7:f7f7"  # client 8.8.8.8


def test_the_addresses_here_embed_the_client_addresses_they_claim():
    # Guards the fixtures: a mistyped obfuscation would make the tests below prove nothing.
    clients = [ipaddress.IPv6Address(a).teredo[1] for a in (TEREDO_LOOPBACK, TEREDO_METADATA, TEREDO_PUBLIC)]
    assert [str(c) for c in clients] == ["127.0.0.1", "169.254.169.254", "8.8.8.8"]


@pytest.mark.parametrize("literal", [TEREDO_LOOPBACK, TEREDO_METADATA])
def test_a_teredo_address_embedding_an_internal_ipv4_is_not_public_and_is_not_fetched(literal):
    # A Teredo relay forwards to the embedded client address, so the loopback or metadata service would be
    # reached through it: the URL is a 400 before any connection is made.
    assert _not_public(literal)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]}
    body["messages"][0]["content"][0]["image_url"]["url"] = f"http://[{literal}]:9/a.png"

    async def go():
        fetcher = ImageFetcher(FetchConfig(fetch_images=True))
        try:
            await fetcher.inline(body)
        finally:
            await fetcher.close()

    with pytest.raises(GatewayError) as err:
        asyncio.run(go())
    assert "non-public address" in str(err.value), str(err.value)


def test_a_teredo_address_embedding_a_public_ipv4_is_judged_public():
    # 2001::/32 itself is not globally routable in Python's table, so only judging the embedded address (as the
    # doc says) makes this one public: it shows the verdict comes from the client IPv4, not the prefix.
    assert not _not_public(TEREDO_PUBLIC)
