"""The periodic pool log line of a crawl, like Scrapy's LogStats but for the shared proxy pool.

Every ``PROXY_SHARD_LOGSTATS_INTERVAL`` seconds (0: off) each crawl logs one INFO line with what
*this host* sees: its own leases and their rate, its success ratio in Redis, bans it met, how
often and how long it waited for a slot; and per pool it uses, the pool size, the live hosts and the
free slots of the tightest sites. The pool figures come from the last heartbeat (``health.py``),
so the line costs no Redis round trip of its own::

    proxy_shard: host-0: 240 leases (at 12.0/min), 96.1% ok, 5 bans, 14 waits (3.2s waited);
    pool 'datacenter': 8 proxies, 3 hosts, free shop-a.test 2/8, market.test 5/8;
    learned intervals shop-a.test 0.213s, market.test 0.250s

The learned intervals (adaptive pacing, ``PROXY_SHARD_AUTOTHROTTLE_ENABLED``) are the last values this
host's releases were answered with (the ``proxy_shard/autothrottle/interval/<site>`` stats).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from scrapy_proxy_shard.engine.store import Beat

logger = logging.getLogger(__name__)

#: Sites named per pool in the line (those with the fewest free slots); the rest are counted.
MAX_SITES = 3
#: Stat (under ``proxy_shard/``) holding a site's learned interval, seconds: ``<INTERVAL_STAT>/<site>``.
INTERVAL_STAT = "autothrottle/interval"
#: Stat (under ``proxy_shard/``) holding a fixed-interval site's path margin, ms: ``<MARGIN_STAT>/<site>``.
MARGIN_STAT = "pacing/margin_ms"


class PoolLogStats:
    """Formats and logs the line; keeps the previous lease count to report a rate."""

    def __init__(self, stats: Any, host_id: str) -> None:
        self.stats = stats
        self.host_id = host_id
        self._last_leases = 0
        self._last_time: float | None = None

    def start(self, now: float) -> None:
        self._last_leases = self._stat("leases")
        self._last_time = now

    def log(self, beats: Mapping[str, Beat], now: float) -> None:
        logger.info("proxy_shard: %(host)s: %(leases)d leases (at %(rate).1f/min), %(ok)s ok, %(bans)d bans, "
                    "%(waits)d waits (%(waited).1fs waited); %(pools)s%(pacing)s", self.values(beats, now))

    def values(self, beats: Mapping[str, Beat], now: float) -> dict[str, Any]:
        """The mapping the line is formatted with (tests read it directly)."""
        leases = self._stat("leases")
        elapsed = now - self._last_time if self._last_time is not None else 0.0
        rate = (leases - self._last_leases) * 60 / elapsed if elapsed > 0 else 0.0
        self._last_leases, self._last_time = leases, now
        ok = sum(b.ok for b in beats.values())
        finished = ok + sum(b.errors + b.bans for b in beats.values())
        return {
            "host": self.host_id,
            "leases": leases,
            "rate": rate,
            "ok": f"{100 * ok / finished:.1f}%" if finished else "-",
            "bans": self._stat("bans"),
            "waits": self._stat("waits"),
            "waited": float(self._stat("wait_time")),
            "pools": "; ".join(pool_summary(pool, beat) for pool, beat in sorted(beats.items()))
                     or "no heartbeat yet",
            "pacing": self._pacing(),
        }

    def _pacing(self) -> str:
        """``; learned intervals a.com 0.213s, b.com 0.250s (+2 sites)``, or "" without adaptive pacing."""
        get_stats = getattr(self.stats, "get_stats", None)
        if get_stats is None:
            return ""
        prefix = f"proxy_shard/{INTERVAL_STAT}/"
        learned = [(k[len(prefix):], v) for k, v in get_stats().items() if k.startswith(prefix)]
        if not learned:
            return ""
        # the slowest sites first: those are the ones the crawl waits for
        learned.sort(key=lambda item: (-item[1], item[0]))
        shown = ", ".join(f"{site} {value:.3f}s" for site, value in learned[:MAX_SITES])
        more = f" (+{len(learned) - MAX_SITES} sites)" if len(learned) > MAX_SITES else ""
        return f"; learned intervals {shown}{more}"

    def _stat(self, name: str) -> Any:
        if self.stats is None:
            return 0
        return self.stats.get_value(f"proxy_shard/{name}", 0)


def pool_summary(pool: str, beat: Beat) -> str:
    """``pool 'x': 8 proxies, 3 hosts, free a.com 2/8, b.com 5/8 (+2 sites)``."""
    text = f"pool {pool!r}: {beat.proxies} proxies, {beat.live_hosts} hosts"
    tight = sorted(beat.sites.items(), key=lambda item: (item[1][1] / max(1, item[1][0]), item[0]))
    if tight:
        shown = ", ".join(f"{site} {free}/{slots}" for site, (slots, free) in tight[:MAX_SITES])
        more = f" (+{len(tight) - MAX_SITES} sites)" if len(tight) > MAX_SITES else ""
        text += f", free {shown}{more}"
    return text
