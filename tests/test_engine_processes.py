"""The engine under real concurrency: OS processes against a real redis-server."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import fakeredis
import pytest
import redis
import redis.asyncio
import redis.cluster

from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, LeaseWait, PoolStore
from scrapy_proxy_shard.exceptions import PoolBackendError

POOL = "contended"
SITES = {"a.example": 1, "b.example": 2}  # site -> per-proxy concurrency
PROXIES = [f"http://10.1.0.{i}:3128" for i in range(1, 4)]


def _client(url: str, cluster: bool):
    if cluster:
        return redis.cluster.RedisCluster.from_url(url, decode_responses=True)
    return redis.Redis.from_url(url, decode_responses=True)


def _worker(url: str, worker: int, iterations: int, queue, cluster: bool = False, go=None) -> None:
    """Lease, mark the slot in use, hold it briefly, unmark, release; report violations."""
    client = _client(url, cluster)
    if go is not None:
        go.wait(120)  # a barrier: all workers start together, so the pool is really contended
    store = PoolStore(client, host_id=f"worker-{worker}", namespace="t")
    violations, done, waits = 0, 0, 0
    sites = list(SITES)
    for i in range(iterations):
        site = sites[(worker + i) % len(sites)]
        while True:
            result = store.lease(POOL, site, ttl=10, concurrency=SITES[site])
            if isinstance(result, Lease):
                break
            waits += 1
            time.sleep(result.wait)
        counter = f"test:inuse:{result.proxy_id}:{site}"
        if client.incr(counter) > SITES[site]:
            violations += 1
        time.sleep(0.003)
        client.decr(counter)
        assert store.release(result, min_interval=0.0).status == "ok"
        done += 1
    client.close()
    queue.put((violations, done, waits))


@pytest.mark.parametrize("kind", ["redis-server", "redis-cluster"])
def test_eight_processes_never_exceed_the_per_site_limit(kind, request):
    cluster = kind == "redis-cluster"
    real_redis = request.getfixturevalue("cluster_redis" if cluster else "real_redis")
    url = request.getfixturevalue("redis_cluster" if cluster else "redis_server").url
    PoolStore(real_redis, namespace="t").add_proxies(POOL, PROXIES)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    go = ctx.Barrier(9)
    procs = [ctx.Process(target=_worker, args=(url, w, 60, queue, cluster, go)) for w in range(8)]
    for p in procs:
        p.start()
    go.wait(120)
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sum(r[0] for r in results) == 0, "a (proxy, site) was used above its concurrency limit"
    assert sum(r[1] for r in results) == 8 * 60
    assert sum(r[2] for r in results) > 0, "the pool was never contended: the test proved nothing"
    store = PoolStore(real_redis, namespace="t")
    for site, concurrency in SITES.items():
        state = store.pool_status(POOL, site)
        assert (state.slots, state.free, state.held) == (3 * concurrency, 3 * concurrency, 0)


def _hold_forever(url: str, queue) -> None:
    store = PoolStore(redis.Redis.from_url(url, decode_responses=True), namespace="t")
    lease = store.lease(POOL, "a.example", ttl=0.5)
    queue.put(lease.proxy_id)
    time.sleep(600)


def test_killed_holder_lease_frees_itself_after_ttl(real_redis, redis_server):
    store = PoolStore(real_redis, namespace="t")
    store.add_proxies(POOL, PROXIES[:1])
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_hold_forever, args=(redis_server.url, queue))
    proc.start()
    held = queue.get(timeout=60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.wait <= 0.5
    time.sleep(wait.wait + 0.02)
    lease = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(lease, Lease) and lease.proxy_id == held


@pytest.mark.parametrize("kind", ["fakeredis", "redis-server"])
def test_async_store_runs_the_same_plans(kind, redis_server):
    async def scenario():
        if kind == "fakeredis":
            client = fakeredis.FakeAsyncRedis(decode_responses=True)
        else:
            client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
            await client.flushall()
        store = AsyncPoolStore(client, host_id="async-host", namespace="t")
        try:
            await store.add_proxies(POOL, PROXIES[:2])
            first = await store.lease(POOL, "a.example", ttl=5)
            second = await store.lease(POOL, "a.example", ttl=5)
            third = await store.lease(POOL, "a.example", ttl=5)
            assert isinstance(third, LeaseWait)
            assert {first.proxy_id, second.proxy_id} == {r.id for r in await store.list_proxies(POOL)}
            assert (await store.release(first, outcome="ban", reason="http_429")).strikes == 1
            assert (await store.release(second)).status == "ok"
            bans = await store.bans(POOL)
            assert [(b.proxy_id, b.reason) for b in bans] == [(first.proxy_id, "http_429")]
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_refused_connection_is_a_clear_error_with_masked_password():
    client = redis.Redis.from_url("redis://:VerySecret@127.0.0.1:1/0", decode_responses=True,
                                  socket_connect_timeout=1)
    store = PoolStore(client, url_for_errors="redis://:VerySecret@127.0.0.1:1/0")
    with pytest.raises(PoolBackendError) as info:
        store.ping()
    message = str(info.value)
    assert "cannot reach Redis at redis://***:***@127.0.0.1:1/0" in message
    assert "VerySecret" not in message
    client.close()


def test_pools_spread_over_cluster_slots(cluster_redis):
    """Each pool is one hash slot; different pools land on different shards."""
    store = PoolStore(cluster_redis, namespace="t")
    slots = {cluster_redis.keyslot(store.prefix(f"pool-{i}")) for i in range(12)}
    nodes = {cluster_redis.nodes_manager.get_node_from_slot(slot).port for slot in slots}
    assert len(slots) > 6 and len(nodes) == 3
