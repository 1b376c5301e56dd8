"""SiteAwarePriorityQueue: requests waiting for a lease count as busy downloads of their slot, so a
throttled site's requests are handed out last (crawl/scheduling.py)."""

from __future__ import annotations

import asyncio

from scrapy import Request, Spider
from scrapy.pqueues import DownloaderAwarePriorityQueue
from scrapy.squeues import FifoMemoryQueue
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.test import get_crawler
from test_middlewares import Harness

from scrapy_proxy_shard.crawl.runtime import ShardRuntime
from scrapy_proxy_shard.crawl.scheduling import SiteAwarePriorityQueue


class _Slot:
    def __init__(self) -> None:
        self.active: set = set()


class _Downloader:
    """What the queue reads of Scrapy's downloader: its slots and their keys."""

    def __init__(self) -> None:
        self.slots: dict[str, _Slot] = {}

    def get_slot_key(self, request: Request) -> str:
        return request.meta.get("download_slot") or urlparse_cached(request).hostname or ""


class _Engine:
    def __init__(self) -> None:
        self.downloader = _Downloader()


class _Runtime:
    def __init__(self, asking: dict[str, int]) -> None:
        self.asking = asking


def _order(queue_cls, asking: dict[str, int]) -> list[str]:
    crawler = get_crawler(Spider)
    crawler.engine = _Engine()
    setattr(crawler, ShardRuntime.ATTRIBUTE, _Runtime(asking))
    queue = queue_cls.from_crawler(crawler, FifoMemoryQueue, "")
    for host in ("a.example", "a.example", "b.example", "b.example"):
        queue.push(Request(f"http://{host}/"))
    return [urlparse_cached(queue.pop()).hostname for _ in range(4)]


def test_a_slot_with_requests_waiting_for_a_lease_is_served_last():
    # Scrapy's queue sees no downloads anywhere and starts with a.example (ties go in slot order) ...
    assert _order(DownloaderAwarePriorityQueue, {"a.example": 5})[0] == "a.example"
    # ... ours counts a.example's five requests waiting for a lease on this host: b.example first.
    assert _order(SiteAwarePriorityQueue, {"a.example": 5}) == ["b.example", "b.example", "a.example", "a.example"]
    assert _order(SiteAwarePriorityQueue, {})[0] == "a.example"  # nobody waiting: as Scrapy's


def test_the_runtime_counts_a_request_per_slot_while_it_asks_for_a_lease():
    h = Harness({"PROXY_SHARD_MIN_INTERVAL": 0.5}, proxies=["http://10.9.9.1:3128"])
    seen: list[dict[str, int]] = []

    async def scenario():
        await h.open()
        first = Request("http://shop.example/1")
        await h.lease_mw.process_request(first)
        await h.respond(first)  # the only proxy now rests 0.5 s on shop.example
        second = asyncio.ensure_future(h.lease_mw.process_request(Request("http://shop.example/2")))
        await asyncio.sleep(0.1)
        seen.append(dict(h.runtime.asking))  # still waiting for the proxy
        await second
        seen.append(dict(h.runtime.asking))

    asyncio.run(scenario())
    assert seen == [{"shop.example": 1}, {}]
