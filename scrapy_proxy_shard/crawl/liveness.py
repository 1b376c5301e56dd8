"""When no proxy can serve a site: fail the request at once, and close the crawl when nothing can be served.

The engine's WAIT says how long until the earliest slot of the site frees, and whether that is *firm*:
no slot of the site is held (so no release can free one sooner) or its circuit breaker is open. A
firm wait that ends after the request's deadline (``PROXY_SHARD_MAX_WAIT`` from its first ask) cannot
end in a lease: the request fails at once with ``PoolExhausted`` naming the pool, the site and until
when, instead of sleeping out the whole wait limit (300 requests at concurrency 16 with a 3 s limit
took 57 s to fail that way; with the defaults 10k requests sat ~10 h). A wait for a slot in use
(``held``) is never firm: its release usually comes long before the lease expires.

A site whose pool is exhausted alone does not stop the crawl: its requests fail fast (stat
``proxy_shard/exhausted``) while the other sites are crawled. The spider is closed with reason
``proxy_pool_exhausted`` (one ERROR line: which pool and site, until when, what to do) when a
request fails that way and this host serves nothing else: no lease in flight, none granted in the
last ``QUIET`` seconds, no request waiting for a site that is not exhausted. With ``JOBDIR`` set,
every request that could not get a proxy from then on is put back in the scheduler's disk queue
(``RequestKept``, stat ``proxy_shard/exhausted/kept``) and the next run sends it, like the requests
still queued; the process exits with code 1, as a crawl that could not finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from scrapy import Request

from scrapy_proxy_shard.crawl import browser
from scrapy_proxy_shard.engine.store import LeaseWait
from scrapy_proxy_shard.exceptions import NoProxyAvailable, PoolExhausted, RequestKept

logger = logging.getLogger(__name__)

REASON = "proxy_pool_exhausted"
#: Seconds without any lease granted on this host before an exhausted site may close the crawl (a
#: site served a moment ago is probably still being crawled: its next request is on its way).
QUIET = 1.0
#: (pool, site) pairs remembered as exhausted; beyond it, the expired ones are forgotten.
REMEMBERED = 10_000
STATS = "proxy_shard"
# meta keys a kept request loses: the proxy leased for its previous attempt (credentials must not be
# written to JOBDIR, and the next run leases again). Names as in middlewares.py (OWN_PROXY, OWN_SLOT)
# and Scrapy's HttpProxyMiddleware (_auth_proxy). What crawl/browser.py bind() added for a browser
# request (its context, credentials included) is undone by browser.unbind().
_LEASE_META = ("proxy", "_proxy_shard_proxy", "proxy_shard_proxy_id", "_auth_proxy")
_OWN_SLOT = "_proxy_shard_slot"


class Liveness:
    """Per crawler: which (pool, site) pairs cannot be served, and whether that ends the crawl."""

    def __init__(self, crawler: Any, stats: Any, max_wait: float, leases_held: Callable[[], int]) -> None:
        self.crawler = crawler
        self.stats = stats
        self.max_wait = max_wait
        self._leases_held = leases_held
        self._until: dict[tuple[str, str], float] = {}  # exhausted until (loop time)
        self._asking: dict[tuple[str, str], int] = {}  # requests asking for a lease, per (pool, site)
        self._last_lease = float("-inf")
        self._closer: asyncio.Future | None = None
        self.closing = False

    # --- bookkeeping (ShardRuntime.acquire) ------------------------------------------------------
    def enter(self, pool: str, site: str) -> None:
        key = (pool, site)
        self._asking[key] = self._asking.get(key, 0) + 1

    def leave(self, pool: str, site: str) -> None:
        key = (pool, site)
        left = self._asking.get(key, 0) - 1
        if left > 0:
            self._asking[key] = left
        else:
            self._asking.pop(key, None)

    def leased(self, pool: str, site: str) -> None:
        self._last_lease = asyncio.get_running_loop().time()
        if self._until:
            self._until.pop((pool, site), None)

    # --- the decision ------------------------------------------------------------------------------
    def check(self, pool: str, site: str, wait: LeaseWait, deadline: float) -> None:
        """Raise ``PoolExhausted`` when ``wait`` is firm and ends after ``deadline`` (loop time)."""
        if not wait.firm:
            return
        now = asyncio.get_running_loop().time()
        if now + wait.wait <= deadline:
            return
        if len(self._until) >= REMEMBERED:
            self._until = {k: t for k, t in self._until.items() if t > now}
        self._until[(pool, site)] = now + wait.wait
        until = time.time() + wait.wait
        what = ("its circuit breaker is open (the site rejected every proxy lately)" if wait.reason == "breaker"
                else "every proxy is quarantined or resting there and none is in use")
        raise PoolExhausted(
            f"pool {pool!r} cannot serve site {site!r} before {_clock(until)} (in {wait.wait:.0f}s, past "
            f"PROXY_SHARD_MAX_WAIT {self.max_wait:g}s): {what}",
            pool=pool, site=site, until=until, reason=wait.reason,
        )

    async def settle(self, request: Request, exc: NoProxyAvailable) -> Exception:
        """``failed``, after waiting out the rest of ``QUIET`` when a lease granted a moment ago is all
        that keeps an exhausted pool from closing the crawl. A pool whose proxies all die at once (each
        leased, refused, quarantined proxy-wide) is exhausted within the second of its last lease: every
        request failed in that second and the crawl ended ``finished``, exit 0, nothing kept."""
        if isinstance(exc, PoolExhausted) and not self.closing and self._only_recent_lease():
            await asyncio.sleep(max(0.0, self._last_lease + QUIET - asyncio.get_running_loop().time()))
        return self.failed(request, exc)

    def _only_recent_lease(self) -> bool:
        now = asyncio.get_running_loop().time()
        return (not self._leases_held() and now - self._last_lease < QUIET
                and all(self._until.get(key, 0.0) > now for key in self._asking))

    def failed(self, request: Request, exc: NoProxyAvailable) -> Exception:
        """What ``acquire`` raises for a request that got no proxy: ``exc``, or ``RequestKept`` once the
        crawl closes for an exhausted pool and ``JOBDIR`` keeps the request for the next run."""
        if isinstance(exc, PoolExhausted):
            self.stats.inc_value(f"{STATS}/exhausted")
            if not self.closing and self._nothing_served():
                self._close(exc)
        if self.closing and self._keep(request):
            self.stats.inc_value(f"{STATS}/exhausted/kept")
            return RequestKept(f"{request.url} not sent ({exc}); kept in JOBDIR for the next run")
        return exc

    def _nothing_served(self) -> bool:
        now = asyncio.get_running_loop().time()
        if self._leases_held() or now - self._last_lease < QUIET:
            return False
        return all(self._until.get(key, 0.0) > now for key in self._asking)

    def _close(self, exc: PoolExhausted) -> None:
        self.closing = True
        jobdir = self._jobdir()
        if exc.reason == "breaker":
            fix = ("wait for the site to accept requests again, then run again (the breaker probes it), or raise "
                   "PROXY_SHARD_MAX_WAIT above the breaker's cool-off")
        else:
            fix = (f"add proxies (scrapy-proxy-shard --pool {exc.pool} load FILE), lift quarantines "
                   f"(scrapy-proxy-shard --pool {exc.pool} unban --all PROXY) or raise PROXY_SHARD_MAX_WAIT")
        kept = ("the requests not sent are kept in JOBDIR for the next run" if jobdir else
                "set JOBDIR to keep the requests not sent for the next run")
        logger.error("proxy_shard: closing the spider (%(reason)s): %(exc)s, and this host serves no other site; "
                     "%(fix)s; %(kept)s", {"reason": REASON, "exc": exc, "fix": fix, "kept": kept})
        self.stats.set_value(f"{STATS}/exhausted/closed", f"{exc.pool}/{exc.site}")
        self._closer = close_spider_soon(self.crawler, REASON)

    def spider_closed(self, reason: str | None = None) -> None:
        """Exit code 1 when the crawl closed for an exhausted pool (startup.py's way: the runners count
        a crawler without a spider at its end as failed)."""
        if reason == REASON and self.closing:
            self.crawler.spider = None

    def _jobdir(self) -> bool:
        settings = getattr(self.crawler, "settings", None)
        return bool(settings is not None and settings.get("JOBDIR"))

    def _keep(self, request: Request) -> bool:
        """Put ``request`` back in the scheduler's JOBDIR queue (without the proxy of an earlier attempt,
        nor the browser context bound to it: no credential is written to disk)."""
        if not self._jobdir():
            return False
        engine = getattr(self.crawler, "engine", None)
        if engine is None or getattr(engine, "spider", None) is None:
            return False
        meta = dict(request.meta)
        headers = request.headers.copy()
        if "_proxy_shard_proxy" in meta:
            headers.pop(b"Proxy-Authorization", None)
            for name in _LEASE_META:
                meta.pop(name, None)
            if meta.pop(_OWN_SLOT, None) is not None:
                meta.pop("download_slot", None)
        browser.unbind(meta)
        try:
            engine.crawl(request.replace(dont_filter=True, meta=meta, headers=headers))
        except RuntimeError:  # the spider closed meanwhile
            return False
        return True


def close_spider_soon(crawler: Any, reason: str) -> asyncio.Future | None:
    """Close the crawler's spider with ``reason`` (a task; None when no engine runs a spider: a test
    harness). Closing a spider that closed meanwhile is not an error."""
    try:
        engine = crawler.engine
    except (AttributeError, RuntimeError):
        engine = None
    if engine is None or getattr(engine, "spider", None) is None:
        return None
    return asyncio.ensure_future(_close_spider(engine, reason))


async def _close_spider(engine: Any, reason: str) -> None:
    try:
        await engine.close_spider_async(reason=reason)
    except Exception as exc:  # already closed meanwhile
        logger.debug("proxy_shard: closing the spider: %(e)r", {"e": exc})


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))
