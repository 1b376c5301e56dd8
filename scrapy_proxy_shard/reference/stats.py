"""Every Scrapy stat the plugin sets: the text of the stats reference page.

A stat name may hold a placeholder in braces (``proxy_shard/bans/reason/{reason}``) for a part the
crawl fills in. tests/test_stats_reference.py reads the package's source for every stat it sets
(``stats.inc_value`` / ``set_value`` calls, the fallback's counters, Scrapy's ``get_retry_request``
keys) and fails when one is missing here, or when a name here matches nothing the code sets.

Descriptions are Markdown; links are relative to ``docs/reference/``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StatDoc:
    """One row of the stats table: one or more stat names, where they are set, what they count."""

    names: tuple[str, ...]
    where: str
    meaning: str


@dataclass(frozen=True)
class StatSection:
    """A group of stats on the reference page."""

    title: str
    intro: str
    stats: tuple[StatDoc, ...]


def _doc(names: str, where: str, meaning: str) -> StatDoc:
    """``names``: one name, or several separated by ", " (each a full name)."""
    return StatDoc(tuple(names.split(", ")), where, meaning)


ACQUIRE = "runtime `acquire`"
FINISH = "runtime `finish`"
MW = "`ProxyShardMiddleware`"
BAN_MW = "`BanDetectionMiddleware`"
GW = "runtime `gateways`"

SECTIONS: tuple[StatSection, ...] = (
    StatSection("Leases and waits", "Taking a proxy for a request, and waiting for one.", (
        _doc("proxy_shard/leases", ACQUIRE, "leases taken"),
        _doc("proxy_shard/leases/session", ACQUIRE, "of which sticky-session uses"),
        _doc("proxy_shard/sessions/rebound", ACQUIRE, "sessions moved to a new proxy"),
        _doc("proxy_shard/waits", ACQUIRE, "requests that had to wait for a slot"),
        _doc("proxy_shard/wait_time", ACQUIRE, "seconds spent waiting, total"),
        _doc("proxy_shard/wait/gave_up", ACQUIRE, "requests failed with `NoProxyAvailable`"),
        _doc("proxy_shard/wait/cancelled_at_stop", ACQUIRE, "waiting requests failed because the crawl stopped "
             "(Ctrl-C, SIGTERM, `CloseSpider`): they fail within 0.2 s instead of holding the shutdown up"),
        _doc("proxy_shard/pauses, proxy_shard/paused_seconds", f"{ACQUIRE} (liveness.py)", "pauses of a "
             "(pool, site) no proxy could serve (every proxy quarantined, or its breaker open), and their total "
             "length (s)"),
        _doc("proxy_shard/exhausted, proxy_shard/exhausted/kept, proxy_shard/exhausted/closed",
             f"{ACQUIRE} (liveness.py)", "a site past `PROXY_SHARD_PAUSE_HORIZON` closed the crawl: requests "
             "failed then, kept in `JOBDIR`, and the pool/site"),
        _doc("proxy_shard/not_sent", f"{MW}, guard", "requests that ended without being sent (not kept in "
             "`JOBDIR`); a crawl that finishes with any exits with code 1"),
        _doc("proxy_shard/pool_lost", ACQUIRE, "a pool found empty after it held proxies (Redis lost it, or a "
             "drain) that this host could not restore: requests waited for it"),
        _doc("proxy_shard/pool_restored", ACQUIRE, "pools this host refilled after Redis lost them (from its "
             "fallback snapshot, else from `PROXY_SHARD_PROXIES`)"),
        _doc("proxy_shard/leases/abandoned/{status}", "store (modes/pools.py)", "lease calls whose reply was "
             "lost (a timeout even on the resend), by how Redis settled them: `released` (it had run: the slot "
             "was given back at once), `gone` (it had run, but its slot had expired or been taken over), "
             "`barred` (it had not run: barred from running later)"),
        _doc("proxy_shard/redis_busy_retries", "store (modes/pools.py)", "calls sent again because Redis "
             "answered `BUSY` (a slow script) or `LOADING` (a restart loading its data); never a failed request"),
    )),
    StatSection("Releases and bans", "Giving a proxy back, with the verdict on its answer.", (
        _doc("proxy_shard/release/ok, proxy_shard/release/stale, proxy_shard/release/expired", FINISH,
             "releases; stale = the lease had expired and another holder had the slot (nothing freed)"),
        _doc("proxy_shard/release/lost", f"{FINISH} (fallback)", "a Redis lease whose release could not be "
             "written during an outage; it expires by its TTL"),
        _doc("proxy_shard/release/errors", FINISH, "releases Redis did not take (the lease expires by itself)"),
        _doc("proxy_shard/bans, proxy_shard/bans/reason/{reason}", FINISH, "quarantines reported, by reason "
             "(`http_403`, `challenge_redirect`, `missing_css`, `small_body`, `connection_refused`, `timeout`, "
             "...)"),
        _doc("proxy_shard/bans/retry_after", FINISH, "of which quarantined for the site's own `Retry-After` "
             "(`PROXY_SHARD_RETRY_AFTER`)"),
        _doc("proxy_shard/dead", FINISH, "proxy-wide quarantines"),
        _doc("proxy_shard/site_groups/linked", FINISH, "links of two sites found to share a blacklist that this "
             "host's rate bans made ([learned site groups](../pacing.md#shared-blacklists-learned))"),
        _doc("proxy_shard/site_groups/apart", FINISH, "clean answers on a site from a proxy resting from another "
             "(a rate quarantine this host started): each vetoes linking the two for 10 minutes"),
        _doc("proxy_shard/site_groups/overlap_bans", FINISH, "rate bans of a request sent while this host had "
             "the same proxy in flight on another site (reported as evidence that the two share a blacklist)"),
        _doc("proxy_shard/site_groups/overlap_apart", FINISH, "clean answers of a request sent while this host "
             "had the same proxy in flight on another site, reported as a veto (at most every 30 s per pair)"),
        _doc("proxy_shard/site_groups/regrouped_waits", ACQUIRE, "waiting requests whose site was linked into a "
             "learned group meanwhile: they ask again under the group's key"),
        _doc("proxy_shard/site_groups/learned_sites", "runtime (at a ban or heartbeat)", "sites this host "
             "leases under a learned group's key"),
        _doc("proxy_shard/released_at_close", "runtime `spider_closed`", "leases still held at close, given "
             "back"),
        _doc("proxy_shard/ban_retries/count, proxy_shard/ban_retries/reason_count/{reason}",
             f"{BAN_MW} (Scrapy's `get_retry_request`)", "requests resent through another proxy, by ban reason "
             "(formerly `proxy_shard/ban_retries`)"),
        _doc("proxy_shard/ban_retries/max_reached", BAN_MW, "requests failed with `ProxyBanned`, ban budget "
             "spent (formerly `proxy_shard/ban_gave_up`)"),
    )),
    StatSection("Site circuit breaker and content checks", "See [the breaker](../guide/breaker.md).", (
        _doc("proxy_shard/breaker/opened, proxy_shard/breaker/reopened, proxy_shard/breaker/closed",
             f"{FINISH}, {BAN_MW}", "site circuit breakers this host's releases opened, re-opened (a probe "
             "rejected) and closed (a probe answered fine)"),
        _doc("proxy_shard/breaker/spared", FINISH, "bans while a site's breaker was open or half-open: no "
             "quarantine, no strike, no ban retry spent"),
        _doc("proxy_shard/breaker/waits", ACQUIRE, "requests that waited for an open breaker"),
        _doc("proxy_shard/content/suspect, proxy_shard/content/breaker_opened", f"{BAN_MW} (content.py)",
             "content-check failures on a site where the check never passed (no quarantine), and breakers they "
             "opened (cause `content`)"),
    )),
    StatSection("Tiered pools", "Per tier (pool) of `PROXY_SHARD_TIERS`: what each tier serves and what it costs "
                "([tiered pools](../guide/tiers.md)).", (
        _doc("proxy_shard/tiers/{pool}/requests, proxy_shard/tiers/{pool}/pages, proxy_shard/tiers/{pool}/bans",
             f"{MW}, {FINISH} (tiers.py)", "requests this host sent through the tier, those answered fine, and "
             "those judged a ban"),
        _doc("proxy_shard/tiers/up, proxy_shard/tiers/down", "tiers.py", "sites this host's steps moved up a "
             "tier (the site blocks the cheaper one) and back down (a probe was answered fine): the change "
             "holds for every host"),
        _doc("proxy_shard/tiers/probes, proxy_shard/tiers/probes/banned, proxy_shard/tiers/probes/skipped",
             "tiers.py", "probe requests sent through the cheaper tier, probes banned there (the next waits "
             "twice as long), and probes given up because the cheaper tier had no free proxy for the site"),
        _doc("proxy_shard/tiers/moved_waits", "tiers.py", "requests that waited for a proxy of one tier (its "
             "proxies quarantined or busy on the site) and went to the site's new tier when it moved"),
        _doc("proxy_shard/tiers/offline, proxy_shard/tiers/local_up", "tiers.py", "tier steps Redis did not "
             "answer (the site kept the last tier this host knew), and sites moved up by this host alone "
             "meanwhile"),
    )),
    StatSection("Pacing", "See [pacing](../guide/pacing.md) and [pacing in depth](../pacing.md).", (
        _doc("proxy_shard/autothrottle/interval/{site}", FINISH, "adaptive pacing: the site's learned interval "
             "(s) as of this host's last release there"),
        _doc("proxy_shard/autothrottle/{event}", FINISH, "adaptive pacing: what this host's releases did to the "
             "learned intervals, by event: `probe`, `down`, `fail`, `back`, `up`, `skip`, `forget` "
             "([the control law](../pacing.md)); and to requests in flight per IP: `conc_probe` (one proxy "
             "tries two), `conc_up` (every proxy gets two), `conc_fail` (the site banned the overlap), `conc_off` "
             "(`PROXY_SHARD_AUTOTHROTTLE_OVERLAP` turned off after the site learned two, or while one proxy tried "
             "them: back to one per IP)"),
        _doc("proxy_shard/pacing/margin_ms/{site}", FINISH, "a fixed interval: the site's path margin (ms) as "
             "of this host's last release there"),
        _doc("proxy_shard/pacing/margin_widened", FINISH, "widenings of a site's path margin this host's "
             "releases caused (an arrival closer than the site allows)"),
        _doc("proxy_shard/pacing/browser_from_answer, proxy_shard/pacing/browser_from_release", FINISH,
             "releases of scrapy-playwright pages: their slot's next start paced from when the page's last "
             "request was answered, or (not known for sure: a held page, a failed request, a context made "
             "during the request) from the release; never from the lease, taken before the browser made the "
             "page ([scrapy-playwright](../recipes/scrapy-playwright.md#pacing))"),
        _doc("proxy_shard/pacing/arrival_guard_ms", FINISH, "ms the arrival guard added to slots' intervals, "
             "total (`PROXY_SHARD_ARRIVAL_GUARD`)"),
        _doc("proxy_shard/pacing/woken", FINISH, "requests sleeping for a pacing slot that a release woke "
             "early: the slot it gave back frees sooner (adaptive pacing's probe, a lowered interval; "
             "[pacing](../pacing.md#adaptive-pacing-proxy_shard_autothrottle_enabled-the-default-where-the-rule-is-not-given))"),
    )),
    StatSection("Requests the plugin does not lease", "Opt-outs, local schemes and refusals.", (
        _doc("proxy_shard/skipped", MW, "requests left alone (opt-out or own `meta['proxy']`)"),
        _doc("proxy_shard/direct, proxy_shard/direct_refused", f"guard / {MW}", "requests sent from this "
             "host's own IP (`PROXY_SHARD_ALLOW_DIRECT`), and those refused for it"),
        _doc("proxy_shard/local", MW, "`file://` and `data:` requests: never leave the host, not leased"),
        _doc("proxy_shard/handler_refused, proxy_shard/browser_refused, proxy_shard/impersonate_refused", MW,
             "requests failed because their download handler cannot use a proxy (Scrapy's FTP, S3, a disabled "
             "scheme), a scrapy-playwright request named a browser context of its own, or a scrapy-impersonate "
             "request a proxy of its own (`impersonate_args`, `impersonate_curl_options`)"),
        _doc("proxy_shard/guard/dropped", "`ProxyShardGuardMiddleware`", "requests dropped before download: no "
             "lease, or not the leased proxy in `meta['proxy']`"),
        _doc("proxy_shard/pool_errors", MW, "requests failed because their `meta['proxy_pool']` is unknown, "
             "empty or not a valid name"),
        _doc("proxy_shard/invalid_session_id", MW, "requests failed with `InvalidSessionId` (a "
             "`meta['session_id']` that is not a valid session name)"),
    )),
    StatSection("Browser contexts (scrapy-playwright)", "See [the scrapy-playwright recipe]"
                "(../recipes/scrapy-playwright.md).", (
        _doc("proxy_shard/browser/contexts", "contexts (contexts.py)", "browser contexts the plugin created "
             "(one per proxy, one per sticky session)"),
        _doc("proxy_shard/browser/retired/{reason}", "contexts (contexts.py)", "contexts that take no new "
             "request (`quarantined`, `removed`, `url_changed`, `session_ended`, `session_expired`, "
             "`session_rebound`); each closes once no page of it is open"),
        _doc("proxy_shard/browser/closed/{why}", "contexts (contexts.py)", "contexts closed: `retired`, or "
             "`lru` / `lru_session` to make room under `PLAYWRIGHT_MAX_CONTEXTS`"),
        _doc("proxy_shard/browser/waits", "contexts (contexts.py)", "browser requests that waited for a "
             "context to go idle before a new one could be opened under the bound"),
        _doc("proxy_shard/browser/over_bound", "contexts (contexts.py)", "contexts opened past the bound "
             "(no `PLAYWRIGHT_MAX_CONTEXTS` set and every context busy)"),
        _doc("proxy_shard/browser/pages_held", FINISH, "`playwright_include_page` pages whose lease was held "
             "until the spider closed the page"),
        _doc("proxy_shard/browser/page_outlived_lease", FINISH, "kept pages still open when their lease "
             "expired (a WARNING each: the page's further requests are not covered)"),
    )),
    StatSection("Start-up and hosts", "Why a crawl stopped, and host ids.", (
        _doc("proxy_shard/open_error", "start-up gate", "why the spider was stopped at open (exception class "
             "name)"),
        _doc("proxy_shard/host_id_taken", "heartbeat (health.py)", "another process took this host id over "
             "while this one ran (its heartbeats had lapsed): this crawl stops"),
    )),
    StatSection("Provider gateways", "Slots of a `<template>#sessions=N` entry "
                "([provider gateways](../recipes/gateways.md)).", (
        _doc("proxy_shard/gateway/rotations", GW, "gateway slots given a new session token (a new exit IP): "
             "after a ban, or after their exit IP turned out to be another slot's"),
        _doc("proxy_shard/gateway/rotate/{status}", GW, "what a ban on a gateway slot did: `rotated`, `stale` "
             "(another host had rotated it already), `noop` (a gateway without placeholder), `cooldown` (the "
             "site's rotation budget was spent: quarantined), `static`, `unknown`"),
        _doc("proxy_shard/gateway/cooldown_bans", GW, "bans that quarantined a gateway slot because the site "
             "used up `PROXY_SHARD_GATEWAY_ROTATIONS` within the window"),
        _doc("proxy_shard/gateway/rotate_errors", GW, "rotations Redis did not answer (the slot was "
             "quarantined instead)"),
        _doc("proxy_shard/gateway/exit_reports", GW, "exit IPs read from `PROXY_SHARD_GATEWAY_EXIT_HEADER` and "
             "recorded (once per slot, token and IP)"),
        _doc("proxy_shard/gateway/shared_exit", GW, "gateway slots found on an exit IP another slot held (one "
             "of the two was rotated)"),
    )),
    StatSection("Local fallback", "While Redis does not answer ([the failure model](../failure-model.md)).", (
        _doc("proxy_shard/fallback/entered, proxy_shard/fallback/exited, proxy_shard/fallback/seconds",
             "fallback", "switches to the local slice and back, and the time spent on it (s)"),
        _doc("proxy_shard/fallback/leases", "fallback", "leases taken from the local slice"),
        _doc("proxy_shard/fallback/leases_adopted, proxy_shard/fallback/leases_not_adopted", "fallback",
             "local leases written into Redis once it answered again, and those it did not take"),
        _doc("proxy_shard/fallback/leases_overlapped", "fallback", "a lease in flight whose slot another Redis "
             "lease held when Redis came back; Redis then keeps the slot from everyone else for the lease's "
             "TTL, however early the other holder gives it back"),
        _doc("proxy_shard/fallback/leases_returned", "fallback", "grace leases Redis refused, never used"),
        _doc("proxy_shard/fallback/silent_waits", "fallback", "lease calls that waited out a silent Redis "
             "instead of falling back"),
        _doc("proxy_shard/fallback/empty_slice_waits", "fallback", "requests of a host whose share of the pool "
             "is empty, waiting for Redis"),
        _doc("proxy_shard/fallback/no_slice", "fallback", "pools for which this host took no slice (no live "
             "host list to split by, or its host id taken)"),
        _doc("proxy_shard/fallback/host_id_taken", "fallback", "another process holds this host id: this "
             "process never takes a slice"),
        _doc("proxy_shard/fallback/bans_replayed, proxy_shard/fallback/pools_restored", "fallback",
             "quarantines started locally and written to Redis when it came back, and pools refilled from the "
             "snapshot"),
    )),
)


def all_stats() -> list[StatDoc]:
    """Every row, in page order."""
    return [doc for section in SECTIONS for doc in section.stats]
