"""Per-site leftovers expire (issue 24): a broad crawl touches many sites once; once they are idle past
PROXY_SHARD_SITE_IDLE_TTL nothing of them stays in Redis (their state, counters and index entry), so
memory returns to the pool's own size. On a real redis-server: expiry is Redis's, not a fake's."""

from __future__ import annotations

import time

import pytest

from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.store import Lease, PoolStore
from scrapy_proxy_shard.exceptions import UnknownPoolError

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
    live = store.site_counters(POOL)  # (a late site: the first ones may have gone idle already on a slow machine)
    assert live["site1997.example"]["l"] == 1 and live["site1997.example"]["ok"] == 1
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


def test_a_ready_set_a_lease_creates_again_gets_the_sites_expiry(real_redis):
    """A lease that learns new proxies may create the site's ready set again (its old members all dropped:
    their proxies were removed): it must not trust the expiry the site hash remembers for the old set."""
    store = PoolStore(real_redis, namespace="t", host_id="h", site_idle_ttl=8.0)
    store.add_proxies(POOL, URLS[:1])
    store.release(store.lease(POOL, "a.example", ttl=0.5), outcome="ok")
    store.remove_proxies(POOL, URLS[:1])
    with pytest.raises(UnknownPoolError):
        store.lease(POOL, "a.example", ttl=0.5)  # drops the removed proxy's member: the set is gone
    store.add_proxies(POOL, URLS[1:])
    assert isinstance(store.lease(POOL, "a.example", ttl=0.5), Lease)
    assert 0 < real_redis.pttl("{t:main}:ready:a.example") <= 8_500


def test_a_learned_pace_keeps_its_week_whatever_a_late_release_says(real_redis):
    """The pace hash's expiry only moves later: a release that learns nothing (here a stale one, its lease
    expired and the slot leased again) does not cut a learned interval's week down to the idle TTL."""
    store = PoolStore(real_redis, namespace="t", host_id="h", site_idle_ttl=60.0)
    pace = AutothrottleOptions(enabled=True, start_interval=0.05, min_interval=0.01, max_interval=5.0)
    store.add_proxies(POOL, URLS[:1])

    def take(ttl: float) -> Lease:  # the one slot, once its pacing lets it go
        for _ in range(100):
            lease = store.lease(POOL, "a.example", ttl=ttl)
            if isinstance(lease, Lease):
                return lease
            time.sleep(min(lease.wait, 0.05))
        raise AssertionError("the slot never came back")

    store.release(take(5), outcome="ok", autothrottle=pace)
    real_redis.hset("{t:main}:pace:a.example", "iv", "300.000")  # as if learned: not its start (50 ms)
    store.release(take(5), outcome="ok", autothrottle=pace)
    assert real_redis.pttl("{t:main}:pace:a.example") > 6 * 86_400_000
    first = take(0.05)
    time.sleep(0.1)  # past its lease TTL: the slot is leased again once its pacing lets it go
    take(5)
    assert store.release(first, outcome="ok", autothrottle=pace).status == "stale"
    assert real_redis.pttl("{t:main}:pace:a.example") > 6 * 86_400_000
