"""What every ``PROXY_SHARD_*`` setting means: the text of the settings reference page.

``scrapy_proxy_shard.settings.DEFAULTS`` holds the defaults; this module holds the descriptions,
grouped into the sections of ``docs/reference/settings.md``. The page's default column is rendered
from ``DEFAULTS`` itself (``markdown.py``); only a setting whose default is computed at start-up
(``None`` in ``DEFAULTS``) states its default here, in words. tests/test_settings_table.py fails when a
``DEFAULTS`` key has no description, a description names a setting ``DEFAULTS`` does not have, or a
setting is described twice.

Descriptions are Markdown. Links are relative to ``docs/reference/`` (the page they are rendered in).
"""

from __future__ import annotations

from dataclasses import dataclass

from scrapy_proxy_shard.crawl.runtime import LEASE_MARGIN


@dataclass(frozen=True)
class SettingDoc:
    """One setting: its name, what it does, and how its default reads."""

    name: str
    meaning: str
    #: Unit of the default shown ("s": seconds), "" for none.
    unit: str = ""
    #: The default in words, only for a setting whose ``DEFAULTS`` value is ``None`` (computed or unset).
    default: str | None = None


@dataclass(frozen=True)
class Section:
    """A group of settings on the reference page, with a sentence saying what they are for."""

    title: str
    intro: str
    settings: tuple[SettingDoc, ...]


S = SettingDoc

