"""Every Redis key name and counter field the project uses is named here.

All keys of one pool share the hash tag ``{namespace:pool}`` so every script touches one Redis
Cluster slot. The Lua scripts build no key name: every key a script touches is passed in its KEYS
(``engine/keyset.py`` builds them from the names below, in the order each script's header states;
see ``lua/_lib.lua`` for what each key holds). Keys never contain proxy URLs: proxies are named by
their short id.

The Lua scripts spell the counter fields as literals (a script is one self-contained source Redis
caches by SHA); ``tests/test_schema.py`` parses ``lua/`` and fails when a key role or counter field
used there is not one of the constants below, or a constant is used nowhere.
"""

from __future__ import annotations

import re

from scrapy_proxy_shard.exceptions import InvalidSessionId, SettingError

# --- key suffixes: every pool key is ``<prefix>:<suffix>[:<part>...]`` --------------------------------
PROXIES = "proxies"      # HASH proxy id -> URL (may hold credentials)
TAGS = "tags"            # HASH proxy id -> JSON tags
ORDER = "order"          # ZSET proxy id -> its add number (sites learn proxies in this order)
SITE = "site"            # HASH per site: c = slots per proxy, seq = add number learnt up to, and one field
#                          per held slot (member -> "token|host|issued_ms|expires_ms|session"), and
#                          member^ -> an overlap floor in ms (hold.lua, see _lib.lua floor_field); expires idle
SITEIDX = "siteidx"      # ZSET site -> ms at which its state expires (the live sites)
READY = "ready"          # ZSET per site: slot member -> ms from which it may be used
SESSION = "session"      # HASH per (site, session id): the sticky session's proxy and use counts
BANS = "bans"            # HASH "<site>|<id>" -> "until_ms|strikes|reason|since"
BANIDX = "banidx"        # ZSET ban entry -> ms after which it is forgotten
PSTATS = "pstats"        # HASH "<proxy id>:<counter>"
HSTATS = "hstats"        # HASH "<host>:<counter>"
SSTATS = "sstats"        # HASH "*:<counter>": proxy-wide quarantines (ban, ban:<reason>)
SITESTATS = "sitestats"  # HASH per site: "<counter>"; expires with the site's state (SITE_IDLE_TTL)
COUNTERS = "counters"    # HASH pool-wide counters
WAITING = "waiting"      # STRING per site: someone got a WAIT lately
FREED = "freed"          # LIST per site: one entry per slot given back (waiters BLPOP it)
HOSTS = "hosts"          # ZSET host -> ms until which it counts as alive
HOSTINFO = "hostinfo"    # HASH host -> JSON {beat, since, seen, info}: the host's last heartbeat
LOAD = "load"            # HASH host -> JSON {minute start ms: leases taken in that minute}
DONE = "done"            # STRING per (op, token): the memoised reply of a write script
META = "meta"            # HASH created=ms (the pool was loaded once), seq, layout; mstep/mcursor while migrating
BREAKER = "breaker"      # HASH per site: the site's circuit breaker (no key: closed)
BREAKER_SEEN = "brkseen"  # ZSET per site: quarantines started since the site's last ok (breaker evidence)
PACE = "pace"            # HASH per site: the learned interval of adaptive pacing (fields PACE_FIELDS)
CONTENT = "content"      # HASH per site: whether a content check ever passed there (content.lua)
GWROT = "gwrot"          # HASH "<gateway id>|<site>" -> "rotations|window start ms" (gateway_rotate.lua)
GWEXIT = "gwexit"        # HASH exit IP -> "<proxy id>|<token>|until_ms": the gateway slot seen on it
GWBUSY = "gwbusy"        # HASH gateway slot id -> "lease token|expires_ms": its request in flight (lease.lua)
LINKBAN = "linkban"      # HASH proxy id -> "<site>|<until ms>": its latest rate ban (site_link.lua)
LINKEV = "linkev"        # HASH "<a>|<b>" -> "<first ms>|<proxy id>|...": evidence that a and b share a
#                          blacklist, or "-<ms>": a veto since then (site_link.lua)
LINKS = "links"          # HASH site -> its learned group's key, "~v" -> the map's version (site_link.lua)
KEY_SUFFIXES = (PROXIES, TAGS, ORDER, SITE, SITEIDX, READY, SESSION, BANS, BANIDX, PSTATS, HSTATS, SSTATS,
                SITESTATS, COUNTERS, WAITING, FREED, HOSTS, HOSTINFO, LOAD, DONE, META, BREAKER, BREAKER_SEEN,
                PACE, CONTENT, GWROT, GWEXIT, GWBUSY, LINKBAN, LINKEV, LINKS)
