"""A scheduler queue for crawls over many sites: requests waiting for a lease count as busy.

A request waiting in ``ProxyShardMiddleware`` for a free proxy on a throttled site (its pace, a
quarantine, an open circuit breaker) holds one of Scrapy's ``CONCURRENT_REQUESTS`` while it waits. The
scheduler does not know: it keeps handing out that site's requests, and when the site is slowed hard
every concurrency slot of the host ends up waiting on it while the other sites have work and free
proxies (head-of-line blocking: measured on the nginx stack, two sites starved for 8 s while a third
had its proxies quarantined).

Scrapy's own answer for broad crawls is ``DownloaderAwarePriorityQueue``: it hands out the request
of the download slot (by default, the host name) with the fewest downloads in progress. But a request
waiting in a downloader middleware is not in its slot yet, so it counts for nothing there.
``SiteAwarePriorityQueue`` is that queue with the requests each slot has waiting for a lease
(``ShardRuntime.asking``) added to its downloads, so a site with many requests waiting is served
last, and the other sites fill the concurrency. The add-on sets it where the project left Scrapy's queue and
no ``JOBDIR`` is set (Scrapy resumes a ``JOBDIR`` crawl only with the priority queue it started with);
by hand::

    SCHEDULER_PRIORITY_QUEUE = "scrapy_proxy_shard.crawl.scheduling.SiteAwarePriorityQueue"

Like its base class it refuses ``CONCURRENT_REQUESTS_PER_IP``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from scrapy.pqueues import DownloaderAwarePriorityQueue, DownloaderInterface

from scrapy_proxy_shard.crawl.runtime import ShardRuntime

__all__ = ["SiteAwarePriorityQueue"]


class _LeaseAwareDownloader(DownloaderInterface):
    """Downloads in progress per slot, plus the slot's requests waiting for a lease on this host."""

    def __init__(self, crawler: Any) -> None:
        super().__init__(crawler)
        self._crawler = crawler

    def stats(self, possible_slots: Iterable[str]) -> list[tuple[int, str]]:
        runtime = getattr(self._crawler, ShardRuntime.ATTRIBUTE, None)
        asking = runtime.asking if runtime is not None else {}
        return [(self._active_downloads(slot) + asking.get(slot, 0), slot) for slot in possible_slots]


class SiteAwarePriorityQueue(DownloaderAwarePriorityQueue):
    """``DownloaderAwarePriorityQueue`` that counts requests waiting for a lease as busy downloads."""

    def __init__(self, crawler: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(crawler, *args, **kwargs)
        self._downloader_interface = _LeaseAwareDownloader(crawler)
