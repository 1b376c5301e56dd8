"""A point-in-time view of one pool, read from Redis for people (the CLI) and for Prometheus.

Everything here is *read* at the moment someone asks: the request path only bumps counters inside
its own Lua scripts, and the heartbeats of ``health.py`` write the host registry, so watching a
pool costs the crawl nothing. ``read_pool`` makes a handful of round trips (one per site for the
slot states); the derived figures (success ratio, quarantine lengths, latency spread, load share)
are plain properties of the ``PoolSnapshot`` so the CLI and the exporter cannot disagree.

Nothing in a snapshot carries a proxy URL except ``ProxyRecord.proxy`` in detail mode, whose
``repr`` and ``masked`` hide credentials; the views must print ``masked`` only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.breaker import BreakerState
from scrapy_proxy_shard.engine.pacing import PaceState
from scrapy_proxy_shard.engine.store import BanRecord, HostRecord, PoolStore, ProxyRecord, SiteStatus

#: Slot states in the order the views show them (``free`` plus the states of ``pool_status.lua``).
STATES = ("free", "leased", "session", "cooling", "banned")
#: Which state a proxy shows on a site when its slots differ (concurrency > 1): the most telling.
_PRECEDENCE = {"banned": 4, "leased": 3, "session": 2, "cooling": 1, "free": 0}
#: Minutes of per-host load that "share of the load" looks back over.
LOAD_WINDOW_MINUTES = 10


@dataclass(frozen=True)
class Outcomes:
    """Request outcomes: ``ok``, ``errors`` (transport failures), ``banned`` (responses judged a ban)."""

    leases: int = 0
    ok: int = 0
    errors: int = 0
    banned: int = 0

    @property
    def finished(self) -> int:
        return self.ok + self.errors + self.banned

    @property
    def success_ratio(self) -> float | None:
        """ok / (ok + errors + banned); None before any request finished. Unknown outcomes (a 404) and
        requests still running count neither way."""
        return self.ok / self.finished if self.finished else None

    def __add__(self, other: Outcomes) -> Outcomes:
        return Outcomes(self.leases + other.leases, self.ok + other.ok, self.errors + other.errors,
                        self.banned + other.banned)


@dataclass(frozen=True)
class ProxySiteRow:
    """One proxy on one site (``status --proxies``): its state and, if quarantined, why and how long."""

    site: str
    proxy_id: str
    masked_url: str
    state: str
    busy_slots: int
    slots: int
    until: float | None  # Redis clock, s: when the proxy is usable on the site again (None: free)
    ban_reason: str | None
    strikes: int
    ban_scope: str | None  # the site, or "*" for a proxy-wide quarantine
    host: str | None


@dataclass
class PoolSnapshot:
    """One pool at one instant (Redis clock ``now``)."""

    pool: str
    now: float
    proxies: int
    sites: list[SiteStatus]
    bans: list[BanRecord]
    hosts: list[HostRecord]
    site_stats: dict[str, dict[str, float]]
    host_stats: dict[str, dict[str, float]]
    proxy_stats: dict[str, dict[str, float]]
    counters: dict[str, float]
    concurrency: dict[str, int] = field(default_factory=dict)  # site -> slots per proxy
    records: list[ProxyRecord] | None = field(default=None, repr=False)
    breakers: dict[str, BreakerState] = field(default_factory=dict)  # sites whose breaker is not closed
    paces: dict[str, PaceState] = field(default_factory=dict)  # site -> learned pacing (adaptive pacing)

    # --- proxies and quarantines -----------------------------------------------------------------
    @property
    def running_bans(self) -> list[BanRecord]:
        """Quarantines still running (the bans hash also remembers ended ones for escalation)."""
        return [b for b in self.bans if b.until > self.now]

    @property
    def dead_ids(self) -> set[str]:
        """Proxies under a proxy-wide quarantine (transport failures, or ``ban`` without ``--site``)."""
        return {b.proxy_id for b in self.running_bans if b.scope == "*"}

    @property
    def banned_ids(self) -> set[str]:
        """Proxies quarantined on at least one site (not counting proxy-wide quarantines)."""
        return {b.proxy_id for b in self.running_bans if b.scope != "*"}

    @property
    def active(self) -> int:
        """Proxies in the pool that are not under a proxy-wide quarantine."""
        return max(0, self.proxies - len(self.dead_ids))

    def running_by_scope_reason(self) -> Counter[tuple[str, str]]:
        return Counter((b.scope, b.reason) for b in self.running_bans)

    @property
    def quarantines_started(self) -> int:
        return int(self.counters.get(schema.Q_STARTED, 0))

    @property
    def quarantine_seconds(self) -> float:
        """Total length of the quarantines started, less what ``unban`` cut short."""
        return max(0.0, self.counters.get(schema.Q_MS, 0.0) / 1000)

    @property
    def mean_quarantine(self) -> float | None:
        """Mean time to recovery of a banned proxy (seconds), over every quarantine started."""
        n = self.quarantines_started
        return self.quarantine_seconds / n if n else None

    # --- outcomes ----------------------------------------------------------------------------------
    def site_outcomes(self, site: str) -> Outcomes:
        return _outcomes(self.site_stats.get(site, {}))

    @property
    def outcomes(self) -> Outcomes:
        total = Outcomes()
        for site in self.site_stats:
            total = total + self.site_outcomes(site)
        return total

    def host_outcomes(self, host: str) -> Outcomes:
        # A pool written before the rename may still hold a host's banned responses under the old name.
        stats = self.host_stats.get(host, {})
        return _outcomes(stats, also_banned=stats.get(schema.LEGACY_HOST_BANNED, 0))

    def bans_by_site_reason(self) -> Counter[tuple[str, str]]:
        """Quarantines started per (site, reason) since the pool began (site "*" = proxy-wide)."""
        out: Counter[tuple[str, str]] = Counter()
        per_reason = schema.QUARANTINES + ":"
        for site, stats in self.site_stats.items():
            for name, value in stats.items():
                if name.startswith(per_reason):
                    out[(site, name[len(per_reason):])] += int(value)
        return out

    # --- site circuit breakers ------------------------------------------------------------------------
    def breaker_state(self, site: str) -> str:
        """``closed``, ``open`` or ``half_open``."""
        b = self.breakers.get(site)
        return "closed" if b is None else ("open" if b.state == "open" else "half_open")

    def breaker_counts(self, site: str) -> dict[str, int]:
        """How often the site's breaker opened, re-opened, closed, and the bans it spared."""
        stats = self.site_stats.get(site, {})
        return {name: int(stats.get(field, 0)) for name, field in (
            ("opened", schema.BREAKER_OPENED), ("reopened", schema.BREAKER_REOPENED),
            ("closed", schema.BREAKER_CLOSED), ("spared", schema.BREAKER_SPARED))}

    # --- latency -----------------------------------------------------------------------------------
    @property
    def latencies(self) -> list[float]:
        """Each proxy's EWMA response time (seconds), for proxies that answered at least once."""
        return sorted(s[schema.LATENCY] / 1000 for s in self.proxy_stats.values() if schema.LATENCY in s)

    def latency_quantile(self, q: float) -> float | None:
        values = self.latencies
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def latency_mean(self) -> float | None:
        values = self.latencies
        return sum(values) / len(values) if values else None

    # --- hosts -------------------------------------------------------------------------------------
    def held_by_host(self) -> Counter[str]:
        """Slots each host holds right now, over every site (leases and sticky sessions)."""
        held: Counter[str] = Counter()
        for status in self.sites:
            held.update(status.held_by_host)
        return held

    def recent_load(self, host: HostRecord, minutes: int = LOAD_WINDOW_MINUTES) -> int:
        since = self.now - minutes * 60
        return sum(n for start, n in host.load.items() if start + 60 > since)

    def load_share(self, host: HostRecord) -> float | None:
        """The host's share of the leases taken by live hosts over the last minutes (or since they
        started, when nobody leased lately)."""
        recent = {h.host: self.recent_load(h) for h in self.hosts}
        total = sum(recent.values())
        if total:
            return recent[host.host] / total
        overall = sum(h.leases for h in self.hosts)
        return host.leases / overall if overall else None

    # --- per proxy and site-----------------------------------------------------------------------
    def proxy_rows(self) -> list[ProxySiteRow]:
        """One row per proxy and site the pool served (needs ``read_pool(..., detail=True)``)."""
        if self.records is None:
            raise ValueError("proxy_rows() needs a snapshot read with detail=True")
        running = {(b.scope, b.proxy_id): b for b in self.running_bans}
        rows = []
        for status in self.sites:
            slots = self.concurrency.get(status.site, 1)
            busy: dict[str, list] = {}
            for slot in status.busy:
                busy.setdefault(slot.proxy_id, []).append(slot)
            for record in self.records:
                mine = busy.get(record.id, [])
                state = max((s.state for s in mine), key=_PRECEDENCE.__getitem__, default="free")
                # The quarantine that ends last decides when the proxy is usable on the site again.
                ban = max((b for b in (running.get((status.site, record.id)), running.get(("*", record.id))) if b),
                          key=lambda b: b.until, default=None)
                until = max((s.until for s in mine), default=None)
                if ban is not None and state in ("free", "cooling"):
                    # A proxy-wide quarantine is never written into the sites' slots (the lease script
                    # checks it), so its free slots look free to pool_status: it is banned here all the same.
                    state = "banned"
                if ban is not None and state == "banned":
                    until = max(until or 0.0, ban.until)
                holder = next((s.host for s in mine if s.host), None)
                rows.append(ProxySiteRow(
                    status.site, record.id, record.proxy.masked, state, len(mine), slots, until,
                    ban.reason if ban else None, ban.strikes if ban else 0, ban.scope if ban else None, holder,
                ))
        return rows