#: Keys of the layout before sites learnt proxies lazily (read only by the in-place migration,
#: ``PoolStore.migrate``: P:sites is the hash site -> slots per proxy, P:sitebuild is deleted).
LEGACY_SITES = "sites"
LEGACY_SITEBUILD = "sitebuild"
LEGACY_KEY_SUFFIXES = (LEGACY_SITES, LEGACY_SITEBUILD)
#: P:meta fields: the layout version (``LAYOUT``), and the last add number. Layout 3: a proxy's id is
#: the hash of its exit (host:port, a declared session), no longer of its URL; a pool written before
#: is re-keyed by the migration (``PoolStore.migrate``), so one pool never mixes the two id schemes.
META_LAYOUT = "layout"
LAYOUT = "3"
#: The hashes ``PoolStore.counters`` reads.
COUNTER_HASHES = (COUNTERS, PSTATS, HSTATS, SSTATS)

# --- counter fields: one name per meaning, on every scope that counts it ------------------------------
LEASES = "l"             # leases taken (proxy, host, site)
OK = "ok"                # responses judged fine (proxy, host, site)
ERRORS = "err"           # download errors (proxy, host, site)
BANNED = "banned"        # responses judged a ban (host, site)
QUARANTINES = "ban"      # quarantines started (proxy, site; per reason as ``ban:<reason>`` on a site)
LATENCY = "lat"          # EWMA response time in ms (proxy)
STALE = "stale"          # releases of a lease someone else holds now (pool, host)
EXPIRED = "expired"      # releases of a lease that had expired, unclaimed (pool, host)
REBINDS = "rebinds"      # sticky sessions moved to another proxy (pool)
Q_STARTED = "q_started"  # quarantines started (pool)
Q_MS = "q_ms"            # their total length in ms, less what unban cut short (pool)
BREAKER_OPENED = "brk_open"      # site circuit breaker opened (site)
BREAKER_REOPENED = "brk_reopen"  # re-opened after a probe was banned or a round of probes ran out (site)
BREAKER_CLOSED = "brk_close"     # closed by a probe answered fine (site)
BREAKER_SPARED = "brk_spared"    # bans while open or half-open: no quarantine, no strike (site)
GW_ROTATIONS = "gw_rot"   # gateway slots given a new token (pool)
GW_COOLDOWNS = "gw_cool"  # gateway bans quarantined because the site's rotation budget was spent (pool)
GW_SHARED = "gw_shared"   # gateway slots found on an exit IP another slot held (pool)
COUNTER_FIELDS = (LEASES, OK, ERRORS, BANNED, QUARANTINES, LATENCY, STALE, EXPIRED, REBINDS, Q_STARTED, Q_MS,
                  BREAKER_OPENED, BREAKER_REOPENED, BREAKER_CLOSED, BREAKER_SPARED, GW_ROTATIONS, GW_COOLDOWNS,
                  GW_SHARED)
#: Fields of a site's ``PACE`` hash (``pace_release`` in lua/_pace.lua), besides ``p:<proxy id>``: the interval
#: in force (ms), its last change, from when starts follow it, the clean run, the lowest interval known to fail,
#: counts (raises, lowerings, skipped rate bans, floors lowered, failed probes), the pending vote, the probe;
#: ``xp``: when the hash expires (ms; ``pace_keep`` refreshes its PEXPIRE from it); ``cc``...: requests in
#: flight per IP (``conc_release``). Not read here: ``ht``, the hash was converted to the hashtable encoding
#: (``pace_as_table``).
PACE_FIELDS = ("iv", "chg", "eff", "run", "bad", "up", "down", "skip", "forget", "fail", "back", "vote", "probe",
               "piv", "pat", "pn", "prev", "pend", "rest", "firm", "pls", "xp", "born", "pfc", "pfi", "lo",
               "cc", "bz", "ccp", "cct", "ccn", "cce")
#: Field prefix of a proxy's last answer on the site in a ``PACE`` hash (``c`` clean, ``b`` a ban).
PACE_PROXY = "p"
#: Field of a session hash (``SESSION`` key): the id of the proxy the session is bound to.
SESSION_PROXY = "p"
#: Before the rename, hosts counted responses judged a ban as ``<host>:ban``; a pool written by an
#: older version still holds it. Readers add it to ``banned`` (no migration step); never written now.
LEGACY_HOST_BANNED = "ban"


