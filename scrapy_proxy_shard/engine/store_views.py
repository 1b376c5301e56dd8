"""The store's read-only views of a pool (CLI, exporter, log line, snapshots): its proxies, size,
quarantines, counters, sessions, sites, learned paces, slots by state, proxy URLs, the Redis clock.
``_Views`` is a mixin of ``store._StoreBase``."""

from __future__ import annotations

import json
from collections.abc import Iterable

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.pacing import PaceState
from scrapy_proxy_shard.engine.proxies import Proxy
from scrapy_proxy_shard.engine.records import BanRecord, BusySlot, ProxyRecord, SiteStatus
from scrapy_proxy_shard.engine.store_calls import Plan, _Command, _Script


class _Views:
    """Read-only views of a pool (mixed into ``store._StoreBase``: plans run by its ``_drive``)."""

    def list_proxies(self, pool: str):
        """Every proxy of the pool with its tags and counters."""
        return self._drive(self._list(pool))

    def _list(self, pool) -> Plan:
        prefix = self.prefix(pool)
        urls = yield _Command(("HGETALL", keys.sub_key(prefix, keys.PROXIES)))
        tags = yield _Command(("HGETALL", keys.sub_key(prefix, keys.TAGS)))
        stats = yield _Command(("HGETALL", keys.sub_key(prefix, keys.PSTATS)))
        per_proxy: dict[str, dict[str, float]] = {}
        for name, value in (stats or {}).items():
            pid, _, counter = name.rpartition(":")
            per_proxy.setdefault(pid, {})[counter] = float(value)
        return [
            ProxyRecord(Proxy(url, json.loads(tags[pid]) if pid in tags else {}), per_proxy.get(pid, {}), pid)
            for pid, url in sorted((urls or {}).items())
        ]

    def pool_size(self, pool: str):
        """Number of proxies in a pool (0 for an unknown pool). O(1)."""
        return self._drive(self._pool_size(pool))

    def _pool_size(self, pool) -> Plan:
        size = yield _Command(("HLEN", keys.sub_key(self.prefix(pool), keys.PROXIES)))
        return int(size or 0)

    def pools(self):
        """Names of the pools of this namespace."""
        return self._drive(self._pools())

    def _pools(self) -> Plan:
        names = yield _Command(("SMEMBERS", keys.pools_registry(self.namespace)))
        return sorted(names or ())

    def bans(self, pool: str):
        """Every quarantine entry (running or remembered for escalation), soonest end first."""
        return self._drive(self._bans(pool))

    def _bans(self, pool) -> Plan:
        raw = yield _Command(("HGETALL", keys.sub_key(self.prefix(pool), keys.BANS)))
        records = []
        for name, value in (raw or {}).items():
            scope, _, pid = name.rpartition("|")
            until, strikes, reason, since = value.split("|", 3)
            records.append(BanRecord(pid, scope, int(until) / 1000, int(strikes), reason, int(since) / 1000))
        return sorted(records, key=lambda r: r.until)

    def counters(self, pool: str, which: str = keys.COUNTERS):
        """A counter hash of the pool: one of ``schema.COUNTER_HASHES``; fields in ``schema``."""
        return self._drive(self._counters(pool, which))

    def _counters(self, pool, which) -> Plan:
        if which not in keys.COUNTER_HASHES:
            raise ValueError(f"unknown counter hash {which!r}")
        raw = yield _Command(("HGETALL", keys.sub_key(self.prefix(pool), which)))
        return {k: float(v) for k, v in (raw or {}).items()}

    def site_counters(self, pool: str, sites: Iterable[str] | None = None):
        """Counters by site: each live site's own (``SITESTATS``: they expire with the site's state, so
        a site idle past PROXY_SHARD_SITE_IDLE_TTL has none) and ``"*"``, the proxy-wide quarantines.
        ``sites``: the live sites when the caller has read them already (``sites()``)."""
        return self._drive(self._site_counters(pool, sites))

    def _site_counters(self, pool, sites) -> Plan:
        prefix = self.prefix(pool)
        if sites is None:
            sites = yield from self._sites(pool)
        out: dict[str, dict[str, float]] = {}
        wide = yield _Command(("HGETALL", keys.sub_key(prefix, keys.SSTATS)))
        for field, value in (wide or {}).items():
            owner, _, counter = field.partition(":")
            out.setdefault(owner, {})[counter] = float(value)
        for site in sites:
            raw = yield _Command(("HGETALL", keys.site_part(prefix, keys.SITESTATS, site)))
            if raw:
                out[site] = {k: float(v) for k, v in raw.items()}
        return out

    def session_proxy(self, pool: str, site: str, session_id: str):
        """Proxy id a sticky session is bound to now, or None."""
        return self._drive(self._session_proxy(pool, site, session_id))

    def _session_proxy(self, pool, site, session_id) -> Plan:
        pid = yield _Command(("HGET", keys.session_key(self.prefix(pool), site, session_id), keys.SESSION_PROXY))
        return pid or None

    def ping(self):
        """Check that Redis answers (raises PoolBackendError naming the masked URL)."""
        return self._drive(self._ping())

    def _ping(self) -> Plan:
        yield _Command(("PING",))
        return True

    def sites(self, pool: str):
        """Sites the pool serves now (used within PROXY_SHARD_SITE_IDLE_TTL), with their slots per
        proxy (concurrency); read a page at a time, so thousands of sites never block Redis."""
        return self._drive(self._sites(pool))

    def _sites(self, pool, page: int = 500) -> Plan:
        prefix = self.prefix(pool)
        found: dict[str, int] = {}
        offset = 0
        while True:
            names = yield _Command(("ZRANGE", keys.sub_key(prefix, keys.SITEIDX), offset, offset + page - 1))
            if names:  # a site whose state expired but whose index entry is not pruned yet is left out
                reply = yield _Script("sites", keyset.sites_keys(prefix, names), ("0",))
                found.update((site, int(reply[3 * i])) for i, site in enumerate(names) if reply[3 * i] != "")
            if len(names or ()) < page:
                return dict(sorted(found.items()))
            offset += page

    def paces(self, pool: str):
        """Each site's learned pacing (adaptive pacing), for the sites that have one: {site: PaceState}."""
        return self._drive(self._paces(pool))

    def _paces(self, pool) -> Plan:
        prefix = self.prefix(pool)
        sites = yield from self._sites(pool)
        out: dict[str, PaceState] = {}
        for site in sorted(sites or ()):
            raw = yield _Command(("HMGET", keys.pace_key(prefix, site), *keys.PACE_FIELDS))
            row = dict(zip(keys.PACE_FIELDS, raw or [], strict=False))
            if not row.get("iv"):
                continue
            bad = float(row.get("bad") or 0)
            out[site] = PaceState(site, float(row["iv"]) / 1000, int(row.get("chg") or 0) / 1000,
                                  bad / 1000 if bad > 0 else None, int(row.get("run") or 0),
                                  *(int(row.get(name) or 0) for name in keys.PACE_FIELDS[5:11]),
                                  row.get("probe") or None, float(row.get("piv") or 0) / 1000 or None,
                                  int(row["cc"]) if row.get("cc") else None,
                                  None if row.get("cc") else row.get("ccp") or None)
        return out

    def pool_status(self, pool: str, site: str, *, detail: bool = False, chunk: int = 256):
        """Slots of a site by state (free, leased, session, cooling, banned) and per host; with
        ``detail`` every slot that is not free. None for a site the pool never served.

        Reads the busy slots ``chunk`` at a time (one short script call each), so Redis is never
        blocked for long however big the pool: for the CLI and the exporter, not for hot paths.
        """
        return self._drive(self._pool_status(pool, site, detail, max(1, min(int(chunk), 2000))))

    def _pool_status(self, pool, site, detail, chunk) -> Plan:
        now = offset = 0
        total = None
        states = [0, 0, 0, 0]  # leased, session, cooling, banned
        held: dict[str, int] = {}
        busy: list[BusySlot] = []
        while True:
            reply = yield _Script("pool_status", keyset.script_keys("pool_status", self.prefix(pool), site),
                                  (site, "1" if detail else "0", now, offset, chunk))
            if reply[0] != "OK":
                return None
            if total is None:
                now, *total = (int(x) for x in reply[1:4])
                next_in = int(reply[8])
            states = [a + int(b) for a, b in zip(states, reply[4:8], strict=True)]
            scanned, nh = int(reply[9]), int(reply[10])
            i = 11
            for j in range(nh):
                host = reply[i + 2 * j]
                held[host] = held.get(host, 0) + int(reply[i + 2 * j + 1])
            i += 2 * nh
            rows = [reply[i + 1 + 5 * j:i + 6 + 5 * j] for j in range(int(reply[i]))]
            sids = sorted({row[4] for row in rows if row[4]})
            sessions: dict[str, tuple[int, int]] = {}
            if sids:  # uses and TTL of the chunk's sessions: their keys declared in a second call
                got = yield _Script("sessions", keyset.session_keys(self.prefix(pool), site, sids), ())
                sessions = {sid: (int(got[2 * j]), int(got[2 * j + 1])) for j, sid in enumerate(sids)}
            for member, state, until, host, sid in rows:
                pid, _, k = member.rpartition("/")
                uses, sttl = sessions.get(sid, (0, 0))
                busy.append(BusySlot(pid, int(k), state, int(until) / 1000, host or None, sid or None, uses,
                                     sttl / 1000))
            offset += scanned
            if scanned < chunk:
                break
        slots, free = total
        return SiteStatus(site, now / 1000, slots, free, *states, next_in / 1000, held, tuple(busy))

    def proxy_urls(self, pool: str, ids: Iterable[str]):
        """The URL (with credentials) of each proxy id, None for ids not in the pool. Never print it."""
        return self._drive(self._proxy_urls(pool, list(ids)))

    def _proxy_urls(self, pool, ids) -> Plan:
        if not ids:
            return {}
        urls = yield _Command(("HMGET", keys.sub_key(self.prefix(pool), keys.PROXIES), *ids))
        return dict(zip(ids, urls or [None] * len(ids), strict=True))

    def server_time(self):
        """The Redis server clock (seconds): the one clock every quarantine and lease is measured by."""
        return self._drive(self._server_time())

    def _server_time(self) -> Plan:
        sec, usec = yield _Command(("TIME",))
        return int(sec) + int(usec) / 1e6
