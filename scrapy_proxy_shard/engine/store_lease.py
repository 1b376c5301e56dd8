"""The store's lease path: leasing a slot, waiting for a release, releasing with the request's outcome
(pacing, quarantine, the site's circuit breaker), adopting a named slot (``hold``, ``lift``) and ending
a sticky session. ``_Leasing`` is a mixin of ``store._StoreBase``."""

from __future__ import annotations

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.breaker import BreakerEvent, BreakerOptions, BreakerState, ContentVerdict
from scrapy_proxy_shard.engine.gateway import gateway_id
from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.records import Lease, LeaseWait, ReleaseResult
from scrapy_proxy_shard.engine.store_admin import MIGRATE_WARMUP
from scrapy_proxy_shard.engine.store_calls import (
    CACHE_ENTRIES,
    MAX_CONCURRENCY,
    Plan,
    _Command,
    _Continue,
    _latency_ms,
    _ms,
    _name,
    _reason,
    _Script,
)
from scrapy_proxy_shard.exceptions import PoolBackendError, UnknownPoolError

OUTCOMES = ("ok", "error", "ban", "dead", "unknown")
#: ``repr`` of a release's interval factor when the interval is not randomized.
_NO_FACTOR = repr(1.0)
#: release.lua ARGV[27..28] without an arrival guard.
_NO_GUARD = (0, 0)
#: Ban reasons of a failed content check (a page that answered 2xx without what the spider needs).
CONTENT_REASONS = frozenset({"missing_css", "small_body"})


def _gateway_arg(session: str) -> str:
    """release.lua ARGV[30]: a gateway slot's id ("gw" when its mark does not parse: lease.lua marked the
    slot busy from its URL all the same), "" for any other proxy."""
    if not session.startswith("gw."):
        return ""
    return gateway_id(session) or "gw"


def _share(value: float) -> str:
    """release.lua ARGV[29], a share from 0 to 1 (the scripts trust their arguments)."""
    share = float(value)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"margin_prior ({value!r}) must be a share from 0 to 1")
    return repr(share)


def _ban_kind(outcome: str, reason: str | None, rate: bool) -> int:
    """release.lua ARGV[24]: 0 not a ban, 1 rate-type, 2 a block, 3 a failed content check."""
    if outcome != "ban":
        return 0
    if rate:
        return 1
    return 3 if reason in CONTENT_REASONS else 2


