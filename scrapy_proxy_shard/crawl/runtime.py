"""Per-crawler state shared by the two middlewares: settings, the pool store and the leases in flight.

Both ``ProxyShardMiddleware`` and ``BanDetectionMiddleware`` get the same ``ShardRuntime`` from
``ShardRuntime.for_crawler``. Leases are tracked by request object (a weak mapping), never by a
token in ``request.meta``: meta is copied into retries, redirects and follow-up requests, and a
copied token would let a child request release its parent's lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scrapy import Request, signals
from scrapy.utils.httpobj import urlparse_cached

from scrapy_proxy_shard import signals as shard_signals
from scrapy_proxy_shard.crawl.arrival import ArrivalGuard
from scrapy_proxy_shard.crawl.browser import OWN_CONTEXT, PROXY_AUTHORIZATION
from scrapy_proxy_shard.crawl.content import ContentChecks
from scrapy_proxy_shard.crawl.gateways import GatewayRuntime
from scrapy_proxy_shard.crawl.health import HostMonitor
from scrapy_proxy_shard.crawl.links import SiteLinker
from scrapy_proxy_shard.crawl.liveness import Liveness, close_spider_soon
from scrapy_proxy_shard.crawl.logstats import INTERVAL_STAT, MARGIN_STAT
from scrapy_proxy_shard.crawl.pacewake import PacingSleepers
from scrapy_proxy_shard.crawl.startup import StartupGate, check_eviction
from scrapy_proxy_shard.crawl.tiers import TierMoved, TierRouter
from scrapy_proxy_shard.engine.breaker import BreakerEvent
from scrapy_proxy_shard.engine.schema import check_name
from scrapy_proxy_shard.engine.sites import SiteMap, site_of_request
from scrapy_proxy_shard.engine.store import Lease, LeaseWait, PoolBackend, ReleaseResult
from scrapy_proxy_shard.exceptions import (
    HostIdTaken,
    NoProxyAvailable,
    PoolBackendError,
    PoolBusy,
    PoolExhausted,
    ProxyShardError,
    SettingError,
    UnknownPoolError,
)
from scrapy_proxy_shard.modes.factory import build_store
from scrapy_proxy_shard.modes.fallback import replay_bans
from scrapy_proxy_shard.modes.pools import initial_proxies, platform_of, platform_pool
from scrapy_proxy_shard.settings import MAX_LEASE_TTL, ShardSettings

logger = logging.getLogger(__name__)
#: The path margin a fixed interval starts with on a site that taught none yet: 3% of the interval (at most
#: 20 ms; docs/pacing.md), so a jitter of a few ms does not cost the first IPs; it decays when unneeded.
MARGIN_PRIOR = 0.03

#: The log line of each step of a site's learned requests in flight per IP (conc_release in
#: engine/lua/_pace.lua; docs/pacing.md).
CONC_EVENTS = {
    "conc_probe": "proxy_shard: adaptive pacing: %(site)s answers outlast its interval: proxy %(proxy)s tries "
                  "two requests in flight",
    "conc_up": "proxy_shard: adaptive pacing: %(site)s answered two requests in flight per IP clean: every "
               "proxy now has two slots there, for every host",
    "conc_fail": "proxy_shard: adaptive pacing: %(site)s refused two requests in flight on proxy %(proxy)s "
                 "(%(reason)s): one per IP",
    "conc_off": "proxy_shard: adaptive pacing: %(site)s is back to one request in flight per IP, for every host "
                "(PROXY_SHARD_AUTOTHROTTLE_OVERLAP is off; what the site taught is kept)",
}
#: Longest single block on a site's freed list; kept below the Redis client's socket timeout.
MAX_BLOCK = 2.0
#: The longest a site spreads its proxies' first requests over (seconds; the adaptive start interval's
#: default): a long fixed interval (minutes) would otherwise hold a proxy's first page back that long.
OPENING_SPREAD_MAX = 3.0
#: Seconds a lease outlives its request's download_timeout (release happens right after the response).
LEASE_MARGIN = 2.0
#: Shortest pause between two lease calls of one waiting request (seconds): the loop cannot spin.
MIN_PAUSE = 0.05
#: ... when the engine said exactly when a slot frees (pacing): slept that long, but at least this.
PACING_PAUSE = 0.005
#: How long a site's breaker cause read from the store is trusted (seconds).
CAUSE_TTL = 5.0
#: How often a waiting request checks whether the crawl is stopping (seconds).
STOP_POLL = 0.2
#: Pause before a request asks again after the store gave up waiting out BUSY / LOADING (seconds).
BUSY_PAUSE = 0.2
# A pool that held proxies and lost them (Redis restarted empty, a drain): ask again this often.
EMPTY_POOL_PAUSE = 0.5
# (pool, site) pairs remembered as exhausted (asks go through the gate); beyond it, forgotten at once.
EXHAUSTED_SITES = 10_000
STATS = "proxy_shard"
#: The close reason of a crawl whose host id another process took over while it ran (health.py).
HOST_ID_TAKEN_REASON = "proxy_shard_host_id_taken"


#: Seconds taken off a browser page's floor (crawl/runtime.py ``_release``): Redis times are whole ms.
BROWSER_CLOCK_STEP = 0.002


@dataclass
class _InFlight:
    lease: Lease
    started: float


class _Gate:
    """One asyncio lock per (pool, site[, session]) in this process, dropped when unused.

    Only one request per site asks Redis at a time while the site is exhausted, so a release wakes
    one local waiter instead of a thundering herd of round trips.
    """

    def __init__(self) -> None:
        self._locks: dict[tuple, list] = {}

    def __call__(self, key: tuple) -> _GateHold:
        return _GateHold(self, key)

    def idle(self, key: tuple) -> bool:
        """True when nobody holds or waits for ``key``'s lock (taking it will not suspend)."""
        entry = self._locks.get(key)
        return entry is None or not entry[0].locked()


