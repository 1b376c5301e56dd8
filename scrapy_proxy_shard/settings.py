"""Every ``PROXY_SHARD_*`` setting: its default, its meaning, and its validation, in one module.

``ShardSettings.from_settings`` turns a Scrapy ``Settings`` object (or any mapping) into plain,
validated values once; nothing else reads settings. A bad value raises ``SettingError`` naming the
setting and the value, never a traceback from deep inside.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.proxies import mask, parse_proxy
from scrapy_proxy_shard.engine.schema import check_name
from scrapy_proxy_shard.exceptions import SettingError

DEFAULTS: dict[str, Any] = {
    "PROXY_SHARD_ENABLED": True,
    "PROXY_SHARD_REDIS_URL": None,  # falls back to scrapy-redis's REDIS_URL
    "PROXY_SHARD_REDIS_PARAMS": {},
    "PROXY_SHARD_NAMESPACE": "proxy_shard",
    "PROXY_SHARD_POOL": "default",
    "PROXY_SHARD_HOST_ID": None,  # default "<hostname>:<pid>"
    "PROXY_SHARD_LEASE_TTL": None,  # default max(60, DOWNLOAD_TIMEOUT + 30) seconds
    "PROXY_SHARD_MAX_WAIT": 60.0,
    "PROXY_SHARD_SITE_CONCURRENCY": 1,
    "PROXY_SHARD_MIN_INTERVAL": 1.0,
    "PROXY_SHARD_SESSION_TTL": 600.0,
    "PROXY_SHARD_SITES": {},
    "PROXY_SHARD_SITE_GROUPS": {},
    "PROXY_SHARD_BAN_TTL": 1800.0,
    "PROXY_SHARD_BAN_MAX_TTL": 21600.0,
    "PROXY_SHARD_BAN_JITTER": 0.1,
    "PROXY_SHARD_BAN_STRIKE_WINDOW": 86400.0,
    "PROXY_SHARD_DEAD_TTL": 300.0,
    "PROXY_SHARD_LATENCY_EWMA_ALPHA": 0.2,
    "PROXY_SHARD_SITE_POOLS": {},
    "PROXY_SHARD_PROXIES": None,
    "PROXY_SHARD_BAN_RETRIES": 5,
    "PROXY_SHARD_BAN_POLICY": "scrapy_proxy_shard.policy.BanPolicy",
    "PROXY_SHARD_HEARTBEAT_INTERVAL": 10.0,
    "PROXY_SHARD_HOST_TTL": None,  # default max(30, 3 x PROXY_SHARD_HEARTBEAT_INTERVAL) seconds
    "PROXY_SHARD_LOGSTATS_INTERVAL": 60.0,
    "PROXY_SHARD_MODE": "auto",
    "PROXY_SHARD_REDIS_CLUSTER": False,
    "PROXY_SHARD_REDIS_SENTINELS": None,
    "PROXY_SHARD_REDIS_SENTINEL_MASTER": None,
    "PROXY_SHARD_HOSTS": None,
    "PROXY_SHARD_SHARDING": "consistent",
    "PROXY_SHARD_PLATFORMS": {},
    "PROXY_SHARD_FALLBACK": True,
    "PROXY_SHARD_REDIS_DOWN_AT_START": "fail",
    "PROXY_SHARD_FALLBACK_GRACE": 10.0,
    "PROXY_SHARD_FALLBACK_WARMUP": 5.0,
    "PROXY_SHARD_SNAPSHOT_INTERVAL": 5.0,
}

MODES = ("auto", "redis", "embedded", "static")

SITE_OPTIONS = ("concurrency", "min_interval")

# Upper bounds (seconds unless said): far above any real use, far below what the Lua scripts' integer
# ms and Redis expiries can hold (a bigger value used to write half a lease and burn the slot forever).
MAX_LEASE_TTL = 86400.0  # also bounds DOWNLOAD_TIMEOUT and meta['download_timeout'] + the lease margin
MAX_SESSION_TTL = 7 * 86400.0
MAX_WAIT = 86400.0
MAX_INTERVAL = 86400.0
MAX_BAN_TTL = 30 * 86400.0
MAX_STRIKE_WINDOW = 365 * 86400.0
MAX_CONCURRENCY = 1000  # slots per proxy and site (MAX_CONCURRENCY in lua/_lib.lua)
MAX_PERIOD = 3600.0  # heartbeat, snapshot, fallback grace and warm-up


@dataclass(frozen=True)
class SiteOptions:
    """Per-site pacing: slots per proxy on the site, and rest between two uses of one slot."""

    concurrency: int
    min_interval: float


@dataclass(frozen=True)
class ShardSettings:
    """Validated settings of scrapy-proxy-shard (plain values; build it directly in tests)."""

    enabled: bool = True
    redis_url: str | None = None
    redis_params: Mapping[str, Any] = field(default_factory=dict)
    namespace: str = "proxy_shard"
    pool: str = "default"
    host_id: str = field(default_factory=lambda: default_host_id())
    lease_ttl: float = 210.0
    max_wait: float = 60.0
    site_concurrency: int = 1
    min_interval: float = 1.0
    session_ttl: float = 600.0
    sites: Mapping[str, SiteOptions] = field(default_factory=dict)
    site_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    bans: BanOptions = field(default_factory=BanOptions)
    latency_ewma_alpha: float = 0.2
    site_pools: Mapping[str, str] = field(default_factory=dict)
    proxies: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    ban_retries: int = 5
    ban_policy: str = "scrapy_proxy_shard.policy.BanPolicy"
    heartbeat_interval: float = 10.0
    host_ttl: float = 30.0
    logstats_interval: float = 60.0
    mode: str = "embedded"
    redis_cluster: bool = False
    redis_sentinels: tuple[tuple[str, int], ...] = ()
    redis_sentinel_master: str | None = None
    hosts: tuple[str, ...] = ()
    sharding: str = "consistent"
    platforms: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    fallback: bool = True
    redis_down_at_start: str = "fail"
    fallback_grace: float = 10.0
    fallback_warmup: float = 5.0
    snapshot_interval: float = 5.0

    @classmethod
    def from_settings(cls, settings: Any) -> ShardSettings:
        """Parse a Scrapy Settings object or a plain mapping."""
        get = _getter(settings)
        lease_ttl_raw = get("PROXY_SHARD_LEASE_TTL")
        if lease_ttl_raw is None:
            download_timeout = _number(get, "DOWNLOAD_TIMEOUT", 180.0, minimum=0.0, maximum=MAX_LEASE_TTL - 30.0)
            lease_ttl = max(60.0, download_timeout + 30.0)
        else:
            lease_ttl = _number(get, "PROXY_SHARD_LEASE_TTL", None, minimum=0.001, maximum=MAX_LEASE_TTL)
        redis_url = get("PROXY_SHARD_REDIS_URL") or get("REDIS_URL") or None
        if redis_url is not None and not isinstance(redis_url, str):
            raise SettingError(f"PROXY_SHARD_REDIS_URL ({mask(redis_url)!r}) must be a redis:// URL string")
        host_id = get("PROXY_SHARD_HOST_ID") or default_host_id()
        if not isinstance(host_id, str) or not host_id.strip() or "|" in host_id:
            raise SettingError(f"PROXY_SHARD_HOST_ID ({host_id!r}) must be a non-empty string without '|'")
        min_interval = _number(get, "PROXY_SHARD_MIN_INTERVAL", minimum=0.0, maximum=MAX_INTERVAL)
        concurrency = _integer(get, "PROXY_SHARD_SITE_CONCURRENCY", minimum=1, maximum=MAX_CONCURRENCY)
        session_ttl = _number(get, "PROXY_SHARD_SESSION_TTL", minimum=0.001, maximum=MAX_SESSION_TTL)
        bans = BanOptions(
            ttl=_number(get, "PROXY_SHARD_BAN_TTL", minimum=0.001, maximum=MAX_BAN_TTL),
            max_ttl=_number(get, "PROXY_SHARD_BAN_MAX_TTL", minimum=0.001, maximum=MAX_BAN_TTL),
            jitter=_number(get, "PROXY_SHARD_BAN_JITTER", minimum=0.0, maximum=1.0),
            strike_window=_number(get, "PROXY_SHARD_BAN_STRIKE_WINDOW", minimum=0.0, maximum=MAX_STRIKE_WINDOW),
            dead_ttl=_number(get, "PROXY_SHARD_DEAD_TTL", minimum=0.001, maximum=MAX_BAN_TTL),
        )
        if bans.max_ttl < bans.ttl:
            raise SettingError(
                f"PROXY_SHARD_BAN_MAX_TTL ({bans.max_ttl!r}) must be >= PROXY_SHARD_BAN_TTL ({bans.ttl!r})"
            )
        return cls(
            enabled=_boolean(get, "PROXY_SHARD_ENABLED"),
            redis_url=redis_url,
            redis_params=_mapping(get, "PROXY_SHARD_REDIS_PARAMS"),
            namespace=_name(get, "PROXY_SHARD_NAMESPACE", "namespace"),
            pool=_name(get, "PROXY_SHARD_POOL", "pool"),
            host_id=host_id,
            lease_ttl=lease_ttl,
            max_wait=_number(get, "PROXY_SHARD_MAX_WAIT", minimum=0.0, maximum=MAX_WAIT),
            site_concurrency=concurrency,
            min_interval=min_interval,
            session_ttl=session_ttl,
            sites=_sites(get, concurrency, min_interval),
            site_groups=_site_groups(get),
            bans=bans,
            latency_ewma_alpha=_number(get, "PROXY_SHARD_LATENCY_EWMA_ALPHA", minimum=0.001, maximum=1.0),
            site_pools=_site_pools(get),
            proxies=_initial_proxies(get, _name(get, "PROXY_SHARD_POOL", "pool")),
            ban_retries=_integer(get, "PROXY_SHARD_BAN_RETRIES", minimum=0),
            ban_policy=_dotted_path(get, "PROXY_SHARD_BAN_POLICY"),
            **_health(get),
            mode=_mode(get, redis_url or get("PROXY_SHARD_REDIS_SENTINELS")),
            redis_cluster=_boolean(get, "PROXY_SHARD_REDIS_CLUSTER"),
            redis_sentinels=_sentinels(get),
            redis_sentinel_master=_sentinel_master(get),
            hosts=_hosts(get, host_id),
            sharding=_choice(get, "PROXY_SHARD_SHARDING", ("consistent", "modulo")),
            platforms=_platforms(get),
            fallback=_boolean(get, "PROXY_SHARD_FALLBACK"),
            redis_down_at_start=_choice(get, "PROXY_SHARD_REDIS_DOWN_AT_START", ("fail", "fallback")),
            fallback_grace=_number(get, "PROXY_SHARD_FALLBACK_GRACE", minimum=0.0, maximum=MAX_PERIOD),
            fallback_warmup=_number(get, "PROXY_SHARD_FALLBACK_WARMUP", minimum=0.0, maximum=MAX_PERIOD),
            snapshot_interval=_number(get, "PROXY_SHARD_SNAPSHOT_INTERVAL", minimum=0.1, maximum=MAX_PERIOD),
        )

    def site_options(self, site: str) -> SiteOptions:
        """Pacing for a site key (a registrable domain or a site group)."""
        return self.sites.get(site) or SiteOptions(self.site_concurrency, self.min_interval)


def default_host_id() -> str:
    """``hostname:pid``: unique per Scrapy process on a cluster, readable in status output."""
    return f"{socket.gethostname()}:{os.getpid()}"


# --- parsing helpers: each names the setting and the bad value ---------------------------------

def _getter(settings: Any):
    if hasattr(settings, "get") and callable(settings.get):
        def get(name: str, default: Any = None) -> Any:
            value = settings.get(name)
            if value is None:
                return DEFAULTS.get(name, default)
            return value
        return get
    raise SettingError(f"settings must be a Scrapy Settings object or a mapping, got {type(settings).__name__}")


def _number(get, name: str, default: Any = None, *, minimum: float | None = None,
            maximum: float | None = None) -> float:
    raw = get(name, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise SettingError(f"{name} ({raw!r}) must be a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingError(f"{name} ({raw!r}) must be a finite number")
    if minimum is not None and value < minimum:
        raise SettingError(f"{name} ({raw!r}) must be >= {minimum:g}")
    if maximum is not None and value > maximum:
        raise SettingError(f"{name} ({raw!r}) must be <= {maximum:g}")
    return value


def _integer(get, name: str, default: Any = None, *, minimum: int | None = None,
             maximum: int | None = None) -> int:
    raw = get(name, default)
    if isinstance(raw, bool):
        raise SettingError(f"{name} ({raw!r}) must be a whole number")
    try:
        value = int(raw)
        if isinstance(raw, float) and raw != value:
            raise ValueError
    except (TypeError, ValueError):
        raise SettingError(f"{name} ({raw!r}) must be a whole number") from None
    if minimum is not None and value < minimum:
        raise SettingError(f"{name} ({raw!r}) must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise SettingError(f"{name} ({raw!r}) must be <= {maximum}")
    return value


def _boolean(get, name: str) -> bool:
    raw = get(name)
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    raise SettingError(f"{name} ({raw!r}) must be True or False")


def _mapping(get, name: str) -> dict:
    raw = get(name)
    if raw is None:
        return {}
    if hasattr(raw, "copy_to_dict"):
        raw = raw.copy_to_dict()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise SettingError(f"{name} ({_shown(name, raw)}) must be a dict or a JSON object") from None
    if not isinstance(raw, Mapping):
        raise SettingError(f"{name} ({_shown(name, raw)}) must be a dict")
    return dict(raw)


#: Settings whose values may hold a password (redis-py's ``password=``): errors never echo them.
_SECRET_SETTINGS = {"PROXY_SHARD_REDIS_PARAMS"}


def _shown(name: str, raw: Any) -> str:
    """A setting's value for an error message: the value, or only its type for a secret-bearing one."""
    return f"a {type(raw).__name__}" if name in _SECRET_SETTINGS else repr(raw)


