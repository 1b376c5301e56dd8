"""Beyond one Redis: a Sentinel failover under a running store (real processes on loopback)."""

from __future__ import annotations

import time

import pytest

from scrapy_proxy_shard.demo.redis_server import RedisSentinelSet
from scrapy_proxy_shard.engine.store import Lease, PoolStore
from scrapy_proxy_shard.exceptions import PoolBackendError
from scrapy_proxy_shard.modes.connection import sync_client
from scrapy_proxy_shard.settings import ShardSettings

pytestmark = pytest.mark.slow


def test_sentinel_failover_keeps_the_pool_leasable(redis_binary):
    """Runs on every Redis line: Redis 7's diskless replica sync left the replica empty here once."""
    with RedisSentinelSet(3, binary=redis_binary.path) as cluster:
        settings = ShardSettings.from_settings({
            "PROXY_SHARD_REDIS_SENTINELS": [f"{h}:{p}" for h, p in cluster.sentinels],
            "PROXY_SHARD_REDIS_SENTINEL_MASTER": cluster.MASTER_NAME,
            "PROXY_SHARD_REDIS_PARAMS": {"socket_timeout": 2, "socket_connect_timeout": 1},
        })
        assert settings.mode == "redis"
        client = sync_client(settings)
        store = PoolStore(client, namespace="t")
        store.add_proxies("default", [f"http://10.3.0.{i}:3128" for i in range(1, 5)])
        lease = store.lease("default", "a.example", ttl=30)
        assert isinstance(lease, Lease)
        # The replica has the pool before the master dies (WAIT answers how many replicas acknowledged).
        assert client.execute_command("WAIT", 1, 5000) == 1
        cluster.master.kill()
        new_port = cluster.wait_for_failover(timeout=30)
        assert new_port == cluster.replica.port
        deadline = time.monotonic() + 20
        while True:  # the client asks the sentinels for the new master and reconnects
            try:
                again = store.lease("default", "a.example", ttl=30)
                break
            except PoolBackendError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert isinstance(again, Lease) and again.proxy_id != lease.proxy_id  # the old lease survived
        assert store.pool_size("default") == 4
        client.close()
