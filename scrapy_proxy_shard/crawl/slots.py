"""Scrapy's download slot of a leased request: no delay, no queue.

A lease is when a request leaves: the engine paced it (start to start, per IP and site, for every host)
and every host paces the IP's next request from that start. Scrapy's downloader puts each request in a
slot (the plugin gives a leased request its own, ``<site>|<proxy id>``) whose ``DOWNLOAD_DELAY`` and
concurrency (``CONCURRENT_REQUESTS_PER_DOMAIN``) are host-local: left alone, a slot would hold a leased
request back, for the delay or behind the proxy's other slot, and send it long after its lease, next to
a request another host leased on time through the same IP. ``scrapy startproject`` writes
``DOWNLOAD_DELAY = 1`` and ``CONCURRENT_REQUESTS_PER_DOMAIN = 1`` into every new project: in the site
zoo's ``api-overlap2`` profile those two lines took a crawl with the rule given from 0.82 of the
reference to 0.08, with 709 of 1,400 items lost, 65 early arrivals and 21 bans.

So the slot Scrapy makes for a leased request has no delay and no concurrency cap (the lease holds
both, cluster-wide), and Scrapy's AutoThrottle leaves its delay alone. ``DOWNLOAD_DELAY`` itself is kept
at the lease instead, as the floor of the site's interval per IP (settings.py). A ``download_slot`` the
spider set itself is left as it is: its delay and concurrency apply after the lease (docs/guide/pacing.md).
"""

from __future__ import annotations

from typing import Any

from scrapy_proxy_shard.settings import MAX_CONCURRENCY

__all__ = ["OWN_SLOT_SETTINGS", "LeasedSlots", "leased_slot"]

#: Scrapy's per-slot settings (DOWNLOAD_SLOTS' keys) of a leased request's own slot: the lease paces it.
#: ``concurrency``: the engine's most slots per proxy and site: never the cap.
OWN_SLOT_SETTINGS = {"concurrency": MAX_CONCURRENCY, "delay": 0.0}
#: Most slot keys kept waiting for Scrapy to make their slot.
PENDING_MAX = 10000


class LeasedSlots(dict):
    """The downloader's ``per_slot_settings`` (DOWNLOAD_SLOTS), read by Scrapy only when it makes a slot:
    a key the middleware leased for and Scrapy has no slot of yet gets :data:`OWN_SLOT_SETTINGS` then
    (its entry goes once read: at most the leased requests not yet queued are kept)."""

    def __init__(self, user: dict) -> None:
        super().__init__(user)
        self._pending: set[str] = set()

    def expect(self, key: str) -> None:
        if len(self._pending) >= PENDING_MAX:  # keys leased and never queued (a cache hit, a dropped request)
            self._pending.clear()  # (safe: a slot made without them is mended by leased_slot on its next use)
        self._pending.add(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self._pending:
            self._pending.discard(key)
            return {**OWN_SLOT_SETTINGS, **super().get(key, {})}
        return super().get(key, default)


def leased_slot(crawler: Any, key: str, meta: dict) -> None:
    """Make the download slot ``key`` of a leased request send it at once: its settings when Scrapy makes
    it, no delay or cap on one it already has (AutoThrottle, or a slot made before the middleware's
    first lease), and ``autothrottle_dont_adjust_delay`` so that AutoThrottle leaves it so."""
    meta["autothrottle_dont_adjust_delay"] = True
    try:
        downloader = crawler.engine.downloader
    except (AttributeError, RuntimeError):  # no engine yet (Scrapy raises RuntimeError): nothing queues
        return
    slot = getattr(downloader, "slots", {}).get(key)
    if slot is not None:
        if slot.delay:
            slot.delay = 0.0
        if slot.concurrency < OWN_SLOT_SETTINGS["concurrency"]:
            slot.concurrency = OWN_SLOT_SETTINGS["concurrency"]
        return
    settings = getattr(downloader, "per_slot_settings", None)
    if not isinstance(settings, LeasedSlots):
        settings = LeasedSlots(settings or {})
        downloader.per_slot_settings = settings
    settings.expect(key)
