"""The KEYS each Lua script is given: every key a script reads or writes is declared by its caller.

Redis documents that a script must receive in KEYS every key it touches (Dragonfly and some managed
Redis services refuse the others). So no script builds a key name: a script with a fixed key list
has its *roles* here, in KEYS order (each script's header repeats the order, and
``tests/test_schema.py`` compares the two); ``scripts.py`` prepends that list to the script, and
``_lib.lua`` binds ``K_<ROLE>`` to ``KEYS[i]``. ``script_keys`` is the one place the key names of a
call are built (from ``schema`` names). The scripts whose keys depend on data (``sites``,
``sessions``, ``migrate``) take a variable list, built by their own helpers below.

A role is a ``schema`` key suffix (a pool-level key ``<prefix>:<role>``, or a per-site one
``<prefix>:<role>:<site>``), ``SESSION`` (``<prefix>:session:<site>:<sid>``; a call without a
session passes the empty session id's key, which the script never touches), ``MEMO`` (this call's
memoised reply ``<prefix>:done:<op>:<token>``) or ``LEASE_MEMO`` (the lease call's: abandon.lua reads it,
release.lua overwrites it with its own reply).
"""

from __future__ import annotations

from functools import lru_cache

from scrapy_proxy_shard.engine import schema as s

MEMO = "memo"
LEASE_MEMO = "lease_memo"

#: Keys of the pool, named ``<prefix>:<role>``.
POOL_ROLES = frozenset({s.PROXIES, s.TAGS, s.ORDER, s.SITEIDX, s.BANS, s.BANIDX, s.PSTATS, s.HSTATS, s.SSTATS,
                        s.COUNTERS, s.META, s.HOSTS, s.HOSTINFO, s.LOAD, s.GWROT, s.GWEXIT, s.GWBUSY,
                        s.LINKBAN, s.LINKEV, s.LINKS})
#: Keys of the call's site, named ``<prefix>:<role>:<site>``.
SITE_ROLES = frozenset({s.SITE, s.READY, s.WAITING, s.FREED, s.BREAKER, s.BREAKER_SEEN, s.PACE, s.CONTENT,
                        s.SITESTATS})

#: KEYS of every script with a fixed key list, in order.
ROLES: dict[str, tuple[str, ...]] = {
    "lease": (MEMO, s.PROXIES, s.META, s.ORDER, s.BANS, s.PSTATS, s.HSTATS, s.SITESTATS, s.COUNTERS, s.SITEIDX,
              s.SITE, s.READY, s.WAITING, s.SESSION, s.BREAKER, s.GWBUSY),
    "release": (LEASE_MEMO, s.PROXIES, s.BANS, s.BANIDX, s.PSTATS, s.HSTATS, s.SSTATS, s.SITESTATS, s.COUNTERS,
                s.SITEIDX, s.SITE, s.READY, s.WAITING, s.FREED, s.SESSION, s.BREAKER, s.BREAKER_SEEN, s.PACE,
                s.GWBUSY, s.GWROT),
    "abandon": (MEMO, LEASE_MEMO, s.BANS, s.SITE, s.READY, s.WAITING, s.FREED, s.SESSION),
    "hold": (MEMO, s.PROXIES, s.META, s.ORDER, s.BANS, s.PSTATS, s.HSTATS, s.SITESTATS, s.SITEIDX, s.SITE, s.READY),
    "lift": (s.BANS, s.SITE, s.READY),
    "end_session": (s.BANS, s.SITE, s.READY, s.WAITING, s.FREED, s.SESSION),
    "ban": (s.PROXIES, s.BANS, s.BANIDX, s.PSTATS, s.SSTATS, s.SITESTATS, s.COUNTERS, s.SITE, s.READY),
    "unban": (s.BANS, s.BANIDX, s.COUNTERS, s.SITE, s.READY),
    "add": (s.META, s.PROXIES, s.TAGS, s.BANS, s.BANIDX, s.ORDER),
    "remove": (s.PROXIES, s.TAGS, s.PSTATS, s.ORDER),
    "host_beat": (s.HOSTS, s.HOSTINFO, s.LOAD, s.HSTATS, s.PROXIES, s.SITEIDX),
    "host_leave": (s.HOSTS, s.HOSTINFO, s.LOAD, s.HSTATS),
    "hosts": (s.HOSTS, s.HOSTINFO, s.LOAD, s.HSTATS),
    "host_list": (s.HOSTS, s.HOSTINFO),
    "pool_status": (s.BANS, s.SITE, s.READY),
    "content": (s.PROXIES, s.SITESTATS, s.BREAKER, s.CONTENT),
    "gateway_rotate": (s.PROXIES, s.COUNTERS, s.GWROT),
    "gateway_exit": (s.PROXIES, s.COUNTERS, s.GWEXIT),
    "site_link": (s.LINKBAN, s.LINKEV, s.LINKS, s.PACE),
}
#: Scripts whose KEYS depend on data (built by ``sites_keys``, ``session_keys``, ``migrate_*_keys``,
#: ``tier_keys``, ``flying_keys``).
VARIABLE = ("sites", "sessions", "migrate", "tier", "flying")