def owned(owner: str, counter: str) -> str:
    """The field of ``owner``'s counter in pstats/hstats/sstats: ``<owner>:<counter>``."""
    return f"{owner}:{counter}"


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")


def check_name(kind: str, value: object) -> str:
    """Validate a namespace or pool name: it becomes part of every key, so keep it plain.

    ``fullmatch``, not ``match`` with ``$``: ``$`` also matches before a trailing newline, which
    would let ``"pool\n"`` in as a second spelling of ``pool`` with keys of its own.
    """
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise SettingError(
            f"invalid {kind} name {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


#: Longest session id: it is part of a Redis key and of every status row that shows the session.
MAX_SESSION_ID = 200


def check_session_id(value: object) -> str | None:
    """``meta['session_id']`` as the string the engine keys the session by; None for no session.

    Only a non-empty printable string or an integer (not a bool) up to MAX_SESSION_ID characters
    names a session. Anything else (False, a dict, a 1 MB string) raises InvalidSessionId rather than
    becoming a session named ``"False"`` that unrelated requests would share.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InvalidSessionId(f"meta['session_id'] must be a string or an integer, got {type(value).__name__}")
    if not value.strip() or not value.isprintable() or len(value) > MAX_SESSION_ID:
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise InvalidSessionId(f"meta['session_id'] ({shown!r}, {len(value)} characters) must be 1-"
                               f"{MAX_SESSION_ID} printable characters, not only spaces")
    return value


def pool_prefix(namespace: str, pool: str) -> str:
    """The hash-tagged prefix of every key of one pool: ``{namespace:pool}``."""
    return f"{{{namespace}:{pool}}}"


def pools_registry(namespace: str) -> str:
    """SET of pool names in a namespace (its own slot; written only by admin operations)."""
    return f"{namespace}:pools"


def session_key(prefix: str, site: str, session_id: str) -> str:
    return f"{prefix}:{SESSION}:{site}:{session_id}"


def site_part(prefix: str, name: str, site: str) -> str:
    """A per-site structure: ``name`` is SITE, READY, WAITING, FREED, BREAKER or BREAKER_SEEN."""
    return f"{prefix}:{name}:{site}"


def memo_key(prefix: str, op: str, token: str) -> str:
    """The memoised reply of write script ``op`` for one call's token (``DONE``)."""
    return f"{prefix}:{DONE}:{op}:{token}"


def freed_key(prefix: str, site: str) -> str:
    return site_part(prefix, FREED, site)


def breaker_key(prefix: str, site: str) -> str:
    return site_part(prefix, BREAKER, site)


def pace_key(prefix: str, site: str) -> str:
    return f"{prefix}:{PACE}:{site}"


def sub_key(prefix: str, name: str) -> str:
    """A pool-level structure: ``name`` is one of KEY_SUFFIXES (``PROXIES``, ``BANS``, ...)."""
    return f"{prefix}:{name}"


# --- tier lists (PROXY_SHARD_TIERS, engine/tiers.py, lua/tier.lua) ------------------------------------
#: A tier list's keys are not a pool's: they share the list's own hash tag ``{namespace:tiers:a>b}``
#: (pool names cannot hold ">"), so every tier.lua call touches one Cluster slot.
TIER_SITE = "site"       # HASH per site: its tier and the evidence (fields in lua/tier.lua)
TIER_COUNTS = "counts"   # HASH "<counter>:<tier index>" (TIER_COUNTERS)
TIER_ON = "on"           # ZSET per tier index: site -> ms its tier state expires (the sites on it now)
#: Counters of a tier list, per tier index: leases, fine answers, bans, escalations to it, descents
#: to it, probes of it, probes of it banned.
TIER_COUNTERS = ("l", "ok", "ban", "up", "down", "probe", "pban")
TIER_SEP = ">"


def tiers_prefix(namespace: str, tiers: tuple[str, ...] | list[str]) -> str:
    """The hash-tagged prefix of one tier list's keys: ``{namespace:tiers:cheap>dear}``."""
    return f"{{{namespace}:tiers:{TIER_SEP.join(tiers)}}}"


def tiers_registry(namespace: str) -> str:
    """SET of the tier lists used in a namespace (``cheap>dear``), for the CLI and the exporter."""
    return f"{namespace}:tiers"