def _name(get, name: str, kind: str) -> str:
    try:
        return check_name(kind, get(name))
    except SettingError as exc:
        raise SettingError(f"{name}: {exc}") from None


def _sites(get, concurrency: int, min_interval: float) -> dict[str, SiteOptions]:
    from scrapy_proxy_shard.engine.sites import check_site

    out: dict[str, SiteOptions] = {}
    for site, options in _mapping(get, "PROXY_SHARD_SITES").items():
        key = check_site(site, "PROXY_SHARD_SITES")
        if not isinstance(options, Mapping):
            raise SettingError(f"PROXY_SHARD_SITES[{site!r}] ({options!r}) must be a dict")
        unknown = set(options) - set(SITE_OPTIONS) - _EXTRA_SITE_OPTIONS
        if unknown:
            raise SettingError(
                f"PROXY_SHARD_SITES[{site!r}]: unknown option(s) {sorted(unknown)} "
                f"(known: {sorted(set(SITE_OPTIONS) | _EXTRA_SITE_OPTIONS)})"
            )
        sub = {**options}

        def site_get(key: str, default: Any = None, _sub=sub) -> Any:
            return _sub.get(key.rsplit(".", 1)[-1], default)

        prefix = f"PROXY_SHARD_SITES[{site!r}]"
        c = _integer(site_get, f"{prefix}.concurrency", concurrency, minimum=1, maximum=MAX_CONCURRENCY)
        i = _number(site_get, f"{prefix}.min_interval", min_interval, minimum=0.0, maximum=MAX_INTERVAL)
        out[key] = SiteOptions(c, i)
    return out


