"""What a crawl does with gateway slots (engine/gateway.py): a ban rotates the slot's token instead of
quarantining it, within a per-site budget; an exit IP the gateway reports is recorded so that two
slots on one IP are found, counted and one of them rotated.

The runtime calls ``on_ban`` before it releases a banned lease (its answer is the outcome the release
records: ``unknown`` after a rotation, so the slot is not quarantined; ``ban`` otherwise) and
``saw_response`` before a response's release. Both are one script call on the pool's store, so every
host sees the new token at its next lease of the slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from scrapy_proxy_shard.engine.gateway import (
    SLOT_RE,
    GatewayOptions,
    GatewaySpec,
    is_gateway_entry,
    parse_gateway,
    slot_of,
)
from scrapy_proxy_shard.engine.proxies import Proxy
from scrapy_proxy_shard.engine.records import Lease
from scrapy_proxy_shard.exceptions import PoolBackendError

logger = logging.getLogger("scrapy_proxy_shard")
STATS = "proxy_shard"
#: Exit IP reports one host remembers (a report is sent once per slot, token and IP within the window).
_SEEN_MAX = 10_000


def gateway_specs(entries: Iterable[Any]) -> list[GatewaySpec]:
    """The gateway entries of a settings list (strings or parsed proxies: a list file's slots are
    Proxies already, and say their gateway in their URL)."""
    return [parse_gateway(e) for e in entries if not isinstance(e, Proxy) and is_gateway_entry(e)]


class GatewayRuntime:
    """One crawler's view of its gateway slots: the rotation budget per gateway and the exit reports."""

    def __init__(self, options: GatewayOptions, stats: Any, store: Any) -> None:
        self.options = options
        self.stats = stats
        self._store = store  # a callable returning the runtime's store (built lazily)
        self.sessions: dict[tuple[str, str], int] = {}  # (pool, gateway id) -> its number of sessions
        self._cooling: set[tuple[str, str]] = set()  # (gateway id, site) whose cooldown was logged
        self._seen: dict[tuple[str, str, str], float] = {}  # (proxy id, session, ip) -> when reported

    def learn(self, pool: str, proxies: Iterable[Any]) -> None:
        """Note the gateways of a pool's list (strings, or Proxies: a gateway's slots say it in their URL)
        and log each once: a gateway without placeholder has no per-IP guarantee, and says so."""
        items = list(proxies)
        for spec in gateway_specs(items):
            self.sessions[(pool, spec.gid)] = spec.sessions
            self._announce(pool, spec.masked, spec.sessions, spec.placeholder)
        found: dict[str, tuple[int, bool, str]] = {}
        for p in items:
            slot = slot_of(p.url) if isinstance(p, Proxy) else None
            if slot is not None and (pool, slot.gid) not in self.sessions:
                k, has, _ = found.get(slot.gid, (0, False, ""))
                found[slot.gid] = (max(k, slot.k), has or slot.token is not None, p.masked.partition("#")[0])
        for gid, (k, has, shown) in found.items():
            self.sessions[(pool, gid)] = k
            self._announce(pool, shown, k, has)

    @staticmethod
    def _announce(pool: str, shown: str, sessions: int, placeholder: bool) -> None:
        where = {"gw": shown, "n": sessions, "pool": pool}
        if placeholder:
            logger.info("proxy_shard: pool %(pool)r: gateway %(gw)s: %(n)d sessions, each its own slot (one exit "
                        "IP per session, one request at a time); a ban gives the slot a new session", where)
        else:
            logger.warning("proxy_shard: pool %(pool)r: gateway %(gw)s has no {session} placeholder: it gets a new "
                           "exit IP per request, so it is used as %(n)d concurrent slots with NO per-IP guarantee "
                           "(two requests to one site may share an IP, and pacing per IP cannot hold); put "
                           "{session} where the provider expects a session token to get one", where)

    # --- bans ------------------------------------------------------------------------------------
    async def on_ban(self, lease: Lease, reason: str | None) -> str:
        """The outcome the release of a banned ``lease`` records: ``unknown`` when its gateway slot was
        given a new token (or another host did it first, or it has no token), ``ban`` when it is not a
        gateway slot or the site's rotation budget is spent (a quarantine, as for a static proxy)."""
        m = SLOT_RE.fullmatch(lease.exit_session) if lease.exit_session else None
        if m is None:
            return "ban"
        gid, k = m.group(1), int(m.group(2))
        sessions = max(self.sessions.get((lease.pool, gid), 0), k)
        budget = self.options.budget(sessions)
        try:
            result = await self._store().gateway_rotate(lease.pool, lease.proxy_id, lease.site, lease.proxy_url,
                                                        rotations=budget, window=self.options.window)
        except PoolBackendError as exc:
            self.stats.inc_value(f"{STATS}/gateway/rotate_errors")
            logger.warning("proxy_shard: gateway slot %(proxy)s: rotation failed (%(e)s): quarantined instead",
                           {"proxy": lease.proxy_id, "e": exc})
            return "ban"
        self.stats.inc_value(f"{STATS}/gateway/rotate/{result.status}")
        if result.status == "rotated":
            self.stats.inc_value(f"{STATS}/gateway/rotations")
            logger.info("proxy_shard: gateway slot %(proxy)s banned on %(site)s (%(reason)s): new session token, a "
                        "new exit IP (rotation %(n)d of %(budget)d for the site within %(window)gs)",
                        {"proxy": lease.proxy_id, "site": lease.site, "reason": reason or "ban",
                         "n": result.count, "budget": budget, "window": self.options.window})
            return "unknown"
        if result.status in ("stale", "noop"):
            return "unknown"
        if result.status == "cooldown":
            self.stats.inc_value(f"{STATS}/gateway/cooldown_bans")
            if (gid, lease.site) not in self._cooling:
                self._cooling.add((gid, lease.site))
                logger.warning(
                    "proxy_shard: site %(site)s banned %(n)d fresh gateway IPs within %(window)gs: its bans "
                    "quarantine gateway slots for the next %(left).0fs instead of rotating them, so the site does "
                    "not burn the plan (budget: PROXY_SHARD_GATEWAY_ROTATIONS, default the gateway's sessions)",
                    {"site": lease.site, "n": result.count, "window": self.options.window, "left": result.left})
        return "ban"

    # --- exit IPs --------------------------------------------------------------------------------
    async def saw_response(self, lease: Lease, headers: Any) -> None:
        """Record the exit IP the gateway reported for ``lease`` (``PROXY_SHARD_GATEWAY_EXIT_HEADER``);
        a slot found on another slot's IP is rotated (stat ``proxy_shard/gateway/shared_exit``)."""
        name = self.options.exit_header
        if not name or not lease.exit_session.startswith("gw."):
            return
        raw = headers.get(name)
        if not raw:
            return
        ip = (raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)).strip()[:64]
        key = (lease.proxy_id, lease.exit_session, ip)
        now = time.monotonic()
        if now - self._seen.get(key, -1e18) < self.options.window / 2:
            return
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        self._seen[key] = now
        self.stats.inc_value(f"{STATS}/gateway/exit_reports")
        try:
            result = await self._store().gateway_exit(lease.pool, lease.proxy_id, lease.proxy_url, ip,
                                                      ttl=self.options.window)
        except PoolBackendError as exc:
            logger.debug("proxy_shard: exit IP report failed: %(e)s", {"e": exc})
            return
        if result.status == "shared":
            self.stats.inc_value(f"{STATS}/gateway/shared_exit")
            self.stats.inc_value(f"{STATS}/gateway/rotations")
            logger.info("proxy_shard: gateway slots %(proxy)s and %(other)s both exit from %(ip)s: %(proxy)s got a "
                        "new session token", {"proxy": lease.proxy_id, "other": result.other, "ip": ip})
