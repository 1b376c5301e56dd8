"""A crawl that cannot start: one clear line, no request sent, and a non-zero exit code.

Scrapy 2.19 exits ``scrapy crawl`` with 1 only when its crawler runner sees a failed bootstrap; an
exception that escapes ``Crawler.crawl_async`` gets there but is printed as a multi-screen traceback
("Task exception was never retrieved" / "Unhandled error in Deferred"), and a spider closed at open
exits 0. Both runners (``AsyncCrawlerProcess`` and ``CrawlerProcess``) also count a crawl whose
crawler has *no spider* when it ends as a failed bootstrap. So a start-up failure here:

1. is logged once, as one ERROR line ``proxy_shard: cannot start: <what and how to fix it>``;
2. closes the spider from ``spider_opened`` with ``CloseSpider("proxy_shard_error")``: the engine
   never starts, no request is scheduled or sent;
3. when the spider has closed (stats dumped, feeds written), clears ``crawler.spider``, which makes
   the runner report the failed bootstrap: exit code 1, with no traceback.

Failures found while the components are built (a bad setting, the wiring check) take the same path
instead of raising from ``from_crawler``.
"""

from __future__ import annotations

import logging
from typing import Any

from scrapy import signals
from scrapy.exceptions import CloseSpider

from scrapy_proxy_shard.crawl.handlers import HandlerMap
from scrapy_proxy_shard.crawl.wiring import check_wiring
from scrapy_proxy_shard.exceptions import ProxyShardError, SettingError
from scrapy_proxy_shard.settings import ShardSettings

logger = logging.getLogger(__name__)

REASON = "proxy_shard_error"


class StartupGate:
    """Per crawler: the first reason the plugin cannot start (see the module docstring)."""

    ATTRIBUTE = "_proxy_shard_startup"

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.error: ProxyShardError | None = None
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)

    @classmethod
    def for_crawler(cls, crawler: Any) -> StartupGate:
        gate = getattr(crawler, cls.ATTRIBUTE, None)
        if gate is None:
            gate = cls(crawler)
            setattr(crawler, cls.ATTRIBUTE, gate)
        return gate

    def fail(self, error: ProxyShardError) -> CloseSpider:
        """Record (and log, once) why the crawl cannot start; returns the CloseSpider to raise."""
        if self.error is None:
            self.error = error
            logger.error("proxy_shard: cannot start: %(error)s", {"error": error})
            try:
                stats = self.crawler.stats
            except (AttributeError, RuntimeError):  # not crawling yet (a test harness)
                stats = None
            if stats is not None:
                stats.set_value("proxy_shard/open_error", type(error).__name__)
        return CloseSpider(REASON)

    def _spider_opened(self, spider: Any) -> None:
        """First ``spider_opened`` receiver of the plugin: check the wiring, stop a failed start."""
        self.crawler.signals.connect(self._spider_closed, signal=signals.spider_closed)
        if self.error is None:
            try:
                for warning in check_wiring(self.crawler.settings):
                    logger.warning("proxy_shard: %(w)s", {"w": warning})
                check_handlers(self.crawler)
            except ProxyShardError as exc:
                self.fail(exc)
        if self.error is not None:
            raise CloseSpider(REASON)

    def _spider_closed(self, spider: Any = None, reason: str | None = None) -> None:
        if self.error is not None:
            # Scrapy's runners: bootstrap_failed |= not crawler.spider -> `scrapy crawl` exits 1.
            self.crawler.spider = None


async def check_eviction(client: Any, where: str, mode: str) -> None:
    """Refuse (or warn about) a Redis that may evict the pool's keys; warn when it cannot be read.

    ``allkeys-*`` may evict the ``proxies`` hash or a site's ready set: leases with no URL, slots
    lost or handed out twice. ``volatile-*`` evicts only keys with a TTL — a site's state (its ready
    set and the records of its held slots, which expire when the site is idle), sticky sessions and
    the quarantines (which expire with their latest entry) — so a session may change IP, a held slot
    may be handed out again and a quarantined proxy come back early: a warning.
    ``maxmemory 0`` means no limit: nothing is evicted whatever the policy.
    """
    try:
        reply = await client.config_get("maxmemory*")
    except Exception as exc:  # CONFIG is often renamed or denied on managed Redis
        logger.warning("proxy_shard: could not read maxmemory-policy of Redis at %(where)s (%(e)s): make sure "
                       "it is 'noeviction'", {"where": where, "e": f"{type(exc).__name__}: {exc}"})
        return
    policy, limit = _policy_of(reply)
    if policy is None or policy == "noeviction" or limit == 0:
        return
    problem = (f"Redis at {where} has maxmemory-policy {policy!r} (maxmemory {limit}): it may evict "
               f"the pool's keys")
    if policy.startswith("allkeys") and mode == "refuse":
        raise SettingError(f"{problem}; set maxmemory-policy noeviction (CONFIG SET maxmemory-policy "
                           f"noeviction), or PROXY_SHARD_REDIS_EVICTION = 'warn' to run anyway")
    logger.warning("proxy_shard: %(p)s (%(what)s); noeviction is recommended",
                   {"p": problem, "what": "proxies, ready sets and bans" if policy.startswith("allkeys")
                    else "sites' held slots and ready sets, sticky sessions and quarantines"})


def check_handlers(crawler: Any) -> None:
    """Refuse a download handler not known to use meta['proxy'] (crawl/handlers.py), unless declared."""
    settings = ShardSettings.for_crawler(crawler)
    if settings.enabled:
        HandlerMap.for_crawler(crawler, settings.proxy_aware_handlers).check()


def _policy_of(reply: Any) -> tuple[str | None, int | None]:
    """(policy, maxmemory) from CONFIG GET: a dict, or per-node dicts from a cluster client."""
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        reply = next(iter(reply.values()))
    if not isinstance(reply, dict):
        return None, None
    policy = reply.get("maxmemory-policy")
    try:
        limit = int(reply.get("maxmemory", 0))
    except (TypeError, ValueError):
        limit = None
    return (policy.decode() if isinstance(policy, bytes) else policy), limit
