"""The hosts' side of the lease ledger the fault-injection test checks: a fallback lease that Redis
refuses to adopt during the grace period is given back unused, and counted as returned, so
``leases - (fallback/leases - fallback/leases_returned)`` is exactly the leases taken from Redis."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, PoolStore
from scrapy_proxy_shard.modes.fallback import FallbackPoolStore
from scrapy_proxy_shard.settings import ShardSettings

PROXY = "http://10.9.0.1:3128"
SITE = "a.example"


class _Stats:
    def __init__(self) -> None:
        self.values: Counter = Counter()

    def inc_value(self, key: str, count: float = 1) -> None:
        self.values[key] += count


def _store(url: str, stats: _Stats) -> FallbackPoolStore:
    settings = ShardSettings.from_settings({
        "PROXY_SHARD_REDIS_URL": url, "PROXY_SHARD_HOST_ID": "host-a", "PROXY_SHARD_HOSTS": ["host-a"],
        "PROXY_SHARD_FALLBACK_GRACE": 30, "PROXY_SHARD_FALLBACK_WARMUP": 0,
    })
    client = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    return FallbackPoolStore(AsyncPoolStore(client, host_id="host-a", url_for_errors=url), settings, stats=stats)


def test_a_grace_lease_redis_refuses_is_counted_as_returned_not_handed_out():
    server = RedisServer().start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", [PROXY])

        async def scenario():
            stats = _Stats()
            store = _store(server.url, stats)
            await store.release(await store.lease("default", SITE, ttl=30))  # snapshot taken
            server.kill()
            local = await store.lease("default", SITE, ttl=30)  # from the local slice
            assert isinstance(local, Lease) and store.state == "fallback"
            await store.release(local)
            server.start()  # empty: the probe restores the pool from the snapshot, then grace
            deadline = time.monotonic() + 15
            while store.state != "grace" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert store.state == "grace"
            other = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), host_id="host-b")
            assert isinstance(other.lease("default", SITE, ttl=30), Lease)  # Redis: the only slot is held
            answer = await store.lease("default", SITE, ttl=30)
            assert not isinstance(answer, Lease)  # the local lease was refused by Redis and given back
            assert stats.values["proxy_shard/fallback/leases"] == 2
            assert stats.values["proxy_shard/fallback/leases_returned"] == 1
            await store.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()
