"""The store's hosts of a pool: heartbeats (a host alive, its load), leaving, and the live hosts'
records. ``_Hosts`` is a mixin of ``store._StoreBase``."""

from __future__ import annotations

import json
from typing import Any

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine.records import Beat, HostRecord
from scrapy_proxy_shard.engine.store_calls import Plan, _ms, _Script
from scrapy_proxy_shard.exceptions import HostIdTaken


class _Hosts:
    """Heartbeats and live hosts (mixed into ``store._StoreBase``: plans run by its ``_drive``;
    ``live_hosts`` reads the pools through ``_Views._pools``)."""

    # --- health: heartbeats and read-only views (CLI, exporter, log line) ----------------------
    def heartbeat(self, pool: str, *, ttl: float, info: dict[str, Any] | None = None, always: bool = True,
                  bucket: float = 60.0, keep: float = 3600.0, token: str = ""):
        """Register this host (``host_id``) as alive in ``pool`` for ``ttl`` seconds and record its load.

        With ``always=False`` nothing is written unless the host leased from the pool or is registered
        there already (returns None). Returns a ``Beat`` summary of the pool otherwise. ``token``: the
        process's instance token; ``HostIdTaken`` when a live record of the id holds another one.
        """
        return self._drive(self._heartbeat(pool, ttl, info, always, bucket, keep, token))

    def _heartbeat(self, pool, ttl, info, always, bucket, keep, token="") -> Plan:
        prefix = self.prefix(pool)
        reply = yield _Script("host_beat", keyset.script_keys("host_beat", prefix), (
            self.host_id, max(1, _ms(ttl)), json.dumps(info or {}, sort_keys=True), "1" if always else "0",
            max(1, _ms(bucket)), max(1, _ms(keep)), token,
        ))
        if reply[0] == "TAKEN":
            raise HostIdTaken(self.host_id, pool, int(reply[1]) / 1000, int(reply[2]) / 1000)
        if reply[0] != "OK":
            return None
        now, proxies, live, leases, ok, err, bans, n = (int(x) for x in reply[1:9])
        names = list(reply[9:9 + n])
        sites = {}
        if names:  # their slots and free slots: a second call, with the sites' keys declared
            counts = yield _Script("sites", keyset.sites_keys(prefix, names), ("1",))
            sites = {site: (int(counts[3 * i + 1]), int(counts[3 * i + 2]))
                     for i, site in enumerate(names) if counts[3 * i] != ""}
        return Beat(now / 1000, proxies, live, leases, ok, err, bans, sites)

    def leave(self, pool: str, token: str = ""):
        """Take this host out of the pool's live hosts now (a closing crawl); True if it was there.
        ``token``: only if its record is this instance's (not another process's that took the id over)."""
        return self._drive(self._leave(pool, token))

    def _leave(self, pool, token="") -> Plan:
        reply = yield _Script("host_leave", keyset.script_keys("host_leave", self.prefix(pool)), (self.host_id, token))
        return bool(int(reply[1]))

    def hosts(self, pool: str):
        """Live hosts of a pool (heartbeat within their TTL), by host id."""
        return self._drive(self._hosts(pool))

    def _hosts(self, pool) -> Plan:
        reply = yield _Script("hosts", keyset.script_keys("hosts", self.prefix(pool)), ())
        records = []
        for i in range(3, 3 + 8 * int(reply[2]), 8):
            host, until, raw, leases, ok, err, bans, raw_load = reply[i:i + 8]
            record = _json_object(raw)
            load = {int(minute) / 1000: int(n) for minute, n in _json_object(raw_load).items()
                    if str(minute).isdigit() and isinstance(n, (int, float))}
            records.append(HostRecord(host, int(until) / 1000, _int(record.get("beat")) / 1000,
                                      _int(record.get("since")) / 1000, _json_object(str(record.get("info", "{}"))),
                                      int(leases), int(ok), int(err), int(bans), dict(sorted(load.items()))))
        return sorted(records, key=lambda r: r.host)

    def host_list(self, pool: str):
        """The pool's live hosts as ``(now, [(host, alive_until, since, last_read), ...])`` (Redis
        clock, s; 0 when unknown), this read stamped as this host's last read (host_list.lua)."""
        return self._drive(self._host_list(pool))

    def _host_list(self, pool) -> Plan:
        reply = yield _Script("host_list", keyset.script_keys("host_list", self.prefix(pool)), (self.host_id,))
        rows = [(str(reply[i]), int(reply[i + 1]) / 1000, int(reply[i + 2]) / 1000, int(reply[i + 3]) / 1000)
                for i in range(3, 3 + 4 * int(reply[2]), 4)]
        return int(reply[1]) / 1000, rows

    def live_hosts(self, pool: str | None = None):
        """Ids of the live hosts of ``pool``, or of every pool of the namespace when None."""
        return self._drive(self._live_hosts(pool))

    def _live_hosts(self, pool) -> Plan:
        pools = [pool] if pool is not None else (yield from self._pools())
        found: set[str] = set()
        for name in pools:
            found.update(r.host for r in (yield from self._hosts(name)))
        return sorted(found)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