# Options read by the ban-detection policy (validated there); accepted here so one dict serves both.
_EXTRA_SITE_OPTIONS = {"required_css", "min_body_size", "min_body_ratio", "ban_codes", "captcha_patterns"}


def _site_groups(get) -> dict[str, tuple[str, ...]]:
    from scrapy_proxy_shard.engine.sites import SITE_KEY_RE, check_site

    out: dict[str, tuple[str, ...]] = {}
    for group, members in _mapping(get, "PROXY_SHARD_SITE_GROUPS").items():
        if not isinstance(group, str) or not SITE_KEY_RE.fullmatch(group):
            raise SettingError(f"PROXY_SHARD_SITE_GROUPS: invalid group name {group!r} "
                               "(letters, digits, '.', '_' and '-'; '*' is reserved for proxy-wide)")
        if isinstance(members, str):
            members = [members]
        if not isinstance(members, (list, tuple, set, frozenset)) or not members:
            raise SettingError(
                f"PROXY_SHARD_SITE_GROUPS[{group!r}] ({members!r}) must be a non-empty list of sites"
            )
        out[group] = tuple(check_site(m, f"PROXY_SHARD_SITE_GROUPS[{group!r}]") for m in members)
    return out


def _site_pools(get) -> dict[str, str]:
    from scrapy_proxy_shard.engine.sites import check_site

    out: dict[str, str] = {}
    for site, pool in _mapping(get, "PROXY_SHARD_SITE_POOLS").items():
        try:
            check_name("pool", pool)
        except SettingError as exc:
            raise SettingError(f"PROXY_SHARD_SITE_POOLS[{site!r}]: {exc}") from None
        out[check_site(site, "PROXY_SHARD_SITE_POOLS")] = pool
    return out


