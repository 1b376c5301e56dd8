"""Tiered pools, the crawl side: which tier (pool) a request leases from, and what its answer tells Redis.

``PROXY_SHARD_TIERS`` (or a spider's ``proxy_tiers``) orders pools cheap -> expensive. Each site's tier
is the cluster's (``engine/tiers.py``, ``lua/tier.lua``): the first host to learn that a site blocks
the cheap tier moves the site up for every host. This module keeps what one process needs:

- **A short-lived copy of each site's tier.** A request reads it from memory; the host asks Redis
  again at most every ``REFRESH`` seconds per site (a step that also hands Redis the answers counted
  since: leases, fine answers, bans per tier), at once after a ban, a probe's answer, or a breaker
  opening, and when the lower tier's probe is due. So the hot path costs no round trip, and a change
  another host made is seen within ``REFRESH``.
- **The probe.** When Redis grants this host the probe of the lower tier, the request asks that tier's
  pool once, without waiting (``ShardRuntime.try_acquire``): leased, it goes through the cheap tier and
  its answer decides (fine: the site comes down on every host; banned: the next probe waits twice as
  long); no free proxy there (quarantined on the site), it goes through its own tier and the probe is
  reported skipped.
- **An outage.** When the step fails (Redis away, the host on its local fallback) the site keeps the
  last tier this host knew (the cheapest for a site it never asked about), Redis is left alone for
  ``OFFLINE_PAUSE`` seconds, and the answers counted meanwhile move a site up locally by the same rule;
  they are handed to Redis when it answers again. A request is never sent without a proxy: a tier is
  only ever a pool to lease from.

Precedence: ``meta['proxy_pool']`` → the spider's ``proxy_tiers`` → its ``proxy_pool`` →
``PROXY_SHARD_SITE_POOLS`` (for its sites) → ``PROXY_SHARD_TIERS`` → ``PROXY_SHARD_POOL``. A sticky
session (``meta['session_id']``) stays on the tier it started on, in this process, until it meets a ban.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scrapy import Request

from scrapy_proxy_shard.engine.sites import site_of_request
from scrapy_proxy_shard.engine.store import Lease
from scrapy_proxy_shard.engine.tiers import TierState
from scrapy_proxy_shard.exceptions import ProxyShardError
from scrapy_proxy_shard.modes.pools import platform_of, platform_pool
from scrapy_proxy_shard.settings import check_tiers

logger = logging.getLogger(__name__)
STATS = "proxy_shard"
#: A host asks Redis for a site's tier (and reports its counts) at most this often (seconds).
REFRESH = 1.0
#: After a failed step, the last known tiers serve this long before Redis is asked again (seconds).
OFFLINE_PAUSE = 5.0
#: Sites (per tier list) and sticky sessions remembered; beyond, the oldest are forgotten.
MAX_SITES = 10_000
MAX_SESSIONS = 10_000


@dataclass
class _Site:
    """This process's copy of one site's tier on one tier list."""

    tier: int = 0
    fetched: float = float("-inf")  # clock of the last step that answered
    probe_due: float | None = None  # clock at which the lower tier's probe is due (None: cheapest tier)
    counts: list[int] = field(default_factory=list)  # leases, ok, bans per tier, since the last step
    local_answers: int = 0  # on ``tier``, counted while Redis was away
    local_bans: int = 0
    step: asyncio.Future | None = None  # a step in flight

    def add(self, tier: int, what: int, n: int = 1) -> None:
        self.counts[3 * tier + what] += n

    def take(self) -> list[int]:
        out, self.counts = self.counts, [0] * len(self.counts)
        return out

    def give_back(self, counts: list[int]) -> None:
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]


@dataclass(frozen=True)
class _Choice:
    tiers: tuple[str, ...]
    site: str
    tier: int
    probe: bool
    session: str | None


LEASES, OKS, BANS = 0, 1, 2


class TierMoved(Exception):
    """A request waiting for a proxy of one tier stopped waiting: its site moved to another tier
    (``ShardRuntime.acquire``'s ``moved``). Internal: the router leases again on the new tier."""


class TierRouter:
    """One per crawler (``ShardRuntime.tiers``): chooses a tiered request's pool and reports its answer."""

    def __init__(self, runtime: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.stats = runtime.stats
        self.clock = clock
        self._sites: dict[tuple[tuple[str, ...], str], _Site] = {}
        self._chosen: weakref.WeakKeyDictionary[Request, _Choice] = weakref.WeakKeyDictionary()
        self._sessions: dict[tuple[str, str], int] = {}
        self._offline_until = float("-inf")
        self._offline_logged = False
        self._spider_tiers: dict[int, tuple[str, ...] | None] = {}

    # --- which tiers apply ------------------------------------------------------------------------
    def spider_tiers(self, spider: Any) -> tuple[str, ...] | None:
        """The spider's ``proxy_tiers`` attribute, validated once (SettingError names the spider)."""
        key = id(spider)
        if key not in self._spider_tiers:
            raw = getattr(spider, "proxy_tiers", None)
            label = f"spider {getattr(spider, 'name', '?')!r} attribute proxy_tiers"
            self._spider_tiers[key] = None if raw is None else check_tiers(raw, label)
        return self._spider_tiers[key]

    def tiers_for(self, request: Request, spider: Any) -> tuple[str, ...] | None:
        """The tier list ``request`` leases by, or None when a pool is named for it (see the module docstring)."""
        if request.meta.get("proxy_pool"):
            return None
        own = self.spider_tiers(spider)
        if own is not None:
            return own
        if getattr(spider, "proxy_pool", None) or self.settings.tiers is None:
            return None
        if self.settings.site_pools and site_of_request(request) in self.settings.site_pools:
            return None
        return self.settings.tiers

    def known_pools(self, spider: Any) -> list[str]:
        """The pools of the tier list a request of ``spider`` may lease from (checked at start)."""
        own = self.spider_tiers(spider)
        if own is not None:
            return list(own)
        if getattr(spider, "proxy_pool", None) or self.settings.tiers is None:
            return []
        return list(self.settings.tiers)

    def source_of(self, pool: str, spider: Any) -> str | None:
        """Which setting named ``pool`` as a tier (for the start-up error), or None."""
        if pool in (self.spider_tiers(spider) or ()):
            return f"spider {getattr(spider, 'name', '?')!r} attribute proxy_tiers"
        if pool in (self.settings.tiers or ()):
            return "PROXY_SHARD_TIERS"
        return None

    def _pool(self, tiers: tuple[str, ...], tier: int, request: Request) -> str:
        pool = tiers[tier]
        platforms = self.settings.platforms
        platform = platform_of(site_of_request(request), platforms) if platforms else None
        return platform_pool(pool, platform) if platform else pool

    # --- leasing ---------------------------------------------------------------------------------
    async def acquire(self, request: Request, spider: Any, pool: str, site: str, session: str | None) -> Lease:
        """Lease for ``request``: from ``pool`` when no tiers apply, else from its site's tier (or the
        tier below, when this request is the probe)."""
        tiers = self.tiers_for(request, spider)
        if tiers is None:
            return await self.runtime.acquire(request, pool, site, session)
        entry = self._entry(tiers, site)
        state = await self._current(tiers, site, entry, claim=session is None)
        tier = state.tier
        if session is not None:
            tier = self._session_tier(site, session, tier)
        elif state.probe and tier > 0:
            lease = await self.runtime.try_acquire(request, self._pool(tiers, tier - 1, request), site)
            if lease is not None:
                self._chose(request, tiers, site, tier - 1, True, None, entry)
                self.stats.inc_value(f"{STATS}/tiers/probes")
                return lease
            self.stats.inc_value(f"{STATS}/tiers/probes/skipped")
            await self._step(tiers, site, entry, probe_answer="skip", probe_tier=tier - 1)
        while True:
            async def moved(tier: int = tier) -> bool:  # asked between two waits (a quarantine, pacing)
                return session is None and (await self._current(tiers, site, entry, claim=False)).tier != tier

            try:
                lease = await self.runtime.acquire(request, self._pool(tiers, tier, request), site, session,
                                                   moved=moved)
            except TierMoved:
                self.stats.inc_value(f"{STATS}/tiers/moved_waits")
                tier = entry.tier
                continue
            self._chose(request, tiers, site, tier, False, session, entry)
            return lease

    def _chose(self, request: Request, tiers: tuple[str, ...], site: str, tier: int, probe: bool,
               session: str | None, entry: _Site) -> None:
        self._chosen[request] = _Choice(tiers, site, tier, probe, session)
        entry.add(tier, LEASES)
        self.stats.inc_value(f"{STATS}/tiers/{tiers[tier]}/requests")

    def _session_tier(self, site: str, session: str, tier: int) -> int:
        key = (site, session)
        kept = self._sessions.get(key)
        if kept is not None:
            return kept
        if len(self._sessions) >= MAX_SESSIONS:
            self._sessions.pop(next(iter(self._sessions)))
        self._sessions[key] = tier
        return tier

    def _entry(self, tiers: tuple[str, ...], site: str) -> _Site:
        key = (tiers, site)
        entry = self._sites.get(key)
        if entry is None:
            if len(self._sites) >= MAX_SITES:
                for old in list(self._sites)[: MAX_SITES // 10]:
                    if self._sites[old].step is None:
                        self._sites.pop(old)
            entry = self._sites[key] = _Site(counts=[0] * (3 * len(tiers)))
        return entry

    async def _current(self, tiers: tuple[str, ...], site: str, entry: _Site, *, claim: bool) -> TierState:
        """The site's tier: the copy in memory while fresh, else one step (one at a time per site)."""
        now = self.clock()
        fresh = now - entry.fetched < REFRESH
        probe_due = claim and entry.probe_due is not None and now >= entry.probe_due
        if (fresh and not probe_due) or now < self._offline_until:
            return TierState(entry.tier)
        if entry.step is not None:
            if entry.fetched == float("-inf"):  # never asked yet: wait for the first answer
                await asyncio.shield(entry.step)
            return TierState(entry.tier)
        return await self._step(tiers, site, entry, claim=claim)

    async def _step(self, tiers: tuple[str, ...], site: str, entry: _Site, *, claim: bool = False,
                    breaker_tier: int = -1, probe_answer: str = "", probe_tier: int = -1) -> TierState:
        """One tier.lua step for the site (see ``engine/tiers.py``); during an outage, the last tier known."""
        if self.clock() < self._offline_until and not probe_answer:
            return self._offline(tiers, site, entry)
        counts = entry.take()
        loop = asyncio.get_running_loop()
        mine = loop.create_future()
        entry.step = mine
        try:
            state = await self.runtime.store.tier_step(
                tiers, site, counts=counts, breaker_tier=breaker_tier, probe_answer=probe_answer,
                probe_tier=probe_tier, claim=claim, options=self.settings.tier_options,
                probe_ttl=self.settings.lease_ttl, idle=self.settings.site_idle_ttl)
        except ProxyShardError as exc:
            entry.give_back(counts)
            self._went_offline(exc)
            return self._offline(tiers, site, entry)
        finally:
            entry.step = None
            mine.set_result(None)
        if self._offline_logged:
            self._offline_logged = False
            logger.info("proxy_shard: tiers: Redis answers again; each site's tier is the cluster's again")
        now = self.clock()
        before = entry.tier
        entry.tier, entry.fetched, entry.local_answers, entry.local_bans = state.tier, now, 0, 0
        if state.next_probe is None:
            entry.probe_due = None
        else:  # a probe due but not ours (another host holds it): ask again no sooner than REFRESH
            entry.probe_due = now + (state.next_probe if state.next_probe > 0 or state.probe else REFRESH)
        self._note(tiers, site, state, before)
        return state

    def _note(self, tiers: tuple[str, ...], site: str, state: TierState, before: int) -> None:
        """Count and log what this host's step changed (the host whose step changed it logs it)."""
        where = {"site": site, "pool": tiers[state.tier], "ans": state.answers, "bans": state.bans,
                 "wait": state.backoff}
        if state.event == "up":
            self.stats.inc_value(f"{STATS}/tiers/up")
            logger.warning("proxy_shard: tiers: %(site)s blocks pool %(low)r: every host now leases for it from "
                           "pool %(pool)r (tier %(tier)d of %(n)d); the cheaper tier is probed in %(wait)gs",
                           {**where, "low": tiers[state.tier - 1], "tier": state.tier + 1, "n": len(tiers)})
        elif state.event == "down":
            self.stats.inc_value(f"{STATS}/tiers/down")
            logger.warning("proxy_shard: tiers: a probe of %(site)s through pool %(pool)r was answered fine: every "
                           "host leases for it from %(pool)r again", where)
        elif state.event == "probe_banned":
            self.stats.inc_value(f"{STATS}/tiers/probes/banned")
            logger.info("proxy_shard: tiers: the probe of %(site)s through the cheaper tier was banned; next "
                        "probe in %(wait)gs", where)
        elif state.tier != before:
            logger.debug("proxy_shard: tiers: %(site)s is on pool %(pool)r (another host's step)", where)

    def _went_offline(self, exc: BaseException) -> None:
        self._offline_until = self.clock() + OFFLINE_PAUSE
        self.stats.inc_value(f"{STATS}/tiers/offline")
        if not self._offline_logged:
            self._offline_logged = True
            logger.warning("proxy_shard: tiers: the sites' tiers cannot be read from Redis (%(e)s): each site "
                           "keeps the last tier this host knew, and moves up on this host's own answers, until "
                           "Redis answers", {"e": exc})

    def _offline(self, tiers: tuple[str, ...], site: str, entry: _Site) -> TierState:
        """The last tier known; moved up here when this host's own answers since cross the threshold."""
        o = self.settings.tier_options
        if (entry.tier < len(tiers) - 1 and entry.local_answers >= o.min_answers
                and entry.local_bans >= o.ban_ratio * entry.local_answers):
            entry.tier += 1
            entry.local_answers = entry.local_bans = 0
            self.stats.inc_value(f"{STATS}/tiers/local_up")
            logger.warning("proxy_shard: tiers: %(site)s blocks pool %(low)r: this host leases for it from pool "
                           "%(pool)r (decided locally: Redis is away)",
                           {"site": site, "low": tiers[entry.tier - 1], "pool": tiers[entry.tier]})
        return TierState(entry.tier)

    # --- answers ---------------------------------------------------------------------------------
    async def answered(self, request: Request, outcome: str, result: Any) -> None:
        """``request``'s lease was released with ``outcome`` (the runtime's ``_release``): count it for its
        tier, and step at once when it was a probe, a ban or a circuit breaker opening."""
        choice = self._chosen.pop(request, None)
        if choice is None:
            return
        tiers, tier, site = choice.tiers, choice.tier, choice.site
        entry = self._entry(tiers, site)
        if outcome == "ban":
            entry.add(tier, BANS)
            self.stats.inc_value(f"{STATS}/tiers/{tiers[tier]}/bans")
            if choice.session is not None:
                self._sessions.pop((site, choice.session), None)
        elif outcome == "ok":
            entry.add(tier, OKS)
            self.stats.inc_value(f"{STATS}/tiers/{tiers[tier]}/pages")
        if tier == entry.tier and outcome in ("ok", "ban"):
            entry.local_answers += 1
            entry.local_bans += outcome == "ban"
        breaker = getattr(result, "breaker", None)
        opened = breaker is not None and breaker.kind == "opened"
        if choice.probe:
            answer = outcome if outcome in ("ok", "ban") else "skip"
            await self._step(tiers, site, entry, probe_answer=answer, probe_tier=tier)
        elif outcome == "ban" or opened:
            await self._step(tiers, site, entry, breaker_tier=tier if opened else -1)

    async def flush(self) -> None:
        """Hand Redis the counts not reported yet (at spider close; best effort)."""
        if self.clock() < self._offline_until:
            return
        for (tiers, site), entry in list(self._sites.items()):
            if any(entry.counts) and entry.step is None:
                try:
                    await self.runtime.store.tier_step(
                        tiers, site, counts=entry.take(), options=self.settings.tier_options,
                        probe_ttl=self.settings.lease_ttl, idle=self.settings.site_idle_ttl)
                except ProxyShardError:
                    return