def read_pool(store: PoolStore, pool: str, *, detail: bool = False) -> PoolSnapshot:
    """Read one pool. ``detail`` also reads every proxy and every busy slot (O(pool size))."""
    site_names = store.sites(pool)
    sites = [s for s in (store.pool_status(pool, site, detail=detail) for site in site_names) if s is not None]
    now = sites[0].now if sites else store.server_time()
    records = store.list_proxies(pool) if detail else None
    bans = store.bans(pool)
    present = store.proxy_urls(pool, {b.proxy_id for b in bans})  # drained proxies' bans do not count
    return PoolSnapshot(
        pool=pool,
        now=now,
        proxies=len(records) if records is not None else store.pool_size(pool),
        sites=sites,
        bans=[b for b in bans if present.get(b.proxy_id)],
        hosts=store.hosts(pool),
        site_stats=store.site_counters(pool, site_names),
        host_stats=_split(store.counters(pool, schema.HSTATS)),
        proxy_stats=({r.id: r.stats for r in records} if records is not None
                     else _split(store.counters(pool, schema.PSTATS))),
        counters=store.counters(pool, schema.COUNTERS),
        concurrency=site_names,
        records=records,
        breakers={site: b for site in site_names if (b := store.breaker(pool, site)) is not None},
        paces=store.paces(pool),
    )


def _outcomes(stats: dict[str, Any], *, also_banned: float = 0) -> Outcomes:
    """Requests of one site or host by outcome (the counter fields of ``schema``)."""
    return Outcomes(int(stats.get(schema.LEASES, 0)), int(stats.get(schema.OK, 0)), int(stats.get(schema.ERRORS, 0)),
                    int(stats.get(schema.BANNED, 0) + also_banned))


def _split(flat: dict[str, float]) -> dict[str, dict[str, Any]]:
    """``"<owner>:<counter>"`` fields into {owner: {counter: value}}: host ids may hold ':'
    (``hostname:pid``) and proxy/host counters do not, so split at the last."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        owner, _, counter = name.rpartition(":")
        out.setdefault(owner, {})[counter] = value
    return out
