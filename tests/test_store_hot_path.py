"""The store's per-call shortcuts on the lease + release path keep the calls exactly what they were.

Lease and release build their KEYS from a template made once per (script, pool, site) and send EVALSHA
themselves (no redis-py ``Script`` per call); a release that bans nothing sends fixed ban arguments
instead of drawing a jitter. These tests pin what that must not change: the keys are ``keyset``'s, a
server that lost the scripts gets them again, and the random source is drawn only for what uses it.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, PoolStore

POOL = "main"
URLS = [f"http://10.3.0.{i}:8000" for i in range(1, 4)]


def _recording(store: PoolStore) -> list:
    """Every request the store sends, in order."""
    sent = []
    execute = store._execute

    def record(request):
        sent.append(request)
        return execute(request)

    store._execute = record
    return sent


def _text(keys) -> list[str]:
    return [k.decode() if isinstance(k, bytes) else k for k in keys]


@pytest.mark.parametrize(("site", "session"), [("a.example", None), ("b.example", "s-1"), ("a.example", "s:2")])
def test_lease_and_release_keys_are_keysets(store, site, session):
    store.add_proxies(POOL, URLS)
    sent = _recording(store)
    for _ in range(2):  # the second call of each runs from the cached template
        lease = store.lease(POOL, site, ttl=5, session_id=session)
        assert isinstance(lease, Lease)
        store.release(lease, outcome="ok", latency=0.01)
    prefix = store.prefix(POOL)
    for request in sent:
        token = request.args[3] if request.name == "lease" else request.args[2]
        expected = keyset.script_keys(request.name, prefix, site, session=session or "", token=token)
        assert _text(request.keys) == expected
    assert [r.name for r in sent] == ["lease", "release"] * 2


def test_keys_follow_the_pool_and_site_of_each_call(store):
    store.add_proxies(POOL, URLS)
    store.add_proxies("other", URLS)
    sent = _recording(store)
    for pool, site in [(POOL, "a.example"), ("other", "a.example"), (POOL, "c.example"), (POOL, "a.example")]:
        lease = store.lease(pool, site, ttl=5)
        assert isinstance(lease, Lease) and (lease.pool, lease.site) == (pool, site)
        store.release(lease)
        for request in sent[-2:]:
            token = request.args[3] if request.name == "lease" else request.args[2]
            assert _text(request.keys) == keyset.script_keys(request.name, store.prefix(pool), site, token=token)


def test_a_server_that_lost_the_scripts_gets_them_again(real_redis):
    store = PoolStore(real_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, URLS)
    store.release(store.lease(POOL, "a.example", ttl=5))
    real_redis.script_flush()
    lease = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(lease, Lease)
    real_redis.script_flush()
    assert store.release(lease, outcome="ok").status == "ok"


def test_an_async_store_that_lost_the_scripts_gets_them_again(redis_server):
    async def scenario() -> str:
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            await client.flushall()
            store = AsyncPoolStore(client, namespace="t", host_id="h")
            await store.add_proxies(POOL, URLS)
            await client.script_flush()
            lease = await store.lease(POOL, "a.example", ttl=5)
            assert isinstance(lease, Lease)
            await client.script_flush()
            return (await store.release(lease, outcome="ok")).status
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == "ok"


@pytest.mark.parametrize("outcome", ["ok", "error", "unknown"])
def test_a_release_that_bans_nothing_draws_no_jitter(make_store, outcome):
    draws = []

    def source() -> float:
        draws.append(1)
        return 0.5

    store = make_store(random_source=source)
    store.add_proxies(POOL, URLS)
    lease = store.lease(POOL, "a.example", ttl=5)
    assert store.release(lease, outcome=outcome).status == "ok"
    assert draws == []
    lease = store.lease(POOL, "a.example", ttl=5)
    assert store.release(lease, outcome=outcome, randomize_interval=True).status == "ok"
    assert draws == [1]  # the interval's draw only


def test_a_ban_release_still_draws_its_jitter(make_store):
    from scrapy_proxy_shard.settings import BanOptions

    store = make_store(bans=BanOptions(ttl=10, max_ttl=10, jitter=0.5), random_source=lambda: 1.0)
    store.add_proxies(POOL, URLS[:1])
    lease = store.lease(POOL, "a.example", ttl=5)
    result = store.release(lease, outcome="ban", reason="http_403")
    assert result.ban_until - result.now == pytest.approx(5.0, abs=0.1)  # 10 s shortened by the full jitter


def test_the_pace_hash_goes_to_the_hashtable_encoding_once(real_redis):
    """A proxy's first mark on a site (pace hash field p:<id>) grows the hash with the pool: past 64
    fields it is converted to the hashtable encoding once (field ht), not again at every later first
    mark (each conversion cost an HLEN, a 2 KB HSET and an HDEL: about 8 us of a release at 10,000
    proxies)."""
    from scrapy_proxy_shard.engine.schema import pace_key

    store = PoolStore(real_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, [f"http://10.4.{i // 200}.{i % 200 + 1}:8000" for i in range(200)])

    def cycles(n: int) -> None:
        for _ in range(n):
            lease = store.lease(POOL, "a.example", ttl=60)
            store.release(lease, outcome="ok", latency=0.05, min_interval=0.0)

    cycles(100)  # 100 first marks: converted at the 64th field
    key = pace_key(store.prefix(POOL), "a.example")
    assert real_redis.object("encoding", key) == "hashtable"
    real_redis.config_resetstat()
    cycles(50)  # 50 more first marks: no conversion, no HLEN of the pace hash
    hlen = real_redis.info("commandstats").get("cmdstat_hlen", {}).get("calls", 0)
    # What is left: the site hash's own check, about 1 release in 8 by the Redis clock (site_as_table);
    # before, one more per first mark (50 here).
    assert hlen < 25, hlen
    assert real_redis.hlen(key) >= 140  # (most of them new proxies)
    assert real_redis.hget(key, "ht") == "1"
