"""Every ``PROXY_SHARD_*`` setting: its default, its meaning, and its validation, in one module.

``ShardSettings.for_crawler`` parses a crawler's settings once into one frozen object that both
middlewares, the runtime and the ban policy share (``from_settings`` parses any Scrapy ``Settings``
or plain mapping, for tests and the CLI); nothing else reads ``PROXY_SHARD_*`` settings. ``DEFAULTS``
is the one table of defaults: the dataclass field defaults are parsed from it, and the settings
reference (``reference/settings.py``, the docs page) is checked against it (tests/test_settings_table.py).
A bad value raises ``SettingError`` naming the setting and the value, never a traceback from deep inside.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import logging
import os
import re
import socket
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from cssselect import SelectorError
from parsel.csstranslator import HTMLTranslator
from scrapy.exceptions import ScrapyDeprecationWarning
from scrapy.settings import BaseSettings

from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.breaker import BreakerOptions
from scrapy_proxy_shard.engine.gateway import GatewayOptions, as_entry, is_gateway_entry, parse_gateway
from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.proxies import Proxy, mask, parse_proxy
from scrapy_proxy_shard.engine.proxyfile import read_proxy_file
from scrapy_proxy_shard.engine.schema import NAME_RE, check_name
from scrapy_proxy_shard.engine.tiers import TierOptions
from scrapy_proxy_shard.exceptions import ProxyURLError, SettingError

logger = logging.getLogger(__name__)

DEFAULT_BAN_CODES: tuple[int, ...] = (403, 429, 503)
DEFAULT_PROXY_FAILURE_CODES: tuple[int, ...] = (407,)
#: Ban reasons (``Verdict.reason``) that say "too fast" rather than "this IP": they may raise a site's
#: learned interval under adaptive pacing (docs/pacing.md).
DEFAULT_RATE_BAN_REASONS: tuple[str, ...] = ("http_429", "http_503", "challenge_redirect", "challenge_page")

#: Where anti-bot systems send a client they distrust; searched (case-insensitively) in a URL's host
#: and in its path + query.
DEFAULT_CHALLENGE_REGEXES: tuple[str, ...] = (
    r"captcha",
    r"challenge",
    r"/cdn-cgi/",
    r"are-?you-?human",
    r"/blocked",
    r"px-captcha",
    r"distil",
    r"/sorry/",
    r"/login",
    r"/signin",
    r"verify",
)
DEFAULT_CHALLENGE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE) for p in DEFAULT_CHALLENGE_REGEXES
)

#: Decoding for content checks stops past this many bytes when DOWNLOAD_MAXSIZE is not given
#: (Scrapy's own default of DOWNLOAD_MAXSIZE).
DEFAULT_MAX_DECODED_SIZE = 1024 * 1024 * 1024

#: The one table of defaults: every setting the plugin reads, and nothing else.
DEFAULTS: dict[str, Any] = {
    "PROXY_SHARD_ENABLED": True,
    "PROXY_SHARD_REDIS_URL": None,  # falls back to scrapy-redis's REDIS_URL
    "PROXY_SHARD_REDIS_PARAMS": {},
    "PROXY_SHARD_REDIS_CLIENT": None,  # an asyncio client, or a callable making one, instead of the URL
    "PROXY_SHARD_NAMESPACE": "proxy_shard",
    "PROXY_SHARD_POOL": "default",
    "PROXY_SHARD_HOST_ID": None,  # default "<hostname>:<pid>" (":<n>" added for the n-th crawler of a process)
    "PROXY_SHARD_LEASE_TTL": None,  # default max(60, DOWNLOAD_TIMEOUT + 30) seconds
    "PROXY_SHARD_MAX_WAIT": 60.0,  # only waits with no known end (a lost pool, Redis stalled or away)
    "PROXY_SHARD_PAUSE_HORIZON": 3600.0,  # a site no proxy can serve for longer closes the crawl
    "PROXY_SHARD_PAUSE_LOG_INTERVAL": 60.0,  # one WARNING per paused (pool, site) this often
    "PROXY_SHARD_SITE_CONCURRENCY": 1,
    "PROXY_SHARD_MIN_INTERVAL": 1.0,  # start-to-start, per IP, site and slot
    "PROXY_SHARD_REST_AFTER_RESPONSE": 0.0,
    "PROXY_SHARD_RANDOMIZE_INTERVAL": False,
    "PROXY_SHARD_ARRIVAL_GUARD": 0.0,  # x the interval: the most a late arrival may push the next start
    # "auto": adaptive pacing where the site's rule is not given (no PROXY_SHARD_MIN_INTERVAL, or a site
    # entry's min_interval, set); True / False: everywhere / nowhere (a site entry may still say)
    "PROXY_SHARD_AUTOTHROTTLE_ENABLED": "auto",
    "PROXY_SHARD_AUTOTHROTTLE_START_INTERVAL": 3.0,  # polite: above most published rules; descends fast
    "PROXY_SHARD_AUTOTHROTTLE_MIN_INTERVAL": 0.1,
    "PROXY_SHARD_AUTOTHROTTLE_MAX_INTERVAL": 60.0,
    "PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS": DEFAULT_RATE_BAN_REASONS,
    "PROXY_SHARD_AUTOTHROTTLE_BAN_TTL": 1.0,
    "PROXY_SHARD_AUTOTHROTTLE_OVERLAP": False,
    "PROXY_SHARD_SESSION_TTL": 600.0,
    "PROXY_SHARD_SITE_IDLE_TTL": 3600.0,  # a site's slot state expires this long after its last use
    "PROXY_SHARD_SITES": {},
    "PROXY_SHARD_SITE_GROUPS": {},
    "PROXY_SHARD_LEARN_SITE_GROUPS": "auto",  # learn shared blacklists from bans (crawl/links.py); auto: on
    #                                           adaptively paced sites (the rule not given)
    "PROXY_SHARD_BAN_TTL": 1800.0,
    "PROXY_SHARD_BAN_MAX_TTL": 21600.0,
    "PROXY_SHARD_BAN_JITTER": 0.1,
    "PROXY_SHARD_BAN_STRIKE_WINDOW": 86400.0,
    "PROXY_SHARD_RETRY_AFTER": True,  # a ban answer's Retry-After sets its quarantine (capped at BAN_MAX_TTL)
    "PROXY_SHARD_DEAD_TTL": 300.0,
    "PROXY_SHARD_LATENCY_EWMA_ALPHA": 0.2,
    "PROXY_SHARD_SITE_POOLS": {},
    "PROXY_SHARD_PROXIES": None,
    "PROXY_SHARD_PROXIES_PATH": None,  # a proxy list file (one per line) for PROXY_SHARD_POOL, or {pool: path}
    "PROXY_SHARD_BAN_RETRIES": 5,
    "PROXY_SHARD_BAN_POLICY": "scrapy_proxy_shard.policy.BanPolicy",
    "PROXY_SHARD_BAN_CODES": DEFAULT_BAN_CODES,
    "PROXY_SHARD_PROXY_FAILURE_CODES": DEFAULT_PROXY_FAILURE_CODES,
    "PROXY_SHARD_CHALLENGE_PATTERNS": DEFAULT_CHALLENGE_REGEXES,
    "PROXY_SHARD_REQUIRED_CSS": (),
    "PROXY_SHARD_SMALL_BODY_RATIO": 0.2,
    "PROXY_SHARD_SMALL_BODY_MIN_SAMPLES": 10,
    "PROXY_SHARD_HEARTBEAT_INTERVAL": 10.0,
    "PROXY_SHARD_HOST_TTL": None,  # default max(30, 3 x PROXY_SHARD_HEARTBEAT_INTERVAL) seconds
    "PROXY_SHARD_LOGSTATS_INTERVAL": 60.0,
    "PROXY_SHARD_MODE": "auto",
    "PROXY_SHARD_REDIS_CLUSTER": False,
    "PROXY_SHARD_REDIS_PIPELINE": True,  # lease/release scripts pipelined on one connection (plain client)
    "PROXY_SHARD_REDIS_FUNCTIONS": True,  # lease/release as Redis Functions (FCALL) where Redis has them
    "PROXY_SHARD_REDIS_SENTINELS": None,
    "PROXY_SHARD_REDIS_SENTINEL_MASTER": None,
    "PROXY_SHARD_HOSTS": None,
    "PROXY_SHARD_SHARDING": "consistent",
    "PROXY_SHARD_PLATFORMS": {},
    "PROXY_SHARD_FALLBACK": True,
    "PROXY_SHARD_REDIS_DOWN_AT_START": "fail",
    "PROXY_SHARD_REDIS_EVICTION": "refuse",
    "PROXY_SHARD_FALLBACK_GRACE": 10.0,
    "PROXY_SHARD_FALLBACK_AFTER": 10.0,
    "PROXY_SHARD_FALLBACK_WARMUP": 5.0,
    "PROXY_SHARD_SNAPSHOT_INTERVAL": 5.0,
    "PROXY_SHARD_METRICS_TOP_SITES": 50,
    "PROXY_SHARD_BREAKER_ENABLED": True,
    "PROXY_SHARD_BREAKER_THRESHOLD": 5,
    "PROXY_SHARD_BREAKER_MIN_PROXIES": 3,
    "PROXY_SHARD_BREAKER_WINDOW": 60.0,
    "PROXY_SHARD_BREAKER_COOLOFF": 30.0,
    "PROXY_SHARD_BREAKER_MAX_COOLOFF": 600.0,
    "PROXY_SHARD_BREAKER_PROBES": 3,
    "PROXY_SHARD_CONTENT_SUSPECT_PROXIES": 3,  # distinct proxies failing a never-passed content check
    "PROXY_SHARD_PROXY_AWARE_HANDLERS": (),  # download handlers you vouch send requests through meta['proxy']
    "PROXY_SHARD_ALLOW_DIRECT": False,  # meta['proxy_shard'] = False may send a request from this host's IP
    # Tiered pools (crawl/tiers.py): pools cheap -> expensive; per site the cluster moves up on blocks
    "PROXY_SHARD_TIERS": None,
    "PROXY_SHARD_TIER_MIN_ANSWERS": 8,  # answers on a tier before its ban ratio can move a site up
    "PROXY_SHARD_TIER_BAN_RATIO": 0.5,  # bans / answers on a tier that move a site up
    "PROXY_SHARD_TIER_WINDOW": 300.0,  # the evidence counts half after this long
    "PROXY_SHARD_TIER_PROBE_INTERVAL": 60.0,  # first probe of the lower tier; doubles when a probe is banned
    "PROXY_SHARD_TIER_MAX_PROBE_INTERVAL": 3600.0,
    "PROXY_SHARD_GATEWAY_ROTATIONS": None,  # fresh IPs in a row per gateway and site; None: min(5, sessions)
    "PROXY_SHARD_GATEWAY_ROTATION_WINDOW": 600.0,
    "PROXY_SHARD_GATEWAY_EXIT_HEADER": None,  # a response header a gateway reports its exit IP in
}

#: Unknown ``PROXY_SHARD_*`` names (``check_setting_names``). The rule: a name whose closest known
#: setting decides *what the hosts share* is an ERROR (the crawl does not start), any other a WARNING.
#: Misspelling one of these does not make a crawl fail or slow: it makes hosts quietly stop
#: coordinating, which nobody sees until a site bans the proxies (a misspelt Redis URL runs the
#: embedded engine, a private pool per host; a misspelt namespace, pool or static-mode host list
#: gives hosts different keys or overlapping slices; a misspelt proxy list leaves a pool to whatever
#: else loads it). Pacing, ban, content and health settings only change how this host behaves inside
#: the shared pool, and keep their defaults: a WARNING names them. Each value says what it decides.
COORDINATION_SETTINGS: dict[str, str] = {
    **dict.fromkeys(("PROXY_SHARD_REDIS_URL", "PROXY_SHARD_REDIS_PARAMS", "PROXY_SHARD_REDIS_CLIENT",
                     "PROXY_SHARD_REDIS_CLUSTER", "PROXY_SHARD_REDIS_SENTINELS",
                     "PROXY_SHARD_REDIS_SENTINEL_MASTER"), "which Redis the hosts share"),
    "PROXY_SHARD_MODE": "whether the hosts share one pool",
    "PROXY_SHARD_NAMESPACE": "which keys the hosts share",
    **dict.fromkeys(("PROXY_SHARD_POOL", "PROXY_SHARD_SITE_POOLS", "PROXY_SHARD_PLATFORMS", "PROXY_SHARD_TIERS"),
                    "which pool the hosts lease from"),
    **dict.fromkeys(("PROXY_SHARD_SITE_GROUPS", "PROXY_SHARD_LEARN_SITE_GROUPS"), "which sites the hosts pace as one"),
    **dict.fromkeys(("PROXY_SHARD_PROXIES", "PROXY_SHARD_PROXIES_PATH"), "which proxies are in the pool"),
    **dict.fromkeys(("PROXY_SHARD_HOSTS", "PROXY_SHARD_HOST_ID", "PROXY_SHARD_SHARDING"),
                    "how the proxies are split between hosts"),
}
#: Names read by the plugin that are not ``DEFAULTS`` keys (a deprecated name still honoured would go
#: here): known, so never reported. Today every name read is in ``DEFAULTS``.
OTHER_KNOWN_SETTINGS: frozenset[str] = frozenset()
_PREFIX = "PROXY_SHARD_"

MODES = ("auto", "redis", "embedded", "static")
EVICTION_CHOICES = ("refuse", "warn")

#: Options of a ``PROXY_SHARD_SITES`` entry: pacing for the lease engine, content rules for the policy.
SITE_PACING_OPTIONS = ("concurrency", "min_interval", "rest_after_response", "randomize_interval", "arrival_guard",
                       "autothrottle_enabled", "autothrottle_start_interval", "autothrottle_min_interval",
                       "autothrottle_max_interval")
SITE_POLICY_OPTIONS = ("required_css", "min_body_size", "min_body_ratio", "ban_codes", "challenge_patterns")
#: The site circuit breaker's options (``PROXY_SHARD_BREAKER_<NAME>`` as ``breaker_<name>``).
BREAKER_FIELDS = ("threshold", "min_proxies", "window", "cooloff", "max_cooloff", "probes")
SITE_BREAKER_OPTIONS = ("breaker_enabled", *(f"breaker_{name}" for name in BREAKER_FIELDS))
SITE_OPTIONS = SITE_PACING_OPTIONS + SITE_POLICY_OPTIONS + SITE_BREAKER_OPTIONS
#: Old per-site option names still accepted (with a deprecation warning): old name -> new name.
RENAMED_SITE_OPTIONS = {"captcha_patterns": "challenge_patterns"}

# Upper bounds (seconds unless said): far above any real use, far below what the Lua scripts' integer
# ms and Redis expiries can hold (a bigger value used to write half a lease and burn the slot forever).
MAX_LEASE_TTL = 86400.0  # also bounds DOWNLOAD_TIMEOUT and meta['download_timeout'] + the lease margin
MAX_SESSION_TTL = 7 * 86400.0
MAX_WAIT = 86400.0
MAX_INTERVAL = 86400.0
MAX_ARRIVAL_GUARD = 2.0  # x the interval
#: Longest factor of a randomized interval ([0.5, 1.5) x the interval, as RANDOMIZE_DOWNLOAD_DELAY).
RANDOMIZED_MAX = 1.5
MAX_BAN_TTL = 30 * 86400.0
MAX_STRIKE_WINDOW = 365 * 86400.0
MAX_CONCURRENCY = 1000  # slots per proxy and site (MAX_CONCURRENCY in lua/_lib.lua)
MAX_PERIOD = 3600.0  # heartbeat, snapshot, fallback grace and warm-up
MAX_BREAKER_COUNT = 1000  # breaker threshold and min proxies
MAX_BREAKER_PROBES = 100


@dataclass(frozen=True)
class SiteOptions:
    """Per-site pacing: slots per proxy on the site; the least gap between two request starts on one
    slot (start-to-start, what a site's rate limit counts); an optional pause after each response; and
    whether each release draws its interval from [0.5, 1.5) x ``min_interval``."""

    concurrency: int
    min_interval: float
    rest_after_response: float = 0.0
    randomize_interval: bool = False
    #: Adaptive pacing (``PROXY_SHARD_AUTOTHROTTLE_*``): when enabled, the interval learned in Redis for
    #: the site replaces ``min_interval``. None: off.
    autothrottle: AutothrottleOptions | None = None
    #: The arrival guard (``PROXY_SHARD_ARRIVAL_GUARD``): a slot's next start may be pushed back by at
    #: most this x the interval when its last request reached the site late (crawl/arrival.py). 0: off.
    arrival_guard: float = DEFAULTS["PROXY_SHARD_ARRIVAL_GUARD"]

    def longest_gap(self, interval: float, raised: float = 1.0) -> float:
        """The longest a release can put between two starts of one slot paced at ``interval``: the
        interval (x ``raised``: what another host may have raised a learned one to since), x
        RANDOMIZED_MAX when randomized, plus the arrival guard's longest shift (guard x ``interval``);
        or the rest after a response, if longer."""
        randomized = RANDOMIZED_MAX if self.randomize_interval else 1.0
        return max(interval * raised * randomized + self.arrival_guard * interval, self.rest_after_response)


@dataclass(frozen=True)
class SiteContentRules:
    """Per-site overrides (keyed by registrable domain); ``None`` / empty means "use the global value".

    ``ban_codes`` and ``challenge_patterns`` replace the global lists for the site (so a site whose
    real pages live under ``/login`` can drop that pattern). ``min_body_size`` is a hard floor on the
    decoded body, checked in addition to the learned-median rule; ``min_body_ratio`` = 0 disables
    the learned rule for the site.
    """

    required_css: tuple[str, ...] = ()
    min_body_size: int | None = None
    min_body_ratio: float | None = None
    ban_codes: frozenset[int] | None = None
    challenge_patterns: tuple[re.Pattern[str], ...] | None = None


def _table(name: str) -> Callable[[], Any]:
    """A field's default factory: its value in the parsed ``DEFAULTS`` table (so the two cannot disagree)."""
    return lambda: getattr(_parsed_defaults(), name)


@dataclass(frozen=True)
class PolicyOptions:
    """What the ban policy is configured with (``BanPolicy.from_options``); parsed with the rest."""

    ban_codes: frozenset[int] = frozenset(DEFAULT_BAN_CODES)
    proxy_failure_codes: frozenset[int] = frozenset(DEFAULT_PROXY_FAILURE_CODES)
    challenge_patterns: tuple[re.Pattern[str], ...] = DEFAULT_CHALLENGE_PATTERNS
    required_css: tuple[str, ...] = DEFAULTS["PROXY_SHARD_REQUIRED_CSS"]
    site_rules: Mapping[str, SiteContentRules] = field(default_factory=dict)
    small_body_ratio: float = DEFAULTS["PROXY_SHARD_SMALL_BODY_RATIO"]
    small_body_min_samples: int = DEFAULTS["PROXY_SHARD_SMALL_BODY_MIN_SAMPLES"]
    max_decoded_size: int = DEFAULT_MAX_DECODED_SIZE

    @classmethod
    def from_settings(cls, settings: Any) -> PolicyOptions:
        """Only the policy's settings (``BanPolicy.from_settings``); crawls get them from ShardSettings."""
        s = _settings(settings)
        return cls._parse(s, _site_rules(_site_entries(s)))

    @classmethod
    def _parse(cls, s: BaseSettings, site_rules: dict[str, SiteContentRules]) -> PolicyOptions:
        get = _getter(s)
        max_size = s.get("DOWNLOAD_MAXSIZE")
        return cls(
            ban_codes=_codes(s, "PROXY_SHARD_BAN_CODES"),
            proxy_failure_codes=_codes(s, "PROXY_SHARD_PROXY_FAILURE_CODES"),
            challenge_patterns=_setting_patterns(get, "PROXY_SHARD_CHALLENGE_PATTERNS"),
            required_css=_setting_css(get, "PROXY_SHARD_REQUIRED_CSS"),
            site_rules=site_rules,
            small_body_ratio=_ratio(get, "PROXY_SHARD_SMALL_BODY_RATIO"),
            small_body_min_samples=_integer(get, "PROXY_SHARD_SMALL_BODY_MIN_SAMPLES", minimum=1),
            max_decoded_size=(DEFAULT_MAX_DECODED_SIZE if max_size is None
                              else _integer(get, "DOWNLOAD_MAXSIZE", minimum=0)),
        )

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``BanPolicy`` (shallow: the rules stay the frozen objects they are)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _defaults_from_table(cls: type) -> type:
    """Give each field declared without a default the parsed table's value (runs before ``@dataclass``)."""
    for name in cls.__annotations__:
        if name not in cls.__dict__:
            setattr(cls, name, field(default_factory=_table(name)))
    return cls


@dataclass(frozen=True)
@_defaults_from_table
class ShardSettings:
    """Validated settings of scrapy-proxy-shard (plain values; build it directly in tests).

    A field declared without a default takes its value from ``DEFAULTS`` as ``from_settings({})``
    parses it (``_defaults_from_table``), so the table is the only place a default is written.
    """

    enabled: bool
    redis_url: str | None
    #: The setting ``redis_url`` came from: PROXY_SHARD_REDIS_URL, else scrapy-redis' REDIS_URL (None: neither).
    redis_url_setting: str | None = None
    redis_params: Mapping[str, Any]
    redis_client: Any = None  # PROXY_SHARD_REDIS_CLIENT: used as given (a client object or a factory)
    namespace: str
    pool: str
    host_id: str = field(default_factory=lambda: default_host_id())
    lease_ttl: float
    max_wait: float
    pause_horizon: float
    pause_log_interval: float
    site_concurrency: int
    min_interval: float
    #: Scrapy's DOWNLOAD_DELAY (the startproject template writes 1): the floor of every interval, kept per
    #: IP and site at the lease for every host (``min_interval`` and the adaptive bounds include it).
    download_delay: float = 0.0
    rest_after_response: float
    randomize_interval: bool
    arrival_guard: float
    autothrottle: AutothrottleOptions
    autothrottle_ban_reasons: frozenset[str]
    autothrottle_ban_ttl: float
    session_ttl: float
    site_idle_ttl: float
    sites: Mapping[str, SiteOptions]
    site_groups: Mapping[str, tuple[str, ...]]
    learn_site_groups: bool | None  # None: "auto", on the sites paced adaptively
    bans: BanOptions
    retry_after: bool
    latency_ewma_alpha: float
    site_pools: Mapping[str, str]
    #: Per pool, what to load at spider open: PROXY_SHARD_PROXIES' URLs, or PROXY_SHARD_PROXIES_PATH's
    #: proxies (read and validated at start, CSV tags kept).
    proxies: Mapping[str, tuple[str | Proxy, ...]]
    ban_retries: int
    ban_policy: str
    policy: PolicyOptions
    heartbeat_interval: float
    host_ttl: float
    logstats_interval: float
    #: The engine in use: "redis", "embedded" or "static" ("auto" resolved); ``requested_mode`` is
    #: PROXY_SHARD_MODE as set, so the runtime can tell an implied embedded engine from a chosen one.
    mode: str
    requested_mode: str
    redis_cluster: bool
    redis_pipeline: bool  # PROXY_SHARD_REDIS_PIPELINE: script calls pipelined on one connection (engine/pipeline.py)
    redis_functions: bool  # PROXY_SHARD_REDIS_FUNCTIONS: lease/release by FCALL (engine/scripts.py function_library)
    redis_sentinels: tuple[tuple[str, int], ...]
    redis_sentinel_master: str | None
    hosts: tuple[str, ...]
    sharding: str
    platforms: Mapping[str, tuple[str, ...]]
    fallback: bool
    redis_down_at_start: str
    redis_eviction: str
    fallback_grace: float
    fallback_after: float
    fallback_warmup: float
    snapshot_interval: float
    #: Per pool, the sites the Prometheus exporter gives series of their own (the rest: site="_other").
    metrics_top_sites: int
    #: The site circuit breaker: on or off, its options, and the sites that set their own (None: off).
    breaker_enabled: bool
    breaker: BreakerOptions
    breakers: Mapping[str, BreakerOptions | None]
    #: A content check never passed on a site fails for this many distinct proxies: the check is suspect.
    content_suspect_proxies: int
    #: Download handlers declared to send every request through meta['proxy'] (crawl/handlers.py).
    proxy_aware_handlers: tuple[str, ...]
    #: An explicit opt-out (meta['proxy_shard'] = False) may go out from this host's own IP.
    allow_direct: bool
    #: PROXY_SHARD_TIERS: pools cheap -> expensive (None: no tiers), and when a site moves between them.
    tiers: tuple[str, ...] | None
    tier_options: TierOptions
    #: Gateway entries (``<template>#sessions=N``, engine/gateway.py): rotation budget and exit header.
    gateway: GatewayOptions = field(default_factory=GatewayOptions)

    ATTRIBUTE = "_proxy_shard_settings"

    @classmethod
    def for_crawler(cls, crawler: Any) -> ShardSettings:
        """The crawler's settings, parsed on first use and shared: both middlewares, the runtime and
        the ban policy read the same object (a crawler's settings are frozen before components load).
        A bad value raises ``SettingError`` on every call, so each caller reports the same cause; so
        does an unknown ``PROXY_SHARD_*`` name close to a coordination setting (``check_setting_names``),
        while other unknown names are logged once, as WARNINGs."""
        parsed = getattr(crawler, cls.ATTRIBUTE, None)
        if parsed is None:
            unknown = check_setting_names(crawler.settings)  # an unknown coordination name: SettingError
            parsed = cls.from_settings(crawler.settings, default_host=crawler_host_id)
            setattr(crawler, cls.ATTRIBUTE, parsed)
            for line in unknown:  # once per crawler: the parse is cached
                logger.warning("proxy_shard: %(line)s", {"line": line})
        return parsed

    @classmethod
    def from_settings(cls, settings: Any, *, default_host: Callable[[], str] | None = None) -> ShardSettings:
        """Parse a Scrapy Settings object or a plain mapping. ``default_host`` makes the host id when
        ``PROXY_SHARD_HOST_ID`` is not set (``default_host_id``; crawls: ``crawler_host_id``)."""
        s = _settings(settings)
        get = _getter(s)
        lease_ttl_raw = get("PROXY_SHARD_LEASE_TTL")
        if lease_ttl_raw is None:
            download_timeout = _number(get, "DOWNLOAD_TIMEOUT", 180.0, minimum=0.0, maximum=MAX_LEASE_TTL - 30.0)
            lease_ttl = max(60.0, download_timeout + 30.0)
        else:
            lease_ttl = _number(get, "PROXY_SHARD_LEASE_TTL", None, minimum=0.001, maximum=MAX_LEASE_TTL)
        # PROXY_SHARD_REDIS_URL, else the REDIS_URL of scrapy-redis (one Redis for both: docs/recipes/scrapy-redis.md)
        url_setting = next((name for name in ("PROXY_SHARD_REDIS_URL", "REDIS_URL") if get(name)), None)
        redis_url = get(url_setting) if url_setting else None
        if redis_url is not None and not isinstance(redis_url, str):
            raise SettingError(f"{url_setting} ({mask(redis_url)!r}) must be a redis:// URL string")
        host_id = get("PROXY_SHARD_HOST_ID") or (default_host or default_host_id)()
        if not isinstance(host_id, str) or not host_id.strip() or "|" in host_id:
            raise SettingError(f"PROXY_SHARD_HOST_ID ({host_id!r}) must be a non-empty string without '|'")
        # Scrapy's DOWNLOAD_DELAY is kept at the lease, per IP and site and for every host, as the floor
        # of the interval; Scrapy's own download slot, which would hold a leased request back after its
        # lease, is kept out of the way (crawl/slots.py). A site's own min_interval still wins.
        download_delay = _number(get, "DOWNLOAD_DELAY", 0.0, minimum=0.0, maximum=MAX_INTERVAL)
        min_interval = max(download_delay,
                           _number(get, "PROXY_SHARD_MIN_INTERVAL", minimum=0.0, maximum=MAX_INTERVAL))
        pacing = SiteOptions(
            concurrency=_integer(get, "PROXY_SHARD_SITE_CONCURRENCY", minimum=1, maximum=MAX_CONCURRENCY),
            min_interval=min_interval,
            rest_after_response=_number(get, "PROXY_SHARD_REST_AFTER_RESPONSE", minimum=0.0, maximum=MAX_INTERVAL),
            randomize_interval=_boolean(s, "PROXY_SHARD_RANDOMIZE_INTERVAL"),
            arrival_guard=_number(get, "PROXY_SHARD_ARRIVAL_GUARD", minimum=0.0, maximum=MAX_ARRIVAL_GUARD),
        )
        autothrottle_ban_ttl = _number(get, "PROXY_SHARD_AUTOTHROTTLE_BAN_TTL", minimum=0.001, maximum=MAX_BAN_TTL)
        auto = _auto_boolean(s, "PROXY_SHARD_AUTOTHROTTLE_ENABLED")
        adaptive = auto if auto is not None else s.get("PROXY_SHARD_MIN_INTERVAL") is None
        autothrottle = _autothrottle(get, None, _AUTOTHROTTLE_SETTINGS, adaptive, ban_ttl=autothrottle_ban_ttl,
                                     overlap=_boolean(s, "PROXY_SHARD_AUTOTHROTTLE_OVERLAP"), floor=download_delay)
        concurrency = pacing.concurrency
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
        site_entries = _site_entries(s)
        sites = _sites(site_entries, pacing, autothrottle, auto=auto is None)
        site_idle_ttl = _site_idle_ttl(get, pacing, sites, autothrottle)
        breaker = _breaker(get, lambda f: f"PROXY_SHARD_BREAKER_{f.upper()}", BreakerOptions())
        return cls(
            enabled=_boolean(s, "PROXY_SHARD_ENABLED"),
            redis_url=redis_url,
            redis_url_setting=url_setting,
            redis_params=_mapping(s, "PROXY_SHARD_REDIS_PARAMS"),
            redis_client=get("PROXY_SHARD_REDIS_CLIENT"),
            namespace=_name(get, "PROXY_SHARD_NAMESPACE", "namespace"),
            pool=_name(get, "PROXY_SHARD_POOL", "pool"),
            host_id=host_id,
            lease_ttl=lease_ttl,
            max_wait=_number(get, "PROXY_SHARD_MAX_WAIT", minimum=0.0, maximum=MAX_WAIT),
            pause_horizon=_number(get, "PROXY_SHARD_PAUSE_HORIZON", minimum=0.0, maximum=MAX_WAIT * 30),
            pause_log_interval=_number(get, "PROXY_SHARD_PAUSE_LOG_INTERVAL", minimum=0.1, maximum=MAX_WAIT),
            site_concurrency=concurrency,
            min_interval=min_interval,
            download_delay=download_delay,
            rest_after_response=pacing.rest_after_response,
            randomize_interval=pacing.randomize_interval,
            arrival_guard=pacing.arrival_guard,
            autothrottle=autothrottle,
            autothrottle_ban_reasons=_reasons(get, "PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS"),
            autothrottle_ban_ttl=autothrottle_ban_ttl,
            session_ttl=session_ttl,
            site_idle_ttl=site_idle_ttl,
            sites=sites,
            site_groups=_site_groups(s),
            learn_site_groups=_auto_boolean(s, "PROXY_SHARD_LEARN_SITE_GROUPS"),
            bans=bans,
            retry_after=_boolean(s, "PROXY_SHARD_RETRY_AFTER"),
            latency_ewma_alpha=_number(get, "PROXY_SHARD_LATENCY_EWMA_ALPHA", minimum=0.001, maximum=1.0),
            site_pools=_site_pools(s),
            proxies=_all_initial_proxies(get, s, _name(get, "PROXY_SHARD_POOL", "pool")),
            ban_retries=_integer(get, "PROXY_SHARD_BAN_RETRIES", minimum=0),
            ban_policy=_dotted_path(get, "PROXY_SHARD_BAN_POLICY"),
            policy=PolicyOptions._parse(s, _site_rules(site_entries)),
            **_health(get),
            mode=_mode(get, redis_url or get("PROXY_SHARD_REDIS_SENTINELS")),
            requested_mode=get("PROXY_SHARD_MODE"),
            redis_cluster=_boolean(s, "PROXY_SHARD_REDIS_CLUSTER"),
            redis_pipeline=_boolean(s, "PROXY_SHARD_REDIS_PIPELINE"),
            redis_functions=_boolean(s, "PROXY_SHARD_REDIS_FUNCTIONS"),
            redis_sentinels=_sentinels(get),
            redis_sentinel_master=_sentinel_master(get),
            hosts=_hosts(get, host_id),
            sharding=_choice(get, "PROXY_SHARD_SHARDING", ("consistent", "modulo")),
            platforms=_platforms(s),
            fallback=_boolean(s, "PROXY_SHARD_FALLBACK"),
            redis_down_at_start=_choice(get, "PROXY_SHARD_REDIS_DOWN_AT_START", ("fail", "fallback")),
            redis_eviction=_choice(get, "PROXY_SHARD_REDIS_EVICTION", EVICTION_CHOICES),
            fallback_grace=_number(get, "PROXY_SHARD_FALLBACK_GRACE", minimum=0.0, maximum=MAX_PERIOD),
            fallback_after=_number(get, "PROXY_SHARD_FALLBACK_AFTER", minimum=0.0, maximum=MAX_PERIOD),
            fallback_warmup=_number(get, "PROXY_SHARD_FALLBACK_WARMUP", minimum=0.0, maximum=MAX_PERIOD),
            snapshot_interval=_number(get, "PROXY_SHARD_SNAPSHOT_INTERVAL", minimum=0.1, maximum=MAX_PERIOD),
            metrics_top_sites=_integer(get, "PROXY_SHARD_METRICS_TOP_SITES", minimum=1, maximum=100_000),
            breaker_enabled=_boolean(s, "PROXY_SHARD_BREAKER_ENABLED"),
            breaker=breaker,
            breakers=_site_breakers(site_entries, breaker),
            content_suspect_proxies=_integer(get, "PROXY_SHARD_CONTENT_SUSPECT_PROXIES", minimum=1, maximum=1000),
            proxy_aware_handlers=_declared_handlers(get("PROXY_SHARD_PROXY_AWARE_HANDLERS")),
            allow_direct=_boolean(s, "PROXY_SHARD_ALLOW_DIRECT"),
            tiers=check_tiers(get("PROXY_SHARD_TIERS"), "PROXY_SHARD_TIERS"),
            tier_options=_tier_options(get),
            gateway=_gateway_options(get),
        )

    def breaker_for(self, site: str) -> BreakerOptions | None:
        """The circuit breaker's options for a site key (None: the breaker is off for it)."""
        if site in self.breakers:
            return self.breakers[site]
        return self.breaker if self.breaker_enabled else None

    def site_options(self, site: str) -> SiteOptions:
        """Pacing for a site key (a registrable domain or a site group)."""
        return self.sites.get(site) or SiteOptions(self.site_concurrency, self.min_interval,
                                                   self.rest_after_response, self.randomize_interval,
                                                   self.autothrottle if self.autothrottle.enabled else None,
                                                   self.arrival_guard)


@functools.cache
def _parsed_defaults() -> ShardSettings:
    """``DEFAULTS`` parsed once: the source of every ``ShardSettings`` field default."""
    return ShardSettings.from_settings({})


def check_setting_names(settings: Any) -> list[str]:
    """Every ``PROXY_SHARD_*`` name set that is not a setting of the plugin, named with the closest one.

    Returns one WARNING line per unknown name; raises ``SettingError`` (one line naming each) when the
    closest setting of any is in ``COORDINATION_SETTINGS`` (see the rule there). The prefix is matched
    in any case (``-s proxy_shard_pool=...``); names are compared without it, so the shared prefix does
    not make every name look close to every other."""
    known = set(DEFAULTS) | OTHER_KNOWN_SETTINGS
    suffixes = {name[len(_PREFIX):]: name for name in known}
    errors, notes = [], []
    for name in sorted(str(n) for n in _settings(settings)):
        if not name.upper().startswith(_PREFIX) or name in known:
            continue
        suffix = name[len(_PREFIX):].upper()
        close = difflib.get_close_matches(suffix, suffixes, n=1, cutoff=0.6)
        match = suffixes[suffix] if suffix in suffixes else (suffixes[close[0]] if close else None)
        line = f"{name} is not a setting of scrapy-proxy-shard"
        if match is None:
            notes.append(f"{line} (ignored)")
        elif match in COORDINATION_SETTINGS:
            errors.append(f"{line}; did you mean {match}? It decides {COORDINATION_SETTINGS[match]}: with it "
                          "misspelt the hosts would not coordinate, so the crawl does not start (rename it)")
        else:
            notes.append(f"{line}; did you mean {match}? (ignored: {match} keeps its value)")
    if errors:
        raise SettingError("; ".join(errors))
    return notes


def default_host_id() -> str:
    """``hostname:pid``: unique per Scrapy process on a cluster, readable in status output."""
    return f"{socket.gethostname()}:{os.getpid()}"


_crawlers_seen = itertools.count(1)


def crawler_host_id() -> str:
    """The default host id of a crawler: ``hostname:pid`` for the first crawler of the process,
    ``hostname:pid:<n>`` for the n-th (several crawlers in one process are several hosts: their
    fallback slices and heartbeats are their own; docs/failure-model.md)."""
    n = next(_crawlers_seen)
    return default_host_id() if n == 1 else f"{default_host_id()}:{n}"


# --- parsing helpers: each names the setting and the bad value ---------------------------------

def _settings(settings: Any) -> BaseSettings:
    """Scrapy settings as they are; a plain mapping (tests, the CLI) wrapped so Scrapy's getters apply."""
    if isinstance(settings, BaseSettings):
        return settings
    if isinstance(settings, Mapping):
        return BaseSettings(dict(settings))
    raise SettingError(f"settings must be a Scrapy Settings object or a mapping, got {type(settings).__name__}")


def _getter(settings: BaseSettings):
    """``get(name, default)``: the value, else the table's default, else ``default``."""
    def get(name: str, default: Any = None) -> Any:
        return settings.get(name, DEFAULTS.get(name, default))
    return get


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


def _boolean(settings: BaseSettings, name: str, *, label: str | None = None) -> bool:
    """Scrapy's ``getbool`` (True/False, 1/0, "True"/"False"/"1"/"0"), its errors naming the setting
    (``label`` names it when ``name`` is only a key of a throw-away Settings, e.g. a per-site option)."""
    try:
        return settings.getbool(name, DEFAULTS.get(name))
    except (TypeError, ValueError):
        raise SettingError(f"{label or name} ({settings.get(name)!r}) must be True or False") from None


def _auto_boolean(settings: BaseSettings, name: str) -> bool | None:
    """A boolean setting that may also be ``"auto"`` (None: the plugin decides)."""
    raw = settings.get(name, DEFAULTS.get(name))
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return None
    try:
        return settings.getbool(name, DEFAULTS.get(name))
    except (TypeError, ValueError):
        raise SettingError(f"{name} ({raw!r}) must be True, False or 'auto'") from None


def _mapping(settings: BaseSettings, name: str) -> dict:
    """Scrapy's ``getdict`` (a dict, or a JSON object string), its errors naming the setting."""
    try:
        return settings.getdict(name, DEFAULTS.get(name))
    except ValueError:
        raise SettingError(f"{name} ({_shown(name, settings.get(name))}) must be a dict or a JSON object") from None
    except TypeError:
        raise SettingError(f"{name} ({_shown(name, settings.get(name))}) must be a dict") from None


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


def _site_entries(settings: BaseSettings) -> list[tuple[str, str, dict[str, Any]]]:
    """``PROXY_SHARD_SITES`` checked once: (site key, label for errors, options under their current names).

    Both the pacing (``_sites``) and the content rules (``_site_rules``) read these entries, so an
    option is known, renamed and refused in one place.
    """
    from scrapy_proxy_shard.engine.sites import check_site

    out = []
    for site, options in _mapping(settings, "PROXY_SHARD_SITES").items():
        key = check_site(site, "PROXY_SHARD_SITES")
        label = f"PROXY_SHARD_SITES[{site!r}]"
        if not isinstance(options, Mapping):
            raise SettingError(f"{label} ({options!r}) must be a dict")
        options = dict(options)
        for old, new in RENAMED_SITE_OPTIONS.items():
            if old not in options:
                continue
            if new in options:
                raise SettingError(f"{label}: set {new!r} only ({old!r} is its deprecated name)")
            warnings.warn(f"{label}.{old} is deprecated: name it {new!r}", ScrapyDeprecationWarning, stacklevel=2)
            options[new] = options.pop(old)
        unknown = set(options) - set(SITE_OPTIONS)
        if unknown:
            raise SettingError(f"{label}: unknown option(s) {sorted(unknown)} (known: {sorted(SITE_OPTIONS)})")
        out.append((key, label, options))
    return out


MIN_SITE_IDLE_TTL = 60.0


def _site_idle_ttl(get: Any, pacing: SiteOptions, sites: Mapping[str, SiteOptions],
                   autothrottle: AutothrottleOptions) -> float:
    """PROXY_SHARD_SITE_IDLE_TTL: at least a minute, and at least twice the longest pacing gap of any
    site, so a site's state never expires between two paced uses of one of its slots (the start of a
    use is what pacing counts from, and it lives in the site's state). A gap is the interval — with
    adaptive pacing, the longest it may learn (AUTOTHROTTLE_MAX_INTERVAL) — x 1.5 when randomized, plus
    the arrival guard's longest shift (guard x the interval), or the rest after a response."""
    idle = _number(get, "PROXY_SHARD_SITE_IDLE_TTL", minimum=MIN_SITE_IDLE_TTL, maximum=MAX_SESSION_TTL)
    gaps = []
    # (a site entry's autothrottle is None where adaptive pacing is off there)
    for own, at in ((pacing, autothrottle), *((site, site.autothrottle) for site in sites.values())):
        gaps.append(own.longest_gap(max(own.min_interval, at.max_interval if at is not None and at.enabled else 0.0)))
    longest = max(gaps)
    if idle < 2 * longest:
        raise SettingError(
            f"PROXY_SHARD_SITE_IDLE_TTL ({idle!r}) must be at least twice the longest pacing gap "
            f"({longest:g} s: PROXY_SHARD_MIN_INTERVAL or AUTOTHROTTLE_MAX_INTERVAL x (1, or 1.5 randomized, + "
            f"ARRIVAL_GUARD), or REST_AFTER_RESPONSE, of the settings or a PROXY_SHARD_SITES entry)"
        )
    return idle


def _sites(entries: list[tuple[str, str, dict[str, Any]]], pacing: SiteOptions,
           autothrottle: AutothrottleOptions, *, auto: bool = False) -> dict[str, SiteOptions]:
    """Pacing of each site, the global values (``pacing``, ``autothrottle``) where a site sets none.
    ``auto`` (AUTOTHROTTLE_ENABLED "auto"): a site that gives its own ``min_interval`` (its rule) is paced
    with it, not adaptively, unless it sets ``autothrottle_enabled``."""
    out: dict[str, SiteOptions] = {}
    for key, label, options in entries:
        def site_get(name: str, default: Any = None, _options=options) -> Any:
            return _options.get(name.rsplit(".", 1)[-1], default)

        randomize = pacing.randomize_interval
        if "randomize_interval" in options:
            randomize = _boolean(BaseSettings({"r": options["randomize_interval"]}), "r",
                                 label=f"{label}.randomize_interval")
        out[key] = SiteOptions(
            _integer(site_get, f"{label}.concurrency", pacing.concurrency, minimum=1, maximum=MAX_CONCURRENCY),
            _number(site_get, f"{label}.min_interval", pacing.min_interval, minimum=0.0, maximum=MAX_INTERVAL),
            _number(site_get, f"{label}.rest_after_response", pacing.rest_after_response, minimum=0.0,
                    maximum=MAX_INTERVAL),
            randomize,
            _site_autothrottle(options, label, autothrottle, rule_given=auto and "min_interval" in options),
            _number(site_get, f"{label}.arrival_guard", pacing.arrival_guard, minimum=0.0,
                    maximum=MAX_ARRIVAL_GUARD),
        )
    return out


def _breaker(get, name: Callable[[str], str], base: BreakerOptions) -> BreakerOptions:
    """The breaker's options read through ``get`` under the names ``name(field)`` gives (the global
    settings, or a site's ``breaker_*`` options), ``base`` where none is set."""
    threshold = _integer(get, name("threshold"), base.threshold, minimum=1, maximum=MAX_BREAKER_COUNT)
    min_proxies = _integer(get, name("min_proxies"), base.min_proxies, minimum=1, maximum=MAX_BREAKER_COUNT)
    if min_proxies > threshold:
        raise SettingError(f"{name('min_proxies')} ({min_proxies}) must be <= {name('threshold')} ({threshold}): "
                           "the breaker counts quarantines, each from one proxy")
    cooloff = _number(get, name("cooloff"), base.cooloff, minimum=0.001, maximum=MAX_BAN_TTL)
    max_cooloff = _number(get, name("max_cooloff"), base.max_cooloff, minimum=0.001, maximum=MAX_BAN_TTL)
    if max_cooloff < cooloff:
        raise SettingError(f"{name('max_cooloff')} ({max_cooloff!r}) must be >= {name('cooloff')} ({cooloff!r})")
    return BreakerOptions(
        threshold=threshold, min_proxies=min_proxies,
        window=_number(get, name("window"), base.window, minimum=0.001, maximum=MAX_STRIKE_WINDOW),
        cooloff=cooloff, max_cooloff=max_cooloff,
        probes=_integer(get, name("probes"), base.probes, minimum=1, maximum=MAX_BREAKER_PROBES),
    )


def _site_breakers(entries: list[tuple[str, str, dict[str, Any]]],
                   base: BreakerOptions) -> dict[str, BreakerOptions | None]:
    """The breaker of each site that sets a ``breaker_*`` option (None: off there), the global values
    where it sets none; ``breaker_enabled`` alone switches it on or off for the site."""
    out: dict[str, BreakerOptions | None] = {}
    for key, label, options in entries:
        if not any(name in options for name in SITE_BREAKER_OPTIONS):
            continue
        def site_get(name: str, default: Any = None, _options=options) -> Any:
            return _options.get(name.rsplit(".", 1)[-1], default)

        breaker = _breaker(site_get, lambda f, _label=label: f"{_label}.breaker_{f}", base)
        enabled = True
        if "breaker_enabled" in options:
            enabled = _boolean(BaseSettings({"e": options["breaker_enabled"]}), "e", label=f"{label}.breaker_enabled")
        out[key] = breaker if enabled else None
    return out


def _autothrottle(get, base: AutothrottleOptions | None, names: Mapping[str, str],
                  enabled: bool, ban_ttl: float | None = None, overlap: bool | None = None,
                  floor: float = 0.0) -> AutothrottleOptions:
    """Adaptive pacing bounds read through ``get`` under ``names`` (field -> setting name), ``base``'s where
    unset. Every bound is above 0 (a raise multiplies the interval) and START within [MIN, MAX]. The rest
    after a rate ban is ``ban_ttl`` and whether two requests in flight per IP may be tried ``overlap``,
    else ``base``'s (one setting each for every site). ``floor`` (DOWNLOAD_DELAY): no bound below it."""
    def one(field_name: str) -> float:
        return max(floor, _number(get, names[field_name], base and getattr(base, field_name), minimum=0.001,
                                  maximum=MAX_INTERVAL))

    if ban_ttl is None:
        ban_ttl = base.ban_ttl if base is not None else AutothrottleOptions.ban_ttl
    if overlap is None:
        overlap = base.overlap if base is not None else AutothrottleOptions.overlap
    options = AutothrottleOptions(enabled=enabled, start_interval=one("start_interval"),
                                  min_interval=one("min_interval"), max_interval=one("max_interval"),
                                  ban_ttl=ban_ttl, overlap=overlap)
    if options.min_interval > options.max_interval:
        raise SettingError(f"{names['min_interval']} ({options.min_interval!r}) must be <= {names['max_interval']} "
                           f"({options.max_interval!r})")
    if not options.min_interval <= options.start_interval <= options.max_interval:
        raise SettingError(f"{names['start_interval']} ({options.start_interval!r}) must be within "
                           f"{names['min_interval']} ({options.min_interval!r}) and {names['max_interval']} "
                           f"({options.max_interval!r})")
    return options


_AUTOTHROTTLE_FIELDS = ("start_interval", "min_interval", "max_interval")
_AUTOTHROTTLE_SETTINGS = {f: f"PROXY_SHARD_AUTOTHROTTLE_{f.upper()}" for f in _AUTOTHROTTLE_FIELDS}


def _site_autothrottle(options: Mapping[str, Any], label: str,
                       base: AutothrottleOptions, *, rule_given: bool = False) -> AutothrottleOptions | None:
    """A site's ``autothrottle_*`` options over the global ones; None when adaptive pacing is off there
    (``rule_given``: the site gives its own interval under AUTOTHROTTLE_ENABLED "auto": off unless it says)."""
    enabled = base.enabled and not rule_given
    if "autothrottle_enabled" in options:
        enabled = _boolean(BaseSettings({"e": options["autothrottle_enabled"]}), "e",
                           label=f"{label}.autothrottle_enabled")
    names = {f: f"{label}.autothrottle_{f}" for f in _AUTOTHROTTLE_FIELDS}
    values = {names[f]: options[f"autothrottle_{f}"] for f in _AUTOTHROTTLE_FIELDS if f"autothrottle_{f}" in options}

    def site_get(name: str, default: Any = None) -> Any:
        return values.get(name, default)

    options = _autothrottle(site_get, base, names, enabled)
    return options if options.enabled else None


def _reasons(get, name: str) -> frozenset[str]:
    """Ban reason slugs (``Verdict.reason``: ``[a-z0-9_:-]``); a lone string is one reason."""
    raw = get(name)
    try:
        items = _one_or_many(raw)
    except TypeError:
        items = None
    if items is None or not all(isinstance(r, str) and re.fullmatch(r"[a-z0-9_:-]+", r) for r in items):
        raise SettingError(f"{name} ({raw!r}) must be a list of ban reasons such as 'http_429' "
                           "(lower-case letters, digits, '_', ':', '-')")
    return frozenset(items)


def _site_rules(entries: list[tuple[str, str, dict[str, Any]]]) -> dict[str, SiteContentRules]:
    """Content rules of the sites that set any policy option."""
    out: dict[str, SiteContentRules] = {}
    for key, label, options in entries:
        if any(name in options for name in SITE_POLICY_OPTIONS):
            out[key] = _one_site(options, label)
    return out


def _one_site(options: Mapping[str, Any], prefix: str) -> SiteContentRules:
    def site_get(name: str, default: Any = None) -> Any:
        value = options.get(name.rsplit(".", 1)[-1])
        return default if value is None else value

    min_size = min_ratio = codes = patterns = None
    if site_get("min_body_size") is not None:
        min_size = _integer(site_get, f"{prefix}.min_body_size", minimum=0)
    if site_get("min_body_ratio") is not None:
        min_ratio = _ratio(site_get, f"{prefix}.min_body_ratio")
    if site_get("ban_codes") is not None:
        codes = _codes(BaseSettings({"ban_codes": options["ban_codes"]}), "ban_codes", f"{prefix}.ban_codes")
    if site_get("challenge_patterns") is not None:
        patterns = _setting_patterns(site_get, f"{prefix}.challenge_patterns")
    css = _setting_css(site_get, f"{prefix}.required_css")
    return SiteContentRules(
        required_css=css, min_body_size=min_size, min_body_ratio=min_ratio, ban_codes=codes,
        challenge_patterns=patterns,
    )


# --- the ban policy's values (also used by BanPolicy.__init__ on values given directly) ---------------

def _one_or_many(raw: Any) -> list[Any]:
    """A list from a list/tuple/set, or one item from a string: regexes and CSS selectors use commas
    themselves (``{1,3}``, ``a, b``), so Scrapy's comma-splitting ``getlist`` would cut them apart."""
    if isinstance(raw, str):
        return [raw] if raw.strip() else []
    if isinstance(raw, (list, tuple, set, frozenset)):
        return list(raw)
    raise TypeError


def _codes(settings: BaseSettings, name: str, label: str | None = None) -> frozenset[int]:
    """HTTP status codes in 100-599 through Scrapy's ``getlist`` (a list, or ``"403,429"``)."""
    label = label or name
    raw = settings.get(name, DEFAULTS.get(name))
    message = f"{label} ({raw!r}) must be a list of HTTP status codes (100-599)"
    try:
        items = settings.getlist(name, DEFAULTS.get(name))
    except (TypeError, ValueError):
        raise SettingError(message) from None
    codes = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise SettingError(message)
        try:
            code = int(item)
        except ValueError:
            raise SettingError(message) from None
        if not 100 <= code <= 599:
            raise SettingError(message)
        codes.add(code)
    return frozenset(codes)


def _setting_patterns(get: Any, name: str) -> tuple[re.Pattern[str], ...]:
    """Regexes; a lone string is one regex."""
    return _validated_list(get, name, compile_patterns, "regular expressions")


def _setting_css(get: Any, name: str) -> tuple[str, ...]:
    """CSS selectors; a lone string is one selector (``"a, b"`` is one selector matching either)."""
    return _validated_list(get, name, css_tuple, "CSS selectors")


def _validated_list(get: Any, name: str, check: Callable[[list[Any], str], tuple], what: str) -> tuple:
    """A setting's list (or lone string) through ``check``, whose ValueError becomes a SettingError."""
    raw = get(name, ())
    try:
        return check(_one_or_many(raw), name)
    except TypeError:
        raise SettingError(f"{name} ({raw!r}) must be a list of {what}") from None
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def _ratio(get: Any, name: str) -> float:
    """A fraction of the usual body size: 0 (disabled) up to, but excluding, 1."""
    value = _number(get, name, minimum=0.0)
    if value >= 1:
        raise SettingError(f"{name} ({get(name)!r}) must be >= 0 and < 1")
    return value


def compile_patterns(
    patterns: Iterable[re.Pattern[str] | str], name: str = "challenge_patterns"
) -> tuple[re.Pattern[str], ...]:
    """Compile regex strings case-insensitively (compiled patterns are kept as given)."""
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    out = []
    for pattern in patterns:
        if isinstance(pattern, re.Pattern):
            out.append(pattern)
            continue
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{name}: {pattern!r} must be a non-empty regular expression string")
        try:
            out.append(re.compile(pattern, re.IGNORECASE))
        except re.error as exc:
            raise ValueError(f"{name}: invalid regular expression {pattern!r} ({exc})") from None
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def check_css(selector: str) -> None:
    """Raise ValueError if the selector is not CSS parsel understands (cached: checked per page)."""
    try:
        _TRANSLATOR.css_to_xpath(selector)
    except SelectorError as exc:
        raise ValueError(f"invalid CSS selector {selector!r} ({exc})") from None


_TRANSLATOR = HTMLTranslator()


def css_tuple(selectors: Sequence[str] | str, name: str) -> tuple[str, ...]:
    """Validated selectors; a lone string is one selector (CSS commas mean "or", so never split)."""
    if isinstance(selectors, str):
        selectors = [selectors]
    out = []
    for selector in selectors:
        if not isinstance(selector, str) or not selector.strip():
            raise ValueError(f"{name}: {selector!r} must be a non-empty CSS selector string")
        try:
            check_css(selector)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        out.append(selector)
    return tuple(out)


def _site_groups(settings: BaseSettings) -> dict[str, tuple[str, ...]]:
    from scrapy_proxy_shard.engine.sites import SITE_KEY_RE, check_site

    out: dict[str, tuple[str, ...]] = {}
    for group, members in _mapping(settings, "PROXY_SHARD_SITE_GROUPS").items():
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


def _site_pools(settings: BaseSettings) -> dict[str, str]:
    from scrapy_proxy_shard.engine.sites import check_site

    out: dict[str, str] = {}
    for site, pool in _mapping(settings, "PROXY_SHARD_SITE_POOLS").items():
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
        out[pool] = tuple(as_entry(entry) for entry in entries)
    return out


def _all_initial_proxies(get, settings: BaseSettings, default_pool: str) -> dict[str, tuple[str | Proxy, ...]]:
    """PROXY_SHARD_PROXIES and PROXY_SHARD_PROXIES_PATH together. Both giving one pool's proxies is an
    error, not a merge: a project that lists proxies in settings.py and a run given a file with
    ``-s PROXY_SHARD_PROXIES_PATH=...`` would otherwise lease from the union, keeping proxies the file
    was meant to replace (and a precedence rule would silently drop one of the two)."""
    listed = _initial_proxies(get, default_pool)
    from_files = _file_proxies(get, settings, default_pool)
    both = sorted(pool for pool in set(listed) & set(from_files) if listed[pool])
    if both:
        raise SettingError(
            f"PROXY_SHARD_PROXIES and PROXY_SHARD_PROXIES_PATH both give the proxies of pool "
            f"{', '.join(repr(p) for p in both)}: set one of them (or give each pool its own: {{pool: ...}})"
        )
    return {**listed, **from_files}


def _file_proxies(get, settings: BaseSettings, default_pool: str) -> dict[str, tuple[Proxy, ...]]:
    """PROXY_SHARD_PROXIES_PATH: a proxy list file for the default pool, or {pool: path}, read at start
    with the parser of ``scrapy-proxy-shard load`` (engine/proxyfile.py: one proxy per line or CSV with
    a header, blank lines and ``#`` comments skipped, every line validated, exits merged)."""
    raw = get("PROXY_SHARD_PROXIES_PATH")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str) and raw.lstrip().startswith("{"):  # -s ...='{"dc": "dc.txt"}'
        raw = _mapping(settings, "PROXY_SHARD_PROXIES_PATH")
    if hasattr(raw, "copy_to_dict"):
        raw = raw.copy_to_dict()
    if isinstance(raw, (str, os.PathLike)):
        raw = {default_pool: raw}
    if not isinstance(raw, Mapping):
        raise SettingError(f"PROXY_SHARD_PROXIES_PATH ({type(raw).__name__}) must be the path of a proxy list "
                           "file, or {pool: path}")
    out: dict[str, tuple[Proxy, ...]] = {}
    for pool, path in raw.items():
        try:
            check_name("pool", pool)
        except SettingError as exc:
            raise SettingError(f"PROXY_SHARD_PROXIES_PATH: {exc}") from None
        label = "PROXY_SHARD_PROXIES_PATH" if len(raw) == 1 and pool == default_pool else \
            f"PROXY_SHARD_PROXIES_PATH[{pool!r}]"
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).strip():
            raise SettingError(f"{label} ({type(path).__name__}) must be the path of a proxy list file")
        out[pool] = _read_proxy_list(label, os.fspath(path).strip())
    return out


