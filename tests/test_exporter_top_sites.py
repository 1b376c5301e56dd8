"""Prometheus series follow the active sites: ``PROXY_SHARD_METRICS_TOP_SITES`` bounds the ``site``
label values per metric to N + ``_other`` however many sites a pool has served, totals unchanged."""

from __future__ import annotations

from collections import defaultdict

import pytest

from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.ops.exporter import OTHER_SITE, PoolCollector, SiteRanking, pool_metrics
from scrapy_proxy_shard.ops.snapshot import read_pool
from scrapy_proxy_shard.settings import ShardSettings

NS = "top"
PROXIES = [f"http://10.6.0.{i}:3128" for i in range(1, 5)]
SITES = 500
HOT = [f"hot{i}.example" for i in range(12)]
COLD = [f"site{i}.example" for i in range(SITES - len(HOT))]
BANNED = COLD[-30:]


def _use(store: PoolStore, site: str, times: int = 1, outcome: str = "ok") -> None:
    for _ in range(times):
        lease = store.lease("dc", site, ttl=60)
        store.release(lease, outcome=outcome, reason="http_429" if outcome == "ban" else None)


@pytest.fixture
def broad_pool(real_redis) -> PoolStore:
    """A pool that has served 500 sites: 12 of them often (4 leases), 30 with a ban (2 leases), the
    rest once."""
    store = PoolStore(real_redis, namespace=NS, host_id="host-a")
    store.add_proxies("dc", PROXIES)
    for site in COLD:
        _use(store, site)
    for site in BANNED:
        _use(store, site, outcome="ban")
    for site in HOT:
        _use(store, site, times=4)
    return store


def _samples(families) -> list[tuple[str, dict[str, str], float]]:
    return [(sample.name, dict(sample.labels), sample.value) for family in families for sample in family.samples]


def _sites_per_metric(samples) -> dict[str, set[str]]:
    sites: dict[str, set[str]] = defaultdict(set)
    for name, labels, _ in samples:
        if "site" in labels:
            sites[name].add(labels["site"])
    return sites


def _totals_without_site(samples) -> dict[tuple, float]:
    totals: dict[tuple, float] = defaultdict(float)
    for name, labels, value in samples:
        if "site" in labels:
            rest = tuple(sorted((k, v) for k, v in labels.items() if k != "site"))
            totals[(name, rest)] += value
    return dict(totals)


def test_500_sites_export_at_most_n_plus_other_with_totals_preserved(broad_pool):
    snapshot = read_pool(broad_pool, "dc")
    assert len(snapshot.site_stats) >= SITES
    top = 20
    chosen = SiteRanking(top).choose(snapshot)
    cut = _samples(pool_metrics([snapshot], {"dc": chosen}))
    whole = _samples(pool_metrics([snapshot]))

    per_metric = _sites_per_metric(cut)
    for name in ("proxy_shard_slots", "proxy_shard_requests_total", "proxy_shard_responses_total",
                 "proxy_shard_site_quarantines_total", "proxy_shard_quarantines_running"):
        sites = per_metric[name] - {"*"}
        assert len(sites) <= top + 1, (name, len(sites))
        assert OTHER_SITE in sites, name
    assert len(_sites_per_metric(whole)["proxy_shard_requests_total"]) >= SITES  # what it was before
    # The busiest sites keep their own series: 12 with 4 leases, then 8 of those with 2.
    assert set(HOT) <= chosen and len(chosen - set(HOT) - set(BANNED)) == 0
    assert _totals_without_site(cut) == pytest.approx(_totals_without_site(whole))
    leases = {labels["site"]: v for name, labels, v in cut if name == "proxy_shard_requests_total"}
    assert leases[OTHER_SITE] == (len(COLD) - 8) + (len(BANNED) - 8)  # one lease each, two if banned


def test_the_collector_cuts_by_the_setting(broad_pool):
    families = list(PoolCollector(broad_pool, ["dc"], top_sites=5).collect())
    sites = _sites_per_metric(_samples(families))
    assert sites["proxy_shard_requests_total"] == {*sites["proxy_shard_requests_total"] - {OTHER_SITE}, OTHER_SITE}
    assert len(sites["proxy_shard_requests_total"]) == 6
    assert max(len(v - {"*"}) for v in sites.values()) <= 6


def test_recent_leases_rank_and_the_set_is_sticky(broad_pool):
    now = [0.0]
    ranking = SiteRanking(len(HOT), clock=lambda: now[0])
    assert ranking.choose(read_pool(broad_pool, "dc")) == frozenset(HOT)  # first scrape: most leases ever
    newcomers = COLD[100:112]
    for site in newcomers:
        _use(broad_pool, site, times=2)
    now[0] = 60.0
    assert ranking.choose(read_pool(broad_pool, "dc")) == frozenset(newcomers)  # 2 recent leases beat 0
    now[0] = 2000.0  # nothing since, past the window: every site ties at 0 recent leases
    assert ranking.choose(read_pool(broad_pool, "dc")) == frozenset(newcomers)  # ties keep the shown sites


def test_a_pool_with_few_sites_is_shown_whole(real_redis):
    store = PoolStore(real_redis, namespace=NS, host_id="host-a")
    store.add_proxies("dc", PROXIES)
    for site in ("a.example", "b.example", "c.example"):
        _use(store, site)
    snapshot = read_pool(store, "dc")
    assert SiteRanking(3).choose(snapshot) is None
    sites = _sites_per_metric(_samples(pool_metrics([snapshot], {"dc": None})))
    assert sites["proxy_shard_requests_total"] == {"a.example", "b.example", "c.example"}


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5])
def test_top_sites_setting_is_checked(bad):
    assert ShardSettings.from_settings({}).metrics_top_sites == 50
    with pytest.raises(SettingError, match="PROXY_SHARD_METRICS_TOP_SITES"):
        ShardSettings.from_settings({"PROXY_SHARD_METRICS_TOP_SITES": bad})
