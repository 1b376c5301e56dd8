"""The store's pool administration: quarantines an operator sets or lifts (``ban``, ``unban``), adding,
restoring and draining proxies, and the in-place migration of a pool an older version wrote.
``_Admin`` is a mixin of ``store._StoreBase``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.exits import rekey_to_exits, unique_exits
from scrapy_proxy_shard.engine.proxies import Proxy, make_proxy, mask, parse_proxy, proxy_id
from scrapy_proxy_shard.engine.records import AddResult, BanResult
from scrapy_proxy_shard.engine.store_calls import Plan, _Command, _ms, _reason, _Script, logger
from scrapy_proxy_shard.exceptions import UnknownPoolError

#: Entries per page of the in-place migration of a pool written by an older version (``migrate``).
MIGRATE_PAGE = 500
#: Seconds a proxy re-keyed by the migration a lease runs rests when that lease names no TTL (a lease
#: passes its own TTL).
MIGRATE_WARMUP = 60.0
#: Seconds a proxy re-keyed by ``migrate`` (and ``scrapy-proxy-shard migrate``) rests by default: longer
#: than a crawl's lease TTL unless DOWNLOAD_TIMEOUT or PROXY_SHARD_LEASE_TTL exceed 570 s (a crawl's
#: lease TTL is max(60, DOWNLOAD_TIMEOUT + 30)); pass that crawl's lease TTL then (``--warmup``).
MIGRATE_SAFE_WARMUP = 600.0
#: Proxies per add / remove script call: each call is O(log N) per proxy, so a page bounds its Redis time.
ADMIN_PAGE = 500


def _ban_tuple(opts: BanOptions, base: float, jitter: float) -> tuple:
    """release.lua / ban.lua's ban arguments: base TTL, cap (never below the base), jitter, strike window."""
    return (_ms(base), _ms(max(opts.max_ttl, base)), repr(jitter), _ms(opts.strike_window))


