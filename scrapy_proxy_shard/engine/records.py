"""What the store's operations return: leases, waits, release and ban results, and the read-only
records of a pool (proxies, quarantines, slots, sites, heartbeats, hosts). Split from ``store.py``,
which still exports every one of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scrapy_proxy_shard.engine.breaker import BreakerEvent
from scrapy_proxy_shard.engine.proxies import SESSION_MARK, Proxy, mask, send_url
from scrapy_proxy_shard.exceptions import PoolBackendError

# --- results --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lease:
    """A held proxy slot. Present ``token`` to release it; the URL holds credentials (the URL the
    request goes through: a gateway entry's declared ``#session=`` is left out, see ``send_url``)."""

    pool: str
    site: str
    proxy_id: str
    proxy_url: str = field(repr=False)
    member: str
    token: str = field(repr=False)
    expires_at: float
    issued_at: float
    session_id: str | None = None
    rebound: bool = False
    #: The exit's declared session (the URL's ``#session=`` mark, "" for none): a gateway slot's
    #: ``gw.<gid>.<k>.<token>`` says which token this lease went out with (engine/gateway.py).
    exit_session: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        # Defence in depth: a lease without a URL would send the request from the host's own IP.
        if not self.proxy_url:
            raise PoolBackendError(f"pool {self.pool!r} answered a lease of proxy {self.proxy_id!r} without a URL")
        if SESSION_MARK in self.proxy_url:
            object.__setattr__(self, "exit_session", self.proxy_url.partition(SESSION_MARK)[2])
            object.__setattr__(self, "proxy_url", send_url(self.proxy_url))

    @property
    def masked_url(self) -> str:
        return mask(self.proxy_url)

    @classmethod
    def _of(cls, pool: str, site: str, proxy_id: str, proxy_url: str, member: str, token: str, expires_at: float,
            issued_at: float, session_id: str | None, rebound: bool) -> Lease:
        """``Lease(...)`` with every field given, made the way the lease path wants it (once per call):
        the same object, checked by the same ``__post_init__``, without the frozen class's
        ``object.__setattr__`` per field."""
        self = object.__new__(cls)
        object.__setattr__(self, "__dict__", {
            "pool": pool, "site": site, "proxy_id": proxy_id, "proxy_url": proxy_url, "member": member,
            "token": token, "expires_at": expires_at, "issued_at": issued_at, "session_id": session_id,
            "rebound": rebound, "exit_session": ""})
        self.__post_init__()
        return self


@dataclass(frozen=True)
class LeaseWait:
    """Nothing usable now; ``wait`` seconds until the earliest slot frees up. ``reason``: ``pool``
    (the earliest slot is cooling or quarantined: it frees exactly then), ``held`` (it is leased:
    ``wait`` is its expiry, but a release may come sooner, see ``wait_for_release``), ``session``
    (a sticky session's own proxy is in use or pacing), ``breaker`` (the site's circuit breaker is
    open: ``wait`` until probing starts; or half-open with its probe in flight: ``wait`` until the
    probe's lease expires, a release may come sooner). ``firm``: nothing but an operator's unban or
    add can free a slot sooner (no slot of the site is held, or the breaker is open): a request whose
    wait limit ends first may give up at once (crawl/liveness.py)."""

    wait: float
    reason: str
    firm: bool = False


@dataclass(frozen=True)
class ReleaseResult:
    """``status``: ``ok``; ``stale`` (the lease had expired and another holder has the slot now:
    nothing was freed); ``expired`` (the lease had expired, nobody held it). ``ban_until`` is the
    end of a quarantine this release started or joined (Redis clock, seconds), else None.
    ``breaker``: what this release did to the site's circuit breaker, if anything."""

    status: str
    now: float
    ban_until: float | None = None
    strikes: int = 0
    breaker: BreakerEvent | None = None
    #: Adaptive pacing (``autothrottle`` given): the site's learned interval in force after this answer
    #: (seconds), and what the answer did (docs/pacing.md): ``""``, ``probe`` (this proxy tries a lower
    #: interval), ``down``, ``fail`` (the probe met a rate ban), ``back`` (a provisional lowering
    #: undone), ``up``, ``skip`` (a rate ban that changed nothing) or ``forget``. None / "" without it.
    interval: float | None = None
    pace_event: str = ""
    #: With a fixed interval: the site's path margin in force after this answer (seconds, added to the
    #: interval for every host; docs/pacing.md), and whether this answer widened it.
    margin: float = 0.0
    widened: bool = False
    #: When the slot given back may be used again (Redis clock, seconds), or None (a session's slot, a
    #: release that freed nothing, the local fallback engine): crawl/pacewake.py wakes a request of
    #: this host sleeping longer than that.
    free_at: float | None = None

    @classmethod
    def _of(cls, status: str, now: float, ban_until: float | None, strikes: int, breaker: BreakerEvent | None,
            interval: float | None, pace_event: str, margin: float, widened: bool,
            free_at: float | None = None) -> ReleaseResult:
        """``ReleaseResult(...)`` with every field given, without the frozen class's ``object.__setattr__``
        per field (the release path makes one per call): the same object."""
        self = object.__new__(cls)
        object.__setattr__(self, "__dict__", {
            "status": status, "now": now, "ban_until": ban_until, "strikes": strikes, "breaker": breaker,
            "interval": interval, "pace_event": pace_event, "margin": margin, "widened": widened,
            "free_at": free_at})
        return self


@dataclass(frozen=True)
class BanResult:
    until: float
    strikes: int
    started: bool


@dataclass(frozen=True)
class AddResult:
    """``updated``: entries whose exit was in the pool already; ``replaced``: the ids among them whose URL
    (credentials, scheme) the add replaced in place (the exit's slots, pacing and bans stay)."""

    added: int
    updated: int
    replaced: tuple[str, ...] = ()


@dataclass(frozen=True)
class BanRecord:
    proxy_id: str
    scope: str  # a site key, or "*" for proxy-wide
    until: float
    strikes: int
    reason: str
    since: float


@dataclass(frozen=True)
class ProxyRecord:
    proxy: Proxy
    stats: dict[str, float]
    #: The id the pool holds it under (an entry an older version added may not be its exit id yet).
    stored_id: str | None = None

    @property
    def id(self) -> str:
        return self.stored_id or self.proxy.id


@dataclass(frozen=True)
class BusySlot:
    """One slot of a site that is not free now (``pool_status(..., detail=True)``).

    ``state``: ``leased`` (a request holds it), ``session`` (bound to a live sticky session),
    ``banned`` (quarantined) or ``cooling`` (resting after a release). ``until`` is when it may be
    used again at the earliest (Redis clock, seconds).
    """

    proxy_id: str
    slot: int
    state: str
    until: float
    host: str | None
    session_id: str | None
    uses: int
    session_ttl: float


@dataclass(frozen=True)
class SiteStatus:
    """Every slot of one site by state, and the slots each host holds there (leases and sessions)."""

    site: str
    now: float
    slots: int
    free: int
    leased: int
    session: int
    cooling: int
    banned: int
    next_free_in: float
    held_by_host: dict[str, int]
    busy: tuple[BusySlot, ...] = ()

    @property
    def held(self) -> int:
        """Slots a request or a sticky session holds now (a live held record), by every host."""
        return sum(self.held_by_host.values())


@dataclass(frozen=True)
class Beat:
    """What a heartbeat learnt about the pool: size, live hosts, this host's counters, free slots."""

    now: float
    proxies: int
    live_hosts: int
    leases: int
    ok: int
    errors: int
    bans: int  # responses judged a ban (the ``banned`` counter)
    sites: dict[str, tuple[int, int]]  # site -> (slots, free)


@dataclass(frozen=True)
class HostRecord:
    """A live Scrapy process of a pool: heartbeat times (Redis clock, s), counters, per-minute load."""

    host: str
    alive_until: float
    beat: float
    since: float
    info: dict[str, Any]
    leases: int
    ok: int
    errors: int
    bans: int  # responses judged a ban (the ``banned`` counter)
    load: dict[float, int]  # minute start -> leases taken in that minute
