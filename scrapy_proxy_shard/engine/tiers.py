"""Tiered pools, the Redis side: each site's tier of an ordered tier list, shared by every host.

A tier list (``PROXY_SHARD_TIERS``) orders pools cheap -> expensive. Per site, the cluster starts on
the cheapest tier; ``lua/tier.lua`` counts the answers the hosts report and moves the site up when it
blocks the tier it is on (bans over answers beyond ``ban_ratio`` after ``min_answers`` answers in a
window, or the site's circuit breaker opening on that tier's pool: the site rejected every proxy of
it), and back down when a probe request through the lower tier is answered fine. The wait before a
probe is learned per site: it doubles each time a probe is banned, or a descent does not hold.

Its keys are the tier list's, not a pool's (``schema.tiers_prefix``): one hash per site (expiring
with the site's idleness), one counters hash per list and one ZSET of sites per tier. This module
holds the options and records, and ``_Tiers``, the store mixin that runs the script (``store.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.store_calls import Plan, _Command, _ms, _Script

__all__ = ["TierCounts", "TierOptions", "TierState"]


@dataclass(frozen=True)
class TierOptions:
    """When a site moves up a tier, and how soon the lower tier is probed again (seconds)."""

    min_answers: int = 8
    ban_ratio: float = 0.5
    window: float = 300.0
    probe_interval: float = 60.0
    max_probe_interval: float = 3600.0

    def packed(self, probe_ttl: float, idle: float) -> str:
        """tier.lua's ARGV[7]: ``min_answers,ban_ratio,window_ms,probe_ms,max_probe_ms,probe_ttl_ms,idle_ms``."""
        return ",".join((str(self.min_answers), repr(float(self.ban_ratio)), *(str(_ms(v, name)) for v, name in (
            (self.window, "window"), (self.probe_interval, "probe_interval"),
            (self.max_probe_interval, "max_probe_interval"), (probe_ttl, "probe_ttl"), (idle, "idle")))))


@dataclass(frozen=True)
class TierState:
    """A site's tier as one step of tier.lua left it.

    ``probe``: this step holds the probe of tier ``tier - 1`` (its answer must be reported);
    ``event``: ``up``, ``down``, ``probe_banned``, ``probe_skipped`` or ""; ``next_probe``: seconds
    until the lower tier's next probe is due (None on the cheapest tier); ``backoff``: the probe
    interval learned for the site; ``answers`` / ``bans``: the evidence counted on its tier now."""

    tier: int
    probe: bool = False
    event: str = ""
    next_probe: float | None = None
    backoff: float = 0.0
    answers: int = 0
    bans: int = 0


@dataclass(frozen=True)
class TierCounts:
    """What a tier list's counters hold for one tier (pool), summed over sites and hosts."""

    pool: str
    counts: dict[str, int]
    sites: int  # sites on this tier now

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


class _Tiers:
    """Tier steps and views (a mixin of ``store._StoreBase``: ``self._drive`` runs the plans)."""

    def tier_step(self, tiers: Sequence[str], site: str, *, counts: Sequence[int] = (), breaker_tier: int = -1,
                  probe_answer: str = "", probe_tier: int = -1, claim: bool = False,
                  options: TierOptions | None = None, probe_ttl: float = 60.0, idle: float = 3600.0):
        """One step of ``site``'s tier on the list ``tiers`` (tier.lua): report ``counts`` (leases, ok,
        bans per tier, flat), a breaker that opened on ``breaker_tier``, a probe's answer; with
        ``claim``, take the lower tier's probe if it is due. Returns a ``TierState``."""
        return self._drive(self._tier_step(tuple(tiers), site, counts, breaker_tier, probe_answer, probe_tier,
                                           claim, options or TierOptions(), probe_ttl, idle))

    def _tier_step(self, tiers, site, counts, breaker_tier, probe_answer, probe_tier, claim, options,
                   probe_ttl, idle) -> Plan:
        registered = self.__dict__.setdefault("_tiers_registered", set())
        if tiers not in registered:
            yield _Command(("SADD", keys.tiers_registry(self.namespace), keys.TIER_SEP.join(tiers)))
            registered.add(tiers)
        flat = list(counts) or [0] * (3 * len(tiers))
        reply = yield _Script("tier", keyset.tier_keys(keys.tiers_prefix(self.namespace, tiers), site, len(tiers)),
                              (site, ",".join(str(int(c)) for c in flat), str(breaker_tier), probe_answer,
                               str(probe_tier), "1" if claim else "0", options.packed(probe_ttl, idle)))
        tier, granted, event, next_ms, backoff_ms, answers, bans = reply
        return TierState(int(tier), bool(int(granted)), event or "",
                         None if int(next_ms) < 0 else int(next_ms) / 1000, int(backoff_ms) / 1000,
                         int(answers), int(bans))

    def tier_lists(self):
        """The tier lists used in this namespace (each a tuple of pools, cheap first)."""
        return self._drive(self._tier_lists())

    def _tier_lists(self) -> Plan:
        names = yield _Command(("SMEMBERS", keys.tiers_registry(self.namespace)))
        return sorted(tuple(name.split(keys.TIER_SEP)) for name in names or ())

    def tier_sites(self, tiers: Sequence[str]):
        """{site: tier index} of the sites whose tier state is alive on the list ``tiers``."""
        return self._drive(self._tier_sites(tuple(tiers)))

    def _tier_sites(self, tiers) -> Plan:
        prefix = keys.tiers_prefix(self.namespace, tiers)
        now = yield _Command(("TIME",))
        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        out: dict[str, int] = {}
        for i in range(len(tiers)):
            names = yield _Command(("ZRANGEBYSCORE", f"{prefix}:{keys.TIER_ON}:{i}", now_ms, "+inf"))
            out.update((name, i) for name in names or ())
        return dict(sorted(out.items()))

    def tier_counts(self, tiers: Sequence[str]):
        """Per tier of the list ``tiers``: its counters and how many sites are on it now."""
        return self._drive(self._tier_counts(tuple(tiers)))

    def _tier_counts(self, tiers) -> Plan:
        prefix = keys.tiers_prefix(self.namespace, tiers)
        raw = yield _Command(("HGETALL", f"{prefix}:{keys.TIER_COUNTS}"))
        if isinstance(raw, list):
            raw = dict(zip(raw[::2], raw[1::2], strict=True))
        sites = yield from self._tier_sites(tiers)
        out = []
        for i, pool in enumerate(tiers):
            counts = {name: int((raw or {}).get(f"{name}:{i}", 0)) for name in keys.TIER_COUNTERS}
            out.append(TierCounts(pool, counts, sum(1 for t in sites.values() if t == i)))
        return out
