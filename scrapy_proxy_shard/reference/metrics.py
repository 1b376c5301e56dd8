"""Every Prometheus metric ``scrapy-proxy-shard metrics`` serves: the text of the metrics reference page.

Names are as Prometheus shows them (a counter with its ``_total`` suffix). tests/test_stats_reference.py
collects the families the exporter yields (``ops.exporter.PoolCollector``) and fails when a name, a
type or a label set differs from this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricDoc:
    """One metric family: name, ``gauge`` or ``counter``, its labels, what it measures."""

    name: str
    kind: str
    labels: tuple[str, ...]
    meaning: str


def _m(name: str, kind: str, labels: str, meaning: str) -> MetricDoc:
    return MetricDoc(name, kind, tuple(label for label in labels.split(", ") if label), meaning)


G, C = "gauge", "counter"

#: Labels a metric may carry (never a proxy URL or id: unbounded, and a URL would leak credentials).
LABELS: dict[str, str] = {
    "pool": "the pool's name",
    "site": "a site key (a registrable domain or a site group); `*` = proxy-wide; `_other` = the sum of the "
            "sites outside the pool's top sites",
    "state": "a slot's or a breaker's state",
    "reason": "a quarantine's reason (`http_403`, `timeout`, `manual`, ...)",
    "outcome": "`ok`, `error` or `banned` (a tier's probes: `sent` or `banned`)",
    "status": "`stale` or `expired`",
    "quantile": "`0.5`, `0.9` or `1.0`",
    "change": "`up`, `down` or `skip` (a tier: `up` or `down`)",
    "tiers": "a tier list (`PROXY_SHARD_TIERS`), its pools joined by `>` cheap first: `datacenter>residential`",
    "host": "a live host's id (`PROXY_SHARD_HOST_ID`)",
}

METRICS: tuple[MetricDoc, ...] = (
    _m("proxy_shard_up", G, "", "1 if Redis answered this scrape"),
    _m("proxy_shard_scrape_duration_seconds", G, "", "time the scrape spent reading Redis"),
    _m("proxy_shard_proxies", G, "pool", "proxies in the pool"),
    _m("proxy_shard_proxies_active", G, "pool", "proxies not under a proxy-wide quarantine"),
    _m("proxy_shard_proxies_dead", G, "pool", "proxies under a proxy-wide quarantine"),
    _m("proxy_shard_proxies_banned", G, "pool", "proxies quarantined on at least one site"),
    _m("proxy_shard_slots", G, "pool, site, state", "slots by state: `free`, `leased`, `session`, `cooling`, "
       "`banned`"),
    _m("proxy_shard_slots_held", G, "pool, host", "slots a host holds now (leases and sticky sessions)"),
    _m("proxy_shard_quarantines_running", G, "pool, site, reason", "quarantines running"),
    _m("proxy_shard_site_quarantines_total", C, "pool, site, reason", "quarantines started (bans per site and "
       "reason)"),
    _m("proxy_shard_quarantines_started_total", C, "pool", "quarantines started"),
    _m("proxy_shard_quarantine_seconds_total", C, "pool", "their total length (less unbans): "
       "`increase(seconds)/increase(started)` = mean time to recovery"),
    _m("proxy_shard_quarantine_mean_seconds", G, "pool", "mean quarantine length since the pool began"),
    _m("proxy_shard_requests_total", C, "pool, site", "leases taken (requests sent through a proxy)"),
    _m("proxy_shard_responses_total", C, "pool, site, outcome", "finished requests: `ok`, `error`, `banned`"),
    _m("proxy_shard_site_interval_seconds", G, "pool, site", "adaptive pacing: the site's learned "
       "start-to-start interval"),
    _m("proxy_shard_site_interval_changes_total", C, "pool, site, change", "changes of it: `up` (raised), "
       "`down` (lowered), `skip` (rate bans that changed nothing)"),
    _m("proxy_shard_success_ratio", G, "pool", "ok / (ok + error + banned) since the pool began"),
    _m("proxy_shard_proxy_latency_seconds", G, "pool, quantile", "spread of the proxies' EWMA response times "
       "(0.5, 0.9, 1.0)"),
    _m("proxy_shard_proxy_latency_mean_seconds", G, "pool", "mean of the proxies' EWMA response times"),
    _m("proxy_shard_releases_total", C, "pool, status", "releases that found their lease expired: `stale` "
       "(re-leased by another host), `expired`"),
    _m("proxy_shard_session_rebinds_total", C, "pool", "sticky sessions moved to another proxy"),
    _m("proxy_shard_gateway_events_total", C, "pool, status", "gateway slots: `rotated` (a new session token: "
       "a new exit IP), `cooldown` (a ban quarantined a slot: the site's rotation budget was spent), "
       "`shared_exit` (a slot met another slot's exit IP)"),
    _m("proxy_shard_breaker_state", G, "pool, site, state", "1 for the state of the site's circuit breaker: "
       "`closed`, `open`, `half_open`"),
    _m("proxy_shard_breaker_opened_total", C, "pool, site", "times the site's breaker opened (the site "
       "rejected every proxy)"),
    _m("proxy_shard_breaker_reopened_total", C, "pool, site", "times it re-opened (a probe was rejected, or a "
       "round of probes gave no verdict)"),
    _m("proxy_shard_breaker_closed_total", C, "pool, site", "times it closed (a probe was answered fine)"),
    _m("proxy_shard_breaker_spared_total", C, "pool, site", "bans while it was open or half-open: no "
       "quarantine, no strike"),
    _m("proxy_shard_tier_sites", G, "tiers, pool", "sites on the tier now ([tiered pools](../guide/tiers.md))"),
    _m("proxy_shard_tier_requests_total", C, "tiers, pool", "requests sent through the tier, every host"),
    _m("proxy_shard_tier_responses_total", C, "tiers, pool, outcome", "their answers: `ok` (pages) and "
       "`banned`: what the tier costs per page"),
    _m("proxy_shard_tier_changes_total", C, "tiers, pool, change", "sites moved to the tier: `up` (the cheaper "
       "tier blocked), `down` (a probe of it answered fine)"),
    _m("proxy_shard_tier_probes_total", C, "tiers, pool, outcome", "probe requests through the tier: `sent`, "
       "`banned`"),
    _m("proxy_shard_host_up", G, "pool, host", "1 per live host"),
    _m("proxy_shard_host_heartbeat_age_seconds", G, "pool, host", "seconds since the host's last heartbeat"),
    _m("proxy_shard_host_requests_total", C, "pool, host", "leases the host took since it registered"),
    _m("proxy_shard_host_responses_total", C, "pool, host, outcome", "its finished requests by outcome"),
    _m("proxy_shard_host_success_ratio", G, "pool, host", "its success ratio"),
    _m("proxy_shard_host_recent_leases", G, "pool, host", "its leases over the last 10 minutes"),
    _m("proxy_shard_host_load_share", G, "pool, host", "its share of the pool's leases over the last 10 "
       "minutes"),
)