def _initial_proxies(get, default_pool: str) -> dict[str, tuple[str, ...]]:
    """PROXY_SHARD_PROXIES: a list (for the default pool) or {pool: list}, loaded when a spider opens.

    A string (``-s PROXY_SHARD_PROXIES=...``, an environment variable) is split on whitespace only,
    never on commas: a password may hold a comma, and splitting it would load half a URL and print
    the other half in the error. Every entry is validated here, so a typo stops the crawl at start.
    """
    raw = get("PROXY_SHARD_PROXIES")
    if raw is None:
        return {}
    if hasattr(raw, "copy_to_dict"):
        raw = raw.copy_to_dict()
    if isinstance(raw, str):
        raw = raw.split()
    if isinstance(raw, (list, tuple)):
        raw = {default_pool: raw}
    if not isinstance(raw, Mapping):
        raise SettingError(
            f"PROXY_SHARD_PROXIES ({type(raw).__name__}) must be a list of proxy URLs or {{pool: [urls]}}"
        )
    out: dict[str, tuple[str, ...]] = {}
    for pool, entries in raw.items():
        try:
            check_name("pool", pool)
        except SettingError as exc:
            raise SettingError(f"PROXY_SHARD_PROXIES: {exc}") from None
        if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
            raise SettingError(f"PROXY_SHARD_PROXIES[{pool!r}] must be a list of proxy URLs")
        for n, entry in enumerate(entries, start=1):
            _check_proxy_entry(pool, n, entry)
        out[pool] = tuple(entries)
    return out


