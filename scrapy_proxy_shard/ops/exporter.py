"""Prometheus exporter: ``scrapy-proxy-shard metrics --port N`` serves ``/metrics`` read from Redis.

Nothing is cached or pushed: a custom collector reads every pool (``snapshot.read_pool``) when
Prometheus scrapes, so the figures are as fresh as the scrape and one exporter serves the whole
cluster (run one, anywhere that reaches Redis). When Redis does not answer, the scrape still
succeeds with ``proxy_shard_up 0``, which is what an alert should watch.

Labels stay low-cardinality, bounded by configuration and live processes: ``pool``, ``site``
(a site key, ``*`` for proxy-wide quarantines), ``state``, ``reason``, ``outcome``, ``host`` (live
hosts only). A proxy's URL or id is never a label: thousands of proxies would make thousands of
series, and a URL would put credentials into the monitoring system.

Sites are bounded too, however many a broad crawl touches: per pool only the
``PROXY_SHARD_METRICS_TOP_SITES`` most active sites (``SiteRanking``: most leases over the last
``RECENT_WINDOW`` of scrapes) get series of their own; every other site is summed into one
``site="_other"`` series per metric and label set, so totals are preserved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.engine.tiers import TierCounts
from scrapy_proxy_shard.exceptions import ProxyShardError
from scrapy_proxy_shard.ops.snapshot import STATES, PoolSnapshot, read_pool
from scrapy_proxy_shard.settings import DEFAULTS

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "error", "banned")
QUANTILES = (0.5, 0.9, 1.0)
#: The ``site`` label of the series that sum every site outside a pool's top sites.
OTHER_SITE = "_other"
#: What "recent" means when ranking sites: leases taken over this many seconds of scrapes.
RECENT_WINDOW = 600.0
#: Scrape history kept per pool for the ranking (points at least RECENT_WINDOW / this apart).
HISTORY_POINTS = 30


class SiteRanking:
    """Which sites of a pool get series of their own: the ``top`` most active ones.

    Active means leases taken recently: the growth of each site's lease counter since the oldest
    scrape within ``window`` (a site first seen since then counts all its leases). Ties (every site
    at the first scrape) go to the sites holding most slots now, then to the sites already chosen
    (so the set does not churn), then to the most leases ever. A pool with at most ``top`` sites is
    not cut at all. The exporter is long-lived: this history is its only state.
    """

    def __init__(self, top: int, *, window: float = RECENT_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.top = max(0, int(top))
        self.window = window
        self.clock = clock
        self._history: dict[str, deque[tuple[float, dict[str, int]]]] = {}
        self._chosen: dict[str, frozenset[str]] = {}

    def choose(self, snapshot: PoolSnapshot) -> frozenset[str] | None:
        """The sites of ``snapshot`` to export one by one, or None for all of them."""
        sites = _all_sites(snapshot)
        leases = {site: snapshot.site_outcomes(site).leases for site in sites}
        now = self.clock()
        history = self._history.setdefault(snapshot.pool, deque())
        if not history or now - history[-1][0] >= self.window / HISTORY_POINTS:
            history.append((now, leases))
        while len(history) > 1 and history[1][0] <= now - self.window:
            history.popleft()
        if len(sites) <= self.top:
            self._chosen.pop(snapshot.pool, None)
            return None
        base = history[0][1]
        in_use = {st.site: st.leased + st.session for st in snapshot.sites}
        before = self._chosen.get(snapshot.pool, frozenset())
        ranked = sorted(sites, key=lambda site: (-(leases[site] - base.get(site, 0)), -in_use.get(site, 0),
                                                 site not in before, -leases[site], site))
        chosen = frozenset(ranked[:self.top])
        self._chosen[snapshot.pool] = chosen
        return chosen


class PoolCollector:
    """Reads the pools at scrape time; ``pools`` None means every pool of the namespace.

    ``top_sites``: per pool, only that many sites (the most active, see ``SiteRanking``) get series
    of their own; the rest are summed under ``site="_other"``.
    """

    def __init__(self, store: PoolStore, pools: Sequence[str] | None = None, *,
                 top_sites: int = DEFAULTS["PROXY_SHARD_METRICS_TOP_SITES"],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.pools = tuple(pools) if pools else None
        self.ranking = SiteRanking(top_sites, clock=clock)
        self._up: float | None = None  # last scrape's answer, to log only when Redis comes or goes

    def describe(self) -> list[Metric]:
        return []  # no Redis call at registration; names are checked by the tests instead

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            snapshots = [read_pool(self.store, pool) for pool in (self.pools or self.store.pools())]
            tiers = [(t, self.store.tier_counts(t)) for t in self.store.tier_lists()
                     if self.pools is None or set(t) & set(self.pools)]
            up = 1.0
            if self._up == 0.0:
                logger.warning("proxy_shard exporter: Redis answers again")
        except ProxyShardError as exc:
            if self._up != 0.0:
                logger.warning("proxy_shard exporter: %(e)s (serving proxy_shard_up 0 until it answers)", {"e": exc})
            snapshots, tiers, up = [], [], 0.0
        self._up = up
        yield from pool_metrics(snapshots, {s.pool: self.ranking.choose(s) for s in snapshots})
        yield from tier_metrics(tiers)
        yield _gauge("proxy_shard_up", "1 if Redis answered this scrape, else 0", [], [((), up)])
        yield _gauge("proxy_shard_scrape_duration_seconds", "Time this scrape spent reading Redis", [],
                     [((), time.perf_counter() - started)])


def pool_metrics(snapshots: Sequence[PoolSnapshot],
                 top_sites: Mapping[str, frozenset[str] | None] | None = None) -> Iterator[Metric]:
    """Every ``proxy_shard_*`` family for the given pools (``reference/metrics.py`` lists them all).

    ``top_sites``: pool -> the sites exported one by one (None: all); the others are summed under
    ``site="_other"`` (``*``, proxy-wide quarantines, is not a site and is always kept).
    """
    top_sites = top_sites or {}

    def site_label(pool: str, site: str) -> str:
        keep = top_sites.get(pool)
        return site if keep is None or site == "*" or site in keep else OTHER_SITE

    def per_pool(name: str, doc: str, value, kind: str = "gauge") -> Metric:
        samples = [((s.pool,), v) for s in snapshots if (v := value(s)) is not None]
        return (_counter if kind == "counter" else _gauge)(name, doc, ["pool"], samples)

    yield per_pool("proxy_shard_proxies", "Proxies in the pool", lambda s: s.proxies)
    yield per_pool("proxy_shard_proxies_active", "Proxies not under a proxy-wide quarantine", lambda s: s.active)
    yield per_pool("proxy_shard_proxies_dead", "Proxies under a proxy-wide quarantine (transport failures)",
                   lambda s: len(s.dead_ids))
    yield per_pool("proxy_shard_proxies_banned", "Proxies quarantined on at least one site",
                   lambda s: len(s.banned_ids))
    yield _gauge("proxy_shard_slots", "Proxy slots per site by state (free, leased, session, cooling, banned)",
                 ["pool", "site", "state"],
                 [((s.pool, site_label(s.pool, st.site), state), getattr(st, state)) for s in snapshots
                  for st in s.sites for state in STATES])
    yield _gauge("proxy_shard_slots_held", "Slots a host holds now (leases and sticky sessions)", ["pool", "host"],
                 [((s.pool, host), n) for s in snapshots for host, n in sorted(s.held_by_host().items())])
    yield _gauge("proxy_shard_quarantines_running", "Quarantines running, by site ('*' = proxy-wide) and reason",
                 ["pool", "site", "reason"],
                 [((s.pool, site_label(s.pool, scope), reason), n) for s in snapshots
                  for (scope, reason), n in sorted(s.running_by_scope_reason().items())])
    yield _counter("proxy_shard_site_quarantines", "Quarantines started, by site ('*' = proxy-wide) and reason",
                   ["pool", "site", "reason"],
                   [((s.pool, site_label(s.pool, site), reason), n) for s in snapshots
                    for (site, reason), n in sorted(s.bans_by_site_reason().items())])
    yield per_pool("proxy_shard_quarantines_started", "Quarantines started", lambda s: s.quarantines_started,
                   "counter")
    yield per_pool("proxy_shard_quarantine_seconds", "Total length of the quarantines started, less unbans",
                   lambda s: s.quarantine_seconds, "counter")
    yield per_pool("proxy_shard_quarantine_mean_seconds", "Mean quarantine length: time to recovery of a banned "
                   "proxy", lambda s: s.mean_quarantine)
    yield _counter("proxy_shard_requests", "Leases taken per site (one per request sent through a proxy)",
                   ["pool", "site"],
                   [((s.pool, site_label(s.pool, site)), s.site_outcomes(site).leases) for s in snapshots
                    for site in _sites(s)])
    yield _counter("proxy_shard_responses", "Finished requests per site by outcome (ok, error, banned)",
                   ["pool", "site", "outcome"],
                   [((s.pool, site_label(s.pool, site), name), v) for s in snapshots for site in _sites(s)
                    for name, v in zip(OUTCOMES, _triple(s.site_outcomes(site)), strict=True)])
    yield _gauge("proxy_shard_site_interval_seconds", "Learned start-to-start interval per site (adaptive pacing)",
                 ["pool", "site"],
                 [((s.pool, site), p.interval) for s in snapshots for site, p in sorted(s.paces.items())])
    yield _counter("proxy_shard_site_interval_changes", "Changes of a site's learned interval by kind (up: rate "
                   "bans raised it, down: clean answers lowered it, skip: a rate ban that changed nothing)",
                   ["pool", "site", "change"],
                   [((s.pool, site, kind), getattr(p, attr)) for s in snapshots for site, p in sorted(s.paces.items())
                    for kind, attr in (("up", "raised"), ("down", "lowered"), ("skip", "skipped"))])
    yield per_pool("proxy_shard_success_ratio", "ok / (ok + error + banned) over the pool's requests",
                   lambda s: s.outcomes.success_ratio)
    yield _gauge("proxy_shard_proxy_latency_seconds", "Spread of the proxies' EWMA response times",
                 ["pool", "quantile"],
                 [((s.pool, str(q)), v) for s in snapshots for q in QUANTILES
                  if (v := s.latency_quantile(q)) is not None])
    yield per_pool("proxy_shard_proxy_latency_mean_seconds", "Mean of the proxies' EWMA response times",
                   lambda s: s.latency_mean)
    yield _counter("proxy_shard_releases", "Releases that found their lease expired ('stale': re-leased by "
                   "another host, 'expired': free)", ["pool", "status"],
                   [((s.pool, st), int(s.counters.get(st, 0))) for s in snapshots
                    for st in (schema.STALE, schema.EXPIRED)])
    yield per_pool("proxy_shard_session_rebinds", "Sticky sessions moved to another proxy",
                   lambda s: int(s.counters.get(schema.REBINDS, 0)), "counter")
    yield _counter("proxy_shard_gateway_events", "Gateway slots: 'rotated' (a new session token), 'cooldown' "
                   "(a ban quarantined a slot: the site's rotation budget was spent), 'shared_exit' (a slot met "
                   "another's exit IP)", ["pool", "status"],
                   [((s.pool, status), int(s.counters.get(field, 0))) for s in snapshots
                    for status, field in (("rotated", schema.GW_ROTATIONS), ("cooldown", schema.GW_COOLDOWNS),
                                         ("shared_exit", schema.GW_SHARED))])
    yield from breaker_metrics(snapshots, site_label)
    yield from host_metrics(snapshots)


def tier_metrics(lists: Sequence[tuple[tuple[str, ...], Sequence[TierCounts]]]) -> Iterator[Metric]:
    """Per tier list (``tiers="dc>resi"``) and tier (``pool``), summed over every host: the sites on the
    tier now, and what the tier served (engine/tiers.py): what the expensive tier costs."""
    rows = [(schema.TIER_SEP.join(tiers), c) for tiers, counts in lists for c in counts]
    labels = ["tiers", "pool"]
    yield _gauge("proxy_shard_tier_sites", "Sites on this tier now (their tier state alive)", labels,
                 [((name, c.pool), c.sites) for name, c in rows])
    yield _counter("proxy_shard_tier_requests", "Requests sent through this tier (leases)", labels,
                   [((name, c.pool), c["l"]) for name, c in rows])
    yield _counter("proxy_shard_tier_responses", "Answers through this tier by outcome (ok, banned)",
                   [*labels, "outcome"],
                   [((name, c.pool, outcome), c[field]) for name, c in rows
                    for outcome, field in (("ok", "ok"), ("banned", "ban"))])
    yield _counter("proxy_shard_tier_changes", "Sites moved to this tier: up (the cheaper tier blocked) or "
                   "down (a probe of it was answered fine)", [*labels, "change"],
                   [((name, c.pool, change), c[change]) for name, c in rows for change in ("up", "down")])
    yield _counter("proxy_shard_tier_probes", "Probe requests sent through this tier, by outcome (sent, banned)",
                   [*labels, "outcome"],
                   [((name, c.pool, outcome), c[field]) for name, c in rows
                    for outcome, field in (("sent", "probe"), ("banned", "pban"))])


BREAKER_STATES = ("closed", "open", "half_open")


def breaker_metrics(snapshots: Sequence[PoolSnapshot],
                    site_label: Callable[[str, str], str] = lambda pool, site: site) -> Iterator[Metric]:
    """Each site's circuit breaker: its state now, and how often it changed. Sites outside the top
    sites are summed under ``_other`` (its state series count how many of them are in each state)."""
    sites = [(s, site) for s in snapshots for site in _sites(s)]
    yield _gauge("proxy_shard_breaker_state", "1 for the state of each site's circuit breaker (closed, open, "
                 "half_open)", ["pool", "site", "state"],
                 [((s.pool, site_label(s.pool, site), state), float(s.breaker_state(site) == state))
                  for s, site in sites
                  for state in BREAKER_STATES])
    for name, doc in (("opened", "Site circuit breaker openings (the site rejected every proxy)"),
                      ("reopened", "Site circuit breaker re-openings (a probe was rejected)"),
                      ("closed", "Site circuit breaker closings (a probe was answered fine)"),
                      ("spared", "Bans while a site's circuit breaker was open: no quarantine, no strike")):
        yield _counter(f"proxy_shard_breaker_{name}", doc, ["pool", "site"],
                       [((s.pool, site_label(s.pool, site)), s.breaker_counts(site)[name]) for s, site in sites])


def host_metrics(snapshots: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    """Per live host (heartbeat within its TTL): presence, heartbeat age, requests, load."""
    hosts = [(s, h) for s in snapshots for h in s.hosts]
    labels = ["pool", "host"]
    yield _gauge("proxy_shard_host_up", "1 for each live host (Scrapy process) of the pool", labels,
                 [((s.pool, h.host), 1) for s, h in hosts])
    yield _gauge("proxy_shard_host_heartbeat_age_seconds", "Seconds since the host's last heartbeat", labels,
                 [((s.pool, h.host), max(0.0, s.now - h.beat)) for s, h in hosts])
    yield _counter("proxy_shard_host_requests", "Leases the host took since it registered", labels,
                   [((s.pool, h.host), h.leases) for s, h in hosts])
    yield _counter("proxy_shard_host_responses", "Finished requests of the host by outcome", [*labels, "outcome"],
                   [((s.pool, h.host, name), v) for s, h in hosts
                    for name, v in zip(OUTCOMES, _triple(s.host_outcomes(h.host)), strict=True)])
    yield _gauge("proxy_shard_host_success_ratio", "ok / (ok + error + banned) of the host's requests", labels,
                 [((s.pool, h.host), r) for s, h in hosts if (r := s.host_outcomes(h.host).success_ratio) is not None])
    yield _gauge("proxy_shard_host_recent_leases", "Leases the host took over the last 10 minutes", labels,
                 [((s.pool, h.host), s.recent_load(h)) for s, h in hosts])
    yield _gauge("proxy_shard_host_load_share", "The host's share of the pool's leases over the last 10 minutes",
                 labels, [((s.pool, h.host), share) for s, h in hosts if (share := s.load_share(h)) is not None])


def serve(store: PoolStore, *, host: str = "127.0.0.1", port: int = 9808,
          pools: Sequence[str] | None = None,
          top_sites: int = DEFAULTS["PROXY_SHARD_METRICS_TOP_SITES"]) -> tuple[Any, threading.Thread]:
    """Serve ``/metrics`` on ``host:port`` in a background thread; returns (server, thread).

    Stop it with ``server.shutdown(); server.server_close()``. Only this package's metrics are
    served (a registry of its own), so one exporter can run beside other Python exporters.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(store, pools, top_sites=top_sites))
    return start_http_server(port, addr=host, registry=registry)


def _sites(s: PoolSnapshot) -> list[str]:
    return sorted(site for site in s.site_stats if site != "*")


def _all_sites(s: PoolSnapshot) -> set[str]:
    """Every site a per-site series of the pool may name (slots, counters, quarantines)."""
    sites = {st.site for st in s.sites} | set(s.site_stats)
    sites.update(b.scope for b in s.bans)
    sites.discard("*")
    return sites


def _triple(o: Any) -> tuple[int, int, int]:
    return (o.ok, o.errors, o.banned)


def _gauge(name: str, doc: str, labels: list[str], samples: list[tuple[tuple, Any]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in _summed(samples):
        family.add_metric(list(values), value)
    return family


def _counter(name: str, doc: str, labels: list[str], samples: list[tuple[tuple, Any]]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, value in _summed(samples):
        family.add_metric(list(values), value)
    return family


def _summed(samples: list[tuple[tuple, Any]]) -> list[tuple[tuple, float]]:
    """One sample per label set, in first-seen order: the sites folded into ``_other`` add up."""
    out: dict[tuple, float] = {}
    for values, value in samples:
        out[values] = out.get(values, 0.0) + float(value)
    return list(out.items())