def _read_proxy_list(label: str, given: str) -> tuple[Proxy, ...]:
    """One list file's proxies, or one SettingError line naming the path and the fix. Lines are shown
    masked only (engine/proxyfile.py): a bad line never prints its password."""
    path = os.path.abspath(os.path.expanduser(given))
    shown = repr(path) if path == given else f"{given!r} ({path})"
    try:
        parsed = read_proxy_file(path)
    except FileNotFoundError:
        raise SettingError(f"{label}: no file {shown}: give the path of a proxy list file (one proxy per line), "
                           f"absolute or relative to the directory scrapy runs in") from None
    except IsADirectoryError:
        raise SettingError(f"{label}: {shown} is a directory: give the path of a proxy list file") from None
    except OSError as exc:
        raise SettingError(f"{label}: cannot read {shown} ({exc.strerror or type(exc).__name__}): make it "
                           f"readable by the user scrapy runs as") from None
    except ProxyURLError as exc:  # not UTF-8 (names the line number, never its text)
        raise SettingError(f"{label}: {exc}") from None
    if parsed.errors:
        first = parsed.errors[0]
        more = len(parsed.errors) - 1
        raise SettingError(
            f"{label}: {path}:{first.line}: {first.message}" + (
                f" (and {more} more bad line(s): `scrapy-proxy-shard load --dry-run {path}` lists them)"
                if more else "")
        )
    if not parsed.proxies:
        raise SettingError(f"{label}: no proxies in {shown} (one proxy per line; blank lines and # comments "
                           "are skipped)")
    for note in parsed.replaced:
        logger.warning("proxy_shard: %(label)s: %(path)s: %(note)s", {"label": label, "path": path, "note": note})
    return tuple(parsed.proxies)


