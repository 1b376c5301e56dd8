"""A Scrapy DNS resolver that sends the demo's ``*.test`` sites to the local anti-bot site.

Without it a request that escapes the proxies (no ``meta['proxy']``) dies in DNS and the site never
sees it: a test could not tell "no direct request was sent" from "a direct request failed". With it
(``TWISTED_DNS_RESOLVER``) and the site's port in the URLs, such a request reaches the site from the
host's own loopback address, 127.0.0.1, while every proxy egresses from its own 127.0.0.x (x >= 2):
the site's log then shows each direct request for what it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from scrapy.resolver import CachingThreadedResolver
from twisted.internet import defer

#: Where a ``*.test`` name resolves to: the site listens there, and a direct connection to it leaves
#: from this same address (the proxies never use it).
DIRECT_ADDRESS = "127.0.0.1"


class DemoSiteResolver(CachingThreadedResolver):
    """``*.test`` -> 127.0.0.1; every other name as Scrapy's default resolver does."""

    def getHostByName(self, name: str, timeout: Sequence[int] = ()) -> defer.Deferred[str]:
        if name.lower().rstrip(".").endswith(".test"):
            return defer.succeed(DIRECT_ADDRESS)
        return super().getHostByName(name, timeout)
