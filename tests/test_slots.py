"""crawl/slots.py on Scrapy's own Downloader: a leased request's slot sends it at once, whatever the
project's DOWNLOAD_DELAY and CONCURRENT_REQUESTS_PER_DOMAIN (the end-to-end check, from the site's log,
is tests/test_scrapy_delay_end_to_end.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from scrapy import Request
from scrapy.core.downloader import Downloader
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.crawl import slots
from scrapy_proxy_shard.crawl.slots import OWN_SLOT_SETTINGS, LeasedSlots, leased_slot

TEMPLATE = {"DOWNLOAD_DELAY": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1,
            "DOWNLOAD_SLOTS": {"other.example": {"delay": 2.0, "concurrency": 3}},
            "DOWNLOAD_HANDLERS": {"http": None, "https": None}}  # (no handler: nothing is downloaded)


def _downloader():
    downloader = Downloader(get_crawler(settings_dict=TEMPLATE))
    return downloader, SimpleNamespace(engine=SimpleNamespace(downloader=downloader))


def test_a_leased_slot_has_no_delay_and_no_cap_and_autothrottle_leaves_it():
    asyncio.run(_a_leased_slot())  # (Scrapy's Downloader wants a running loop without a reactor)


async def _a_leased_slot():
    downloader, crawler = _downloader()
    meta: dict = {}
    leased_slot(crawler, "s.example|p1", meta)
    assert meta["autothrottle_dont_adjust_delay"] is True
    _, slot = downloader._get_slot(Request("http://s.example/", meta={"download_slot": "s.example|p1"}))
    assert slot.delay == 0 and slot.download_delay() == 0 and slot.concurrency == OWN_SLOT_SETTINGS["concurrency"]
    # the project's own slots keep their settings: a plain one the template's, a DOWNLOAD_SLOTS one its own
    _, plain = downloader._get_slot(Request("http://plain.example/"))
    assert (plain.delay, plain.concurrency) == (1, 1)
    _, other = downloader._get_slot(Request("http://other.example/"))
    assert (other.delay, other.concurrency) == (2.0, 3)
    # a slot that got a delay later (AutoThrottle) or was made before the first lease is mended
    slot.delay, slot.concurrency = 3.0, 1
    leased_slot(crawler, "s.example|p1", {})
    assert slot.delay == 0 and slot.concurrency == OWN_SLOT_SETTINGS["concurrency"]


def test_keys_leased_and_never_queued_stay_bounded(monkeypatch):
    monkeypatch.setattr(slots, "PENDING_MAX", 3)
    settings = LeasedSlots({})
    for n in range(10):
        settings.expect(f"s|p{n}")
    assert len(settings._pending) <= 3
    assert settings.get("s|p9") == OWN_SLOT_SETTINGS and settings.get("s|p9") is None


def test_no_engine_yet_only_marks_the_request():
    meta: dict = {}
    leased_slot(SimpleNamespace(), "s|p", meta)
    assert meta == {"autothrottle_dont_adjust_delay": True}