def _gateway_options(get) -> GatewayOptions:
    """``PROXY_SHARD_GATEWAY_*``: how gateway slots rotate after bans, and where their exit IP is read."""
    rotations = get("PROXY_SHARD_GATEWAY_ROTATIONS")
    header = get("PROXY_SHARD_GATEWAY_EXIT_HEADER") or None  # "" (-s NAME=): unset
    if header is not None and (not isinstance(header, str) or not re.fullmatch(r"[A-Za-z0-9-]{1,64}", header)):
        raise SettingError(f"PROXY_SHARD_GATEWAY_EXIT_HEADER ({header!r}) must be a response header name such as "
                           "'X-Exit-IP', or None")
    return GatewayOptions(
        rotations=None if rotations is None else _integer(get, "PROXY_SHARD_GATEWAY_ROTATIONS", minimum=1,
                                                          maximum=1_000_000),
        window=_number(get, "PROXY_SHARD_GATEWAY_ROTATION_WINDOW", minimum=1.0, maximum=MAX_BAN_TTL),
        exit_header=header or None,
    )


def _check_proxy_entry(pool: str, n: int, entry: Any) -> None:
    try:
        parse_gateway(entry) if is_gateway_entry(entry) else parse_proxy(entry)
    except ValueError as exc:
        hint = (" (a PROXY_SHARD_PROXIES string is split on spaces and newlines only, never on commas: "
                "a password may contain one)") if isinstance(entry, str) and "," in entry else ""
        raise SettingError(f"PROXY_SHARD_PROXIES[{pool!r}] entry {n}: {exc}{hint}") from None