def _check_proxy_entry(pool: str, n: int, entry: Any) -> None:
    try:
        parse_proxy(entry)
    except ValueError as exc:
        hint = (" (a PROXY_SHARD_PROXIES string is split on spaces and newlines only, never on commas: "
                "a password may contain one)") if isinstance(entry, str) and "," in entry else ""
        raise SettingError(f"PROXY_SHARD_PROXIES[{pool!r}] entry {n}: {exc}{hint}") from None


def _dotted_path(get, name: str) -> str:
    raw = get(name)
    if not isinstance(raw, str) or "." not in raw:
        raise SettingError(f"{name} ({raw!r}) must be a dotted import path such as 'package.module.Class'")
    return raw


def _choice(get, name: str, allowed: tuple[str, ...]) -> str:
    raw = get(name)
    if raw not in allowed:
        raise SettingError(f"{name} ({raw!r}) must be one of {', '.join(repr(a) for a in allowed)}")
    return raw


def _mode(get, redis_url: str | None) -> str:
    """``auto``: Redis when a URL is set, else the embedded single-host engine."""
    mode = _choice(get, "PROXY_SHARD_MODE", MODES)
    if mode == "auto":
        return "redis" if redis_url else "embedded"
    if mode == "redis" and not redis_url:
        raise SettingError("PROXY_SHARD_MODE is 'redis' but PROXY_SHARD_REDIS_URL (or REDIS_URL) is not set")
    return mode


