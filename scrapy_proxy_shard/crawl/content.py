"""A content check that fails for every proxy before it ever passed: suspect the check, not the proxies.

A spider-wide required CSS selector its pages lack (a typo, a redesign, the README example's own start
page) makes every answer a ``missing_css`` ban: before, each proxy was quarantined on its first answer
(for ~28 minutes on every host), the pool was burnt in a minute and the crawl ended with 0 items and
exit code 0. Now, while a content check has never passed on a site (recorded cluster-wide in Redis,
``content.lua``), its failures are *suspect*: the proxy is released without a quarantine (stat
``proxy_shard/content/suspect``). When ``PROXY_SHARD_CONTENT_SUSPECT_PROXIES`` distinct proxies (all
of them in a smaller pool) failed it with no pass, the site's circuit breaker opens with cause
``content`` (no lease for the site on any host), the host whose answer opened it logs one ERROR line
naming the selector and the site (stat ``proxy_shard/content/breaker_opened``), and the requests for
the site wait for nothing: the crawl closes with reason ``proxy_shard_content_check`` (exit code 1)
once this host serves nothing else (crawl/liveness.py). Once the check passed on a site, its failures
are bans as before.
"""

from __future__ import annotations

import logging
from typing import Any

from scrapy_proxy_shard import signals as shard_signals
from scrapy_proxy_shard.engine.records import Lease
from scrapy_proxy_shard.exceptions import ProxyShardError

logger = logging.getLogger(__name__)

STATS = "proxy_shard"
#: Ban reasons of a content check (a 2xx page judged by its content, not by the site's status).
CONTENT_REASONS = frozenset({"missing_css"})
#: (pool, site) pairs remembered per host; beyond it, forgotten (asked of Redis again).
REMEMBERED = 10_000


def describe(selectors: tuple[str, ...] | list[str]) -> str:
    """A check as logged and stored: ``'div.product'`` or ``'div.a', 'h1'``."""
    return ", ".join(repr(s) for s in selectors) or "(required CSS)"


class ContentChecks:
    """Per crawler: the sites whose content check passed (cached), and the checks this host applies."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._passed: set[tuple[str, str]] = set()
        self._checks: dict[str, set[str]] = {}  # site -> checks this host found failing there

    def checks_here(self, site: str, check: str) -> bool:
        """``check`` (a breaker's cause) may be one this host applies on ``site``: it found it failing
        there, or its spider-wide / settings check is that one, or it knows no check of its own there
        (per-request checks, no answer seen yet). Otherwise (this crawl checks something else there) an
        ordinary breaker wait: its check may be right, and the breaker's probe tells."""
        seen = self._checks.get(site)
        if seen:
            return check in seen
        spider = getattr(self.runtime.crawler, "spider", None)
        own = getattr(spider, "proxy_shard_required_css", None)
        if own is None:
            policy = self.runtime.settings.policy
            rules = (getattr(policy, "site_rules", None) or {}).get(site)
            own = getattr(rules, "required_css", None) or policy.required_css
        if isinstance(own, str):
            own = [own]
        return not own or describe(tuple(own)) == check

    async def passed(self, lease: Lease) -> None:
        """A content check passed on the lease's site: record it once per host (then failures are bans)."""
        key = (lease.pool, lease.site)
        if key in self._passed:
            return
        try:
            await self.runtime.store.content_check(lease.pool, lease.site, "pass")
        except (AttributeError, ProxyShardError):
            return
        self._remember(key)

    async def failed(self, lease: Lease, check: str, request: Any = None) -> bool:
        """A content check failed through the lease's proxy. Returns True when the failure is suspect (the
        check never passed on the site): release it without a ban."""
        key = (lease.pool, lease.site)
        if key in self._passed:
            return False
        checks = self._checks.setdefault(lease.site, set())
        if len(checks) < 16:
            checks.add(check)
        stats = self.runtime.stats
        try:
            verdict = await self.runtime.store.content_check(
                lease.pool, lease.site, "fail", proxy_id=lease.proxy_id, check=check,
                suspects=self.runtime.settings.content_suspect_proxies)
        except (AttributeError, ProxyShardError) as exc:
            logger.debug("proxy_shard: content check state of %(site)s unknown: %(e)s", {"site": lease.site, "e": exc})
            return False
        if verdict is None:
            return False
        if verdict.kind == "trusted":
            self._remember(key)
            return False
        if not verdict.suspect:
            return False
        stats.inc_value(f"{STATS}/content/suspect")
        if verdict.kind == "opened":
            stats.inc_value(f"{STATS}/content/breaker_opened")
            stats.inc_value(f"{STATS}/breaker/opened")
            logger.error(
                "proxy_shard: the check may be wrong: every proxy's first answer from %(site)s lacks %(check)s "
                "(%(n)d distinct proxies failed it, none ever passed it there); circuit breaker OPEN for "
                "%(site)s (pool %(pool)r, cause content) on every host, no proxy quarantined; fix "
                "PROXY_SHARD_REQUIRED_CSS / the spider attribute proxy_shard_required_css (or the site's "
                "required_css in PROXY_SHARD_SITES)",
                {"site": lease.site, "check": check, "n": verdict.proxies, "pool": lease.pool})
            self.runtime.crawler.signals.send_catch_log(
                shard_signals.content_check_suspected, request=request, site=lease.site, pool=lease.pool,
                check=check, proxies=verdict.proxies)
        else:
            logger.info("proxy_shard: %(site)s: answer through proxy %(proxy)s lacks %(check)s, a check that never "
                        "passed there: suspect, proxy not quarantined (%(n)d of %(needed)d distinct proxies)",
                        {"site": lease.site, "proxy": lease.proxy_id, "check": check, "n": verdict.proxies,
                         "needed": verdict.needed})
        return True

    def _remember(self, key: tuple[str, str]) -> None:
        if len(self._passed) >= REMEMBERED:
            self._passed.clear()
        self._passed.add(key)