class _Admin:
    """Quarantines set by hand, adding / restoring / removing proxies, migrating an old pool (mixed into
    ``store._StoreBase``: plans run by its ``_drive``)."""

    # --- quarantine ----------------------------------------------------------------------------
    def ban(self, pool: str, proxy: str, *, site: str | None = None, reason: str = "manual",
            ttl: float | None = None):
        """Quarantine a proxy (id or URL) on ``site``, or proxy-wide when ``site`` is None."""
        return self._drive(self._ban(pool, proxy, site, reason, ttl))

    def _ban(self, pool, proxy, site, reason, ttl) -> Plan:
        pid = _as_id(proxy)
        scope = site or "*"
        reply = yield _Script("ban", keyset.script_keys("ban", self.prefix(pool), scope), (
            scope, pid, _reason(reason), *self._ban_args(site is None, ttl),
        ))
        if reply[0] == "UNKNOWN":
            raise UnknownPoolError(f"pool {pool!r} has no proxy {mask(str(proxy))!r}")
        return BanResult(int(reply[1]) / 1000, int(reply[2]), bool(int(reply[3])))

    def unban(self, pool: str, proxy: str, *, site: str | None = None):
        """Lift a quarantine (site, or proxy-wide when ``site`` is None); True if one existed."""
        return self._drive(self._unban(pool, proxy, site))

    def _unban(self, pool, proxy, site) -> Plan:
        scope = site or "*"
        reply = yield _Script("unban", keyset.script_keys("unban", self.prefix(pool), scope), (scope, _as_id(proxy)))
        return bool(int(reply[1]))

    def _ban_args(self, proxy_wide: bool, ttl: float | None) -> tuple:
        opts = self.bans_options
        base = ttl if ttl is not None else (opts.dead_ttl if proxy_wide else opts.ttl)
        if ttl is not None and _ms(ttl, "ban_ttl") < 1:  # (the scripts trust their arguments)
            raise ValueError(f"ban_ttl ({ttl!r}) must be at least 1 ms")
        jitter = -opts.jitter * self._random()  # subtractive: a capped TTL never exceeds the cap
        return _ban_tuple(opts, base, jitter)

    def _quiet_ban_args(self) -> tuple:
        """The ban arguments of a release that bans nothing (the script checks but never reads them):
        the site ban's, without a jitter draw, made once per ``bans_options``."""
        opts = self.bans_options
        cached = self._quiet_ban
        if cached is None or cached[0] is not opts:
            cached = self._quiet_ban = (opts, _ban_tuple(opts, opts.ttl, 0.0))
        return cached[1]

    # --- pool administration -------------------------------------------------------------------
    def add_proxies(self, pool: str, proxies: Iterable[Proxy | str]):
        """Add proxies (validated; duplicates merged); usable at once by every host."""
        return self._drive(self._add(pool, proxies))

    def _add(self, pool, proxies) -> Plan:
        added = updated = 0
        replaced: list[str] = []
        items = list(_unique(proxies, pool).values())
        for start in range(0, len(items), ADMIN_PAGE):
            args = [a for p in items[start:start + ADMIN_PAGE] for a in _add_args(p)]
            reply = yield _Script("add", keyset.script_keys("add", self.prefix(pool)), ("add", 0, *args))
            added += int(reply[1])
            updated += int(reply[2])
            replaced.extend(reply[3:])
        yield _Command(("SADD", keys.pools_registry(self.namespace), pool))
        if replaced:
            by_id = {p.id: p for p in items}
            shown = ", ".join(f"{pid} ({by_id[pid].masked})" for pid in replaced[:5] if pid in by_id)
            more = f" and {len(replaced) - 5} more" if len(replaced) > 5 else ""
            logger.warning("proxy_shard: pool %(pool)r: %(n)d exit(s) already in the pool got a new URL (credentials "
                           "or scheme), replacing the old one in place: %(shown)s%(more)s; their slots, pacing and "
                           "quarantines are kept", {"pool": pool, "n": len(replaced), "shown": shown, "more": more})
        return AddResult(added, updated, tuple(replaced))

    def restore_pool(self, pool: str, proxies: Iterable[Proxy | str], *, warmup: float = 0.0):
        """Reload a pool that Redis lost (FLUSHALL, a restart without persistence, a failover to an
        empty replica) from a copy the caller kept; returns how many proxies were restored.

        Does nothing (returns 0) unless the pool is empty *and* was never loaded as far as Redis knows:
        a pool an operator drained with ``remove`` stays drained. Restored proxies rest ``warmup``
        seconds first (their held records were lost too: requests in flight through them may still run).
        At most ADMIN_PAGE (500) proxies are restored per call; the first call decides, the rest are plain adds.
        """
        return self._drive(self._restore(pool, proxies, warmup))

    def _restore(self, pool, proxies, warmup) -> Plan:
        items = list(_unique(proxies, pool).values())
        if not items:
            return 0
        args = [a for p in items[:ADMIN_PAGE] for a in _add_args(p)]
        names = keyset.script_keys("add", self.prefix(pool))
        reply = yield _Script("add", names, ("restore", _ms(warmup, "warmup"), *args))
        if reply[0] != "OK":
            return 0
        restored = int(reply[1])
        if len(items) > ADMIN_PAGE:
            restored += (yield from self._add(pool, items[ADMIN_PAGE:])).added
        yield _Command(("SADD", keys.pools_registry(self.namespace), pool))
        return restored

    def remove_proxies(self, pool: str, proxies: Iterable[str]):
        """Drain proxies (ids or URLs): no new leases; running leases finish. Returns the count."""
        return self._drive(self._remove(pool, proxies))

    def _remove(self, pool, proxies) -> Plan:
        ids = [_as_id(p) for p in proxies]
        removed = 0
        # A page of ADMIN_PAGE proxies per call, as add does: one call for 10,000 held Redis 44-82 ms.
        for start in range(0, len(ids), ADMIN_PAGE):
            reply = yield _Script("remove", keyset.script_keys("remove", self.prefix(pool)),
                                  tuple(ids[start:start + ADMIN_PAGE]))
            removed += int(reply[1])
        return removed

    def migrate(self, pool: str, *, warmup: float = MIGRATE_SAFE_WARMUP):
        """Bring a pool written by an older version (sites listed in P:sites, no add numbers; proxy ids
        hashed from URLs rather than exits) onto the current layout, a page at a time (every script call
        declares its keys). Runs by itself at the first lease or hold that meets such a pool
        (``scrapy-proxy-shard migrate`` runs it ahead); idempotent, and harmless when two hosts run it
        at once. A re-keyed proxy rests ``warmup`` seconds, proxy-wide: a request sent through its old id
        may still run until its lease expires, so it must be at least the longest lease TTL of the crawls
        using the pool (default ``MIGRATE_SAFE_WARMUP``). Returns False when there was nothing to migrate."""
        return self._drive(self._migrate(pool, warmup))

    def _migrate(self, pool, warmup: float = MIGRATE_WARMUP) -> Plan:
        prefix = self.prefix(pool)
        meta = keys.sub_key(prefix, keys.META)
        layout = yield _Command(("HGET", meta, keys.META_LAYOUT))
        exists = yield _Command(("EXISTS", meta))
        if layout == keys.LAYOUT or not int(exists or 0):  # current, or nothing here (a new or lost pool)
            return False
        logger.warning("proxy_shard: pool %(pool)r was written by an older version: migrating it in place",
                       {"pool": pool})
        cursor = "0"
        while True:  # 1. every proxy gets its add number (sites learn the pool in that order)
            cursor, page = yield _Command(("HSCAN", keys.sub_key(prefix, keys.PROXIES), cursor,
                                           "COUNT", MIGRATE_PAGE))
            ids = list(page)[::2] if isinstance(page, list) else list(page or ())
            if ids:
                yield _Script("migrate", keyset.migrate_proxies_keys(prefix), ("proxies", *ids))
            if str(cursor) == "0":
                break
        sites = 0
        while True:  # 2. every old site gets its P:site hash, an expiry and a P:siteidx entry
            cursor, page = yield _Command(("HSCAN", keys.sub_key(prefix, keys.LEGACY_SITES), cursor,
                                           "COUNT", MIGRATE_PAGE))
            pairs = _pairs(page)
            if pairs:
                names = [site for site, _ in pairs]
                reply = yield _Script("migrate", keyset.migrate_sites_keys(prefix, names),
                                      ("sites", self.site_idle_ms, *(x for pair in pairs for x in pair)))
                sites += int(reply[1])
            if str(cursor) == "0":
                break
        rekeyed = yield from rekey_to_exits(prefix, _ms(warmup, "warmup"), _Command, _Script)
        yield _Script("migrate", keyset.migrate_done_keys(prefix), ("done",))
        logger.info("proxy_shard: pool %(pool)r migrated (%(n)d sites, %(k)d proxy ids re-keyed to their exit)",
                    {"pool": pool, "n": sites, "k": rekeyed})
        return True


def _unique(proxies: Iterable[Proxy | str], pool: str) -> dict[str, Proxy]:
    """Validated proxies by id: one per exit, a later entry of an exit replacing an earlier one (logged)."""
    return unique_exits((p if isinstance(p, Proxy) else make_proxy(p) for p in proxies), f"adding to pool {pool!r}")


def _add_args(p: Proxy) -> list[str]:
    return [p.id, p.url, json.dumps(p.tags, sort_keys=True) if p.tags else ""]


def _as_id(proxy: str) -> str:
    """Accept a proxy id (16 hex digits) or a proxy URL."""
    if isinstance(proxy, Proxy):
        return proxy.id
    text = str(proxy).strip()
    if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
        return text
    return proxy_id(parse_proxy(text))


def _pairs(page: Any) -> list[tuple[str, str]]:
    """An HSCAN page (a flat list, or a dict once decoded by the client) as (field, value) pairs."""
    if isinstance(page, dict):
        return list(page.items())
    page = list(page or ())
    return list(zip(page[::2], page[1::2], strict=True))
