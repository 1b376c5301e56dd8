"""Shared fixtures: a real redis-server per test session, fakeredis, and stores over both.

The real server is started on a free loopback port by the fixture itself (never assumed to run)
and stopped by PID at the end. A missing binary is an error, not a skip: the test extras ship one.
"""

from __future__ import annotations

import fakeredis
import pytest
import redis
from redis.cluster import RedisCluster

from scrapy_proxy_shard.redis_server import RedisClusterServers, RedisServer
from scrapy_proxy_shard.settings import BanOptions
from scrapy_proxy_shard.store import PoolStore


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def real_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-master Redis Cluster on loopback (redis-cli --cluster create), for the whole session."""
    cluster = RedisClusterServers(3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_redis(redis_cluster):
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port, decode_responses=True)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def fake_redis():
    client = fakeredis.FakeRedis(decode_responses=True)
    yield client
    client.close()


FAST_BANS = BanOptions(ttl=0.3, max_ttl=1.2, jitter=0.0, strike_window=5.0, dead_ttl=0.3)


BACKENDS = {"fakeredis": "fake_redis", "redis-server": "real_redis", "redis-cluster": "cluster_redis"}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    """A Redis client of each kind: the contract suite runs against all three (fakeredis is also the
    embedded engine)."""
    return request.getfixturevalue(BACKENDS[request.param])


@pytest.fixture
def make_store(backend):
    """Build stores on the same backend, as separate hosts would (own host id, same Redis)."""

    def build(host_id: str = "host-a", **kwargs) -> PoolStore:
        kwargs.setdefault("bans", FAST_BANS)
        return PoolStore(backend, host_id=host_id, namespace="t", **kwargs)

    return build


@pytest.fixture
def store(make_store):
    return make_store()