@lru_cache(maxsize=8192)
def _template(name: str, prefix: str, site: str) -> tuple[tuple[str, ...], int, int, int]:
    """The call's keys with the per-call ones left empty, and their positions (-1: not used)."""
    out, memo, lease_memo, session = [], -1, -1, -1
    for i, role in enumerate(ROLES[name]):
        if role in POOL_ROLES:
            out.append(s.sub_key(prefix, role))
        elif role in SITE_ROLES:
            out.append(s.site_part(prefix, role, site))
        else:
            out.append("")
            if role == MEMO:
                memo = i
            elif role == LEASE_MEMO:
                lease_memo = i
            elif role == s.SESSION:
                session = i
            else:  # pragma: no cover - a role added to ROLES but not here
                raise KeyError(role)
    return tuple(out), memo, lease_memo, session


def script_keys(name: str, prefix: str, site: str = "", *, session: str = "", token: str = "") -> list[str]:
    """KEYS of one call of script ``name`` on pool ``prefix`` for ``site`` (a ban's scope, ``*`` for
    proxy-wide), sticky session ``session`` and call token ``token`` (the memo's)."""
    template, memo, lease_memo, sess = _template(name, prefix, site)
    out = list(template)
    if memo >= 0:
        out[memo] = s.memo_key(prefix, name, token)
    if lease_memo >= 0:
        out[lease_memo] = s.memo_key(prefix, "lease", token)
    if sess >= 0:
        out[sess] = s.session_key(prefix, site, session)
    return out


def sites_keys(prefix: str, sites: list[str]) -> list[str]:
    """sites.lua: each site's SITE hash and READY ZSET, pair by pair."""
    return [key for site in sites for key in (s.site_part(prefix, s.SITE, site), s.site_part(prefix, s.READY, site))]


def flying_keys(prefix: str, sites: list[str]) -> list[str]:
    """flying.lua: each site's SITE hash."""
    return [s.site_part(prefix, s.SITE, site) for site in sites]


def session_keys(prefix: str, site: str, session_ids: list[str]) -> list[str]:
    """sessions.lua: the session hashes of one site."""
    return [s.session_key(prefix, site, sid) for sid in session_ids]


def migrate_proxies_keys(prefix: str) -> list[str]:
    """migrate.lua "proxies": the add-order ZSET and P:meta."""
    return [s.sub_key(prefix, s.ORDER), s.sub_key(prefix, s.META)]


def migrate_sites_keys(prefix: str, sites: list[str]) -> list[str]:
    """migrate.lua "sites": P:siteidx, then each old site's SITE hash and READY ZSET."""
    return [s.sub_key(prefix, s.SITEIDX), *sites_keys(prefix, sites)]


def migrate_rekey_keys(prefix: str) -> list[str]:
    """migrate.lua "rekey": P:proxies, P:tags, P:order, P:meta, P:bans, P:banidx."""
    return [s.sub_key(prefix, name) for name in (s.PROXIES, s.TAGS, s.ORDER, s.META, s.BANS, s.BANIDX)]


def migrate_done_keys(prefix: str) -> list[str]:
    """migrate.lua "done": P:meta and the old layout's two hashes (deleted)."""
    return [s.sub_key(prefix, s.META), s.sub_key(prefix, s.LEGACY_SITES), s.sub_key(prefix, s.LEGACY_SITEBUILD)]


def tier_keys(prefix: str, site: str, n_tiers: int) -> list[str]:
    """tier.lua: the site's tier hash, the list's counters, then one ZSET of sites per tier."""
    return [f"{prefix}:{s.TIER_SITE}:{site}", f"{prefix}:{s.TIER_COUNTS}",
            *(f"{prefix}:{s.TIER_ON}:{i}" for i in range(n_tiers))]