def _hosts(get, host_id: str) -> tuple[str, ...]:
    raw = get("PROXY_SHARD_HOSTS")
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [h for h in raw.split(",") if h.strip()]
    if not isinstance(raw, (list, tuple)) or not all(isinstance(h, str) and h.strip() for h in raw):
        raise SettingError(f"PROXY_SHARD_HOSTS ({raw!r}) must be a list of host ids")
    hosts = tuple(dict.fromkeys(h.strip() for h in raw))
    if host_id not in hosts:
        raise SettingError(f"PROXY_SHARD_HOST_ID ({host_id!r}) must be one of PROXY_SHARD_HOSTS {list(hosts)!r}")
    return hosts


def _platforms(get) -> dict[str, tuple[str, ...]]:
    from scrapy_proxy_shard.engine.sites import check_site

    out: dict[str, tuple[str, ...]] = {}
    for platform, sites in _mapping(get, "PROXY_SHARD_PLATFORMS").items():
        try:
            check_name("platform", platform)
        except SettingError as exc:
            raise SettingError(f"PROXY_SHARD_PLATFORMS: {exc}") from None
        if isinstance(sites, str):
            sites = [sites]
        if not isinstance(sites, (list, tuple)) or not sites:
            raise SettingError(f"PROXY_SHARD_PLATFORMS[{platform!r}] must be a non-empty list of sites")
        out[platform] = tuple(check_site(s, f"PROXY_SHARD_PLATFORMS[{platform!r}]") for s in sites)
    return out


def _health(get) -> dict[str, float]:
    """Heartbeat, host TTL and log line intervals (health.py): a host TTL must outlast a few beats."""
    interval = _number(get, "PROXY_SHARD_HEARTBEAT_INTERVAL", minimum=0.01, maximum=MAX_PERIOD)
    if get("PROXY_SHARD_HOST_TTL") is None:
        host_ttl = max(30.0, 3 * interval)
    else:
        host_ttl = _number(get, "PROXY_SHARD_HOST_TTL", minimum=0.01, maximum=MAX_LEASE_TTL)
        if host_ttl <= interval:
            raise SettingError(
                f"PROXY_SHARD_HOST_TTL ({host_ttl!r}) must be longer than PROXY_SHARD_HEARTBEAT_INTERVAL "
                f"({interval!r}), or every host would age out between two heartbeats"
            )
    return {"heartbeat_interval": interval, "host_ttl": host_ttl,
            "logstats_interval": _number(get, "PROXY_SHARD_LOGSTATS_INTERVAL", minimum=0.0, maximum=MAX_LEASE_TTL)}


def _sentinels(get) -> tuple[tuple[str, int], ...]:
    raw = get("PROXY_SHARD_REDIS_SENTINELS")
    if not raw:
        return ()
    if isinstance(raw, str):
        raw = [part for part in raw.split(",") if part.strip()]
    if not isinstance(raw, (list, tuple)):
        raise SettingError(f"PROXY_SHARD_REDIS_SENTINELS ({type(raw).__name__} {mask(str(raw))!r}) must be a "
                           "list of 'host:port' strings or one string 'host:port,host:port'")
    out = []
    for entry in raw:
        host, sep, port = str(entry).strip().rpartition(":")
        if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingError(f"PROXY_SHARD_REDIS_SENTINELS: {mask(str(entry))!r} is not host:port")
        out.append((host, int(port)))
    return tuple(out)


def _sentinel_master(get) -> str | None:
    name = get("PROXY_SHARD_REDIS_SENTINEL_MASTER")
    if get("PROXY_SHARD_REDIS_SENTINELS") and not name:
        raise SettingError("PROXY_SHARD_REDIS_SENTINELS is set: PROXY_SHARD_REDIS_SENTINEL_MASTER must name the master")
    return name or None