def _dotted_path(get, name: str) -> str:
    raw = get(name)
    if not isinstance(raw, str) or "." not in raw:
        raise SettingError(f"{name} ({raw!r}) must be a dotted import path such as 'package.module.Class'")
    return raw


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _declared_handlers(raw: Any) -> tuple[str, ...]:
    """``PROXY_SHARD_PROXY_AWARE_HANDLERS`` as dotted paths (a list of paths or classes)."""
    if raw is None or raw == "":
        return ()
    if isinstance(raw, str) and raw.lstrip().startswith("["):  # -s ...='["a.B", "c.D"]' (JSON, as Scrapy reads lists)
        try:
            raw = json.loads(raw)
        except ValueError:
            raise SettingError(f"PROXY_SHARD_PROXY_AWARE_HANDLERS ({raw!r}) is not a JSON list: write "
                               f"'[\"myproject.handlers.MyHandler\"]' or a.B,c.D") from None
    elif isinstance(raw, str):  # -s PROXY_SHARD_PROXY_AWARE_HANDLERS=a.B,c.D
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    items = [raw] if isinstance(raw, type) else raw
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise SettingError(f"PROXY_SHARD_PROXY_AWARE_HANDLERS ({raw!r}) must be a list of download handler classes "
                           f"or their dotted paths, e.g. ['myproject.handlers.MyHandler']")
    out = []
    for item in items:
        if not (isinstance(item, type) or (isinstance(item, str) and _DOTTED.fullmatch(item))):
            raise SettingError(f"PROXY_SHARD_PROXY_AWARE_HANDLERS entry {item!r} must be a download handler class "
                               f"or its dotted path, e.g. 'myproject.handlers.MyHandler'")
        out.append(_class_path(item))
    return tuple(out)


