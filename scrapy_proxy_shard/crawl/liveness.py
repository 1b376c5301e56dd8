"""When no proxy can serve a site: wait while the pool will recover, close the crawl when it will not.

The engine's WAIT says how long until the earliest slot of the site frees, and whether that is *firm*:
no slot of the site is held (so no release can free one sooner) or its circuit breaker is open.

A request is never dropped because proxies are quarantined, paced or in use for a while: it waits as
long as the pool will recover (``PROXY_SHARD_MAX_WAIT`` no longer bounds such waits; it bounds only
waits with no known end: a pool Redis lost, Redis stalled, or the host on its local fallback). A site
whose proxies are all quarantined (or whose breaker is open) is *paused*: one WARNING line per
(pool, site) every ``PROXY_SHARD_PAUSE_LOG_INTERVAL`` seconds says how many requests wait, until when
and why, and one INFO line says when serving resumes (stats ``proxy_shard/pauses``,
``proxy_shard/paused_seconds``).

A firm wait that ends past ``PROXY_SHARD_PAUSE_HORIZON`` (or never: a content check found wrong, see
``content``) cannot be waited out. Its requests stay parked while this host serves anything else; when
it serves nothing else (no lease in flight, none granted in the last ``QUIET`` seconds, no request
waiting for a site that is not past the horizon) the spider is closed with reason
``proxy_pool_exhausted`` (``proxy_shard_content_check`` for a wrong content check) and one ERROR line
(which pool and site, until when, what to do). With ``JOBDIR`` set, every request that could not get a
proxy from then on is put back in the scheduler's disk queue (``RequestKept``, stat
``proxy_shard/exhausted/kept``) and the next run sends it; the process exits with code 1, as a crawl
that could not finish. A request that ends without being sent (and is not kept) is counted in
``proxy_shard/not_sent``; a crawl that finishes with any exits with code 1 too.
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
#: The close reason when a content check failed for every proxy and never passed (the check is wrong).
CONTENT_REASON = "proxy_shard_content_check"
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


class _Pause:
    """One pause of a (pool, site): no proxy can serve it until ``until`` (wall clock)."""

    __slots__ = ("logged", "reason", "since", "until", "why")

    def __init__(self, since: float, until: float, why: str, reason: str) -> None:
        self.since, self.until, self.why, self.reason = since, until, why, reason
        self.logged = float("-inf")  # loop time of its last WARNING line


class Liveness:
    """Per crawler: which (pool, site) pairs are paused or cannot be served, and whether that ends the crawl."""

    def __init__(self, crawler: Any, stats: Any, max_wait: float, leases_held: Callable[[], int], *,
                 horizon: float = 3600.0, log_interval: float = 60.0) -> None:
        self.crawler = crawler
        self.stats = stats
        self.max_wait = max_wait
        self.horizon = horizon
        self.log_interval = log_interval
        self._leases_held = leases_held
        self._until: dict[tuple[str, str], float] = {}  # past the horizon until (loop time)
        self._asking: dict[tuple[str, str], int] = {}  # requests asking for a lease, per (pool, site)
        self._paused: dict[tuple[str, str], _Pause] = {}
        self._last_lease = float("-inf")
        self._closer: asyncio.Future | None = None
        self.closing = False
        self.close_reason = REASON

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

    def waiting(self, pool: str, site: str) -> int:
        """Requests of this host asking for a lease on (pool, site) now."""
        return self._asking.get((pool, site), 0)

    def leased(self, pool: str, site: str) -> None:
        self._last_lease = asyncio.get_running_loop().time()
        if self._until:
            self._until.pop((pool, site), None)
        if self._paused:
            pause = self._paused.pop((pool, site), None)
            if pause is not None:
                took = self._end_pause(pause)
                logger.info("proxy_shard: serving %(site)s (pool %(pool)r) again after %(s).0fs paused",
                            {"site": site, "pool": pool, "s": took})

    def _end_pause(self, pause: _Pause) -> float:
        took = max(0.0, asyncio.get_running_loop().time() - pause.since)
        self.stats.inc_value(f"{STATS}/paused_seconds", round(took, 3))
        return took

    # --- the decision ------------------------------------------------------------------------------
    def past_horizon(self, wait: LeaseWait, cause: str | None = None) -> bool:
        """No lease can come within the horizon: a firm wait ending past it, or never (``cause`` content)."""
        return wait.firm and (cause == "content" or wait.wait > self.horizon)

    def check(self, pool: str, site: str, wait: LeaseWait, *, cause: str | None = None,
              check: str | None = None) -> bool:
        """Whether ``wait`` is past the horizon (the request parks: it waits, asking again now and
        then). Raises ``PoolExhausted`` when it is and this host serves nothing else (the crawl closes)."""
        if not self.past_horizon(wait, cause):
            return False
        now = asyncio.get_running_loop().time()
        if len(self._until) >= REMEMBERED:
            self._until = {k: t for k, t in self._until.items() if t > now}
        never = cause == "content"
        self._until[(pool, site)] = float("inf") if never else now + wait.wait
        if not self._nothing_served():
            return True
        until = float("inf") if never else time.time() + wait.wait
        if never:
            what = (f"the content check {check or '(required CSS)'} failed for every proxy's first answer and "
                    f"never passed there: the check (or the site) is wrong, not the proxies")
            message = f"pool {pool!r} cannot serve site {site!r}: {what}"
            reason = "content"
        else:
            what = ("its circuit breaker is open (the site rejected every proxy lately)" if wait.reason == "breaker"
                    else "every proxy is quarantined or resting there and none is in use")
            message = (f"pool {pool!r} cannot serve site {site!r} before {_clock(until)} (in {wait.wait:.0f}s, "
                       f"past PROXY_SHARD_PAUSE_HORIZON {self.horizon:g}s): {what}")
            reason = wait.reason
        raise PoolExhausted(message, pool=pool, site=site, until=until, reason=reason)

    # --- pauses --------------------------------------------------------------------------------
    def pause_due(self, pool: str, site: str) -> bool:
        """A WARNING line about (pool, site)'s pause is due now (the first, or ``log_interval`` after the last)."""
        pause = self._paused.get((pool, site))
        return pause is None or asyncio.get_running_loop().time() - pause.logged >= self.log_interval

    def paused(self, pool: str, site: str, wait: LeaseWait, why: str) -> None:
        """No proxy can serve (pool, site) for ``wait``: start or go on with its pause; one WARNING line
        per ``log_interval`` saying how many requests wait, until when and why."""
        loop_now = asyncio.get_running_loop().time()
        until = time.time() + wait.wait
        key = (pool, site)
        pause = self._paused.get(key)
        if pause is None:
            if len(self._paused) >= REMEMBERED:
                for old in list(self._paused)[: REMEMBERED // 10]:
                    self._end_pause(self._paused.pop(old))
            pause = self._paused[key] = _Pause(loop_now, until, why, wait.reason)
            self.stats.inc_value(f"{STATS}/pauses")
        pause.until, pause.why = until, why
        if loop_now - pause.logged < self.log_interval:
            return
        pause.logged = loop_now
        n = self.waiting(pool, site)
        logger.warning(
            "proxy_shard: %(n)d request%(s)s for %(site)s (pool %(pool)r) wait%(v)s: %(why)s until %(until)s; "
            "next line in %(every)g s",
            {"n": n, "s": "" if n == 1 else "s", "v": "s" if n == 1 else "", "site": site, "pool": pool,
             "why": why, "until": _clock(until, short=wait.wait < 72000), "every": self.log_interval})

    # --- failures ------------------------------------------------------------------------------
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
        if exc.reason == "content":
            self.close_reason = CONTENT_REASON
            fix = ("fix PROXY_SHARD_REQUIRED_CSS / the spider's proxy_shard_required_css (or the site's "
                   "required_css), then run again")
        elif exc.reason == "breaker":
            fix = ("wait for the site to accept requests again, then run again (the breaker probes it), or raise "
                   "PROXY_SHARD_PAUSE_HORIZON above the breaker's cool-off")
        else:
            fix = (f"add proxies (scrapy-proxy-shard --pool {exc.pool} load FILE), lift quarantines "
                   f"(scrapy-proxy-shard --pool {exc.pool} unban --all PROXY) or raise PROXY_SHARD_PAUSE_HORIZON")
        kept = ("the requests not sent are kept in JOBDIR for the next run" if jobdir else
                "set JOBDIR to keep the requests not sent for the next run")
        logger.error("proxy_shard: closing the spider (%(reason)s): %(exc)s, and this host serves no other site; "
                     "%(fix)s; %(kept)s", {"reason": self.close_reason, "exc": exc, "fix": fix, "kept": kept})
        self.stats.set_value(f"{STATS}/exhausted/closed", f"{exc.pool}/{exc.site}")
        self._closer = close_spider_soon(self.crawler, self.close_reason)

    def spider_closed(self, reason: str | None = None) -> None:
        """Exit code 1 when the crawl closed for an exhausted pool or a wrong content check, or finished
        with requests not sent (startup.py's way: the runners count a crawler without a spider at its
        end as failed). Pauses still running end here (their seconds counted)."""
        for pause in self._paused.values():
            self._end_pause(pause)
        self._paused.clear()
        if reason == self.close_reason and self.closing:
            self.crawler.spider = None
            return
        not_sent = self.stats.get_value(f"{STATS}/not_sent", 0) or 0
        if reason == "finished" and not_sent:
            logger.error("proxy_shard: the crawl finished with %(n)d request%(s)s not sent (stat "
                         "proxy_shard/not_sent: each got no proxy, see the lines above); exit code 1",
                         {"n": not_sent, "s": "" if not_sent == 1 else "s"})
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
            headers.pop(browser.PROXY_AUTHORIZATION, None)
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


def _clock(epoch: float, *, short: bool = False) -> str:
    if epoch == float("inf"):
        return "never"
    return time.strftime("%H:%M:%S UTC" if short else "%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))
