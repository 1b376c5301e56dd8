"""Hybrid mode: the shared Redis pool while Redis answers, a local consistent-hash shard when not.

While Redis answers, the host keeps a snapshot of each pool it uses (proxies and running quarantines)
and of the host list, refreshed every ``PROXY_SHARD_SNAPSHOT_INTERVAL`` (one extra round trip per
interval, never per request). When Redis stops answering, the host switches to an in-process engine
holding only *its* rendezvous-hash slice of that snapshot over that host list; pacing, bans and
sessions keep working locally. The host list is re-read every interval and a host takes a slice only
when no other host can hold one that overlaps it (``hostview.py`` states the rule and why it holds);
otherwise it takes none and its requests wait for Redis.

It probes Redis with exponential backoff. When Redis answers again it (1) reloads a pool that came
back empty (a restart without persistence) from the snapshot, (2) writes the quarantines it learned
into Redis, (3) *adopts* its local leases that are still in flight into Redis (``hold.lua``, even
onto a slot Redis says is resting; those issued while it reconciles too), and
then keeps leasing locally, adopting each new lease too, for ``PROXY_SHARD_FALLBACK_GRACE`` seconds
— long enough for every other host to notice Redis is back and adopt its own — before it uses Redis
alone again. Requests in flight are neither lost nor duplicated: each lease is released to the engine
that issued it.

What it does not cover: a *partial* partition (this host cannot reach Redis while others can) lets
other hosts lease proxies of this host's slice meanwhile; a configured ``PROXY_SHARD_HOSTS`` is
trusted to be the same on every host.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.proxies import Proxy, make_proxy
from scrapy_proxy_shard.engine.store import (
    AddResult,
    AsyncPoolStore,
    BanRecord,
    BanResult,
    Beat,
    Lease,
    LeaseWait,
    PoolBackend,
    ReleaseResult,
)
from scrapy_proxy_shard.engine.store_links import (
    LINK_EVIDENCE,
    LINK_KEEP,
    LINK_MAX_GROUP,
    LINK_PROXIES,
    LINK_SETTLE,
    LINK_SPAN,
    LINK_VETO,
)
from scrapy_proxy_shard.engine.tiers import TierOptions, TierState
from scrapy_proxy_shard.exceptions import (
    HostIdTaken,
    PoolBackendError,
    PoolBusy,
    PoolUnreachable,
    ProxyShardError,
    UnknownPoolError,
)
from scrapy_proxy_shard.modes.hostview import HOST_ID_TAKEN, HostView, SliceDecision, decide
from scrapy_proxy_shard.modes.pools import embedded_store, initial_proxies
from scrapy_proxy_shard.modes.sharding import slice_for
from scrapy_proxy_shard.settings import ShardSettings

logger = logging.getLogger(__name__)
STATS = "proxy_shard/fallback"
PROBE_MIN, PROBE_MAX = 0.5, 5.0
#: How long a request whose host holds no proxy of its pool in fallback waits before asking again.
EMPTY_SLICE_WAIT = 1.0
#: Pause before asking a silent (timed-out) Redis again, while PROXY_SHARD_FALLBACK_AFTER runs.
SILENT_RETRY = 0.2
WARMUP = "fallback_warmup"


async def replay_bans(store: PoolBackend, pool: str, records) -> int:
    """Write the quarantines of ``records`` that still run into ``store``: a pool Redis lost comes back
    with its bans, so an IP a site just banned is not offered to that site again. Returns how many."""
    replayed = 0
    for ban in records:
        left = ban.until - time.time()
        if left > 0 and ban.reason != WARMUP:
            await store.ban(pool, ban.proxy_id, site=None if ban.scope == "*" else ban.scope,
                            reason=ban.reason, ttl=left)
            replayed += 1
    return replayed


@dataclass
class _Snapshot:
    proxies: dict[str, list[Proxy]] = field(default_factory=dict)
    bans: dict[str, list[BanRecord]] = field(default_factory=dict)


class FallbackPoolStore(PoolBackend):
    """A ``PoolBackend`` that survives Redis outages (see the module docstring).

    Every method of the interface is written out: the ones with no local meaning (heartbeats, the
    pool list, restoring a lost pool) go to Redis and raise ``PoolUnreachable`` during an outage.
    """

    def __init__(self, primary: AsyncPoolStore, settings: ShardSettings, *, stats: Any = None,
                 clock=time.monotonic) -> None:
        self.primary = primary
        self.settings = settings
        self.stats = stats
        self.clock = clock
        self.local: AsyncPoolStore | None = None
        self.state = "redis"  # "redis" | "fallback" | "grace"
        self.snapshot = _Snapshot()
        self._local_leases: dict[str, Lease] = {}  # token -> lease issued by the local engine
        self._adopted: dict[str, Lease] = {}  # local token -> the Redis lease that adopted it
        self._overlapped: dict[str, str] = {}  # local token -> token of the hold Redis refused (an overlap)
        self._probe: asyncio.Task | None = None
        self._entered_at = 0.0
        self._grace_until = 0.0
        self._site_concurrency: dict[tuple[str, str], int] = {}
        self._entering: asyncio.Future | None = None
        self._snapshot_at: dict[str, float] = {}
        self._views: dict[str, HostView] = {}  # pool -> the live hosts this host read last (hostview.py)
        self._views_at: dict[str, float] = {}
        self._decisions: dict[str, SliceDecision] = {}  # pool -> the hosts it slices over in this fallback
        self._silent_since: float | None = None  # first timeout of the current silence of Redis
        self.host_id_taken = False  # a heartbeat was answered TAKEN: never a slice again (hostview.py)
        self._taken_logged = False

    # --- the PoolBackend interface -----------------------------------------------------------------
    @property
    def host_id(self) -> str:
        return self.primary.host_id

    @property
    def where(self) -> str:
        return self.primary.where

    @property
    def redis_client(self) -> Any:
        return self.primary.redis_client

    @property
    def fallback_state(self) -> str | None:
        return self.state

    def snapshot_proxies(self, pool: str) -> list[Proxy]:
        return list(self.snapshot.proxies.get(pool, ()))

    def snapshot_bans(self, pool: str) -> list[BanRecord]:
        return list(self.snapshot.bans.get(pool, ()))

    async def restore_pool(self, pool: str, proxies, *, warmup: float = 0.0) -> int:
        return await self.primary.restore_pool(pool, proxies, warmup=warmup)

    async def ban(self, pool: str, proxy: str, *, site: str | None = None, reason: str = "manual",
                  ttl: float | None = None) -> BanResult:
        """Written to Redis (a restore replays the snapshot's quarantines, only while Redis answers)."""
        return await self.primary.ban(pool, proxy, site=site, reason=reason, ttl=ttl)

    async def pools(self) -> list[str]:
        return await self.primary.pools()

    async def heartbeat(self, pool: str, *, ttl: float, info: dict[str, Any] | None = None, always: bool = True,
                        bucket: float = 60.0, keep: float = 3600.0, token: str = "") -> Beat | None:
        try:
            beat = await self.primary.heartbeat(pool, ttl=ttl, info=info, always=always, bucket=bucket,
                                                keep=keep, token=token)
        except HostIdTaken:
            # Another process took this host id over (this one's heartbeats lapsed): it computes the
            # same slice for the id, so this process must never take one, in this outage or a later.
            if not self.host_id_taken:
                self.host_id_taken = True
                self._decisions.clear()  # decided again, to no slice
                self._inc("host_id_taken")
            raise
        if beat is not None and self.state == "redis" and pool in self.snapshot.proxies:
            await self._quietly(self._refresh_hosts(pool))  # an idle host's list stays fresh too
        return beat

    async def leave(self, pool: str, token: str = "") -> bool:
        self._views.pop(pool, None)  # out of the others' lists from now on: no slice of this pool
        self._views_at[pool] = float("inf")
        return await self.primary.leave(pool, token)

    async def ping(self) -> bool:
        return await self.primary.ping()

    async def add_proxies(self, pool: str, proxies) -> AddResult:
        """Add to Redis; while Redis is unreachable, to the snapshot (and this host's local slice)."""
        items = [p if isinstance(p, Proxy) else make_proxy(p) for p in proxies]
        if self.state == "redis":
            try:
                return await self.primary.add_proxies(pool, items)
            except PoolUnreachable as exc:
                await self._enter_fallback(exc)
        known = {p.id: p for p in self.snapshot.proxies.get(pool, [])}
        known.update((p.id, p) for p in items)
        self.snapshot.proxies[pool] = list(known.values())
        mine = {p.id for p in self._my_slice(pool)}
        return await self._ensure_local().add_proxies(pool, [p for p in items if p.id in mine])

    async def pool_size(self, pool: str) -> int:
        if self.state == "redis":
            try:
                size = await self.primary.pool_size(pool)
                if size and not self.snapshot.proxies.get(pool):
                    # The first sight of the pool (the runtime asks at open) takes its snapshot: a host
                    # whose first lease comes after Redis lost the pool still has a copy to restore
                    # and a slice to fall back on.
                    self._snapshot_at.pop(pool, None)
                    await self._refresh_snapshot(pool)
                return size
            except PoolUnreachable as exc:
                await self._enter_fallback(exc)
        return len(self._my_slice(pool))

    async def start_offline(self, reason: BaseException) -> None:
        """Begin in fallback (Redis down at start, ``PROXY_SHARD_REDIS_DOWN_AT_START = 'fallback'``):
        the snapshot is ``PROXY_SHARD_PROXIES`` over ``PROXY_SHARD_HOSTS`` (without it, no slice: the
        host never read a host list, so its requests wait for Redis)."""
        self.snapshot = _Snapshot(proxies=initial_proxies(self.settings))
        await self._enter_fallback(reason)

    async def lease(self, pool: str, site: str, *, ttl: float, concurrency: int = 1,
                    session_id: str | None = None, session_ttl: float = 600.0,
                    spacing: float = 0.0, spread: float = 0.0) -> Lease | LeaseWait:
        self._site_concurrency[(pool, site)] = concurrency
        if self.state == "redis":
            try:
                await self._refresh_snapshot(pool)
                result = await self.primary.lease(pool, site, ttl=ttl, concurrency=concurrency,
                                                  session_id=session_id, session_ttl=session_ttl, spacing=spacing,
                                                  spread=spread)
                self._silent_since = None
                return result
            except PoolUnreachable as exc:
                if not self._gives_up_on_redis(exc):
                    return LeaseWait(SILENT_RETRY, "held")  # wait and ask Redis again
                await self._enter_fallback(exc)
        if self.state == "grace" and self.clock() >= self._grace_until:
            self._leave_fallback()
            return await self.lease(pool, site, ttl=ttl, concurrency=concurrency, session_id=session_id,
                                    session_ttl=session_ttl, spacing=spacing, spread=spread)
        return await self._local_lease(pool, site, ttl, concurrency, session_id, session_ttl, spacing)

    async def wait_for_release(self, pool: str, site: str, timeout: float) -> bool:
        if self.state == "redis":
            try:
                return await self.primary.wait_for_release(pool, site, timeout)
            except PoolUnreachable as exc:
                if not self._gives_up_on_redis(exc):
                    return True  # ask Redis again (the lease call waits out its own timeout)
                await self._enter_fallback(exc)
                return True  # retry at once, locally
        return await self._ensure_local().wait_for_release(pool, site, timeout)

    async def release(self, lease: Lease, *, outcome: str = "ok", latency: float | None = None,
                      min_interval: float = 0.0, reason: str | None = None,
                      session_ttl: float = 600.0, ban_ttl: float | None = None,
                      rest_after_response: float = 0.0, randomize_interval: bool = False,
                      autothrottle: AutothrottleOptions | None = None, rate_ban: bool = False,
                      retry_after: float | None = None,
                      arrival_guard: tuple[float, float | None] | None = None,
                      rest_min: float | None = None, margin_prior: float = 0.0) -> ReleaseResult:
        how = {"outcome": outcome, "latency": latency, "min_interval": min_interval, "reason": reason,
               "session_ttl": session_ttl, "ban_ttl": ban_ttl, "rest_after_response": rest_after_response,
               "randomize_interval": randomize_interval, "autothrottle": autothrottle, "rate_ban": rate_ban,
               "retry_after": retry_after, "arrival_guard": arrival_guard, "rest_min": rest_min,
               "margin_prior": margin_prior}
        local = self._local_leases.pop(lease.token, None)
        if local is not None:
            result = await self._ensure_local().release(lease, **how)
            adopted = self._adopted.pop(lease.token, None)
            if adopted is not None:
                await self._quietly(self.primary.release(adopted, **how))
            refused = self._overlapped.pop(lease.token, None)
            if refused is not None:  # its overlap floor in Redis ends with the request, not its lease TTL
                await self._quietly(self.primary.lift(lease.pool, lease.site, lease.member, refused,
                                                      gap=max(min_interval, rest_after_response)))
            return result
        try:
            result = await self.primary.release(lease, **how)
            self._silent_since = None
            if result.ban_until:  # known at once to this host's fallback, not a snapshot later
                self.snapshot.bans.setdefault(lease.pool, []).append(BanRecord(
                    lease.proxy_id, "*" if outcome == "dead" else lease.site, result.ban_until,
                    result.strikes, reason or "ban", result.now))
            return result
        except PoolUnreachable as exc:
            if not self._gives_up_on_redis(exc):
                # Redis is silent, maybe stalled: the release may still run; if not, the lease runs
                # out by itself. A ban verdict is lost unless Redis gets the release.
                return ReleaseResult("lost", time.time())
            await self._enter_fallback(exc)
            # The Redis lease runs out by itself; a ban verdict is kept locally and replayed later.
            if outcome in ("ban", "dead") and self.local is not None:
                scope = None if outcome == "dead" else lease.site
                await self._quietly(self.local.ban(lease.pool, lease.proxy_id, site=scope, reason=reason or outcome,
                                                   ttl=retry_after if outcome == "ban" else None))
            return ReleaseResult("lost", time.time())

    async def content_check(self, pool: str, site: str, verdict: str, *, proxy_id: str = "", check: str = "",
                            suspects: int = 3) -> Any:
        """The engine in use records it (Redis, or the local slice's engine while Redis is away: a check
        found suspect there opens the local breaker only, a pass is told to Redis at the next one)."""
        store = self.primary if self.state == "redis" else self._ensure_local()
        try:
            return await store.content_check(pool, site, verdict, proxy_id=proxy_id, check=check, suspects=suspects)
        except PoolUnreachable:
            return None

    async def gateway_rotate(self, pool: str, proxy_id: str, site: str, sent_url: str, *, rotations: int,
                             window: float) -> Any:
        """Redis rotates for every host; while it is away, the local slice's engine does (its slots are
        this host's alone until Redis returns: the rotated token is then forgotten, the old one kept)."""
        store = self.primary if self.state == "redis" else self._ensure_local()
        return await store.gateway_rotate(pool, proxy_id, site, sent_url, rotations=rotations, window=window)

    async def gateway_exit(self, pool: str, proxy_id: str, sent_url: str, ip: str, *, ttl: float) -> Any:
        store = self.primary if self.state == "redis" else self._ensure_local()
        return await store.gateway_exit(pool, proxy_id, sent_url, ip, ttl=ttl)

    async def site_link(self, pool: str, site: str, proxy_id: str, *, quarantine: float, known: str = "",
                        evidence: float = LINK_EVIDENCE, max_group: int = LINK_MAX_GROUP,
                        keep: float = LINK_KEEP, proxies: int = LINK_PROXIES, start: float = 0.0,
                        rested_from: str = "", veto: float = LINK_VETO, span: float = LINK_SPAN,
                        overlapped: str = "", settle: float = LINK_SETTLE) -> Any:
        """Redis learns for every host; while it is away nothing is learned (the groups known stay)."""
        if self.state != "redis":
            return None
        try:
            return await self.primary.site_link(pool, site, proxy_id, quarantine=quarantine, known=known,
                                                evidence=evidence, max_group=max_group, keep=keep,
                                                proxies=proxies, start=start, rested_from=rested_from,
                                                veto=veto, span=span, overlapped=overlapped,
                                                settle=settle)
        except PoolUnreachable:
            return None

    async def in_flight(self, pool: str, proxy_id: str, sites: list[str], since: float) -> list[str]:
        """Redis knows every host's requests; while it is away none is known (site groups are not learned)."""
        if self.state != "redis":
            return []
        try:
            return await self.primary.in_flight(pool, proxy_id, sites, since)
        except PoolUnreachable:
            return []

    async def breaker(self, pool: str, site: str) -> Any:
        store = self.primary if self.state == "redis" else self._ensure_local()
        try:
            return await store.breaker(pool, site)
        except PoolUnreachable:
            return None

    async def end_session(self, pool: str, site: str, session_id: str, *, min_interval: float = 0.0) -> bool:
        store = self.primary if self.state == "redis" else self._ensure_local()
        try:
            return await store.end_session(pool, site, session_id, min_interval=min_interval)
        except PoolUnreachable:
            return False

    async def tier_step(self, tiers: Sequence[str], site: str, *, counts: Sequence[int] = (), breaker_tier: int = -1,
                        probe_answer: str = "", probe_tier: int = -1, claim: bool = False,
                        options: TierOptions | None = None, probe_ttl: float = 60.0,
                        idle: float = 3600.0) -> TierState:
        """Redis only: a site's tier is the cluster's word. During an outage this raises at once
        (``PoolUnreachable``, no round trip to a silent Redis): the crawl keeps the last tier it knew
        for the site (crawl/tiers.py)."""
        if self.state != "redis":
            raise PoolUnreachable(f"tier of {site!r} not asked: {self.primary.where} is away (local fallback)")
        return await self.primary.tier_step(tiers, site, counts=counts, breaker_tier=breaker_tier,
                                            probe_answer=probe_answer, probe_tier=probe_tier, claim=claim,
                                            options=options, probe_ttl=probe_ttl, idle=idle)

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        if self.state == "fallback":  # a last chance to hand what we learned to the other hosts
            try:
                await self.primary.ping()
                await self._reconcile()
            except ProxyShardError:
                logger.warning("proxy_shard: closing in fallback; quarantines learned locally were not written")
        await self.primary.aclose()
        if self.local is not None:
            await self.local.aclose()

    # --- snapshot --------------------------------------------------------------------------------
    async def _refresh_snapshot(self, pool: str) -> None:
        """Every ``PROXY_SHARD_SNAPSHOT_INTERVAL``: the running quarantines (one HGETALL of a bounded
        hash) and the pool size (HLEN); the proxy list itself only when the size changed."""
        now = self.clock()
        if now - self._snapshot_at.get(pool, -1e18) < self.settings.snapshot_interval:
            return
        self._snapshot_at[pool] = now
        size = await self.primary.pool_size(pool)
        if size == 0 and self.snapshot.proxies.get(pool):
            return  # keep the copy: Redis may have lost the pool (the runtime restores it from this)
        if pool not in self.snapshot.proxies or len(self.snapshot.proxies[pool]) != size:
            self.snapshot.proxies[pool] = [r.proxy for r in await self.primary.list_proxies(pool)]
        self.snapshot.bans[pool] = await self.primary.bans(pool)
        await self._refresh_hosts(pool)

    async def _refresh_hosts(self, pool: str) -> None:
        """Every ``PROXY_SHARD_SNAPSHOT_INTERVAL`` (at a lease or a heartbeat): the pool's live hosts,
        this read stamped in Redis as this host's last (``host_list.lua``, one round trip). Not with a
        configured ``PROXY_SHARD_HOSTS``: that list is the one every host slices over."""
        now = self.clock()
        if self.settings.hosts or now - self._views_at.get(pool, -1e18) < self.settings.snapshot_interval:
            return
        self._views_at[pool] = now
        redis_now, rows = await self.primary.host_list(pool)
        window = max(self.settings.host_ttl, 3 * self.settings.snapshot_interval)
        self._views.setdefault(pool, HostView()).update(redis_now, rows, self.clock(), window)

    def _decision(self, pool: str) -> SliceDecision:
        """The hosts this host slices ``pool`` over in this fallback, decided once when it starts."""
        if pool not in self._decisions:
            if self.settings.hosts and not self.host_id_taken:
                decision = SliceDecision(tuple(sorted(self.settings.hosts)))
            else:
                decision = decide(self._views.get(pool), self.host_id, self.clock(), taken=self.host_id_taken)
            self._decisions[pool] = decision
            if decision.hosts is None:
                self._inc("no_slice")
            if decision.reason == HOST_ID_TAKEN:
                if not self._taken_logged:  # once per process, not per pool and outage
                    self._taken_logged = True
                    logger.error("proxy_shard: this host takes no slice of any pool while Redis is unreachable "
                                 "(%(why)s: another process heartbeats as %(id)r); its requests wait for Redis",
                                 {"why": decision.reason, "id": self.host_id})
            elif decision.hosts is None:
                logger.warning("proxy_shard: pool %(pool)r: this host takes no slice while Redis is unreachable "
                               "(%(why)s); its requests wait for Redis", {"pool": pool, "why": decision.reason})
        return self._decisions[pool]

    def _my_slice(self, pool: str) -> list[Proxy]:
        """This host's rendezvous slice (never modulo: only rendezvous keeps slices apart when hosts'
        lists differ; see hostview.py), or nothing when it may not take one."""
        proxies = {p.id: p for p in self.snapshot.proxies.get(pool, [])}
        hosts = self._decision(pool).hosts
        if not proxies or hosts is None:
            return []
        mine = set(slice_for(proxies, hosts, self.host_id, "consistent"))
        return [p for pid, p in proxies.items() if pid in mine]

    # --- switching -------------------------------------------------------------------------------
    def _gives_up_on_redis(self, exc: PoolUnreachable) -> bool:
        """Whether this failure switches the host to its local slice.

        A refused or lost connection: yes, Redis is down for every host. A timeout: only once Redis
        has stayed silent ``PROXY_SHARD_FALLBACK_AFTER`` seconds. A stall (a slow script, a fork, DEBUG
        SLEEP) times out only the calls that were in flight; hosts that sent nothing meanwhile keep
        leasing from Redis afterwards, so a host that fell back at once would use its slice locally
        while they lease the same proxies from Redis (the fault-injection test saw that overlap).
        A Redis answering BUSY or LOADING (``PoolBusy``, after the store's own retries) is such a
        stall: FALLBACK_AFTER then counts from its first BUSY/LOADING answer.
        """
        if self.state != "redis" or not exc.timed_out:
            return True
        now = self.clock()
        if self._silent_since is None:
            self._silent_since = now - (exc.waited if isinstance(exc, PoolBusy) else 0.0)
            logger.warning("proxy_shard: Redis does not answer (%(e)s); waiting up to %(s)gs before "
                           "falling back (PROXY_SHARD_FALLBACK_AFTER)", {"e": exc, "s": self.settings.fallback_after})
        if now - self._silent_since < self.settings.fallback_after:
            self._inc("silent_waits")
            return False
        return True

    async def _enter_fallback(self, exc: BaseException) -> None:
        """Switch to the local slice once; concurrent callers wait until it is ready, so no
        request leases locally before the warm-up quarantines are in place."""
        if self.state != "redis":
            return
        if self._entering is None:
            self._entering = asyncio.ensure_future(self._prepare_fallback(exc))
        await asyncio.shield(self._entering)

    async def _prepare_fallback(self, exc: BaseException) -> None:
        self._entered_at = self.clock()
        self._decisions.clear()
        local = self._ensure_local()
        loaded = 0
        warmup = self.settings.fallback_warmup
        for pool in self.snapshot.proxies:
            mine = self._my_slice(pool)
            if mine:
                await local.add_proxies(pool, mine)
                loaded += len(mine)
            # A request another host sent through one of these proxies just before Redis vanished
            # may still be running, or have just ended: let it finish and rest before the first use.
            for proxy in mine if warmup > 0 else ():
                await local.ban(pool, proxy.id, site=None, reason=WARMUP, ttl=warmup)
            for ban in self.snapshot.bans.get(pool, []):
                left = ban.until - time.time()
                if left > 0 and any(p.id == ban.proxy_id for p in mine):
                    await local.ban(pool, ban.proxy_id, site=None if ban.scope == "*" else ban.scope,
                                    reason=ban.reason, ttl=left)
        self.state = "fallback"
        self._inc("entered")
        logger.warning(
            "proxy_shard: Redis unreachable (%(error)s): using this host's slice of the last snapshot "
            "(%(n)d proxies over %(hosts)s hosts) until it answers again",
            {"error": exc, "n": loaded, "hosts": "/".join(
                str(len(d.hosts)) if d.hosts else "no" for d in self._decisions.values()) or "no"},
        )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_redis())

    def _ensure_local(self) -> AsyncPoolStore:
        if self.local is None:
            self.local = embedded_store(self.settings, "fallback")  # shared by the process's crawlers
        return self.local

    def _probe_limit(self) -> float:
        """Longest pause between probes. The host that sees Redis back first uses it alone once its
        grace is over; by then every other host must have seen it too and adopted its local leases,
        or Redis hands their slots out again. So probe at least twice per grace period."""
        grace = self.settings.fallback_grace
        return max(0.05, min(PROBE_MAX, grace / 2)) if grace > 0 else PROBE_MAX

    async def _probe_redis(self) -> None:
        limit = self._probe_limit()
        delay = min(PROBE_MIN, limit)
        while self.state == "fallback":
            await asyncio.sleep(delay)
            try:
                await self.primary.ping()
            except PoolBackendError:
                delay = min(delay * 2, limit)
                continue
            try:
                await self._reconcile()
            except ProxyShardError as exc:
                logger.warning("proxy_shard: Redis answered but reconciling failed (%(e)s); retrying", {"e": exc})
                delay = min(PROBE_MIN, limit)
                continue
            # No await between _reconcile's last look at the local leases and this switch: a lease
            # issued from here on is adopted by _local_lease (state "grace") before a request gets it.
            self.state = "grace"
            self._grace_until = self.clock() + self.settings.fallback_grace
            logger.warning("proxy_shard: Redis answers again after %(s).1fs; back to the shared pool in %(g)gs",
                           {"s": self.clock() - self._entered_at, "g": self.settings.fallback_grace})
            if self.settings.fallback_grace == 0:
                self._leave_fallback()

    async def _reconcile(self) -> None:
        """Restore an emptied pool, write learned quarantines, adopt local leases in flight.

        Requests keep getting local leases while this awaits Redis (the state is still "fallback"), so
        the leases in flight are looked at again until none is left that was not tried; it returns
        right after that last look, and the caller switches to "grace" before anything else runs."""
        local = self._ensure_local()
        for pool, proxies in self.snapshot.proxies.items():
            if proxies and await self.primary.pool_size(pool) == 0:
                await self.primary.add_proxies(pool, proxies)
                self._inc("pools_restored")
                replayed = await replay_bans(self.primary, pool, self.snapshot.bans.get(pool, ()))
                logger.warning("proxy_shard: pool %(pool)r came back empty; reloaded %(n)d proxies and %(b)d "
                               "running quarantines from the snapshot",
                               {"pool": pool, "n": len(proxies), "b": replayed})
            self._inc("bans_replayed", await replay_bans(self.primary, pool, await local.bans(pool)))
        tried: set[str] = set()
        while True:
            pending = [(t, lease) for t, lease in self._local_leases.items() if t not in tried]
            if not pending:
                return
            for token, lease in pending:
                tried.add(token)
                await self._adopt(token, lease, in_flight=True)

    async def _adopt(self, token: str, lease: Lease, *, in_flight: bool = False) -> None:
        """Hold ``lease``'s slot in Redis. ``in_flight``: its request already runs, so the slot is
        taken even while Redis says it is cooling or quarantined; only another live holder refuses it
        (an overlap that happened during the outage: counted ``leases_overlapped``; hold.lua keeps the
        slot from everyone else for the lease's TTL, however early that holder gives it back)."""
        if token in self._adopted or token not in self._local_leases:  # adopted, or already released
            return
        concurrency = self._site_concurrency.get((lease.pool, lease.site), 1)
        ttl = max(1.0, lease.expires_at - time.time())
        hold_token = f"{token}.hold"
        held = await self.primary.hold(lease.pool, lease.site, lease.member, ttl=ttl, concurrency=concurrency,
                                       in_flight=in_flight, token=hold_token)
        if not isinstance(held, Lease):
            self._inc("leases_overlapped" if in_flight and held is not None else "leases_not_adopted")
            if in_flight and held is not None and token in self._local_leases:
                self._overlapped[token] = hold_token
        elif token not in self._local_leases:
            # The request ended while hold() ran: release() found nothing adopted to give back, and
            # nobody else would ever release this Redis lease (its slot stayed held for the TTL).
            await self._quietly(self.primary.release(held))
        else:
            self._adopted[token] = held
            self._inc("leases_adopted")

    def _leave_fallback(self) -> None:
        seconds = self.clock() - self._entered_at
        self.state = "redis"
        self._entering = None
        self._snapshot_at.clear()  # refresh at the next lease
        self._views_at.clear()
        self._inc("exited")
        if self.stats is not None:
            self.stats.inc_value(f"{STATS}/seconds", seconds)
        logger.warning("proxy_shard: back on the shared Redis pool after %(s).1fs in fallback", {"s": seconds})

    # --- local leasing -----------------------------------------------------------------------------
    async def _local_lease(self, pool, site, ttl, concurrency, session_id, session_ttl, spacing=0.0):
        local = self._ensure_local()
        while True:
            try:
                result = await local.lease(pool, site, ttl=ttl, concurrency=concurrency, session_id=session_id,
                                           session_ttl=session_ttl, spacing=spacing)
            except UnknownPoolError:
                if not self.snapshot.proxies.get(pool):
                    raise
                # The pool has proxies, but this host's share of them is empty (few proxies, many
                # hosts): wait for Redis like a request waits for a busy pool, never fail the request.
                self._inc("empty_slice_waits")
                return LeaseWait(EMPTY_SLICE_WAIT, "pool")
            if not isinstance(result, Lease):
                # The local engine knows this host's slice only; Redis, with the whole pool and every
                # host's releases, may answer at the next probe. So a local wait is never firm (no
                # request is given up as exhausted on a slice's view, crawl/liveness.py) and lasts at
                # most until that probe, when the request asks again.
                return replace(result, firm=False, wait=min(result.wait, self._probe_limit()))
            self._local_leases[result.token] = result
            self._inc("leases")
            if self.state == "fallback":
                return result
            # Redis answers again (the grace, or already past it: another call may have switched the
            # host back to Redis while this one awaited the local engine): Redis must know the slot
            # before a request gets it, or it hands the slot out again.
            try:
                await self._adopt(result.token, result)
            except PoolBackendError:
                return result  # Redis went away again; the probe will notice
            if result.token in self._adopted:
                return result
            # Redis says another host holds that slot: give it back locally and try another.
            self._local_leases.pop(result.token, None)
            await local.release(result, outcome="unknown")
            self._inc("leases_returned")  # counted in /leases, never handed to a request
            return LeaseWait(0.05, "held")

    async def _quietly(self, coro) -> None:
        try:
            await coro
        except ProxyShardError as exc:
            logger.debug("proxy_shard: ignored while Redis is unreachable: %(e)s", {"e": exc})

    def _inc(self, name: str, count: int = 1) -> None:
        if self.stats is not None and count:
            self.stats.inc_value(f"{STATS}/{name}", count)