def _class_path(value: Any) -> str:
    return value if isinstance(value, str) else f"{value.__module__}.{value.__qualname__}"


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


def _platforms(settings: BaseSettings) -> dict[str, tuple[str, ...]]:
    from scrapy_proxy_shard.engine.sites import check_site

    out: dict[str, tuple[str, ...]] = {}
    for platform, sites in _mapping(settings, "PROXY_SHARD_PLATFORMS").items():
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


def check_tiers(raw: Any, label: str) -> tuple[str, ...] | None:
    """A tier list (``PROXY_SHARD_TIERS``, a spider's ``proxy_tiers``): two or more distinct pool names,
    cheapest first; None when not given. A bad one is one ``SettingError`` naming the problem and the fix."""
    if raw is None:
        return None
    example = "e.g. ['datacenter', 'residential']"
    if isinstance(raw, str):
        items: list[Any] = [part.strip() for part in raw.split(",")] if raw.strip() else []
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise SettingError(f"{label} ({raw!r}) must be a list of pool names, cheapest first ({example})")
    if not items:
        raise SettingError(f"{label} is empty: name two or more pools, cheapest first ({example}), or remove "
                           f"it to lease from one pool")
    for item in items:
        if not isinstance(item, str) or not NAME_RE.fullmatch(item):
            raise SettingError(f"{label} ({items!r}): {item!r} is not a pool name (1-64 letters, digits, '.', '_' "
                               f"or '-'); list the pools by name, cheapest first ({example})")
    seen = [item for n, item in enumerate(items) if item in items[:n]]
    if seen:
        raise SettingError(f"{label} ({items!r}) names pool {seen[0]!r} twice: list each pool once, cheapest first")
    if len(items) < 2:
        raise SettingError(f"{label} ({items!r}) names one pool: tiers need two or more, cheapest first; to lease "
                           f"from one pool set PROXY_SHARD_POOL (or the spider's proxy_pool) instead")
    return tuple(items)


def _tier_options(get: Any) -> TierOptions:
    probe = _number(get, "PROXY_SHARD_TIER_PROBE_INTERVAL", minimum=0.001, maximum=MAX_BAN_TTL)
    longest = _number(get, "PROXY_SHARD_TIER_MAX_PROBE_INTERVAL", minimum=0.001, maximum=MAX_BAN_TTL)
    if longest < probe:
        raise SettingError(f"PROXY_SHARD_TIER_MAX_PROBE_INTERVAL ({longest!r}) must be >= "
                           f"PROXY_SHARD_TIER_PROBE_INTERVAL ({probe!r})")
    return TierOptions(
        min_answers=_integer(get, "PROXY_SHARD_TIER_MIN_ANSWERS", minimum=1, maximum=1_000_000),
        ban_ratio=_number(get, "PROXY_SHARD_TIER_BAN_RATIO", minimum=0.01, maximum=1.0),
        window=_number(get, "PROXY_SHARD_TIER_WINDOW", minimum=1.0, maximum=MAX_BAN_TTL),
        probe_interval=probe,
        max_probe_interval=longest,
    )