class _GateHold:
    def __init__(self, gate: _Gate, key: tuple) -> None:
        self.gate, self.key = gate, key

    async def __aenter__(self) -> None:
        entry = self.gate._locks.setdefault(self.key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._drop(entry)
            raise

    async def __aexit__(self, *exc: object) -> None:
        entry = self.gate._locks[self.key]
        entry[0].release()
        self._drop(entry)

    def _drop(self, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            self.gate._locks.pop(self.key, None)


class ShardRuntime:
    """What one crawler process knows: its settings, its store, and the leases it holds."""

    ATTRIBUTE = "_proxy_shard_runtime"

    def __init__(self, crawler: Any, settings: ShardSettings,
                 store_factory: Callable[[], PoolBackend] | None = None) -> None:
        self.crawler = crawler
        self.settings = settings
        self.stats = crawler.stats
        self.sites = SiteMap(settings.site_groups)
        self._store_factory = store_factory or self._default_store
        self._store: PoolBackend | None = None
        self._inflight: weakref.WeakKeyDictionary[Request, _InFlight] = weakref.WeakKeyDictionary()
        #: Requests the lease middleware left alone (opt-out, user's own meta['proxy']): the guard lets them by.
        self.left_alone: weakref.WeakSet[Request] = weakref.WeakSet()
        self._held: dict[str, Lease] = {}
        self._gate = _Gate()
        self._learned: dict[str, float] = {}  # adaptive pacing: site -> the last learned interval seen
        self._sleepers = PacingSleepers()  # requests sleeping for a pacing slot (a release may wake one)
        self._arrival = ArrivalGuard()  # paces from when a request can have reached its site (arrival.py)
        self._margins: dict[str, float] = {}  # the path margin of each fixed-interval site (Redis's word)
        self._site_options: dict[str, Any] = {}  # site -> settings.site_options(site), for options_of
        self._site_options_of: ShardSettings | None = None  # the settings those were read from
        self._stopping: asyncio.Event | None = None  # set when the crawl stops (see _stopping_event)
        self._watcher: asyncio.Future | None = None
        self._waiters = 0  # requests inside _until; the watcher runs only while there are some
        #: Scrapy download slot -> requests of it asking this host for a lease (SiteAwarePriorityQueue
        #: counts them as busy, like the downloads of the slot).
        self.asking: dict[str, int] = {}
        self._opened = False
        self._served_pools: set[str] = set()  # pools that held proxies in this crawl (empty now = lost)
        self._lost_pools: set[str] = set()  # pools found empty after they held proxies (warned once)
        self._exhausted: set[tuple[str, str]] = set()  # (pool, site) whose last ask here got a wait
        self._monitor: HostMonitor | None = None  # heartbeats + pool log line (health.py)
        #: Fails a request at once when no proxy can serve its site in time; closes an exhausted crawl.
        self.liveness = Liveness(crawler, self.stats, settings.max_wait, lambda: len(self._held),
                                 horizon=settings.pause_horizon, log_interval=settings.pause_log_interval)
        self._causes: dict[tuple[str, str], tuple[float, str | None, str | None]] = {}  # breaker cause cache
        #: Content checks that never passed on a site: suspect, not bans (content.py).
        self.content = ContentChecks(self)
        self.open_error: ProxyShardError | None = None
        self.host_id_lost = False  # another process took this crawl's host id over (host_id_taken)
        self._taken_closer: asyncio.Future | None = None
        #: The plugin's scrapy-playwright contexts (crawl/contexts.py); None without a browser handler.
        self.browser: Any = None
        self._page_releases: set[asyncio.Future] = set()  # releases of held pages' leases, under way
        #: Tiered pools (PROXY_SHARD_TIERS, a spider's proxy_tiers): each site's tier (crawl/tiers.py).
        self.tiers = TierRouter(self)
        #: Gateway slots: a ban rotates the session token; reported exit IPs are recorded (gateways.py).
        self.gateways = GatewayRuntime(settings.gateway, self.stats, lambda: self.store)
        #: Site groups learned from bans: sites that share a blacklist (links.py).
        self.links = SiteLinker(self)

    @classmethod
    def for_crawler(cls, crawler: Any) -> ShardRuntime:
        runtime = getattr(crawler, cls.ATTRIBUTE, None)
        if runtime is None:
            settings = ShardSettings.for_crawler(crawler)
            runtime = cls(crawler, settings, _injected_store_factory(crawler, settings))
            setattr(crawler, cls.ATTRIBUTE, runtime)
            crawler.signals.connect(runtime.spider_opened, signal=signals.spider_opened)
            crawler.signals.connect(runtime.spider_closed, signal=signals.spider_closed)
        return runtime

    # --- lifecycle -----------------------------------------------------------------------------
    @property
    def store(self) -> PoolBackend:
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def _default_store(self) -> PoolBackend:
        return build_store(self.settings, stats=self.stats)

    async def spider_opened(self, spider: Any) -> None:
        """Fail fast: Redis must answer, every pool known at open must hold proxies.

        A failure goes through the start-up gate (startup.py): one line, no request sent, exit code 1.
        """
        gate = StartupGate.for_crawler(self.crawler)
        if self._opened or gate.error is not None:
            return
        self._opened = True
        try:
            await self._connect()
            await self._check_eviction()
            for pool, entries in initial_proxies(self.settings).items():
                self.gateways.learn(pool, entries)
                result = await self.store.add_proxies(pool, entries)
                logger.info("proxy_shard: pool %(pool)r: %(added)d proxies added, %(updated)d already there",
                            {"pool": pool, "added": result.added, "updated": result.updated})
            sizes = await self._pool_sizes(spider)
            self._served_pools.update(sizes)
            self._log_engine(sizes)
            home = (self.tiers.known_pools(spider) or [self.spider_pool(spider)])[0]  # tiers: the cheapest
            self._monitor = HostMonitor.for_runtime(self, spider, home)
            await self._monitor.start()
        except ProxyShardError as exc:
            self.open_error = exc
            raise gate.fail(exc) from None

    def known_pools(self, spider: Any) -> list[str]:
        """The pools a request of ``spider`` can lease from without naming one in meta['proxy_pool']."""
        if getattr(spider, "proxy_pool", None):
            pools = [self.spider_pool(spider)]
        else:
            pools = [self.settings.pool]
            for site, pool in (self.settings.site_pools or {}).items():
                try:
                    pools.append(check_name("pool", pool))
                except SettingError:
                    raise SettingError(
                        f"PROXY_SHARD_SITE_POOLS[{site!r}] ({pool!r}) is not a valid pool name") from None
        tiered = self.tiers.known_pools(spider)
        if self.tiers.spider_tiers(spider) is not None:
            pools = []  # the spider's tiers take every request that names no pool
        elif tiered:  # PROXY_SHARD_POOL serves only requests that name no pool: with tiers there are none
            pools = [p for p in pools if p != self.settings.pool or p in self.settings.site_pools.values()]
        pools = list(dict.fromkeys(pools + tiered))
        for platform in self.settings.platforms or {}:
            pools += [platform_pool(pool, platform) for pool in pools if "." not in pool]
        return pools

    async def _pool_sizes(self, spider: Any) -> dict[str, int]:
        """Size of every pool known at open; UnknownPoolError names the first empty one and its source."""
        sizes = {}
        for pool in self.known_pools(spider):
            sizes[pool] = await self.store.pool_size(pool)
            if sizes[pool] == 0:
                raise UnknownPoolError(
                    f"pool {pool!r} (namespace {self.settings.namespace!r}, from {self._pool_source(pool, spider)}) "
                    f"holds no proxies: load some (scrapy-proxy-shard load --pool {pool} FILE, or "
                    f"PROXY_SHARD_PROXIES / PROXY_SHARD_PROXIES_PATH) or fix the pool name"
                )
        return sizes

    def _pool_source(self, pool: str, spider: Any) -> str:
        tier_source = self.tiers.source_of(pool, spider)
        if tier_source is not None:
            return tier_source
        if getattr(spider, "proxy_pool", None):
            return f"spider {spider.name!r} attribute proxy_pool"
        if pool in (self.settings.site_pools or {}).values():
            return "PROXY_SHARD_SITE_POOLS"
        return "PROXY_SHARD_POOL" if pool == self.settings.pool else "PROXY_SHARD_PLATFORMS"

    async def _check_eviction(self) -> None:
        """Redis mode: refuse or warn when Redis may evict the pool's keys (startup.check_eviction)."""
        mode = self.settings.redis_eviction
        if self.settings.mode != "redis" or self.store.fallback_state not in (None, "redis"):
            return
        await check_eviction(self.store.redis_client, self.store.where, mode)

    def _log_engine(self, sizes: dict[str, int]) -> None:
        """One line: which engine runs, where (masked), for whom, and the pools (item 10)."""
        s = self.settings
        if s.mode == "redis":
            state, where = self.store.fallback_state, self.store.where
            engine = f"redis at {where}" + (f" (fallback: {state})" if state and state != "redis" else
                                            " (local fallback on)" if s.fallback else " (no fallback)")
        elif s.mode == "static":
            engine = (f"static engine (in-process, not shared with other hosts: this host's slice over hosts "
                      f"{', '.join(s.hosts)}; no Redis)")
        else:
            engine = "embedded engine (in-process, not shared with other hosts; no Redis)"
        if s.redis_url_setting == "REDIS_URL" and s.mode == "redis" and not (s.redis_sentinels or s.redis_client):
            logger.info("proxy_shard: PROXY_SHARD_REDIS_URL is not set: the pool uses REDIS_URL (scrapy-redis' "
                        "setting), Redis at %(where)s", {"where": self.store.where})
        logger.info("proxy_shard: engine %(engine)s, namespace %(ns)r, host %(host)r, pools %(pools)s",
                    {"engine": engine, "ns": s.namespace, "host": s.host_id,
                     "pools": ", ".join(f"{p!r} ({n} proxies)" for p, n in sizes.items())})
        if s.download_delay > 0:  # (crawl/slots.py: Scrapy's slot itself no longer delays a leased request)
            logger.info("proxy_shard: DOWNLOAD_DELAY = %(dd)gs is kept per IP and site, for every host: no site's "
                        "interval goes below it (scrapy startproject writes 1; set DOWNLOAD_DELAY = 0 to let "
                        "the plugin pace by what each site allows)", {"dd": s.download_delay})
        if s.mode == "embedded" and s.requested_mode == "auto" and s.proxies:
            logger.warning(
                "proxy_shard: PROXY_SHARD_MODE is 'auto' and no PROXY_SHARD_REDIS_URL is set: this process "
                "leases from a private in-memory pool and hosts do NOT coordinate (3 hosts get 3 private "
                "pools on the same proxies). Set PROXY_SHARD_REDIS_URL on every host to share one pool, or "
                "PROXY_SHARD_MODE = 'embedded' (one host) / 'static' (fixed slices) to say this is intended"
            )

    async def _connect(self) -> None:
        """Ping Redis; if it is down at start, fail, or start in fallback when told to."""
        try:
            await self.store.ping()
        except PoolBackendError as exc:
            if self.settings.redis_down_at_start != "fallback" or self.store.fallback_state is None:
                raise
            logger.warning("proxy_shard: %(e)s: starting in fallback (PROXY_SHARD_REDIS_DOWN_AT_START)", {"e": exc})
            await self.store.start_offline(exc)

    def host_id_taken(self, taken: HostIdTaken) -> None:
        """Another process took this crawl's host id over (this one's heartbeats lapsed past its host
        TTL): both would lease as one host, and take the same fallback slice if Redis went away (the
        fallback store refuses this one any slice from now on). So this crawl stops: one ERROR line,
        the spider closed with ``proxy_shard_host_id_taken``, exit code 1."""
        self.host_id_lost = True
        logger.error("proxy_shard: closing the spider (%(reason)s): %(e)s since this crawl's heartbeats lapsed "
                     "(its event loop stalled past PROXY_SHARD_HOST_TTL); it takes no fallback slice from now on; "
                     "give every process its own PROXY_SHARD_HOST_ID",
                     {"reason": HOST_ID_TAKEN_REASON, "e": taken})
        self._taken_closer = close_spider_soon(self.crawler, HOST_ID_TAKEN_REASON)

    async def spider_closed(self, spider: Any = None, reason: str | None = None) -> None:
        """Give back every lease still held, then close the Redis connection."""
        if self._stopping is not None:
            self._stopping.set()
        self.liveness.spider_closed(reason)
        if reason == HOST_ID_TAKEN_REASON and self.host_id_lost:
            self.crawler.spider = None  # exit code 1 (the runners count a crawler without a spider as failed)
        await self.tiers.flush()
        leases, self._held = list(self._held.values()), {}
        self._inflight.clear()
        self.links.clear()
        released = 0
        for lease in leases:
            try:
                # Cut short in flight: when (or whether) it reached the site is unknown, the whole guard.
                await self.store.release(lease, outcome="unknown", **self._pacing(lease.site),
                                         session_ttl=self.settings.session_ttl,
                                         arrival_guard=(self._guard_cap(lease.site), None))
                released += 1
            except PoolBackendError as exc:
                logger.warning("proxy_shard: lease not released at close (it expires by itself): %(e)s", {"e": exc})
        if released:
            self.stats.inc_value(f"{STATS}/released_at_close", released)
        if self.browser is not None:
            await self.browser.close()
        if self._monitor is not None:
            await self._monitor.stop()  # leave the pools' host lists now rather than age out
            self._monitor = None
        if self._store is not None:
            await self._store.aclose()
            self._store = None

    # --- pools and sites -----------------------------------------------------------------------
    def spider_pool(self, spider: Any) -> str:
        pool = getattr(spider, "proxy_pool", None) or self.settings.pool
        try:
            return check_name("pool", pool)
        except SettingError:
            raise SettingError(f"spider attribute proxy_pool ({pool!r}) is not a valid pool name") from None

    def pool_for(self, request: Request, spider: Any) -> str:
        """``meta['proxy_pool']`` → spider ``proxy_pool`` → ``PROXY_SHARD_SITE_POOLS`` → ``PROXY_SHARD_POOL``."""
        pool = request.meta.get("proxy_pool")
        source = "meta['proxy_pool']"
        if not pool:
            pool, source = getattr(spider, "proxy_pool", None), "spider attribute proxy_pool"
        if not pool:
            pool = self.settings.site_pools.get(site_of_request(request)) if self.settings.site_pools else None
            source = "PROXY_SHARD_SITE_POOLS"
        if not pool:
            pool = self.settings.pool
        else:
            try:
                check_name("pool", pool)
            except SettingError:
                raise SettingError(f"{source} ({pool!r}) is not a valid pool name") from None
        platform = platform_of(site_of_request(request), self.settings.platforms) if self.settings.platforms else None
        return platform_pool(pool, platform) if platform else pool

    def options_of(self, site: str) -> Any:
        """``settings.site_options(site)``, read once per site (every request asks for its site's)."""
        cache = self._site_options
        if self._site_options_of is not self.settings:
            cache.clear()
            self._site_options_of = self.settings
        options = cache.get(site)
        if options is None:
            if len(cache) >= 4096:
                cache.clear()
            options = cache[site] = self.settings.site_options(site)
        return options

    def _pacing(self, site: str, reason: str | None = None) -> dict[str, Any]:
        """The site's pacing as ``release`` keywords (the store applies the law and the randomization),
        and whether a ban of ``reason`` is rate-type (PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS), in every mode:
        its quarantine is brief (the site's learned rest, at least PROXY_SHARD_AUTOTHROTTLE_BAN_TTL), and
        it widens the site's path margin (a fixed interval) or may raise the learned interval (adaptive)."""
        o = self.options_of(site)
        kw = {"min_interval": o.min_interval, "rest_after_response": o.rest_after_response,
              "randomize_interval": o.randomize_interval,
              "rate_ban": reason in self.settings.autothrottle_ban_reasons,
              "rest_min": self.settings.autothrottle_ban_ttl, "margin_prior": MARGIN_PRIOR}
        if o.autothrottle is not None and o.autothrottle.enabled:
            kw["autothrottle"] = o.autothrottle
        return kw

    def _guard_cap(self, site: str) -> float:
        """The most the arrival guard may add to the site's interval (PROXY_SHARD_ARRIVAL_GUARD x it)."""
        return self.options_of(site).arrival_guard * self.interval_of(site)

    def _spacing(self, site: str) -> float:
        """What a lease keeps between the starts of one proxy's slots on ``site`` (several slots per
        proxy): the interval it is paced with; 0 with one slot (nothing to keep)."""
        return self.interval_of(site) if self.options_of(site).concurrency > 1 else 0.0

    def _spread(self, site: str) -> float:
        """Over how long a site spreads its proxies' first requests when it learns them (the opening
        spread, learn() in engine/lua/_lib.lua): its interval, at most OPENING_SPREAD_MAX."""
        return min(self.interval_of(site), OPENING_SPREAD_MAX)

    def interval_of(self, site: str) -> float:
        """The start-to-start interval paced on ``site``: the configured one, or with adaptive pacing the
        last learned value this host saw (its start interval before any)."""
        o = self.options_of(site)
        if o.autothrottle is not None and o.autothrottle.enabled:
            return self._learned.get(site, o.autothrottle.start_interval)
        if o.min_interval > 0.0:
            return o.min_interval + self._margins.get(site, 0.0)
        return o.min_interval

    def _note_pace(self, lease: Lease, result: ReleaseResult, reason: str | None) -> None:
        """The site's path margin (a fixed interval) or learned interval (adaptive) as a stat, its changes
        counted and logged."""
        site = lease.site
        if result.interval is None:
            if result.margin or site in self._margins:
                self._margins[site] = result.margin
                self.stats.set_value(f"{STATS}/{MARGIN_STAT}/{site}", round(result.margin * 1000, 1))
            if result.widened:
                self.stats.inc_value(f"{STATS}/pacing/margin_widened")
                logger.info("proxy_shard: pacing: %(site)s path margin widened to %(mg).0f ms for every host "
                            "(%(reason)s on proxy %(proxy)s: an arrival closer than the site allows)",
                            {"site": site, "mg": result.margin * 1000, "reason": reason, "proxy": lease.proxy_id})
            return
        self._learned[site] = result.interval
        self.stats.set_value(f"{STATS}/{INTERVAL_STAT}/{site}", round(result.interval, 4))
        if result.pace_event:
            self.stats.inc_value(f"{STATS}/autothrottle/{result.pace_event}")
        if result.pace_event == "up":
            logger.info("proxy_shard: adaptive pacing: %(site)s interval raised to %(iv).3fs for every host "
                        "(%(reason)s on proxy %(proxy)s)",
                        {"site": site, "iv": result.interval, "reason": reason, "proxy": lease.proxy_id})
        elif result.pace_event in CONC_EVENTS:
            logger.info(CONC_EVENTS[result.pace_event], {"site": site, "proxy": lease.proxy_id, "reason": reason})

    # --- leasing -------------------------------------------------------------------------------
    def lease_of(self, request: Request) -> Lease | None:
        entry = self._inflight.get(request)
        return entry.lease if entry else None

    async def acquire(self, request: Request, pool: str, site: str, session_id: str | None,
                      moved: Callable[[], Any] | None = None) -> Lease:
        """Lease a slot for ``request``, waiting as long as the engine says (``_acquire``); a request whose
        site was linked into a learned site group while it waited asks again under the group's key
        (crawl/links.py): leasing on under the old key would let one IP serve both at once."""
        while True:
            try:
                return await self._acquire(request, pool, site, session_id, moved)
            except _Regrouped:
                self.stats.inc_value(f"{STATS}/site_groups/regrouped_waits")
                site = self.sites.regroup(site)

    async def _acquire(self, request: Request, pool: str, site: str, session_id: str | None,
                       moved: Callable[[], Any] | None = None) -> Lease:
        """Lease a slot for ``request``, waiting as long as the engine says.

        A wait the pool will end (slots in use, pacing, quarantines, an open breaker) lasts as long as
        it takes, within ``PROXY_SHARD_PAUSE_HORIZON`` (see liveness.py: a site no proxy can serve
        within the horizon parks its requests, and closes the crawl when nothing else is served). A
        wait with no known end (a pool Redis lost, Redis stalled, the host on its local fallback) is
        bounded by ``PROXY_SHARD_MAX_WAIT`` from the moment the request first asked. Any wait ends at
        once when the crawl stops (the request fails; it is never sent without a proxy).

        ``moved``: an async callable asked between two waits; when it answers True the request's site
        left ``pool`` (its tier changed, crawl/tiers.py) and ``TierMoved`` ends the wait, no lease taken.
        """
        loop = asyncio.get_running_loop()
        asked = loop.time()
        deadline = asked + self.settings.max_wait
        ttl = self._lease_ttl(request)
        key = (pool, site, session_id)
        gate = self._gate(key)
        slot = self._download_slot(request)
        self.asking[slot] = self.asking.get(slot, 0) + 1
        self.liveness.enter(pool, site)
        try:
            result = None
            if session_id is None and (pool, site) not in self._exhausted and not self._gate.idle(key):
                # The site had a free slot at this host's last ask: ask at once, beside the request
                # holding the gate. The gate serialises asks only while the site is exhausted (one
                # asker, not a herd of futile round trips); before that it would only queue requests
                # that Redis can serve now, one round trip at a time.
                result = await self._ask_once(pool, site, ttl)
            if result is None:
                if self._gate.idle(key):
                    await gate.__aenter__()  # uncontended: taken at once, even with PROXY_SHARD_MAX_WAIT = 0
                else:
                    await self._until(gate.__aenter__(), None, pool, site, release=gate.__aexit__)
                try:
                    result = await self._lease_loop(pool, site, session_id, ttl, deadline, moved)
                finally:
                    await gate.__aexit__(None, None, None)
            if self._lost_pools or pool not in self._served_pools:  # a pool back, or first seen now
                self._pool_back(pool)
        except NoProxyAvailable as exc:
            raise await self.liveness.settle(request, exc) from None
        finally:
            self.liveness.leave(pool, site)
            left = self.asking[slot] - 1
            if left:
                self.asking[slot] = left
            else:
                del self.asking[slot]
        self.liveness.leased(pool, site)
        waited = loop.time() - asked
        if waited > MIN_PAUSE:
            self.stats.inc_value(f"{STATS}/wait_time", waited)
        self._record(request, result, session_id, site)
        self.crawler.signals.send_catch_log(shard_signals.lease_acquired, request=request, lease=result, waited=waited)
        return result

    async def try_acquire(self, request: Request, pool: str, site: str) -> Lease | None:
        """Lease for ``request`` from ``pool`` only if a slot is free now (one call, no wait): a tier's
        probe (crawl/tiers.py). None when the pool has none free for ``site``, or did not answer."""
        lease = await self._ask_once(pool, site, self._lease_ttl(request))
        if lease is not None:
            self._record(request, lease, None, site)
            self.crawler.signals.send_catch_log(shard_signals.lease_acquired, request=request, lease=lease, waited=0.0)
        return lease

    async def _ask_once(self, pool: str, site: str, ttl: float) -> Lease | None:
        """One lease call outside the gate: the lease, or None (a wait, or any error) after which the
        request goes the gated way (``_lease_loop`` handles waits, restores and stalls)."""
        self._check_stopping(pool, site)
        try:
            result = await self.store.lease(pool, site, ttl=ttl, concurrency=self.options_of(site).concurrency,
                                            session_ttl=self.settings.session_ttl, spacing=self._spacing(site),
                                            spread=self._spread(site))
        except ProxyShardError:
            return None
        if isinstance(result, Lease):
            return result
        self._note_exhausted(pool, site)
        return None

    def _note_exhausted(self, pool: str, site: str) -> None:
        if len(self._exhausted) >= EXHAUSTED_SITES:
            self._exhausted.clear()
        self._exhausted.add((pool, site))

    def _download_slot(self, request: Request) -> str:
        """The Scrapy download slot ``request`` will use (``download_slot`` meta, else its host name)."""
        try:
            return self.crawler.engine.downloader.get_slot_key(request)
        except (AttributeError, RuntimeError):  # no engine (a crawler built by hand): Scrapy's default key
            return request.meta.get("download_slot") or urlparse_cached(request).hostname or ""

    async def _lease_loop(self, pool: str, site: str, session_id: str | None, ttl: float,
                          deadline: float, moved: Callable[[], Any] | None = None) -> Lease:
        """Ask the store until it hands out a lease; every pass waits at least MIN_PAUSE (cannot spin)."""
        s = self.settings
        concurrency = self.options_of(site).concurrency
        loop = asyncio.get_running_loop()
        restored = False
        waits = 0
        breaker_waits = 0
        while True:
            self._check_stopping(pool, site)
            if moved is not None and await moved():  # also after queueing at the gate: no wait counted
                raise TierMoved(f"site {site!r} left pool {pool!r} while its request waited")
            if self.sites.regroup(site) != site:  # linked into a learned group meanwhile: ask under its key
                raise _Regrouped(site)
            started = loop.time()
            try:
                result = await self.store.lease(pool, site, ttl=ttl, concurrency=concurrency,
                                                session_id=session_id, session_ttl=s.session_ttl,
                                                spacing=self._spacing(site), spread=self._spread(site))
            except UnknownPoolError as exc:
                if not restored and await self._restore_lost_pool(pool):
                    restored = True
                    continue
                if pool not in self._served_pools:  # never held proxies in this crawl: a setup error
                    raise
                # The pool held proxies and lost them, and this host has no copy to restore it from
                # (or another host is restoring it): wait for it within MAX_WAIT, never drop the request.
                self._warn_pool_lost(pool, exc)
                empty = (f"pool {pool!r} held no proxies for site {site!r} within PROXY_SHARD_MAX_WAIT "
                         f"({s.max_wait:g}s): Redis lost it or it was drained; load it again")
                if loop.time() >= deadline:
                    self.stats.inc_value(f"{STATS}/wait/gave_up")
                    raise NoProxyAvailable(empty) from None
                try:
                    await self._until(asyncio.sleep(EMPTY_POOL_PAUSE), deadline, pool, site)
                except NoProxyAvailable:
                    if self._crawl_stopping():
                        raise
                    raise NoProxyAvailable(empty) from None
                restored = False
                continue
            except PoolBusy as exc:
                # Redis answered BUSY / LOADING past the store's own retries (a store without the local
                # fallback, which handles this itself): a stall, so the request waits on within MAX_WAIT.
                if loop.time() >= deadline:
                    self.stats.inc_value(f"{STATS}/wait/gave_up")
                    raise NoProxyAvailable(f"no proxy of pool {pool!r} for site {site!r} within PROXY_SHARD_MAX_WAIT "
                                           f"({s.max_wait:g}s): {exc}") from None
                await self._until(asyncio.sleep(BUSY_PAUSE), deadline, pool, site)
                continue
            if isinstance(result, Lease):
                if session_id is None:
                    self._exhausted.discard((pool, site))
                return result
            if session_id is None:
                self._note_exhausted(pool, site)
            outage = self._outage()
            until: float | None = deadline if outage else None
            if not outage:
                cause, check = await self._breaker_cause(pool, site, result)
                try:  # past the horizon: park, or close the crawl when nothing else is served
                    self.liveness.check(pool, site, result, cause=cause, check=check)
                except PoolExhausted:
                    self.stats.inc_value(f"{STATS}/wait/gave_up")
                    if result.reason == "breaker" and breaker_waits == 0:
                        self.stats.inc_value(f"{STATS}/breaker/waits")  # held back by an open breaker
                    raise
                if self._is_pause(site, result) and self.liveness.pause_due(pool, site):
                    self.liveness.paused(pool, site, result, await self._pause_why(pool, site, result, cause, check))
            elif loop.time() >= deadline:
                self.stats.inc_value(f"{STATS}/wait/gave_up")
                raise NoProxyAvailable(
                    f"no proxy of pool {pool!r} became free for site {site!r} within "
                    f"PROXY_SHARD_MAX_WAIT ({s.max_wait:g}s)" + _breaker_note(result)
                )
            if waits == 0:
                self.stats.inc_value(f"{STATS}/waits")
            waits += 1
            if result.reason == "breaker" and breaker_waits == 0:
                self.stats.inc_value(f"{STATS}/breaker/waits")  # requests held back by an open breaker
                breaker_waits += 1
            try:
                remaining = float("inf") if until is None else until - loop.time()
                exact = await self._until(self._wait(pool, site, result, remaining), until, pool, site)
            except NoProxyAvailable as exc:
                if result.reason != "breaker" or self._crawl_stopping():
                    raise
                raise NoProxyAvailable(f"{exc}{_breaker_note(result)}") from None
            rest = (PACING_PAUSE if exact else MIN_PAUSE / 5) - (loop.time() - started)
            if rest > 0:  # a wake-up that came at once (a stale freed entry): still not a busy loop
                await self._until(asyncio.sleep(rest), until, pool, site)

    def _outage(self) -> bool:
        """The host leases from its local fallback engine (Redis away): waits there have no known end."""
        return getattr(self.store, "fallback_state", None) in ("fallback", "grace")

    def _is_pause(self, site: str, wait: LeaseWait) -> bool:
        """A firm wait longer than any pacing gap: every proxy of the site is quarantined (or its breaker
        is open) and none is in use: the site is paused, not paced."""
        if not wait.firm:
            return False
        if wait.reason == "breaker":
            return True
        o = self.options_of(site)
        raised = 1.5 if o.autothrottle is not None and o.autothrottle.enabled else 1.0
        return wait.reason == "pool" and wait.wait > max(1.0, o.longest_gap(self.interval_of(site), raised))

    async def _breaker_cause(self, pool: str, site: str, wait: LeaseWait) -> tuple[str | None, str | None]:
        """For a firm breaker wait: why the site's breaker is open (``content``: a content check that
        never passed there, and which check), read from the store at most every CAUSE_TTL seconds."""
        if wait.reason != "breaker" or not wait.firm:
            return None, None
        now = asyncio.get_running_loop().time()
        key = (pool, site)
        cached = self._causes.get(key)
        if cached is not None and now - cached[0] < CAUSE_TTL:
            _, cause, check = cached
        else:
            read = getattr(self.store, "breaker", None)
            cause = check = None
            if read is not None:
                try:
                    state = await read(pool, site)
                except ProxyShardError:
                    state = None
                if state is not None:
                    cause, check = getattr(state, "cause", None), getattr(state, "check", None)
            if len(self._causes) >= EXHAUSTED_SITES:
                self._causes.clear()
            self._causes[key] = (now, cause, check)
        if cause == "content" and check and not self.content.checks_here(site, check):
            cause = None  # another crawl's check (this one's differs): an ordinary breaker wait
        return cause, check

    async def _pause_why(self, pool: str, site: str, wait: LeaseWait, cause: str | None,
                         check: str | None) -> str:
        """Why (pool, site) is paused, for its WARNING line: the breaker, or the quarantines there."""
        if wait.reason == "breaker":
            if cause == "content":
                return (f"the content check {check} failed for every proxy and never passed there "
                        f"(circuit breaker open, cause content)")
            return "the site's circuit breaker is open (the site rejected every proxy lately)"
        store = getattr(self.store, "primary", self.store)  # the fallback store reads from Redis
        try:
            bans = await store.bans(pool)
            size = await store.pool_size(pool)
        except (AttributeError, ProxyShardError):
            return "every proxy is quarantined or resting there and none is in use"
        now = time.time()
        reasons: dict[str, int] = {}
        for ban in bans:
            if ban.scope in (site, "*") and ban.until > now:
                reasons[ban.reason] = reasons.get(ban.reason, 0) + 1
        quarantined = sum(reasons.values())
        if not quarantined:
            return f"all {size} proxies resting there (pacing) and none in use"
        why = ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items(), key=lambda x: -x[1]))
        if quarantined >= size:
            return f"all {size} proxies quarantined ({why})"
        return f"{quarantined} of {size} proxies quarantined ({why}), the others resting"

    def _lease_ttl(self, request: Request) -> float:
        """The lease must outlive the download (Scrapy cancels it after ``download_timeout``).

        A bad ``meta['download_timeout']`` fails this request with a clear error, before Redis is asked.
        """
        raw = request.meta.get("download_timeout")
        if not raw:
            return self.settings.lease_ttl
        try:
            timeout = float(raw)
        except (TypeError, ValueError):
            timeout = float("nan")
        if isinstance(raw, bool) or not 0 <= timeout <= MAX_LEASE_TTL - LEASE_MARGIN:
            raise SettingError(
                f"meta['download_timeout'] ({raw!r}) of {request.url} must be a number of seconds from 0 to "
                f"{MAX_LEASE_TTL - LEASE_MARGIN:g}"
            )
        return max(self.settings.lease_ttl, timeout + LEASE_MARGIN)

    def _record(self, request: Request, result: Lease, session_id: str | None, site: str) -> None:
        self._inflight[request] = _InFlight(result, asyncio.get_running_loop().time())
        self._held[result.token] = result
        self.links.leased(result)
        self.stats.inc_value(f"{STATS}/leases")
        if session_id:
            self.stats.inc_value(f"{STATS}/leases/session")
        if result.rebound:
            self.stats.inc_value(f"{STATS}/sessions/rebound")
            logger.info("proxy_shard: session %(sid)r on %(site)s rebound to proxy %(proxy)s",
                        {"sid": session_id, "site": site, "proxy": result.proxy_id})
            self.crawler.signals.send_catch_log(shard_signals.session_rebound, request=request,
                                                session_id=session_id, site=site, proxy_id=result.proxy_id)

    async def _restore_lost_pool(self, pool: str) -> bool:
        """Redis lost the pool (FLUSHALL, a restart without persistence, a failover to an empty
        replica): reload it from this host's snapshot (fallback store) or else from
        ``PROXY_SHARD_PROXIES`` / ``PROXY_SHARD_PROXIES_PATH`` (as read at start), once per loss across
        all hosts (restore.lua decides), and say so.

        Returns True when the pool holds proxies again (restored here or by another host just now).
        """
        snapshot = self.store.snapshot_proxies(pool)
        proxies = snapshot or initial_proxies(self.settings).get(pool)
        if not proxies:
            return False
        try:
            restored = await self.store.restore_pool(pool, proxies, warmup=self.settings.fallback_warmup)
        except PoolBackendError:
            return False
        if restored:
            bans = await replay_bans(self.store, pool, self.store.snapshot_bans(pool)) if snapshot else 0
            self.stats.inc_value(f"{STATS}/pool_restored")
            logger.warning(
                "proxy_shard: pool %(pool)r was lost by Redis (flushed, restarted empty or failed over); "
                "restored %(n)d proxies and %(b)d running quarantines from %(source)s, usable after a "
                "%(w)gs warm-up",
                {"pool": pool, "n": restored, "b": bans,
                 "source": "the snapshot" if snapshot else "the settings (PROXY_SHARD_PROXIES / _PATH)",
                 "w": self.settings.fallback_warmup},
            )
            return True
        return await self.store.pool_size(pool) > 0

    def _warn_pool_lost(self, pool: str, exc: BaseException) -> None:
        """One WARNING per loss of ``pool``: requests wait for the pool instead of failing."""
        if pool in self._lost_pools:
            return
        self._lost_pools.add(pool)
        self.stats.inc_value(f"{STATS}/pool_lost")
        logger.warning("proxy_shard: pool %(pool)r is empty now (%(e)s) and this host has no copy to restore "
                       "it from; requests wait for it up to PROXY_SHARD_MAX_WAIT (%(w)gs)",
                       {"pool": pool, "e": exc, "w": self.settings.max_wait})

    def _pool_back(self, pool: str) -> None:
        self._served_pools.add(pool)
        if pool in self._lost_pools:
            self._lost_pools.discard(pool)
            logger.warning("proxy_shard: pool %(pool)r holds proxies again; leasing resumed", {"pool": pool})

    # --- bounded waiting ------------------------------------------------------------------------
    def _stopping_event(self) -> asyncio.Event:
        """Set when the crawl stops; a watcher polls for it while any request waits.

        Scrapy 2.19 sends no signal when a graceful stop begins: ``Crawler.stop_async`` (SIGTERM,
        Ctrl-C) clears ``crawler.crawling`` and ``engine.running`` and ``close_spider_async`` (finished,
        CloseSpider, our own open error) sets ``engine._slot.closing``, then both wait for every
        download in progress, a request waiting in ``process_request`` included. ``spider_closed`` and
        ``engine_stopped`` come only after that, too late, so the flags are watched instead.
        """
        if self._stopping is None:
            self._stopping = asyncio.Event()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_crawl())
        return self._stopping

    async def _watch_crawl(self) -> None:
        while self._stopping is not None and not self._stopping.is_set() and self._waiters:
            if self._crawl_stopping():
                self._stopping.set()
                return
            await asyncio.sleep(STOP_POLL)

    def _crawl_stopping(self) -> bool:
        try:
            engine = self.crawler.engine
        except (AttributeError, RuntimeError):
            return False
        if engine is None:
            return False  # not crawling under an engine (a test harness)
        if getattr(self.crawler, "crawling", True) is False or getattr(engine, "running", True) is False:
            return True
        return getattr(getattr(engine, "_slot", None), "closing", None) is not None

    def _check_stopping(self, pool: str, site: str) -> None:
        if (self._stopping is not None and self._stopping.is_set()) or self._crawl_stopping():
            self.stats.inc_value(f"{STATS}/wait/cancelled_at_stop")
            raise NoProxyAvailable(
                f"the crawl is stopping: request for site {site!r} (pool {pool!r}) dropped while it waited "
                f"for a free proxy (never sent without one)"
            )

    async def _until(self, awaitable: Any, deadline: float | None, pool: str, site: str,
                     release: Callable[..., Any] | None = None) -> Any:
        """Await ``awaitable`` (a wait, never a lease call: a lease cut off mid-flight would be lost)
        until ``deadline`` (None: none) or a stop of the crawl, whichever comes first."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(awaitable)
        self._waiters += 1
        stop = asyncio.ensure_future(self._stopping_event().wait())
        try:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({task, stop}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters -= 1
            stop.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            if release is not None:  # it completed (took the gate) just as we gave up: hand it back
                await release(None, None, None)
        self._check_stopping(pool, site)
        self.stats.inc_value(f"{STATS}/wait/gave_up")
        raise NoProxyAvailable(
            f"no proxy of pool {pool!r} became free for site {site!r} within PROXY_SHARD_MAX_WAIT "
            f"({self.settings.max_wait:g}s, counted from the request's first ask)"
        )

    async def _wait(self, pool: str, site: str, wait: LeaseWait, remaining: float) -> bool:
        """Wait as long as the engine said, waking early only when that can help.

        The reported wait is exact when the earliest slot is pacing or quarantined, and only an upper
        bound when it is held (its holder usually releases long before the lease expires). A pacing
        wait (no longer than the longest pacing a release sets: the interval, x1.5 when randomized,
        plus the arrival guard, or the rest after response) is slept exactly (locally: Redis checks
        blocking timeouts only ``hz`` times a second, up to 100 ms late, which would eat the pacing
        gain), at least PACING_PAUSE: every ms late is throughput lost at the site's limit (path
        jitter that makes an exact start land early is the arrival guard's job). Under
        start-to-start pacing a slot released meanwhile is free at its own start + interval, so it
        can beat the pacing slot only if it started earlier (a slow download) and by no more than
        the gap between the two starts; within ``rest_after_response`` nothing can beat it at all.
        Longer waits (a quarantine) block on the site's freed list, which a release on any host
        wakes, with the reported wait as timeout. A session waits for its own proxy: a plain sleep.
        Any other pause lasts at least MIN_PAUSE, whatever the engine answered (never a busy loop).
        Returns whether the wait was an exact (pacing) one.
        """
        o = self.options_of(site)
        # With adaptive pacing another host may have raised the interval once (x1.5) since this host
        # last saw it; the guard's cap is this host's (guard x the interval it knows).
        raised = 1.5 if o.autothrottle is not None and o.autothrottle.enabled else 1.0
        longest_pacing = o.longest_gap(self.interval_of(site), raised)
        if wait.wait <= 0:  # no engine answers this (a half-written lease once did): never a busy loop
            await asyncio.sleep(MIN_PAUSE)
            return False
        exact = wait.reason == "session" or (wait.reason == "pool" and wait.wait <= longest_pacing)
        if exact:
            pause = max(PACING_PAUSE, min(wait.wait, remaining))
            if wait.reason == "session":  # its own proxy: no other slot's release helps it
                await asyncio.sleep(pause)
            else:  # a slot given back meanwhile may free sooner (a probe's, a lowered interval's)
                await self._sleepers.sleep(pool, site, pause)
            return True
        await self.store.wait_for_release(pool, site, min(max(MIN_PAUSE, min(wait.wait, remaining)), MAX_BLOCK))
        return False

    async def finish(self, request: Request, outcome: str, *, reason: str | None = None,
                     retry_after: float | None = None) -> ReleaseResult | None:
        """Release ``request``'s lease with its outcome, once (later calls are no-ops).

        ``retry_after``: the site's Retry-After of a ban answer (seconds): the quarantine lasts that long.
        """
        entry = self._inflight.pop(request, None)
        if entry is None:
            return None
        # The download is over: the proxy's credentials (HttpProxyMiddleware's header) are not needed
        # again, and a retry copied from this request (Scrapy's RetryMiddleware, the ban retry) would
        # carry them into the scheduler's queue: scrapy-redis's in the shared Redis, a JOBDIR on disk.
        request.headers.pop(PROXY_AUTHORIZATION, None)
        lease = entry.lease
        loop = asyncio.get_running_loop()
        latency = loop.time() - entry.started if outcome == "ok" else None
        if self.browser is not None:
            page = self.browser.finished(request)
            if page is not None and outcome not in ("ban", "dead"):
                # A playwright_include_page page the spider holds: its own requests (XHR, images) still go
                # out through the proxy, so the lease is released when the spider closes it; bounded by
                # the lease's own expiry.
                self._hold_for_page(request, page, entry, outcome, reason, retry_after, latency)
                return None
        return await self._release(request, lease, outcome, reason, retry_after, latency)

    def _hold_for_page(self, request: Request, page: Any, entry: _InFlight, outcome: str, reason: str | None,
                       retry_after: float | None, latency: float | None) -> None:
        lease = entry.lease
        loop = asyncio.get_running_loop()
        self.stats.inc_value(f"{STATS}/browser/pages_held")
        left = (lease.expires_at - lease.issued_at) - (loop.time() - entry.started)

        def expired() -> None:
            if self._held.pop(lease.token, None) is None:
                return  # released (page closed) or given back at close
            self.links.released(lease)
            self.stats.inc_value(f"{STATS}/browser/page_outlived_lease")
            logger.warning("proxy_shard: a playwright_include_page page of %(url)s is still open as its lease of "
                           "proxy %(proxy)s expires (PROXY_SHARD_LEASE_TTL): the proxy may now serve another "
                           "request for %(site)s; close the page sooner, or raise the lease TTL",
                           {"url": request.url, "proxy": lease.proxy_id, "site": lease.site})

        timer = loop.call_later(max(0.0, left), expired)

        def closed() -> None:
            timer.cancel()
            if lease.token in self._held:
                task = asyncio.ensure_future(self._release(request, lease, outcome, reason, retry_after, latency))
                self._page_releases.add(task)
                task.add_done_callback(self._page_releases.discard)

        self.browser.keep(request, page, closed)

    async def _release(self, request: Request, lease: Lease, outcome: str, reason: str | None,
                       retry_after: float | None, latency: float | None) -> ReleaseResult | None:
        self._held.pop(lease.token, None)
        self.links.released(lease)
        try:
            how = self._pacing(lease.site, reason)
            if retry_after is not None:
                how["retry_after"] = retry_after
            cap = self._guard_cap(lease.site)
            # Sent with the guard off too: a proxy's first use on the site (floor None: a new connection)
            # is paced from its release, the only sure bound on when it arrived.
            floor = self._arrival.floor(lease.site, lease.proxy_id)
            # A browser page: the lease was taken before the browser made the page (0.4-1.5 s on a loaded
            # host, varying page to page), so its start says nothing of when the document left. Paced from
            # when the page's last request was answered (every one reached the site before; release.lua
            # pushes the next start back by now - start - floor: floor = the time since then, on this
            # host's clock, less a clock step), or when that is not known for sure from the release (a
            # held page's close).
            rendered = request.meta.get(OWN_CONTEXT) is not None
            if rendered:
                settled = self.browser.settled(request) if self.browser is not None else None
                if settled is None:
                    floor = None
                    self.stats.inc_value(f"{STATS}/pacing/browser_from_release")
                else:
                    floor = max(0.0, asyncio.get_running_loop().time() - settled - BROWSER_CLOCK_STEP)
                    cap = max(cap, lease.expires_at - lease.issued_at)
                    self.stats.inc_value(f"{STATS}/pacing/browser_from_answer")
            how["arrival_guard"] = (cap, floor)
            # A banned gateway slot gets a new session token (a new exit IP) rather than a quarantine.
            recorded = await self.gateways.on_ban(lease, reason) if outcome == "ban" else outcome
            result = await self.store.release(lease, outcome=recorded, latency=latency, reason=reason,
                                              session_ttl=self.settings.session_ttl, **how)
        except PoolBackendError as exc:
            self.stats.inc_value(f"{STATS}/release/errors")
            logger.warning("proxy_shard: release failed (the lease expires by itself): %(e)s", {"e": exc})
            await self.tiers.answered(request, outcome, None)
            return None
        await self.tiers.answered(request, outcome, result)
        self.stats.inc_value(f"{STATS}/release/{result.status}")
        if (result.free_at is not None and outcome in ("ok", "unknown")
                and self._sleepers.release_freed(lease.pool, lease.site, result.free_at - result.now)):
            self.stats.inc_value(f"{STATS}/pacing/woken")
        if result.status == "ok":
            elapsed = result.now - lease.issued_at  # both on the Redis clock
            shift = self._arrival.shift(elapsed, floor, cap) if cap > 0.0 else 0.0
            if shift > 0.0:
                self.stats.inc_value(f"{STATS}/pacing/arrival_guard_ms", round(shift * 1000))
            if not rendered and outcome in ("ok", "unknown") and 0.0 < elapsed < lease.expires_at - lease.issued_at:
                self._arrival.observe(lease.site, lease.proxy_id, elapsed)
        self._note_pace(lease, result, reason)
        self.crawler.signals.send_catch_log(shard_signals.lease_released, request=request, lease=lease,
                                            outcome=outcome, reason=reason, result=result)
        # Judged a ban, no quarantine: the site's breaker spared it, or its gateway slot was rotated.
        spared = (result.ban_until is None and result.breaker is not None) or recorded != outcome
        if self.browser is not None and outcome in ("ban", "dead") and not spared:
            self.browser.proxy_banned(lease.proxy_id, None if outcome == "dead" else lease.site)
        if outcome in ("ban", "dead"):
            self.stats.inc_value(f"{STATS}/bans")
            self.stats.inc_value(f"{STATS}/bans/reason/{reason or outcome}")
        if outcome in ("ban", "dead") and not spared:
            if outcome == "dead":
                self.stats.inc_value(f"{STATS}/dead")
            scope = "proxy-wide" if outcome == "dead" else f"{lease.site}"
            if result.ban_until is None:  # Redis did not run the release (an outage): nothing started there
                logger.info(
                    "proxy_shard: %(scope)s ban of proxy %(proxy)s (%(reason)s) without a quarantine confirmed by "
                    "Redis (release %(status)s; in the local fallback it is kept and replayed when Redis is back)",
                    {"scope": scope, "proxy": lease.proxy_id, "reason": reason or outcome, "status": result.status},
                )
            else:
                logger.info(
                    "proxy_shard: %(scope)s quarantine of proxy %(proxy)s (%(reason)s, strike %(strikes)d, "
                    "%(ttl).1fs%(told)s)",
                    {"scope": scope, "proxy": lease.proxy_id, "reason": reason or outcome, "strikes": result.strikes,
                     "ttl": result.ban_until - result.now,
                     "told": "" if retry_after is None else f", the site's Retry-After {retry_after:g}s"},
                )
                if retry_after is not None:
                    self.stats.inc_value(f"{STATS}/bans/retry_after")
        # A rate ban may say two sites share a blacklist; a clean answer, that they do not (links.py).
        if outcome == "ban" and recorded == outcome:
            await self.links.banned(lease, result, reason, retry_after)
        elif outcome == "ok" and self.links.enabled and result.status == "ok":
            await self.links.answered(lease, result)
        if result.breaker is not None:
            self._breaker_event(lease, result.breaker, reason or outcome)
        if lease.session_id and request.meta.get("proxy_shard_end_session"):
            await self.store.end_session(lease.pool, lease.site, lease.session_id,
                                         min_interval=self.interval_of(lease.site))
            if self.browser is not None:
                self.browser.session_ended(lease.site, lease.session_id)
        return result

    def _breaker_event(self, lease: Lease, event: BreakerEvent, reason: str) -> None:
        """Count and log what a release did to its site's circuit breaker (the engine decided it once,
        for every host: only the host whose release changed it logs the change)."""
        self.stats.inc_value(f"{STATS}/breaker/{event.kind}")
        where = {"site": lease.site, "pool": lease.pool, "cool": event.cooloff, "proxy": lease.proxy_id,
                 "reason": reason}
        if event.kind == "opened":
            reasons = ", ".join(f"{name} x{n}" for name, n in sorted((event.reasons or {}).items()))
            logger.warning(
                "proxy_shard: circuit breaker OPEN for site %(site)s (pool %(pool)r): %(bans)d quarantines from "
                "%(proxies)d distinct proxies within %(window)gs with no successful response between (%(reasons)s): "
                "the site rejects everyone, not one IP. No lease for it on any host for %(cool)gs, then one probe "
                "at a time; bans on it quarantine no proxy meanwhile",
                {**where, "bans": event.bans, "proxies": event.proxies, "window": event.window, "reasons": reasons},
            )
        elif event.kind == "reopened":
            logger.warning("proxy_shard: circuit breaker for site %(site)s (pool %(pool)r) re-opened: its probe "
                           "through proxy %(proxy)s was rejected (%(reason)s); next probe in %(cool)gs", where)
        elif event.kind == "closed":
            logger.warning("proxy_shard: circuit breaker for site %(site)s (pool %(pool)r) closed: a probe through "
                           "proxy %(proxy)s was answered fine; leasing resumes on every host", where)
        else:
            logger.debug("proxy_shard: ban on %(site)s (%(reason)s) while its circuit breaker is open: proxy "
                         "%(proxy)s not quarantined", where)


class _Regrouped(Exception):
    """A waiting request's site was linked into a learned site group: ``acquire`` asks again."""


def _breaker_note(wait: LeaseWait) -> str:
    """What a gave-up message adds when the wait was an open circuit breaker."""
    if wait.reason != "breaker":
        return ""
    return ("; the site's circuit breaker is open (the site rejected every proxy lately): a request may wait "
            "through a cool-off only if PROXY_SHARD_MAX_WAIT is longer than PROXY_SHARD_BREAKER_COOLOFF")


def _injected_store_factory(crawler: Any, settings: ShardSettings) -> Callable[[], PoolBackend] | None:
    """``PROXY_SHARD_REDIS_CLIENT``: an asyncio Redis client (or a callable making one) to use instead of
    ``PROXY_SHARD_REDIS_URL``: for Redis Cluster/Sentinel clients built by hand, and fakeredis in tests."""
    client = settings.redis_client
    if client is None:
        return None

    def factory() -> PoolBackend:
        made = client() if callable(client) and not hasattr(client, "execute_command") else client
        return build_store(settings, stats=crawler.stats, client=made)

    return factory
