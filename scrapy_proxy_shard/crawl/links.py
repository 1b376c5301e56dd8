"""Site groups learned from bans: sites that share one blacklist, found out by the crawl.

Two domains behind one anti-bot system count an IP's requests together, so an IP in flight on both
at once, or sent to one while the other has it banned, is banned on both. ``PROXY_SHARD_SITE_GROUPS``
declares such sites; without it, every site is leased on its own and such a crawl loses pages to bans
it cannot explain. So each rate-type quarantine (a ban reason of ``PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS``,
or any ban with a ``Retry-After``) is reported to Redis (``engine/lua/site_link.lua``): a proxy
rate-banned on one site right after a clean answer there, while it is quarantined on another, is
evidence that the two share a blacklist, and the same evidence from three distinct proxies links them
for every host (one proxy bad everywhere links nothing; bans after bans and hard blocks never count).
From then on the two are one site group: one slot per IP across both, one pace, one ban scope
(``SiteMap.learn``).

A shared blacklist also shows at once, without a quarantine before: a proxy in flight on both sites (a
crawl's opening wave sends every IP to every site) is rate-banned on the second while the first is still
being served. So a rate ban of a request sent while this host had the same proxy in flight on another
site, and that request still in flight, is reported as *overlap* evidence for the two; the same
proxy's overlaps that are answered clean are reported as a veto (at most every ``APART_EVERY`` seconds
per pair and host). Overlap evidence from three distinct proxies links once it has settled two seconds
without a veto: a proxy banned on one site while in flight on two others is evidence for both pairs,
and the clean overlaps of the same wave, which answer later, veto the independent one. A request in
flight whose lease expired (it never came back) is no longer counted. With several hosts most overlaps
are across hosts. Evidence counts only the banning host's own requests in flight (read across hosts too,
it linked two of stock nginx's independent vhosts in 1 of 2 zoo runs: coincidental overlap bans are
common where every IP serves every site at once). Vetoes are read across hosts: the proxy's held records
on the other sites this host crawled lately (``engine/lua/flying.lua``, one short call, whatever host
leased them), for one clean answer every ``REFRESH`` seconds, and for every clean answer while overlap
evidence this host reported settles (``WATCH`` seconds more).

Every host learns the map at its own bans, and at each heartbeat otherwise (``refresh``). Redis keeps it
7 days after the last link; ``DEL {<namespace>:<pool>}:links`` forgets it. ``PROXY_SHARD_LEARN_SITE_GROUPS
= False`` turns the learning off (declared groups still apply); the default ``"auto"`` learns from bans on
the sites paced adaptively only (no ``PROXY_SHARD_MIN_INTERVAL`` for them): where the settings give a
site's rule, a burst of bans on several sites is the rules tightening at once (the zoo's ``tighten``
linked its independent sites), and the user who read the rules declares the groups.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from scrapy_proxy_shard.engine.records import Lease, ReleaseResult
from scrapy_proxy_shard.engine.store_links import LINK_SETTLE, LINK_SPAN
from scrapy_proxy_shard.exceptions import ProxyShardError

logger = logging.getLogger(__name__)

STATS = "proxy_shard"
#: How often a host reads the learned groups while it crawls (seconds; and at each of its rate bans).
REFRESH = 2.0
#: A clean answer vetoes a link only for a request started at least this long before its proxy's rest
#: ends (and a tenth of the rest): the site's word on the ban is whole seconds, its clock ahead of ours.
VETO_MARGIN = 1.5
#: Rests kept before the ended ones are dropped (one per proxy this host rate-banned lately).
RESTING_MAX = 4096
HOW_QUARANTINE = ("proxies answered clean on one were rate-banned there while quarantined on the other, "
                  "three of them")
HOW_OVERLAP = ("three proxies were rate-banned on one while in flight on the other, and no overlap was "
               "answered clean")
#: Least time between two overlap vetoes this host tells for one pair of sites (seconds).
APART_EVERY = 30.0
#: Pairs whose last overlap veto is remembered before the list is cleared.
APART_MAX = 4096
#: The most other sites a clean answer's proxy is looked up on across hosts (the ones this host leased
#: on last), and how recent their last lease must be (seconds, Redis clock).
ELSEWHERE_SITES = 8
ELSEWHERE_FOR = 120.0
#: After reporting overlap evidence, how much longer than its settling this host checks every clean
#: answer for overlaps across hosts (seconds).
WATCH = 1.0


class SiteLinker:
    """Reports rate bans to Redis and keeps the crawl's ``SiteMap`` up to date with the learned groups."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        learn = runtime.settings.learn_site_groups
        self.enabled = learn is not False
        #: Report bans on every site (True), or only on those paced adaptively ("auto": where the settings
        #: give a site's rule, they vouch for it, and a burst of bans there is the rule tightening).
        self.everywhere = learn is True
        self._known: dict[str, str] = {}  # pool -> the map version this host holds
        #: proxy id -> [site, since, until, sites reported]: its last rate quarantine this host started
        #: (Redis clock), and the sites where a clean answer during it was reported as counter-evidence.
        self._resting: dict[str, list[Any]] = {}
        self._read_at: dict[str, float] = {}  # pool -> when this host last read its groups (loop clock)
        self.span = LINK_SPAN  # least time between the first and the linking evidence (store_links.py)
        self.settle = LINK_SETTLE  # how long overlap evidence waits for a veto before it links
        #: proxy id -> {token: lease} of this host's leases in flight (to find a request's overlaps)
        self._flying: dict[str, dict[str, Lease]] = {}
        self._apart: dict[tuple[str, str, str], float] = {}  # (pool, site, site) -> last veto told (loop clock)
        self._settling: dict[str, asyncio.Future] = {}  # pool -> its read once overlap evidence settled
        #: pool -> {site: the start of this host's last lease there (Redis clock)}: where a proxy may be in
        #: flight from another host (``_elsewhere``)
        self._recent: dict[str, dict[str, float]] = {}
        self._watch: dict[str, float] = {}  # pool -> until when every clean answer is checked (loop clock)

    def leased(self, lease: Lease) -> None:
        """This host leased ``lease`` (its overlaps with the proxy's other requests are looked up later)."""
        if self.enabled:
            self._flying.setdefault(lease.proxy_id, {})[lease.token] = lease
            recent = self._recent.get(lease.pool)
            if recent is None:
                recent = self._recent[lease.pool] = {}
            elif len(recent) >= 8 * ELSEWHERE_SITES and lease.site not in recent:
                keep = sorted(recent, key=recent.__getitem__)[-ELSEWHERE_SITES:]
                recent = self._recent[lease.pool] = {site: recent[site] for site in keep}
            recent[lease.site] = lease.issued_at

    def released(self, lease: Lease) -> None:
        """``lease`` is being given back (its answer is known)."""
        flying = self._flying.get(lease.proxy_id)
        if flying is not None:
            flying.pop(lease.token, None)
            if not flying:
                del self._flying[lease.proxy_id]

    def clear(self) -> None:
        self._flying.clear()
        for task in self._settling.values():
            task.cancel()
        self._settling.clear()

    async def _read_settled(self, pool: str, start: float) -> None:
        try:
            await asyncio.sleep(self.settle + 0.05)
            await self.refresh(pool, start=start)
        finally:
            self._settling.pop(pool, None)

    def _enclosing(self, lease: Lease, now: float) -> list[str]:
        """The other sites this host had a request through ``lease``'s proxy in flight on for the whole of
        ``lease``'s (sent before it, not answered yet, its lease not expired at ``now``: a request that
        never came back, e.g. replaced by a later middleware, is dropped here), each once."""
        flying = self._flying.get(lease.proxy_id, {})
        for token in [t for t, other in flying.items() if other.expires_at <= now]:
            del flying[token]
        return sorted({other.site for other in flying.values()
                       if other.site != lease.site and other.pool == lease.pool
                       and other.issued_at <= lease.issued_at})

    async def _elsewhere(self, lease: Lease) -> list[str]:
        """The other sites (of those this host leased on lately) where ``lease``'s proxy is in flight now,
        leased by any host before ``lease`` was: this host's own requests and the other hosts' alike."""
        recent = self._recent.get(lease.pool, {})
        oldest = lease.issued_at - ELSEWHERE_FOR
        sites = sorted((site for site, at in recent.items() if site != lease.site and at >= oldest),
                       key=recent.__getitem__, reverse=True)[:ELSEWHERE_SITES]
        if not sites:
            return []
        try:
            return await self.runtime.store.in_flight(lease.pool, lease.proxy_id, sites, lease.issued_at)
        except ProxyShardError as exc:
            logger.debug("proxy_shard: proxy %(proxy)s's requests on other sites not read: %(e)s",
                         {"proxy": lease.proxy_id, "e": exc})
            return []

    def counts(self, reason: str | None, retry_after: float | None) -> bool:
        """Whether a quarantine of this reason is evidence (a rate-type ban: never a hard block)."""
        return retry_after is not None or (reason is not None
                                           and reason in self.runtime.settings.autothrottle_ban_reasons)

    async def banned(self, lease: Lease, result: ReleaseResult, reason: str | None,
                     retry_after: float | None) -> None:
        """A release judged ``lease``'s answer a ban: tell Redis when it is a rate ban. A ban the site's
        open circuit breaker spared (no quarantine) counts for the site's ``Retry-After``: the site still
        said how long it refuses the IP, and a shared blacklist's first round of bans often opens it."""
        if not self.enabled or not self.counts(reason, retry_after):
            return
        start = self._start(lease.site)
        if not self.everywhere and not start:
            return
        if result.ban_until is not None:
            quarantine = result.ban_until - result.now
            if retry_after:
                # The site's own word on how long it refuses the IP: a quarantine escalated past it
                # (banned again right after an earlier one) outlasts the site's ban, and a clean answer
                # elsewhere after the site forgave the IP would veto a blacklist that is shared.
                quarantine = min(quarantine, retry_after)
        elif result.breaker is not None and retry_after:
            quarantine = retry_after
        else:
            return
        if len(self._resting) >= RESTING_MAX:  # a proxy that never answers again leaves its entry
            self._resting = {k: v for k, v in self._resting.items() if v[2] > result.now}
        self._resting[lease.proxy_id] = [lease.site, result.now, result.now + quarantine, set()]
        # (this host's own overlaps only: evidence read across hosts as well linked stock nginx's
        # independent vhosts in the zoo, 1 run of 2, even with vetoes read across hosts)
        overlapped = self._enclosing(lease, result.now)
        if overlapped:
            self.runtime.stats.inc_value(f"{STATS}/site_groups/overlap_bans")
            # the clean overlaps that would veto it answer meanwhile, on any host: look for them
            self._watch[lease.pool] = asyncio.get_running_loop().time() + self.settle + WATCH
        # (one call per site it was in flight on: evidence for each pair; the clean overlaps veto the
        # independent ones)
        for other in overlapped or [""]:
            await self._ask(lease.pool, lease.site, lease.proxy_id, max(0.001, quarantine), start=start,
                            overlapped=other)
        if overlapped and lease.pool not in self._settling:
            # Overlap evidence links once settled, at the next call: read the map then (an opening wave's
            # bans may open the breakers, and nothing else would call before the next heartbeat).
            self._settling[lease.pool] = asyncio.ensure_future(self._read_settled(lease.pool, start))

    async def answered(self, lease: Lease, result: ReleaseResult) -> None:
        """A clean answer: when its proxy rests from another site (a rate quarantine this host started
        before the request), tell Redis once per site: the two do not share a blacklist (a veto). And
        every ``REFRESH`` seconds, read the groups other hosts linked (a host that waits on a site linked
        meanwhile leases under its old key until it knows: one IP could serve both)."""
        now = asyncio.get_running_loop().time()
        enclosing = self._enclosing(lease, result.now)
        due = now - self._read_at.get(lease.pool, 0.0) >= REFRESH
        if due:
            await self.refresh(lease.pool)
        if due or now < self._watch.get(lease.pool, 0.0):
            # overlaps across hosts too: one clean answer each REFRESH, every one while evidence settles
            enclosing = sorted(set(enclosing) | set(await self._elsewhere(lease)))
        for overlapped in enclosing:
            a, b = sorted((overlapped, lease.site))
            if now - self._apart.get((lease.pool, a, b), -APART_EVERY) >= APART_EVERY:
                if len(self._apart) >= APART_MAX:
                    self._apart.clear()
                self._apart[(lease.pool, a, b)] = now
                self.runtime.stats.inc_value(f"{STATS}/site_groups/overlap_apart")
                await self._ask(lease.pool, lease.site, lease.proxy_id, 0.0, overlapped=overlapped)
        rest = self._resting.get(lease.proxy_id)
        if rest is None:
            return
        site, since, until, told = rest
        if result.now >= until:
            del self._resting[lease.proxy_id]
            return
        # Only a request started well inside the rest counts: the site's own ban began a little before
        # our quarantine (the answer's way back) and a Retry-After is whole seconds, so the site may
        # forgive the IP up to a second or so before the rest ends.
        inside = until - max(VETO_MARGIN, 0.1 * (until - since))
        if site == lease.site or not since < lease.issued_at < inside or lease.site in told:
            return
        told.add(lease.site)
        self.runtime.stats.inc_value(f"{STATS}/site_groups/apart")
        await self._ask(lease.pool, lease.site, lease.proxy_id, 0.0, rested_from=site)

    async def refresh(self, pool: str, *, start: float = 0.0) -> None:
        """Read ``pool``'s learned groups when they changed (one short call: the version, else the map).
        ``start``: the adaptive start interval a group this read links (settled overlap evidence) begins
        its pace at (0: not adaptive)."""
        if self.enabled:
            await self._ask(pool, "-", "", 0.0, start=start)

    def _start(self, site: str) -> float:
        """The adaptive start interval a group linked through ``site`` begins at (0: not adaptive)."""
        pace = self.runtime.options_of(site).autothrottle
        return pace.start_interval if pace is not None and pace.enabled else 0.0

    async def _ask(self, pool: str, site: str, proxy_id: str, quarantine: float, *, start: float = 0.0,
                   rested_from: str = "", overlapped: str = "") -> None:
        """One site_link call (a rate ban, a clean answer while resting, or a read); every reply carries
        the map when this host's version is not current, so each call also refreshes it."""
        self._read_at[pool] = asyncio.get_running_loop().time()
        try:
            links = await self.runtime.store.site_link(pool, site, proxy_id, quarantine=quarantine,
                                                      known=self._known.get(pool, ""), start=start, span=self.span,
                                                      rested_from=rested_from, overlapped=overlapped,
                                                      settle=self.settle)
        except ProxyShardError as exc:
            logger.debug("proxy_shard: learned site groups of pool %(pool)r not told or read: %(e)s",
                         {"pool": pool, "e": exc})
            return
        if links is None:
            return
        stats = self.runtime.stats
        if links.linked is not None:
            stats.inc_value(f"{STATS}/site_groups/linked")
            a, b = links.linked
            why = (HOW_OVERLAP if links.how == "overlap" else HOW_QUARANTINE)
            logger.warning(
                "proxy_shard: sites %(a)s and %(b)s share a blacklist (%(why)s): every host now leases, paces "
                "and quarantines them as one site group %(a)s. Declare PROXY_SHARD_SITE_GROUPS to skip the "
                "learning cost, or DEL the pool's links key to forget", {"a": a, "b": b, "why": why})
        if links.groups is None:
            return
        self._known[pool] = links.version
        if self.runtime.sites.learn(pool, links.groups):
            learned = self.runtime.sites.learned()
            stats.set_value(f"{STATS}/site_groups/learned_sites", len(learned))
            if links.linked is None:
                logger.info("proxy_shard: learned site groups of pool %(pool)r now in force: %(groups)s",
                            {"pool": pool, "groups": _shown(learned)})


def _shown(learned: dict[str, str]) -> str:
    groups: dict[str, list[str]] = {}
    for site, group in sorted(learned.items()):
        groups.setdefault(group, [group]).append(site)
    return "; ".join(", ".join(members) for members in groups.values()) or "none"
