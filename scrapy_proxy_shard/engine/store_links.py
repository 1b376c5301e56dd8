"""The store's learned site groups: sites found to share one blacklist from the bans that coincide on one
proxy (``lua/site_link.lua`` says how). ``_Links`` is a mixin of ``store._StoreBase``: one script call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.store_calls import Plan, _Command, _ms, _name, _Script

#: How long the first proxy's evidence that two sites share a blacklist waits for the others' (seconds).
LINK_EVIDENCE = 60.0
#: Distinct proxies whose evidence links two sites.
LINK_PROXIES = 3
#: How long a clean answer that proved two sites apart keeps them from being linked (seconds).
LINK_VETO = 600.0
#: The least time between the first evidence for two sites and the one that links them (seconds): one
#: burst of bans never links (independent sites tightening their rules at once ban every IP together).
LINK_SPAN = 5.0
#: How long overlap evidence (a ban while the proxy was in flight on the other site) settles before it
#: links (seconds): the same opening wave's overlaps that stay clean, which veto, answer after its bans.
LINK_SETTLE = 2.0
#: The most sites one learned group may hold (a link that would make it larger is refused).
LINK_MAX_GROUP = 32
#: How long Redis keeps the learned groups after the last link (seconds).
LINK_KEEP = 7 * 86400.0
#: How long a learned pace is kept (_pace.lua PACE_KEEP_MS; its field xp says until when).
PACE_KEEP_MS = 7 * 86400000


@dataclass(frozen=True)
class SiteLinks:
    """A pool's learned site groups. ``version``: raised at each link; ``groups``: site key -> its
    group's key (None when the caller's version was current: nothing changed); ``linked``: the two
    group keys this call linked, or None."""

    version: str
    groups: dict[str, str] | None = field(default=None)
    linked: tuple[str, str] | None = None
    #: How the link was found: "quarantine" (bans while quarantined on the other site) or "overlap"
    #: (bans while in flight on the other site).
    how: str = ""


class _Links:
    """Learned site groups (mixed into ``store._StoreBase``)."""

    def site_link(self, pool: str, site: str, proxy_id: str, *, quarantine: float, known: str = "",
                  evidence: float = LINK_EVIDENCE, max_group: int = LINK_MAX_GROUP, keep: float = LINK_KEEP,
                  proxies: int = LINK_PROXIES, start: float = 0.0, rested_from: str = "",
                  veto: float = LINK_VETO, span: float = LINK_SPAN, overlapped: str = "",
                  settle: float = LINK_SETTLE):
        """Tell Redis that ``proxy_id`` was rate-banned on ``site`` (after the release that said so), for
        ``quarantine`` seconds (0: tell nothing, read the map): when the ban followed a clean answer
        there and the proxy is quarantined on another site, that is evidence the two share a blacklist;
        ``proxies`` distinct proxies' evidence within ``evidence`` seconds, the last at least ``span``
        seconds after the first, links them for every host.
        Returns ``SiteLinks`` (its map only when ``known`` is not the current version).

        ``rested_from``: instead, ``proxy_id`` answered clean on ``site`` to a request started while it
        rested from that other site (a rate quarantine): the two do not share a blacklist, and no link
        between them is made for ``veto`` seconds.

        ``overlapped``: the site ``proxy_id`` was in flight on, on this host, for the whole of this request.
        With a ``quarantine``, the ban came while it was: overlap evidence (the site counted that other
        request), which links once ``proxies`` distinct proxies gave it and the first is ``settle``
        seconds old without a veto (at any call, a read included); with none, the request was answered
        clean while it was: the two do not share a blacklist for overlaps (an overlap veto).

        A link forgets both sites' adaptive pacing: the bans that linked them voted as rate bans and
        raised their intervals, though the blacklist, not the pace, refused the IPs. With ``start`` (the
        group's adaptive start interval, seconds) the group's pace starts there at once, and a rate ban
        votes on it only from an IP that answered clean on the group since: IPs the blacklist still
        refuses (quarantined on the other site only, or banned by hosts that had not yet learned the
        link) are refused on the group for that, not for its pace. The group's key's circuit breaker is
        closed (the same bans opened it), and the proxies a member's rest still holds back are
        quarantined on the group's key as long."""
        return self._drive(self._site_link(pool, site, proxy_id, quarantine, known, evidence, max_group, keep,
                                           proxies, start, rested_from, veto, span, overlapped, settle))

    def in_flight(self, pool: str, proxy_id: str, sites: list[str], since: float):
        """Which of ``sites`` ``proxy_id`` is in flight on now, leased by any host at or before ``since``
        (the Redis clock, seconds) and not answered yet (a sticky session's binding is not a request).
        A list, in the order of ``sites``."""
        return self._drive(self._in_flight(pool, proxy_id, list(sites), since))

    def _in_flight(self, pool, proxy_id, sites, since) -> Plan:
        _name(proxy_id, "proxy id")
        for site in sites:
            _name(site, "site")
        if not sites:
            return []
        reply = yield _Script("flying", keyset.flying_keys(self.prefix(pool), sites),
                              (proxy_id, round(float(since) * 1000)))
        return [sites[int(i) - 1] for i in reply]

    def _site_link(self, pool, site, proxy_id, quarantine, known, evidence, max_group, keep, proxies,
                   start, rested_from, veto, span, overlapped, settle) -> Plan:
        _name(site, "site")
        if rested_from:
            _name(rested_from, "site rested from")
            quarantine, overlapped = 0, ""
        if overlapped:
            _name(overlapped, "site overlapped")
        if quarantine:
            _name(proxy_id, "proxy id")
        ttl = max(0, _ms(quarantine, "quarantine")) if quarantine else 0
        reply = yield _Script("site_link", keyset.script_keys("site_link", self.prefix(pool), site), (
            site, proxy_id or "-", ttl, max(1, _ms(evidence, "evidence")), max(2, int(max_group)),
            max(1, _ms(keep, "keep")), known, max(1, int(proxies)), rested_from, max(1, _ms(veto, "veto")),
            _ms(span, "span"), overlapped, _ms(settle, "settle")))
        version, linked, now = str(reply[0]), str(reply[1]), int(reply[2])
        parts = linked.split("|") if linked else []
        pair = (parts[0], parts[1]) if parts else None
        how = ("overlap" if parts[2:] == ["o"] else "quarantine") if parts else ""
        if pair is not None:
            prefix = self.prefix(pool)
            paces = [keys.pace_key(prefix, key) for key in pair]
            proven = []
            for pace in paces:
                proven.append((yield _Command(("HMGET", pace, "lo", "bad"))))
            # The bans that linked them also opened their circuit breakers (every proxy rejected at once:
            # the blacklist's doing, not the site refusing everyone): the group's key starts closed, and
            # opens again if its own bans say so. The other's stays as it was: hosts that have not read
            # the new map yet lease under it, and must not send one IP to both meanwhile.
            breakers = [keys.site_part(prefix, name, pair[0]) for name in (keys.BREAKER, keys.BREAKER_SEEN)]
            yield _Command(("DEL", *paces, *breakers))
            if start > 0:
                iv = _group_start(start, proven)
                # Clean answers from now on count (eff): a rate ban votes only from an IP that answered
                # clean on the group (its marks went with the paces), so the IPs the blacklist still
                # refuses cast no vote.
                yield _Command(("HSET", paces[0], "iv", f"{iv:.3f}", "chg", now, "eff", now,
                                "run", 0, "bad", 0, "vote", "", "probe", "",
                                "xp", now + PACE_KEEP_MS))
                yield _Command(("PEXPIRE", paces[0], PACE_KEEP_MS))
        if len(reply) == 3 and version == known:
            return SiteLinks(version, None, pair, how)
        rest = [str(x) for x in reply[3:]]
        groups = dict(zip(rest[::2], rest[1::2], strict=True))
        if pair is not None:
            yield from _one_ban_scope(self.prefix(pool), pair[0], groups, now)
        return SiteLinks(version, groups, pair, how)


def _one_ban_scope(prefix: str, group: str, groups: dict[str, str], now: int) -> Plan:
    """A new group is one ban scope: a proxy rate-banned on one of its sites (a rest still running, as
    the linking evidence recorded it) waits as long on the group's key, which leases for all of them.
    Without it the group's first leases go to IPs the blacklist still refuses, and their bans, five
    distinct proxies with no clean answer between, open the group's circuit breaker at once."""
    members = {site for site, key in groups.items() if key == group} | {group}
    banned = yield _Command(("HGETALL", keys.sub_key(prefix, keys.LINKBAN)))
    rests = {pid: int(until) for pid, (site, _, until) in ((pid, entry.rpartition("|"))
                                                         for pid, entry in (banned or {}).items())
             if site in members and site != group and until.isdigit() and int(until) > now}
    if not rests:
        return
    fields = [f"{group}|{pid}" for pid in rests]
    bans = keys.sub_key(prefix, keys.BANS)
    held = yield _Command(("HMGET", bans, *fields))
    slots = yield _Command(("HGET", keys.site_part(prefix, keys.SITE, group), "c"))
    per_proxy = max(1, int(slots or 1))
    entries: list[Any] = []  # bans: field, value
    forget: list[Any] = []  # banidx: until, field
    scores: list[Any] = []  # the group's ready set: until, slot member
    for (pid, until), field_, entry in zip(rests.items(), fields, held, strict=True):
        if entry and int(entry.split("|", 1)[0]) >= until:
            continue  # quarantined on the group's own key as long already
        # (as ban() in _lib.lua writes it: release and lease keep the slot back until then)
        entries += [field_, f"{until}|1|blacklist|{now}"]
        forget += [until, field_]
        scores += [x for k in range(per_proxy) for x in (until, f"{pid}/{k}")]
    if entries:
        yield _Command(("HSET", bans, *entries))
        yield _Command(("ZADD", keys.sub_key(prefix, keys.BANIDX), "GT", *forget))
        yield _Command(("ZADD", keys.site_part(prefix, keys.READY, group), "XX", "GT", *scores))
        want = max(forget[::2]) - now + 1000  # (bans_expire in _lib.lua: the entries outlive their rest)
        for key in (bans, keys.sub_key(prefix, keys.BANIDX)):
            if (yield _Command(("PTTL", key))) < want:
                yield _Command(("PEXPIRE", key, want))


def _group_start(start: float, proven: list) -> float:
    """Where a group's adaptive pace starts (ms): the larger of the intervals probes last proved clean on
    its two sites (each site's rule is at most that; one IP's requests to both now count as one site's),
    when both proved one, and never above the start interval. Their learned intervals are not used (the
    bans that linked them raised those, the blacklist's doing), nor the intervals they knew to fail
    (bad): each failed while the other site used the same IPs too, so it says nothing of the group's
    own limit (seeded with it, the zoo's ``issue`` group sat at 0.75 s above a 0.5 s rule). The group's
    probes learn its own."""
    start_ms = start * 1000
    los = [float(lo) for lo, _ in proven if lo]  # (float() takes bytes and str alike)
    iv = min(start_ms, max(los)) if len(los) == len(proven) and los else start_ms
    return iv
