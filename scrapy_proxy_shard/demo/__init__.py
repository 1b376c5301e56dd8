"""Offline stand-ins for the internet, so the demo and end-to-end tests need no network.

``site`` is a local anti-bot web site that bans a client IP that hits it too fast or
too concurrently; ``forward_proxy`` is a fleet of local HTTP proxies, each sending
from its own loopback address (127.0.0.x) so the site sees one client IP per proxy;
``sitelog`` turns the site's JSON-lines request log into the numbers the demo and
the tests assert on (overlapping use of one IP on one site, bans, session IP changes).
Everything here is stdlib-only asyncio.
"""
