"""The store's learned site groups: sites found to share one blacklist from the bans that coincide on one
proxy (``lua/site_link.lua`` says how). ``_Links`` is a mixin of ``store._StoreBase``: one script call."""

from __future__ import annotations

from dataclasses import dataclass, field

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine.store_calls import Plan, _ms, _name, _Script

#: How long one proxy's evidence that two sites share a blacklist waits for a second proxy's.
LINK_EVIDENCE = 300.0
#: The most sites one learned group may hold (a link that would make it larger is refused).
LINK_MAX_GROUP = 32
#: How long Redis keeps the learned groups after the last link (seconds).
LINK_KEEP = 7 * 86400.0


@dataclass(frozen=True)
class SiteLinks:
    """A pool's learned site groups. ``version``: raised at each link; ``groups``: site key -> its
    group's key (None when the caller's version was current: nothing changed); ``linked``: the two
    group keys this call linked, or None."""

    version: str
    groups: dict[str, str] | None = field(default=None)
    linked: tuple[str, str] | None = None


class _Links:
    """Learned site groups (mixed into ``store._StoreBase``)."""

    def site_link(self, pool: str, site: str, proxy_id: str, *, quarantine: float, known: str = "",
                  evidence: float = LINK_EVIDENCE, max_group: int = LINK_MAX_GROUP, keep: float = LINK_KEEP):
        """Tell Redis that ``proxy_id`` starts a rate-ban quarantine of ``quarantine`` seconds on ``site``
        (0: tell nothing, read the map): when it is already quarantined on another site, that is
        evidence the two share a blacklist, and the second proxy's evidence links them for every host.
        Returns ``SiteLinks`` (its map only when ``known`` is not the current version)."""
        return self._drive(self._site_link(pool, site, proxy_id, quarantine, known, evidence, max_group, keep))

    def _site_link(self, pool, site, proxy_id, quarantine, known, evidence, max_group, keep) -> Plan:
        _name(site, "site")
        if quarantine:
            _name(proxy_id, "proxy id")
        ttl = max(0, _ms(quarantine, "quarantine")) if quarantine else 0
        reply = yield _Script("site_link", keyset.script_keys("site_link", self.prefix(pool)), (
            site, proxy_id or "-", ttl, max(1, _ms(evidence, "evidence")), max(2, int(max_group)),
            max(1, _ms(keep, "keep")), known))
        version, linked = str(reply[0]), str(reply[1])
        pair = tuple(linked.split("|", 1)) if linked else None
        if len(reply) == 2 and version == known:
            return SiteLinks(version, None, pair)
        rest = [str(x) for x in reply[2:]]
        return SiteLinks(version, dict(zip(rest[::2], rest[1::2], strict=True)), pair)