SECTIONS: tuple[Section, ...] = (
    Section("Redis", "Where the shared pool lives, and how the crawls talk to it.", (
        S("PROXY_SHARD_ENABLED", "switch (`False`: the middlewares are not loaded)"),
        S("PROXY_SHARD_REDIS_URL", "the one Redis every host points at", default="`REDIS_URL`, else unset"),
        S("PROXY_SHARD_REDIS_PARAMS", "extra keyword arguments for redis-py's `from_url` (timeouts, TLS, ...)"),
        S("PROXY_SHARD_REDIS_CLIENT", "an asyncio Redis client object, or a callable making one, used instead of "
          "the URL (hand-built cluster/sentinel clients; fakeredis in tests)", default="unset"),
        S("PROXY_SHARD_REDIS_CLUSTER", "the URL names a Redis Cluster node (pools spread over shards: one hash "
          "slot per pool)"),
        S("PROXY_SHARD_REDIS_SENTINELS", "`[\"host:port\", ...]`: follow Sentinel failovers (with "
          "`PROXY_SHARD_REDIS_SENTINEL_MASTER`)", default="unset"),
        S("PROXY_SHARD_REDIS_SENTINEL_MASTER", "the Sentinel master's name", default="unset"),
        S("PROXY_SHARD_REDIS_PIPELINE", "on a plain (not Cluster, not Sentinel) Redis client, send the "
          "lease/release script calls pipelined on one connection of their own (less client CPU per call); "
          "`False` sends each on redis-py's pooled connections, for proxies or middleboxes in front of Redis "
          "that mishandle pipelining"),
        S("PROXY_SHARD_REDIS_FUNCTIONS", "on Redis ≥ 7.0 (not Cluster), call lease and release as Redis "
          "Functions (`FCALL`; the library is loaded by the first call that misses it, named after a hash of "
          "its code so hosts on different versions never share one): their helpers are defined once instead "
          "of at every call, about a tenth less Redis time per lease + release. Redis 6.2, Cluster clients, "
          "an ACL that refuses `FCALL`/`FUNCTION` and `False` use `EVALSHA`"),
        S("PROXY_SHARD_NAMESPACE", "prefix of every key"),
    )),
    Section("Pools and proxies", "Which proxies a request may use ([choosing a pool]"
            "(../guide/requests.md#choosing-a-pool)).", (
        S("PROXY_SHARD_POOL", "pool when neither request, spider nor site names one"),
        S("PROXY_SHARD_SITE_POOLS", "`{\"site.com\": \"pool\"}`"),
        S("PROXY_SHARD_PROXIES", "proxies added (merged) when a spider opens: a list for `PROXY_SHARD_POOL`, "
          "or `{pool: [urls]}`; a string (`-s`, environment) is split on spaces and newlines only, never on "
          "commas (a password may contain one). Every entry is validated at start. Two entries of one exit "
          "(`host:port`, plus a declared `#session=<token>`) are one proxy: the later wins, with one WARNING "
          "naming both entries (masked). A gateway entry `<template>#sessions=N` (or `{\"url\": template, "
          "\"sessions\": N}`) adds N slots ([provider gateways](../recipes/gateways.md))", default="unset"),
        S("PROXY_SHARD_PROXIES_PATH", "a proxy list file loaded (merged) when a spider opens, like "
          "scrapy-rotating-proxies' `ROTATING_PROXY_LIST_PATH`: a path for `PROXY_SHARD_POOL`, or "
          "`{pool: path}`, relative to the directory scrapy runs in. The format of `scrapy-proxy-shard load`: "
          "one proxy per line (or CSV with the header `url,type,provider,country`), blank lines and `#` "
          "comments skipped, every line validated at start; a bad line, a missing or unreadable file, or a "
          "file with no proxies stops the crawl with one line naming the path (lines shown masked). Read once "
          "at start. Setting it and `PROXY_SHARD_PROXIES` for one pool is an error: set one", default="unset"),
        S("PROXY_SHARD_GATEWAY_ROTATIONS", "how many fresh IPs in a row one gateway may try for one site (new "
          "session tokens after bans, with no clean answer through the gateway there between them) within "
          "`PROXY_SHARD_GATEWAY_ROTATION_WINDOW`; past it, a ban there quarantines the slot as for a static "
          "proxy, so a site that blocks every fresh IP does not burn the plan "
          "([provider gateways](../recipes/gateways.md))", default="5, or the gateway's sessions if fewer"),
        S("PROXY_SHARD_GATEWAY_ROTATION_WINDOW", "the window of that budget; also how long an exit IP reported "
          "for a slot is remembered", unit="s"),
        S("PROXY_SHARD_GATEWAY_EXIT_HEADER", "a response header in which the gateway reports the exit IP "
          "(e.g. `X-Exit-IP`): two slots seen on one IP are counted and one is rotated", default="unset"),
        S("PROXY_SHARD_PLATFORMS", "`{\"platform\": [sites]}`: each proxy serves one platform only (pool "
          "`<pool>.<platform>`)"),
        S("PROXY_SHARD_SITE_GROUPS", "`{\"group\": [\"site-a.com\", \"site-b.com\"]}`: sites that share a "
          "blacklist share exclusivity and bans"),
        S("PROXY_SHARD_LEARN_SITE_GROUPS", "learn site groups nobody declared: two sites on which three "
          "distinct proxies were each rate-banned, after a clean answer, while quarantined on the other are "
          "paced as one group on every host from then on (kept 7 days in `{ns:pool}:links`; `DEL` it to forget). "
          "`auto`: from bans on the sites paced adaptively only (whose rule the settings do not give); `True`: "
          "every site. See [Pacing](../pacing.md#shared-blacklists-learned)"),
        S("PROXY_SHARD_SITES", "per site: `concurrency`, `min_interval`, `rest_after_response`, "
          "`randomize_interval`, `arrival_guard`, `autothrottle_enabled`, `autothrottle_start_interval`, "
          "`autothrottle_min_interval`, `autothrottle_max_interval`, `required_css`, `min_body_size`, "
          "`min_body_ratio`, `ban_codes`, `challenge_patterns` (formerly `captcha_patterns`: still accepted, "
          "with a deprecation warning), and the breaker's `breaker_enabled`, `breaker_threshold`, "
          "`breaker_min_proxies`, `breaker_window`, `breaker_cooloff`, `breaker_max_cooloff`, "
          "`breaker_probes`"),
        S("PROXY_SHARD_HOST_ID", "this crawler's name in counters and status; a live duplicate in another "
          "process is refused at open", default="`<hostname>:<pid>` (`:<n>` for the n-th crawler of a process)"),
    )),
    Section("Leases, waits and sessions", "How long a request holds a proxy, and how long it may wait for one "
            "([waiting](../guide/requests.md#waiting-for-a-proxy)).", (
        S("PROXY_SHARD_LEASE_TTL", "a dead holder's lease frees itself after this; per request at least "
          f"`download_timeout + {LEASE_MARGIN:g}` s, so a live download never loses its lease: Scrapy's "
          "`download_timeout` bounds the whole transfer and the lease is released right after the response "
          "(each leased request has its own download slot, which sends it at once: Scrapy's `DOWNLOAD_DELAY` "
          "is kept at the lease instead, as every site's floor per IP). A longer margin would only delay "
          "the recovery of a crashed host's slots", unit="s", default="`max(60, DOWNLOAD_TIMEOUT + 30)` s"),
        S("PROXY_SHARD_MAX_WAIT", "longest wait *with no known end* (a pool Redis lost, Redis stalled, the "
          "host on its local fallback) before `NoProxyAvailable`; waits the pool will end (slots in use, "
          "pacing, quarantines, an open breaker) are not bounded by it (see `PROXY_SHARD_PAUSE_HORIZON`)",
          unit="s"),
        S("PROXY_SHARD_PAUSE_HORIZON", "a site that no proxy can serve for longer than this (every proxy "
          "quarantined past it, or the breaker's cool-off, or never: a wrong content check) parks its "
          "requests and closes the crawl once this host serves nothing else (`proxy_pool_exhausted` / "
          "`proxy_shard_content_check`, exit code 1); shorter pauses are waited out", unit="s"),
        S("PROXY_SHARD_PAUSE_LOG_INTERVAL", "while a site is paused, one WARNING line per (pool, site) this "
          "often: how many requests wait, until when, why", unit="s"),
        S("PROXY_SHARD_SITE_CONCURRENCY", "requests per IP per site at once"),
        S("PROXY_SHARD_SESSION_TTL", "sticky session lifetime, sliding on each use", unit="s"),
        S("PROXY_SHARD_SITE_IDLE_TTL", "a site's slot state in Redis expires this long after its last use "
          "(≥ 60 s and ≥ 2 × the longest pacing gap: the interval, or the longest adaptive pacing may learn, "
          "× 1.5 when randomized, + the arrival guard × the interval); quarantines, sessions and running "
          "leases outlive it", unit="s"),
    )),
    Section("Pacing", "The least gap between two requests through one IP on one site "
            "([pacing](../guide/pacing.md)).", (
        S("PROXY_SHARD_MIN_INTERVAL", "least gap between the *starts* of two requests through one IP on one "
          "site (per slot when `PROXY_SHARD_SITE_CONCURRENCY` > 1), on the Redis clock across all hosts: "
          "Scrapy's `DOWNLOAD_DELAY` meaning, what a site's rate limit counts. A `DOWNLOAD_DELAY` above 0 is the "
          "floor of this and of the adaptive bounds (`scrapy startproject` writes 1: set it to 0 to let the "
          "plugin pace lower); a site's own `min_interval` still wins", unit="s"),
        S("PROXY_SHARD_REST_AFTER_RESPONSE", "pause of a slot after each response before its next use on that "
          "site (the meaning `PROXY_SHARD_MIN_INTERVAL` had in earlier versions: a slot is free at "
          "max(start + `MIN_INTERVAL`, response + this))", unit="s"),
        S("PROXY_SHARD_ARRIVAL_GUARD", "off by default (the learned path margin does its work where arrivals "
          "come early, at no cost where none do: [pacing in depth](../pacing.md)); above 0, the most a "
          "slot's next start is pushed back, as a fraction of the interval, when its last request reached the "
          "site later than the quickest this host has seen on that (proxy, site) "
          "([the arrival guard](../guide/pacing.md#the-arrival-guard))"),
        S("PROXY_SHARD_RANDOMIZE_INTERVAL", "draw each release's interval from [0.5, 1.5) × `MIN_INTERVAL` "
          "(like `RANDOMIZE_DOWNLOAD_DELAY`), so starts do not look machine-timed; some gaps are then as "
          "short as half the interval"),
        S("PROXY_SHARD_RETRY_AFTER", "a ban answer with a `Retry-After` header (a 429 or 503, seconds or an "
          "HTTP date) quarantines the proxy on that site for exactly that long, capped at "
          "`PROXY_SHARD_BAN_MAX_TTL`, instead of `PROXY_SHARD_BAN_TTL` with its doubling: the site said when "
          "the IP may come back"),
    )),
    Section("Adaptive pacing", "Learning each site's interval when its rule is not given "
            "([adaptive pacing](../guide/pacing.md#adaptive-pacing-when-the-rule-is-unknown), "
            "[the control law](../pacing.md)).", (
        S("PROXY_SHARD_AUTOTHROTTLE_ENABLED", "adaptive pacing: learn each site's start-to-start interval in "
          "Redis, once for all hosts, instead of using `MIN_INTERVAL`. `\"auto\"`: wherever the site's rule "
          "is not given (no `PROXY_SHARD_MIN_INTERVAL` set, and for a `PROXY_SHARD_SITES` entry no "
          "`min_interval` of its own); `True` / `False`: everywhere / nowhere"),
        S("PROXY_SHARD_AUTOTHROTTLE_START_INTERVAL", "the learned interval of a site nobody has learned yet: "
          "polite (above most published rules), then lowered fast (× 0.25 per step until an interval fails, "
          "then halfway towards it)", unit="s"),
        S("PROXY_SHARD_AUTOTHROTTLE_MIN_INTERVAL", "lower bound of the learned interval (above 0; "
          "`START_INTERVAL` within the bounds)", unit="s"),
        S("PROXY_SHARD_AUTOTHROTTLE_MAX_INTERVAL", "upper bound of the learned interval", unit="s"),
        S("PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS", "ban reasons that say \"too fast\" rather than \"this IP\": "
          "they may raise the learned interval (add e.g. `http_403` for a site that answers its rate limit "
          "with 403)"),
        S("PROXY_SHARD_AUTOTHROTTLE_BAN_TTL", "while adaptive pacing is on, the shortest rest of a proxy after "
          "a rate-type ban that followed a clean answer (instead of `PROXY_SHARD_BAN_TTL`: the pace takes the "
          "blame and is slowed, the IP is only rested); each site learns its own rest from there: doubled when "
          "an IP is banned again right after its rest, shortened 10% when one comes back clean", unit="s"),
        S("PROXY_SHARD_AUTOTHROTTLE_OVERLAP", "opt-in: while adaptive pacing is on, a site whose answers outlast "
          "its learned interval may be tried with two requests in flight per IP (one proxy first; every proxy "
          "once its overlapped answers are clean, none again once one is banned). Off, one request per IP and "
          "site at a time everywhere, the plugin's guarantee. Not yet the default: a host slow to send a leased "
          "request can still put it next to the IP's other one (docs/pacing.md, step 6); turned off, a site that "
          "learned two goes back to one per IP at its next release"),
    )),
    Section("Bans and quarantines", "What a ban costs a proxy, and the request that met it.", (
        S("PROXY_SHARD_BAN_TTL", "first quarantine of a proxy on a site; doubled per strike up to "
          "`PROXY_SHARD_BAN_MAX_TTL`", unit="s"),
        S("PROXY_SHARD_BAN_MAX_TTL", "the cap of the doubling quarantine", unit="s"),
        S("PROXY_SHARD_BAN_JITTER", "fraction taken off at random, so quarantines do not end together"),
        S("PROXY_SHARD_BAN_STRIKE_WINDOW", "a ban this soon after the previous one ended escalates", unit="s"),
        S("PROXY_SHARD_DEAD_TTL", "first proxy-wide quarantine (transport failures)", unit="s"),
        S("PROXY_SHARD_BAN_RETRIES", "retries through other proxies after a ban"),
    )),
    Section("Ban detection", "What counts as a ban ([the ban policy](../guide/requests.md#bans-and-retries)).", (
        S("PROXY_SHARD_BAN_POLICY", "dotted path of the ban policy class"),
        S("PROXY_SHARD_BAN_CODES", "statuses that mean \"banned on this site\""),
        S("PROXY_SHARD_PROXY_FAILURE_CODES", "statuses that mean \"the proxy itself failed\""),
        S("PROXY_SHARD_CHALLENGE_PATTERNS", "regexes (case-insensitive) for redirect targets and landing URLs "
          "that mean a challenge, searched in a URL's host and in its path + query"),
        S("PROXY_SHARD_REQUIRED_CSS", "selectors every HTML page must match"),
        S("PROXY_SHARD_SMALL_BODY_RATIO", "an HTML page under this fraction of the site's median size is a "
          "stub (0: off)"),
        S("PROXY_SHARD_SMALL_BODY_MIN_SAMPLES", "pages seen before the median is trusted"),
        S("PROXY_SHARD_CONTENT_SUSPECT_PROXIES", "a content check (required CSS...) that never passed on a site "
          "and failed for this many distinct proxies (all of them, in a smaller pool) is suspected wrong: the "
          "site's breaker opens with cause `content` and the crawl closes `proxy_shard_content_check`; until "
          "then such failures quarantine nobody "
          "([content checks](../guide/breaker.md#a-content-check-that-never-passes))"),
        S("PROXY_SHARD_LATENCY_EWMA_ALPHA", "weight of a new sample in each proxy's latency average"),
    )),
    Section("Site circuit breaker", "Telling \"this IP is banned\" from \"this site rejects everyone\" "
            "([the breaker](../guide/breaker.md)). Every host of a pool should use the same values: the state "
            "is shared.", (
        S("PROXY_SHARD_BREAKER_ENABLED", "the site circuit breaker; per site `breaker_enabled`"),
        S("PROXY_SHARD_BREAKER_THRESHOLD", "quarantines on one site, with no `ok` response between, that open "
          "its breaker"),
        S("PROXY_SHARD_BREAKER_MIN_PROXIES", "distinct proxies those quarantines must come from "
          "(≤ `PROXY_SHARD_BREAKER_THRESHOLD`)"),
        S("PROXY_SHARD_BREAKER_WINDOW", "how long a quarantine counts toward the threshold", unit="s"),
        S("PROXY_SHARD_BREAKER_COOLOFF", "no lease for the site on any host this long after it opens; doubled "
          "at each re-opening, up to `PROXY_SHARD_BREAKER_MAX_COOLOFF`. Requests wait a cool-off out while it "
          "is within `PROXY_SHARD_PAUSE_HORIZON`", unit="s"),
        S("PROXY_SHARD_BREAKER_MAX_COOLOFF", "the cap of the doubling cool-off", unit="s"),
        S("PROXY_SHARD_BREAKER_PROBES", "probe leases per half-open round (one at a time); that many without a "
          "verdict (404, network error) re-open it"),
    )),
    Section("Tiered pools", "Cheap proxies first, dearer ones only for the sites that block them "
            "([tiered pools](../guide/tiers.md)). The state is shared: every host should use the same values.", (
        S("PROXY_SHARD_TIERS", "pools ordered cheap → expensive (`[\"datacenter\", \"residential\"]`, or "
          "`datacenter,residential` with `-s`): per site, every host starts on the first and moves up when the "
          "site blocks the one it is on; a spider's `proxy_tiers` attribute overrides it. `meta['proxy_pool']`, a "
          "spider's `proxy_pool` and `PROXY_SHARD_SITE_POOLS` win over tiers. An empty list, a duplicate, a bad "
          "name or a pool holding no proxies stops the crawl at start", default="unset (no tiers)"),
        S("PROXY_SHARD_TIER_MIN_ANSWERS", "answers on a site's tier before its ban ratio may move the site up"),
        S("PROXY_SHARD_TIER_BAN_RATIO", "bans / answers on a site's tier that move it up a tier on every host "
          "(the site's circuit breaker opening on that tier's pool moves it up at once)"),
        S("PROXY_SHARD_TIER_WINDOW", "the evidence counts half after this long; a descent that fails within it "
          "doubles the wait before the next probe", unit="s"),
        S("PROXY_SHARD_TIER_PROBE_INTERVAL", "after a site moves up, one request through the tier below is sent "
          "this long after (one at a time, cluster-wide); answered fine, the site comes back down; banned, the "
          "wait doubles", unit="s"),
        S("PROXY_SHARD_TIER_MAX_PROBE_INTERVAL", "the cap of that doubling wait", unit="s"),
    )),
    Section("Download handlers", "What may download a leased request, and whether anything may leave from the "
            "host's own IP ([download handlers](../failure-model.md#download-handlers)).", (
        S("PROXY_SHARD_PROXY_AWARE_HANDLERS", "download handler classes (or dotted paths) you vouch send every "
          "request through `meta['proxy']`; any other handler the crawl does not know to be proxy-aware stops "
          "it at start"),
        S("PROXY_SHARD_ALLOW_DIRECT", "let a request with `meta['proxy_shard'] = False` and no proxy of its "
          "own (or a proxy its handler ignores) go out from this host's own IP; each is counted and logged at "
          "WARNING. `False`: such a request fails with `RequestNotLeased`"),
    )),
    Section("Cluster health", "Host heartbeats, the periodic log line and the exporter "
            "([monitoring](../guide/monitoring.md)).", (
        S("PROXY_SHARD_HEARTBEAT_INTERVAL", "how often each crawl says it is alive and records its load",
          unit="s"),
        S("PROXY_SHARD_HOST_TTL", "a host without a heartbeat this long is dead (must exceed the interval)",
          unit="s", default="`max(30, 3 × PROXY_SHARD_HEARTBEAT_INTERVAL)` s"),
        S("PROXY_SHARD_LOGSTATS_INTERVAL", "the periodic pool log line (0: off)", unit="s"),
        S("PROXY_SHARD_METRICS_TOP_SITES", "per pool, the sites (most leases recently) the Prometheus exporter "
          "gives series of their own; the rest are summed under `site=\"_other\"` "
          "(`scrapy-proxy-shard metrics --top-sites`)"),
    )),
    Section("Modes and failures", "Where the engine runs, and what a host does when Redis goes away "
            "([the failure model](../failure-model.md)).", (
        S("PROXY_SHARD_MODE", "`redis` when a Redis URL (or sentinels) is set, else `embedded` (one process, "
          "same semantics, in memory); `static`: shared-nothing slices (`auto` picks one of the first two)"),
        S("PROXY_SHARD_HOSTS", "every host id of the crawl (static mode, and the fallback's split; otherwise "
          "the hosts alive in Redis)", default="unset"),
        S("PROXY_SHARD_SHARDING", "`consistent` (rendezvous hashing: a joining host moves ~1/(n+1) of the "
          "proxies) or `modulo`"),
        S("PROXY_SHARD_FALLBACK", "when Redis stops answering, use this host's consistent-hash slice of the "
          "last snapshot"),
        S("PROXY_SHARD_REDIS_DOWN_AT_START", "`fail`: stop the crawl with one clear line (exit code 1); "
          "`fallback`: start on the local slice"),
        S("PROXY_SHARD_REDIS_EVICTION", "Redis with an `allkeys-*` `maxmemory-policy` and a memory limit: "
          "`refuse` to start, or `warn` ([Redis requirements](../guide/redis.md))"),
        S("PROXY_SHARD_FALLBACK_WARMUP", "rest of every proxy of the slice before its first local use "
          "(requests other hosts had in flight finish)", unit="s"),
        S("PROXY_SHARD_FALLBACK_GRACE", "after Redis returns, keep the local slice (adopting each lease into "
          "Redis) this long so every host can switch back", unit="s"),
        S("PROXY_SHARD_FALLBACK_AFTER", "a Redis that *times out* (maybe only stalled: hosts with no call in "
          "flight keep using it) must stay silent this long before this host falls back; its requests wait "
          "meanwhile. A Redis answering `BUSY` (a slow script) or `LOADING` (a restart loading its data) is "
          "such a stall, counted from its first such answer. A refused or lost connection falls back at once",
          unit="s"),
        S("PROXY_SHARD_SNAPSHOT_INTERVAL", "how often the snapshot re-reads quarantines (and the proxy list "
          "when the pool size changed)", unit="s"),
    )),
)


def all_settings() -> list[SettingDoc]:
    """Every described setting, in page order."""
    return [doc for section in SECTIONS for doc in section.settings]