class _Leasing:
    """Lease, release, the breaker, hold / lift and sticky sessions (mixed into ``store._StoreBase``:
    one-request operations run by its ``_run``, plans by its ``_drive``)."""

    # --- leasing -------------------------------------------------------------------------------
    def lease(self, pool: str, site: str, *, ttl: float, concurrency: int = 1,
              session_id: str | None = None, session_ttl: float = 600.0, spacing: float = 0.0,
              spread: float = 0.0):
        """Lease the slot free longest on ``site``, or continue ``session_id``'s sticky proxy.

        ``spacing`` (seconds; with ``concurrency`` > 1): the interval the caller paces the site with.
        The proxy's other slots on the site start no sooner than that after this lease (the site counts
        arrivals per IP); 0: the spacing the site's last release paced with.

        ``spread`` (seconds; the site's first interval): the first use of each proxy the site learns at
        this call is spread over it, each site at its own phase (learn() in lua/_lib.lua): a site's first
        round is not one burst, and one IP's first requests to the sites a crawl opens at once are far
        apart. 0: every proxy is free at once.

        Returns a ``Lease`` or a ``LeaseWait``; raises ``UnknownPoolError`` for an empty pool.
        """
        return self._run(self._lease_request, self._lease_done, pool, site, ttl, concurrency, session_id,
                         session_ttl, spacing, spread)

    def _lease_request(self, pool, site, ttl, concurrency, session_id, session_ttl, spacing=0.0,
                       spread=0.0) -> _Script:
        token = self._token()
        session = session_id or ""
        slots = int(concurrency)
        ttl_ms = _ms(ttl, "ttl")
        if not 1 <= slots <= MAX_CONCURRENCY or ttl_ms < 1:  # lease.lua trusts its arguments
            if ttl_ms < 1:
                raise ValueError(f"ttl ({ttl!r}) must be at least 1 ms")
            raise ValueError(f"concurrency ({concurrency!r}) must be a whole number from 1 to {MAX_CONCURRENCY}")
        if session:
            _name(session, "session id")
        return _Script("lease", self._call_keys("lease", self.prefix(pool), _name(site, "site"), session, token), (
            site, slots, ttl_ms, token, self.host_id, session,
            _ms(max(session_ttl, ttl), "session_ttl"), self.site_idle_ms, _ms(spacing, "spacing"),
            _ms(spread, "spread"),
        ))

    def _lease_done(self, reply, request, pool, site, ttl, concurrency, session_id, session_ttl, spacing=0.0,
                    spread=0.0):
        if reply[0] == "MIGRATE":
            return _Continue(self._lease_migrated(request, pool, site, session_id, ttl))
        return self._lease_result(reply, pool, site, session_id)

    def _lease_migrated(self, request, pool, site, session_id, ttl=MIGRATE_WARMUP) -> Plan:
        yield from self._migrate(pool, ttl)
        reply = yield request
        if reply[0] == "MIGRATE":  # another host reset it meanwhile (an older version): ask again soon
            return LeaseWait(0.001, "pool")
        return self._lease_result(reply, pool, site, session_id)

    def _lease_result(self, reply, pool, site, session_id) -> Lease | LeaseWait:
        status = reply[0]
        if status == "OK":
            return Lease._of(pool, site, reply[1], reply[2], reply[3], reply[4], int(reply[5]) / 1000,
                             int(reply[6]) / 1000, session_id, bool(int(reply[8])))
        if status == "WAIT":
            return LeaseWait(int(reply[1]) / 1000, reply[2], len(reply) > 3 and int(reply[3]) == 1)
        if status == "EMPTY":
            raise UnknownPoolError(
                f"pool {pool!r} (namespace {self.namespace!r}) holds no proxies: load some first "
                f"(scrapy-proxy-shard load --pool {pool} FILE, or PROXY_SHARD_PROXIES)"
            )
        raise PoolBackendError(f"lease: unexpected reply {status!r}")

    def wait_for_release(self, pool: str, site: str, timeout: float):
        """Block until a slot of ``site`` is given back by any host, or ``timeout`` seconds pass.

        Returns True when woken by a release. Used after a ``LeaseWait`` with reason ``held``: the
        earliest slot is leased and its holder will usually release it long before it expires.
        Keep ``timeout`` below the client's socket timeout (the caller loops).
        """
        return self._drive(self._wait_for_release(pool, site, timeout))

    def _wait_for_release(self, pool, site, timeout) -> Plan:
        timeout = max(0.001, round(float(timeout), 3))
        reply = yield _Command(("BLPOP", keys.freed_key(self.prefix(pool), site), timeout))
        return reply is not None

    def release(self, lease: Lease, *, outcome: str = "ok", latency: float | None = None,
                min_interval: float = 0.0, reason: str | None = None,
                session_ttl: float = 600.0, ban_ttl: float | None = None,
                rest_after_response: float = 0.0, randomize_interval: bool = False,
                autothrottle: AutothrottleOptions | None = None, rate_ban: bool = False,
                retry_after: float | None = None,
                arrival_guard: tuple[float, float | None] | None = None, rest_min: float | None = None,
                margin_prior: float = 0.0):
        """Give a slot back with the request's outcome; ``ban``/``dead`` quarantine the proxy.

        Pacing (on the Redis clock): the slot is free again at the later of the lease's start +
        ``min_interval`` (two starts through one IP on the site at least that far apart, what a
        site's rate limit counts) and now + ``rest_after_response``. ``randomize_interval`` draws
        this release's interval from [0.5, 1.5) x ``min_interval`` (RANDOMIZE_DOWNLOAD_DELAY's
        band), so starts do not look machine-timed.

        ``autothrottle`` (enabled): the site's interval learned in Redis for all hosts replaces
        ``min_interval`` (randomized the same way); this answer updates it first: ``rate_ban`` says the
        ban is rate-type (a 429, a challenge...), which may raise it; clean answers lower it.

        ``retry_after`` (a ban only): the site's ``Retry-After`` in seconds. The quarantine on the site
        lasts exactly that long (capped at the ban cap, no jitter) instead of the ban TTL or the learned
        rest: the site said when the IP may come back. Unless the site's word proved wrong: an IP
        banned again within one quarantine length of its return gets the usual escalating quarantine
        (a site that says ``Retry-After: 1`` to an IP it blocks for good). A rate ban still moves the pace.

        In every mode the answer teaches the site's state first (docs/pacing.md): a ban's kind (rate-type
        when ``rate_ban`` or ``retry_after``; a failed content check by its reason; else a block) picks
        its quarantine: brief (the site's rest learned from when banned IPs come back clean, at least
        ``rest_min``, default AUTOTHROTTLE_BAN_TTL) for a rate-type ban or any ban after a clean answer,
        the ban TTL for a hard block; with a fixed interval, strike-like answers widen the site's path
        margin, added to ``min_interval`` for every host (``ReleaseResult.margin``); ``margin_prior``: the
        margin before the site taught one, as a share of the interval (at most 20 ms; the crawl: 0.03).

        ``arrival_guard``: ``(cap, floor)`` in seconds: the slot's next start is pushed back by
        ``min(cap, max(1 ms, release - lease start - floor))`` on the Redis clock (by ``release - lease
        start`` when ``floor`` is None: paced from the release), so it is paced from when this request
        can have reached the site rather than from its lease (see crawl/arrival.py). None: no guard.
        """
        return self._run(self._release_request, self._release_done, lease, outcome, latency, min_interval, reason,
                         session_ttl, ban_ttl, rest_after_response, randomize_interval, autothrottle, rate_ban,
                         retry_after, arrival_guard, rest_min, margin_prior)

    def _release_request(self, lease, outcome, latency, min_interval, reason, session_ttl, ban_ttl,
                         rest_after_response=0.0, randomize_interval=False, autothrottle=None,
                         rate_ban=False, retry_after=None, arrival_guard=None, rest_min=None,
                         margin_prior=0.0) -> _Script:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        adaptive = autothrottle is not None and autothrottle.enabled
        told = 0  # the site's Retry-After, ms (release.lua ARGV[26]; 0: none)
        if retry_after is not None and outcome == "ban":
            told = max(1, _ms(min(max(0.0, float(retry_after)), self.bans_options.max_ttl), "retry_after"))
        if outcome == "ban" or outcome == "dead" or ban_ttl is not None:
            # A rate ban under adaptive pacing blames the pace (which is raised), not the IP: release.lua
            # rests the IP for the site's learned rest from the first strike when the proxy's previous
            # answer on the site was clean, and escalates as usual when it was a ban.
            ban_args = self._ban_args(outcome == "dead", ban_ttl)
        else:  # release.lua reads them only for a ban: valid values, no jitter drawn
            ban_args = self._quiet_ban_args()
        interval = _ms(min_interval, "min_interval")
        factor = 1.0
        if randomize_interval:
            factor = 0.5 + self._random()  # [0.5, 1.5) x, like Scrapy's
            interval = round(interval * factor)
        kind = _ban_kind(outcome, reason, rate_ban or told > 0)
        if rest_min is None:
            rest_min = autothrottle.ban_ttl if autothrottle is not None else AutothrottleOptions.ban_ttl
        rest = max(1, _ms(rest_min, "rest_min"))
        if adaptive:
            pace_args = (
                "1", *(max(1, _ms(getattr(autothrottle, name), name))
                       for name in ("start_interval", "min_interval", "max_interval")),
                repr(factor), kind, rest,
            )
        else:
            pace_args = ("0", 1, 1, 1, _NO_FACTOR if factor == 1.0 else repr(factor), kind, rest)
        session = lease.session_id or ""
        token = lease.token
        site = lease.site
        return _Script("release", self._call_keys("release", self.prefix(lease.pool), site, session, token), (
            site, lease.member, token, outcome,
            -1 if latency is None else _latency_ms(latency),
            interval, self.host_id, session,
            _ms(max(session_ttl, 0.001)), _reason(reason or outcome), *ban_args,
            self._alpha_arg(), _ms(rest_after_response, "rest_after_response"),
            self._breaker_arg(site), self.site_idle_ms, *pace_args, told,
            *(_NO_GUARD if arrival_guard is None else self._guard_args(arrival_guard)), self._share_arg(margin_prior),
            _gateway_arg(lease.exit_session), "1" if adaptive and autothrottle.overlap else "0",
        ))

    def _alpha_arg(self) -> str:
        """release.lua's EWMA alpha, ``repr(float(self.ewma_alpha))``, made again only when the value changes."""
        alpha = self.ewma_alpha
        cached = self._alpha_repr
        if cached[0] is not alpha:
            cached = self._alpha_repr = (alpha, repr(float(alpha)))
        return cached[1]

    def _share_arg(self, value: float) -> str:
        """``_share(value)``, kept for the value object last given (a crawl passes the same one every call)."""
        cached = self._share_repr
        if cached[0] is not value:
            cached = self._share_repr = (value, _share(value))
        return cached[1]

    @staticmethod
    def _guard_args(arrival_guard: tuple[float, float | None] | None) -> tuple[int, int]:
        """release.lua ARGV[27..28]: the arrival guard's cap and floor, ms (floor -1: cold, paced from the
        release even with cap 0). None: neither."""
        if not arrival_guard:
            return 0, 0
        cap, floor = arrival_guard
        return _ms(cap or 0.0, "arrival guard"), -1 if floor is None else _ms(floor, "arrival floor")

    def _release_done(self, reply, request, *_) -> ReleaseResult:
        until = int(reply[2])
        n = len(reply)
        breaker = _breaker_event(reply[4:10]) if n > 4 and reply[4] else None
        learned = reply[10] if n > 10 else ""
        margin = float(reply[12]) / 1000 if n > 12 else 0.0
        return ReleaseResult._of(reply[0].lower(), int(reply[1]) / 1000,
                                 until / 1000 if until else None, int(reply[3]), breaker,
                                 float(learned) / 1000 if learned else None, reply[11] if n > 11 else "",
                                 margin, n > 13 and reply[13] == "widen",
                                 int(reply[14]) / 1000 if n > 14 and reply[14] else None)

    def breaker_options(self, site: str) -> BreakerOptions | None:
        """The circuit breaker's options for ``site`` on this store (None: off)."""
        b = self._breakers
        if b is None or isinstance(b, BreakerOptions):
            return b
        return b(site)

    def _breaker_arg(self, site: str) -> str:
        options = self.breaker_options(site)
        if options is None:
            return ""
        cached = self._packed.get(id(options))
        if cached is not None and cached[0] is options:
            return cached[1]
        packed = options.packed()
        if len(self._packed) >= CACHE_ENTRIES:
            self._packed.clear()
        self._packed[id(options)] = (options, packed)
        return packed

    def breaker(self, pool: str, site: str):
        """The site's circuit breaker as stored (``BreakerState``), or None when it is closed."""
        return self._drive(self._breaker(pool, site))

    def _breaker(self, pool, site) -> Plan:
        raw = yield _Command(("HGETALL", keys.breaker_key(self.prefix(pool), site)))
        if not raw or "st" not in raw:
            return None
        n = {k: int(v) if str(v).lstrip("-").isdigit() else 0 for k, v in raw.items()}
        return BreakerState(site, raw["st"], n.get("until", 0) / 1000, n.get("cool", 0) / 1000, n.get("used", 0),
                            n.get("probes", 0), bool(raw.get("ptok")), n.get("since", 0) / 1000, n.get("trips", 0),
                            raw.get("cause") or None, raw.get("chk") or None)

    def content_check(self, pool: str, site: str, verdict: str, *, proxy_id: str = "", check: str = "",
                      suspects: int = 3):
        """Record what a content check said on ``site`` (``verdict`` ``pass`` or ``fail``, through
        ``proxy_id``) and learn whether its failure is a ban (``ContentVerdict``, see content.lua): a
        check that never passed there and failed for ``suspects`` distinct proxies opens the site's
        breaker with cause ``content``."""
        return self._drive(self._content_check(pool, site, verdict, proxy_id, check, suspects))

    def _content_check(self, pool, site, verdict, proxy_id, check, suspects) -> Plan:
        options = self.breaker_options(site) or BreakerOptions()
        reply = yield _Script("content", keyset.script_keys("content", self.prefix(pool), site), (
            site, verdict, proxy_id, check, int(suspects), options.packed()))
        kind = reply[0].lower()
        n = [int(x) for x in reply[1:]]
        if kind == "passed":
            return ContentVerdict(kind, first=bool(n[0]))
        if kind == "trusted":
            return ContentVerdict(kind)
        return ContentVerdict(kind, proxies=n[0], needed=n[1], cooloff=n[2] / 1000 if len(n) > 2 else 0.0)

    def hold(self, pool: str, site: str, member: str, *, ttl: float, concurrency: int = 1,
             in_flight: bool = False, token: str | None = None):
        """Take the named slot if it is free (adopting a lease made while Redis was unreachable).

        Returns a ``Lease`` (with a fresh token), a
        ``LeaseWait`` with reason ``held`` when the slot is busy, or None when there is no such slot.
        ``in_flight``: the lease's request already runs, so the slot is taken even while it is cooling
        or quarantined (it becomes ready no sooner); busy then means another live lease or session
        holds it, and the slot is kept from everyone else for ``ttl`` at least (see hold.lua), or
        until ``lift(pool, site, member, token)`` says that lease ended (``token``: this call's).
        """
        return self._drive(self._hold(pool, site, member, ttl, concurrency, in_flight, token))

    def _hold(self, pool, site, member, ttl, concurrency, in_flight=False, token=None) -> Plan:
        token = token or self._token()
        request = _Script("hold", keyset.script_keys("hold", self.prefix(pool), site, token=token), (
            site, member, int(concurrency), _ms(ttl), token, self.host_id, self.site_idle_ms,
            "1" if in_flight else "0",
        ))
        reply = yield request
        if reply[0] == "MIGRATE":
            yield from self._migrate(pool, ttl)
            reply = yield request
        if reply[0] == "OK":
            return Lease(pool=pool, site=site, proxy_id=member.rpartition("/")[0], proxy_url=reply[3],
                         member=member, token=token, expires_at=int(reply[1]) / 1000,
                         issued_at=int(reply[2]) / 1000)
        if reply[0] == "BUSY":
            return LeaseWait(int(reply[1]) / 1000, "held")
        if reply[0] == "MIGRATE":
            return LeaseWait(0.001, "held")
        return None

    def lift(self, pool: str, site: str, member: str, token: str, *, gap: float = 0.0):
        """The lease whose in-flight ``hold`` (call ``token``) was refused has ended: its part of the
        slot's overlap floor ends now; a slot nobody holds is ready ``gap`` seconds from now (lift.lua).
        Returns the slot's ready time (Redis clock, s; 0: no such slot)."""
        return self._drive(self._lift(pool, site, member, token, gap))

    def _lift(self, pool, site, member, token, gap) -> Plan:
        reply = yield _Script("lift", keyset.script_keys("lift", self.prefix(pool), site), (
            site, member, token, _ms(gap)))
        return int(reply[1]) / 1000

    def end_session(self, pool: str, site: str, session_id: str, *, min_interval: float = 0.0):
        """End a sticky session now; its proxy goes back to the site when its last use's pacing
        (computed at that use's release) ends, or at that use's start + ``min_interval`` if it is
        still in flight."""
        return self._drive(self._end_session(pool, site, session_id, min_interval))

    def _end_session(self, pool, site, session_id, min_interval) -> Plan:
        names = keyset.script_keys("end_session", self.prefix(pool), site, session=session_id)
        reply = yield _Script("end_session", names, (site, session_id, _ms(min_interval)))
        return bool(int(reply[1]))


def _breaker_event(fields: list) -> BreakerEvent | None:
    """release.lua's breaker fields (event, bans, proxies, "reason:n,...", window ms, cool-off ms)."""
    if len(fields) < 6 or not fields[0]:
        return None
    kind, bans, proxies, reasons, window, cool = fields[:6]
    counted = {}
    for part in str(reasons or "").split(","):
        name, _, n = part.rpartition(":")
        if name and n.isdigit():
            counted[name] = int(n)
    return BreakerEvent(kind, int(bans), int(proxies), counted or None, int(window) / 1000, int(cool) / 1000)
