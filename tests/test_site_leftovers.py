"""Per-site leftovers expire (issue 24): a broad crawl touches many sites once; once they are idle past
PROXY_SHARD_SITE_IDLE_TTL nothing of them stays in Redis (their state, counters and index entry), so
memory returns to the pool's own size. On a real redis-server: expiry is Redis's, not a fake's."""

from __future__ import annotations

import time

from scrapy_proxy_shard.engine.store import Lease, PoolStore

POOL = "main"
URLS = [f"http://10.9.0.{i}:3128" for i in range(1, 4)]


def _pool_keys(client) -> set[str]:
    return set(client.scan_iter(match="{t:*"))


def test_sites_touched_once_leave_nothing_once_idle(real_redis):
    store = PoolStore(real_redis, namespace="t", host_id="h", site_idle_ttl=1.0)
    store.add_proxies(POOL, URLS)
    baseline = _pool_keys(real_redis) - {k for k in _pool_keys(real_redis) if ":done:" in k}
    sites = [f"site{i}.example" for i in range(2000)]
    for site in sites:
        lease = store.lease(POOL, site, ttl=0.5)  # a site lives lease TTL + idle TTL after its lease
        assert isinstance(lease, Lease), lease
        store.release(lease, outcome="ok")
    live = store.site_counters(POOL)
    assert live["site7.example"]["l"] == 1 and live["site7.example"]["ok"] == 1
    time.sleep(2.5)  # past the idle TTL: every site's keys, counters and the index expire in Redis
    left = {k for k in _pool_keys(real_redis) if ":done:" not in k} - baseline
    pool_level = {k.rsplit("}:", 1)[1] for k in left}
    # what remains is pool-wide only: counters of the host and proxies (bounded by hosts and proxies)
    assert not [k for k in left if any(s in k for s in ("site0.", "site1999."))], sorted(left)[:10]
    assert pool_level <= {"pstats", "hstats", "counters"}, pool_level
    assert store.site_counters(POOL) == {} and store.sites(POOL) == {}
    # the pool-wide hashes did not grow with the sites: was ~262 B per site touched, forever (>= 500 KB)
    sizes = {k: real_redis.memory_usage(k) for k in left}
    assert sum(sizes.values()) < 4096, sizes
