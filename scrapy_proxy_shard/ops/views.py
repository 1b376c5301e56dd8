"""What the CLI prints: tables for people (tabulate, plain text that pipes and greps cleanly) and
JSON-ready dicts for scripts, both made from the same ``PoolSnapshot`` so they never disagree.

Proxies are shown by id and masked URL only (``http://***:***@host:port``); nothing here ever
formats ``Proxy.url``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tabulate import tabulate

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.store import HostRecord, ProxyRecord
from scrapy_proxy_shard.ops.snapshot import LOAD_WINDOW_MINUTES, STATES, Outcomes, PoolSnapshot

TABLE_FORMAT = "simple"


# --- small formatters ---------------------------------------------------------------------------

def duration(seconds: float | None) -> str:
    """``0.4s``, ``12s``, ``5m03s``, ``2h05m``, ``3d04h``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    s = round(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def millis(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def table(rows: Iterable[Iterable[Any]], headers: list[str], indent: str = "") -> str:
    text = tabulate(list(rows), headers=headers, tablefmt=TABLE_FORMAT, disable_numparse=True)
    return "\n".join(indent + line for line in text.splitlines())


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def outcomes_json(o: Outcomes) -> dict[str, Any]:
    return {"leases": o.leases, "ok": o.ok, "errors": o.errors, "banned": o.banned,
            "success_ratio": _r(o.success_ratio, 4)}


# --- list -----------------------------------------------------------------------------------------

def proxies_table(pool: str, records: list[ProxyRecord]) -> str:
    rows = [(pool, r.id, r.proxy.masked, _tags(r.proxy.tags), *_counts(r.stats), millis(_lat(r.stats)))
            for r in records]
    return table(rows, ["pool", "id", "proxy", "tags", "leases", "ok", "errors", "quarantines", "latency"])


def proxies_json(pool: str, records: list[ProxyRecord]) -> list[dict[str, Any]]:
    return [{"pool": pool, "id": r.id, "proxy": r.proxy.masked, "tags": r.proxy.tags,
             **dict(zip(("leases", "ok", "errors", "quarantines"), _counts(r.stats), strict=True)),
             "latency_ewma": _r(_lat(r.stats))} for r in records]


def _tags(tags: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(tags.items())) or "-"


def _lat(stats: dict[str, float]) -> float | None:
    return stats[schema.LATENCY] / 1000 if schema.LATENCY in stats else None


def _counts(stats: dict[str, float]) -> tuple[int, int, int, int]:
    """A proxy's leases, ok, errors and quarantines started."""
    return tuple(int(stats.get(name, 0)) for name in (schema.LEASES, schema.OK, schema.ERRORS, schema.QUARANTINES))


# --- status ----------------------------------------------------------------------------------------

def status_text(snap: PoolSnapshot, *, proxies: bool = False) -> str:
    o = snap.outcomes
    running = snap.running_bans
    lines = [
        f"pool {snap.pool!r}: {snap.proxies} proxies ({snap.active} active, {len(snap.dead_ids)} dead), "
        f"{len(snap.banned_ids)} banned on some site, {len(snap.hosts)} live hosts",
        f"  requests {o.leases}: {percent(o.success_ratio)} ok ({o.ok} ok, {o.errors} errors, {o.banned} banned); "
        f"latency {millis(snap.latency_mean)} mean of proxy EWMAs (p90 {millis(snap.latency_quantile(0.9))})",
        f"  quarantines: {len(running)} running, {snap.quarantines_started} started, "
        f"mean length {duration(snap.mean_quarantine)}; stale releases {int(snap.counters.get(schema.STALE, 0))}, "
        f"expired {int(snap.counters.get(schema.EXPIRED, 0))}, "
        f"session rebinds {int(snap.counters.get(schema.REBINDS, 0))}",
    ]
    if snap.sites:
        rows = []
        for s in snap.sites:
            so = snap.site_outcomes(s.site)
            rows.append((s.site, s.slots, s.free, s.leased, s.session, s.cooling, s.banned,
                         duration(s.next_free_in) if s.free == 0 else "now", so.leases, percent(so.success_ratio),
                         int(snap.site_stats.get(s.site, {}).get(schema.QUARANTINES, 0)), breaker_text(snap, s.site),
                         _pace_cell(snap, s.site)))
        lines += ["", table(rows, ["site", "slots", *STATES, "next free", "requests", "ok", "quarantines", "breaker",
                                   "learned interval"],
                            "  ")]
    else:
        lines.append("  no site served yet")
    host_rows = hosts_of_status(snap)
    if host_rows:
        rows = [(h["host"], h["held"], h["requests"], percent(h["success_ratio"]), percent(h["share"]),
                 "yes" if h["live"] else "no") for h in host_rows]
        lines += ["", table(rows, ["host", "held now", "requests", "ok", f"share ({LOAD_WINDOW_MINUTES}m)", "live"],
                            "  ")]
    if proxies and snap.sites:
        lines += ["", proxy_rows_table(snap, indent="  ")]
    return "\n".join(lines)


def breaker_text(snap: PoolSnapshot, site: str) -> str:
    """A site's circuit breaker for the status table: ``closed``, ``OPEN 25s`` (until probing),
    ``half-open 1/3`` (probes this round); then how often it opened (``opened 2x``)."""
    b = snap.breakers.get(site)
    counts = snap.breaker_counts(site)
    trips = counts["opened"] + counts["reopened"]
    history = f" (opened {trips}x)" if trips else ""
    if b is None:
        return "closed" + history
    if b.state == "open":
        return f"OPEN {duration(b.until - snap.now)}{history}"
    return f"half-open {b.probes_used}/{b.probes}{history}"


def breaker_json(snap: PoolSnapshot, site: str) -> dict[str, Any]:
    b = snap.breakers.get(site)
    out: dict[str, Any] = {"state": snap.breaker_state(site), **snap.breaker_counts(site)}
    if b is not None:
        out.update(probe_in=_r(max(0.0, b.until - snap.now)) if b.state == "open" else 0.0,
                   cooloff=_r(b.cooloff), probes_used=b.probes_used, probes=b.probes, since=_r(b.since),
                   trips=b.trips)
    return out


def _pace_cell(snap: PoolSnapshot, site: str) -> str:
    """``0.213s (3 up, 41 down)``: the site's learned interval (adaptive pacing), or ``-``."""
    pace = snap.paces.get(site)
    if pace is None:
        return "-"
    return f"{pace.interval:.3f}s ({pace.raised} up, {pace.lowered} down)"


def _pace_json(snap: PoolSnapshot, site: str) -> dict[str, Any] | None:
    pace = snap.paces.get(site)
    if pace is None:
        return None
    return {"learned_interval": _r(pace.interval, 4), "changed_ago": _r(snap.now - pace.changed_at),
            "floor_of": _r(pace.floor_of, 4), "clean_run": pace.clean_run, "raised": pace.raised,
            "lowered": pace.lowered, "skipped": pace.skipped, "forgotten": pace.forgotten}


def hosts_of_status(snap: PoolSnapshot) -> list[dict[str, Any]]:
    """Leases per host: live hosts and any host that holds slots now (even without heartbeats)."""
    held = snap.held_by_host()
    live = {h.host: h for h in snap.hosts}
    out = []
    for name in sorted(set(live) | set(held)):
        record = live.get(name)
        o = snap.host_outcomes(name)
        out.append({"host": name, "held": held.get(name, 0), "requests": o.leases, "success_ratio": o.success_ratio,
                    "share": snap.load_share(record) if record else None, "live": record is not None})
    return out


def proxy_rows_table(snap: PoolSnapshot, indent: str = "") -> str:
    rows = []
    for r in snap.proxy_rows():
        left = r.until - snap.now if r.until is not None else None
        scope = {"*": "proxy-wide", None: "-"}.get(r.ban_scope, "site")
        rows.append((r.site, r.proxy_id, r.masked_url, r.state, f"{r.busy_slots}/{r.slots}", duration(left),
                     r.ban_reason or "-", r.strikes or "-", scope, r.host or "-",
                     millis(_lat(snap.proxy_stats.get(r.proxy_id, {})))))
    return table(rows, ["site", "id", "proxy", "state", "busy", "free in", "ban reason", "strikes", "ban scope",
                        "host", "latency"], indent)


def status_json(snap: PoolSnapshot, *, proxies: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pool": snap.pool,
        "time": round(snap.now, 3),
        "proxies": snap.proxies,
        "active": snap.active,
        "dead": len(snap.dead_ids),
        "banned": len(snap.banned_ids),
        "live_hosts": len(snap.hosts),
        "requests": outcomes_json(snap.outcomes),
        "latency": {"mean": _r(snap.latency_mean), "p50": _r(snap.latency_quantile(0.5)),
                    "p90": _r(snap.latency_quantile(0.9)), "max": _r(snap.latency_quantile(1.0))},
        "quarantines": {
            "running": len(snap.running_bans),
            "started": snap.quarantines_started,
            "mean_seconds": _r(snap.mean_quarantine),
            "running_by_scope_reason": [{"scope": scope, "reason": reason, "count": n} for (scope, reason), n
                                        in sorted(snap.running_by_scope_reason().items())],
            "started_by_site_reason": [{"site": site, "reason": reason, "count": n} for (site, reason), n
                                       in sorted(snap.bans_by_site_reason().items())],
        },
        "counters": {k: int(v) for k, v in sorted(snap.counters.items())},
        "sites": [{
            "site": s.site, "slots": s.slots, **{state: getattr(s, state) for state in STATES},
            "next_free_in": _r(s.next_free_in), "requests": outcomes_json(snap.site_outcomes(s.site)),
            "quarantines_started": int(snap.site_stats.get(s.site, {}).get(schema.QUARANTINES, 0)),
            "breaker": breaker_json(snap, s.site),
            "pacing": _pace_json(snap, s.site),
        } for s in snap.sites],
        "hosts": [{**h, "success_ratio": _r(h["success_ratio"], 4), "share": _r(h["share"], 4)}
                  for h in hosts_of_status(snap)],
    }
    if proxies:
        out["proxies_by_site"] = [{
            "site": r.site, "id": r.proxy_id, "proxy": r.masked_url, "state": r.state, "busy_slots": r.busy_slots,
            "slots": r.slots, "free_in": _r(r.until - snap.now) if r.until is not None else 0.0,
            "ban_reason": r.ban_reason, "strikes": r.strikes, "ban_scope": r.ban_scope, "host": r.host,
            "latency_ewma": _r(_lat(snap.proxy_stats.get(r.proxy_id, {}))),
        } for r in snap.proxy_rows()]
    return out


# --- sessions, hosts, pools ----------------------------------------------------------------------

def sessions_json(snap: PoolSnapshot) -> list[dict[str, Any]]:
    masked = {r.id: r.proxy.masked for r in snap.records or ()}
    out = []
    for status in snap.sites:
        for slot in status.busy:
            if slot.session_id:
                out.append({"pool": snap.pool, "site": status.site, "session": slot.session_id,
                            "proxy_id": slot.proxy_id, "proxy": masked.get(slot.proxy_id, "?"), "state": slot.state,
                            "uses": slot.uses, "ttl_left": _r(slot.session_ttl), "host": slot.host})
    return sorted(out, key=lambda s: (s["site"], s["session"]))


def sessions_table(sessions: list[dict[str, Any]]) -> str:
    rows = [(s["pool"], s["site"], s["session"], s["proxy_id"], s["proxy"], s["state"], s["uses"],
             duration(s["ttl_left"]), s["host"] or "-") for s in sessions]
    return table(rows, ["pool", "site", "session", "proxy id", "proxy", "state", "uses", "ttl left", "host"])


def hosts_json(snap: PoolSnapshot) -> list[dict[str, Any]]:
    held = snap.held_by_host()
    return [_host_json(snap, h, held.get(h.host, 0)) for h in snap.hosts]


def _host_json(snap: PoolSnapshot, h: HostRecord, held: int) -> dict[str, Any]:
    o = snap.host_outcomes(h.host)
    return {
        "pool": snap.pool, "host": h.host, "heartbeat_age": _r(snap.now - h.beat), "up_for": _r(snap.now - h.since),
        "alive_for": _r(h.alive_until - snap.now), "info": h.info, "requests": o.leases,
        "ok": o.ok, "errors": o.errors, "banned": o.banned, "success_ratio": _r(o.success_ratio, 4),
        "held": held, "recent_leases": snap.recent_load(h), "share": _r(snap.load_share(h), 4),
        "load_per_minute": [{"minute": int(start), "leases": n} for start, n in h.load.items()],
    }


def hosts_table(hosts: list[dict[str, Any]]) -> str:
    rows = [(h["pool"], h["host"], h["info"].get("spider") or "-", duration(h["heartbeat_age"]),
             duration(h["up_for"]), h["requests"], percent(h["success_ratio"]), h["banned"], h["held"],
             h["recent_leases"], percent(h["share"])) for h in hosts]
    return table(rows, ["pool", "host", "spider", "heartbeat", "up", "requests", "ok", "banned", "held now",
                        f"leases ({LOAD_WINDOW_MINUTES}m)", "share"])


def pools_json(snap: PoolSnapshot) -> dict[str, Any]:
    return {"pool": snap.pool, "proxies": snap.proxies, "active": snap.active, "dead": len(snap.dead_ids),
            "banned": len(snap.banned_ids), "sites": len(snap.sites), "live_hosts": len(snap.hosts),
            "held": sum(snap.held_by_host().values()), "success_ratio": _r(snap.outcomes.success_ratio, 4)}


def pools_table(pools: list[dict[str, Any]]) -> str:
    rows = [(p["pool"], p["proxies"], p["active"], p["dead"], p["banned"], p["sites"], p["live_hosts"], p["held"],
             percent(p["success_ratio"])) for p in pools]
    return table(rows, ["pool", "proxies", "active", "dead", "banned", "sites", "live hosts", "held now", "ok"])
