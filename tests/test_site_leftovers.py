"""Per-site leftovers expire (issue 24): a broad crawl touches many sites once; once they are idle past
PROXY_SHARD_SITE_IDLE_TTL nothing of them stays in Redis (their state, counters and index entry), so
memory returns to the pool's own size. On a real redis-server: expiry is Redis's, not a fake's."""

from __future__ import annotations

import time

from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.store import Lease, PoolStore

POOL = "main"
URLS = [f"http://10.9.0.{i}:3128" for i in range(1, 4)]


def _pool_keys(client) -> set[str]:
    return set(client.scan_iter(match="{t:*"))


def test_sites_touched_once_leave_nothing_once_idle(real_redis):
    # released as a crawl with the defaults does (adaptive pacing), one site in ten with a rate ban: the
    # pace hash, the proxy's mark and the ban entries are per-site leftovers too
    store = PoolStore(real_redis, namespace="t", host_id="h", site_idle_ttl=1.0,
                      bans=BanOptions(ttl=0.5, max_ttl=1.0, strike_window=0.5))
    pace = AutothrottleOptions(enabled=True, start_interval=1.0, min_interval=0.05, max_interval=30.0)
    store.add_proxies(POOL, URLS)
    baseline = _pool_keys(real_redis) - {k for k in _pool_keys(real_redis) if ":done:" in k}
    sites = [f"site{i}.example" for i in range(2000)]
    for i, site in enumerate(sites):
        lease = store.lease(POOL, site, ttl=0.5)  # a site lives lease TTL + idle TTL after its lease
        assert isinstance(lease, Lease), lease
        if i % 10 == 9:
            store.release(lease, outcome="ban", reason="http_429", rate_ban=True, retry_after=0.5,
                          autothrottle=pace)
        else:
            store.release(lease, outcome="ok", autothrottle=pace)
    live = store.site_counters(POOL)
    assert live["site7.example"]["l"] == 1 and live["site7.example"]["ok"] == 1
    assert real_redis.exists("{t:main}:pace:site1999.example", "{t:main}:bans") == 2
    time.sleep(2.5)  # past the idle TTL and the bans' windows: every site's keys, pace, bans, index expire
    left = {k for k in _pool_keys(real_redis) if ":done:" not in k} - baseline
    pool_level = {k.rsplit("}:", 1)[1] for k in left}
    # what remains is pool-wide only: counters of the host and proxies (bounded by hosts and proxies)
    assert not [k for k in left if any(s in k for s in ("site0.", "site1999."))], sorted(left)[:10]
    assert pool_level <= {"pstats", "hstats", "counters", "sstats"}, pool_level
    assert store.site_counters(POOL) == {} and store.sites(POOL) == {}
    # the pool-wide hashes did not grow with the sites: was ~262 B per site touched, forever (>= 500 KB)
    sizes = {k: real_redis.memory_usage(k) for k in left}
    assert sum(sizes.values()) < 4096, sizes


def test_ban_entries_expire_with_the_latest_entry_never_before_it(real_redis):
    """P:bans and P:banidx expire with their latest entry (strike window included): a short ban after a
    long one does not shorten the keys' life, and an operator's restore keeps its warm-up bans."""
    store = PoolStore(real_redis, namespace="t", host_id="h", bans=BanOptions(strike_window=5.0))
    store.add_proxies(POOL, URLS)
    store.ban(POOL, URLS[0], site="a.example", ttl=30.0)
    store.ban(POOL, URLS[1], site="b.example", ttl=1.0)
    store.ban(POOL, URLS[2], ttl=2.0)  # proxy-wide
    latest = real_redis.zrange("{t:main}:banidx", -1, -1, withscores=True)[0]
    assert latest[0].startswith("a.example|")
    seconds, micros = real_redis.time()
    left = latest[1] - (seconds * 1000 + micros // 1000)  # ~30 s (jittered) + the 5 s window
    for key in ("{t:main}:bans", "{t:main}:banidx"):
        assert left <= real_redis.pttl(key) <= left + 1100, key
    assert real_redis.hlen("{t:main}:bans") == 3 and real_redis.zcard("{t:main}:banidx") == 3
