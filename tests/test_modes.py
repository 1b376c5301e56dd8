"""Embedded, static and hybrid-fallback modes, against real redis-server processes we stop and restart."""

from __future__ import annotations

import asyncio
import inspect
import time

import fakeredis
import pytest
import redis
import redis.asyncio
from scrapy import Request, Spider
from scrapy.utils.misc import build_from_crawler
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, LeaseWait, PoolBackend, PoolStore
from scrapy_proxy_shard.exceptions import PoolBackendError, PoolUnreachable, SettingError
from scrapy_proxy_shard.middlewares import ProxyShardMiddleware
from scrapy_proxy_shard.modes import fallback
from scrapy_proxy_shard.modes.factory import build_store
from scrapy_proxy_shard.modes.fallback import FallbackPoolStore
from scrapy_proxy_shard.modes.pools import initial_proxies
from scrapy_proxy_shard.modes.process import SharedEngineStore
from scrapy_proxy_shard.settings import ShardSettings

PROXIES = [f"http://10.7.0.{i}:3128" for i in range(1, 13)]
HOSTS = ("host-a", "host-b", "host-c")


def test_embedded_mode_needs_no_redis():
    crawler = get_crawler(Spider, {"PROXY_SHARD_PROXIES": PROXIES[:2], "PROXY_SHARD_MIN_INTERVAL": 0})
    spider = Spider.from_crawler(crawler, name="solo")
    crawler.spider = spider
    mw = build_from_crawler(ProxyShardMiddleware, crawler)
    assert mw.runtime.settings.mode == "embedded"

    async def scenario():
        await mw.runtime.spider_opened(spider)
        first, second = Request("http://a.example/1"), Request("http://a.example/2")
        await mw.process_request(first)
        await mw.process_request(second)
        assert first.meta["proxy"] != second.meta["proxy"]
        await mw.runtime.spider_closed(spider, "finished")

    asyncio.run(scenario())
    assert crawler.stats.get_value("proxy_shard/leases") == 2


def _static(host: str, **extra) -> ShardSettings:
    values = {"PROXY_SHARD_MODE": "static", "PROXY_SHARD_HOSTS": list(HOSTS), "PROXY_SHARD_HOST_ID": host,
              "PROXY_SHARD_PROXIES": PROXIES, **extra}
    return ShardSettings.from_settings(values)


@pytest.mark.parametrize("sharding", ["consistent", "modulo"])
def test_static_mode_gives_each_host_a_disjoint_slice(sharding):
    slices = [{p.url for p in initial_proxies(_static(h, PROXY_SHARD_SHARDING=sharding))["default"]}
              for h in HOSTS]
    assert sum(map(len, slices)) == len(PROXIES)
    assert set().union(*slices) == set(PROXIES)


def test_static_mode_settings_are_checked():
    with pytest.raises(SettingError, match="must be one of PROXY_SHARD_HOSTS"):
        _static("host-z")
    with pytest.raises(SettingError, match="PROXY_SHARD_SHARDING"):
        _static("host-a", PROXY_SHARD_SHARDING="random")


def test_platform_partition_keeps_each_ip_on_one_platform():
    settings = ShardSettings.from_settings({
        "PROXY_SHARD_PROXIES": PROXIES,
        "PROXY_SHARD_PLATFORMS": {"ozon": ["ozon.ru", "ozon.kz"], "wb": ["wildberries.ru"]},
    })
    pools = initial_proxies(settings)
    ozon = {p.url for p in pools["default.ozon"]}
    wb = {p.url for p in pools["default.wb"]}
    assert ozon and wb and not ozon & wb and ozon | wb == set(PROXIES)


def _fallback_store(url: str, host: str, grace: float = 0.3) -> FallbackPoolStore:
    settings = ShardSettings.from_settings({
        "PROXY_SHARD_REDIS_URL": url, "PROXY_SHARD_HOST_ID": host, "PROXY_SHARD_HOSTS": list(HOSTS),
        "PROXY_SHARD_FALLBACK_GRACE": grace, "PROXY_SHARD_FALLBACK_WARMUP": 0,
        "PROXY_SHARD_REDIS_PARAMS": {"socket_connect_timeout": 1},
    })
    client = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    primary = AsyncPoolStore(client, host_id=host, url_for_errors=url)
    return FallbackPoolStore(primary, settings)


def test_outage_switches_to_disjoint_local_slices_and_back():
    server = RedisServer().start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES)

        async def scenario():
            stores = [_fallback_store(server.url, h) for h in HOSTS]
            for store in stores:  # take the snapshot while Redis answers
                lease = await store.lease("default", "a.example", ttl=30)
                await store.release(lease)
            before = [await s.lease("default", "a.example", ttl=30) for s in stores]  # held across the outage
            server.kill()
            seen: dict[str, set[str]] = {}
            for store in stores:
                ids = set()
                while isinstance(lease := await store.lease("default", "a.example", ttl=30), Lease):
                    ids.add(lease.proxy_id)
                seen[store.host_id] = ids
                assert store.state == "fallback"
            # Every host uses only its own slice: no proxy on two hosts while Redis is down.
            all_ids = [i for ids in seen.values() for i in ids]
            assert len(all_ids) == len(set(all_ids)) and len(all_ids) >= len(PROXIES) - 3
            banned = next(iter(seen["host-a"]))
            local = stores[0]._local_leases
            victim = next(lease for lease in local.values() if lease.proxy_id == banned)
            await stores[0].release(victim, outcome="ban", reason="http_403")
            server.start()  # same port, empty: a restart without persistence
            deadline = time.monotonic() + 15
            while any(s.state == "fallback" for s in stores) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert all(s.state == "grace" for s in stores)
            admin = PoolStore(redis.Redis.from_url(server.url, decode_responses=True))
            assert admin.pool_size("default") == len(PROXIES)  # restored from the snapshot
            assert banned in {b.proxy_id for b in admin.bans("default")}  # the learned ban was written
            state = admin.pool_status("default", "a.example")
            assert state.held >= len(all_ids) - 1  # local leases in flight were adopted into Redis
            for store in stores:
                for lease in list(store._local_leases.values()):
                    await store.release(lease)
            assert admin.pool_status("default", "a.example").held == 0
            await asyncio.sleep(0.35)  # grace over
            lease = await stores[1].lease("default", "a.example", ttl=30)
            assert stores[1].state == "redis" and isinstance(lease, Lease)
            for lease in before:  # leases from before the outage died with Redis' memory
                assert (await stores[0].release(lease)).status in ("expired", "stale", "ok")
            for store in stores:
                await store.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_host_whose_fallback_share_is_empty_waits_instead_of_failing():
    """One proxy over three hosts: two hosts hold no proxy of the pool in fallback. Their requests
    wait for Redis (a LeaseWait, bounded by PROXY_SHARD_MAX_WAIT upstream), never UnknownPoolError."""
    server = RedisServer().start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES[:1])

        async def scenario():
            stores = [_fallback_store(server.url, h) for h in HOSTS]
            for store in stores:  # take the snapshot while Redis answers
                await store.release(await store.lease("default", "a.example", ttl=30))
            server.kill()
            answers = [await store.lease("default", "a.example", ttl=30) for store in stores]
            assert all(store.state == "fallback" for store in stores)
            assert sum(isinstance(a, Lease) for a in answers) == 1  # the one proxy, on its one host
            waits = [a for a in answers if not isinstance(a, Lease)]
            assert len(waits) == 2 and all(w.reason == "pool" and w.wait > 0 for w in waits)
            for store in stores:
                await store.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_fallback_wait_is_never_firm_and_asks_again_by_the_next_probe():
    """The local engine knows this host's slice only: every proxy of it quarantined on the site for
    10 minutes is no reason to fail requests at once (crawl/liveness.py), since Redis, with the whole
    pool, may answer at the next probe. Before: a firm 600 s wait, and the outage end-to-end test lost
    17 pages to PoolExhausted 2.6 s before Redis came back."""
    server = RedisServer().start()
    try:
        admin = PoolStore(redis.Redis.from_url(server.url, decode_responses=True))
        admin.add_proxies("default", PROXIES)
        for proxy in PROXIES:
            admin.ban("default", proxy, site="a.example", ttl=600)

        async def scenario():
            store = _fallback_store(server.url, HOSTS[0])
            first = await store.lease("default", "a.example", ttl=30)  # the snapshot, quarantines included
            assert isinstance(first, LeaseWait) and first.firm  # Redis, with the whole pool: firm
            server.kill()
            answer = await store.lease("default", "a.example", ttl=30)
            assert store.state == "fallback" and isinstance(answer, LeaseWait)
            assert not answer.firm and 0 < answer.wait <= fallback.PROBE_MAX
            await store.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()


def test_redis_down_at_start_can_start_in_fallback():
    port_owner = RedisServer()  # never started: nothing listens on its port
    settings = {
        "PROXY_SHARD_REDIS_URL": port_owner.url, "PROXY_SHARD_HOST_ID": "host-b", "PROXY_SHARD_HOSTS": list(HOSTS),
        "PROXY_SHARD_PROXIES": PROXIES, "PROXY_SHARD_REDIS_DOWN_AT_START": "fallback", "PROXY_SHARD_FALLBACK_WARMUP": 0,
        "PROXY_SHARD_REDIS_PARAMS": {"socket_connect_timeout": 1}, "PROXY_SHARD_MIN_INTERVAL": 0,
    }
    crawler = get_crawler(Spider, settings)
    spider = Spider.from_crawler(crawler, name="offline")
    crawler.spider = spider
    mw = build_from_crawler(ProxyShardMiddleware, crawler)

    async def scenario():
        await mw.runtime.spider_opened(spider)
        assert mw.runtime.open_error is None
        request = Request("http://a.example/1")
        await mw.process_request(request)
        expected = {p.url for p in initial_proxies(_static("host-b"))["default"]}
        assert request.meta["proxy"] in expected
        await mw.runtime.spider_closed(spider, "finished")

    asyncio.run(scenario())
    assert crawler.stats.get_value("proxy_shard/fallback/entered") == 1


# --- the declared store interface --------------------------------------------------------------------

def _interface() -> list[str]:
    """Every method and property PoolBackend declares (what the runtime may call)."""
    return sorted(name for name, value in vars(PoolBackend).items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, property)))


def _stores() -> list:
    redis_settings = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "redis://127.0.0.1:1/0"})
    return [build_store(ShardSettings.from_settings({})), build_store(redis_settings),
            build_store(redis_settings, client=fakeredis.FakeAsyncRedis(decode_responses=True))]


def test_every_store_the_factory_builds_implements_the_declared_interface():
    built = _stores()
    assert [type(s) for s in built] == [SharedEngineStore, FallbackPoolStore, AsyncPoolStore]
    assert issubclass(SharedEngineStore, AsyncPoolStore)  # the embedded engine: a store on the process's server
    assert {"lease", "release", "start_offline", "snapshot_proxies", "fallback_state", "heartbeat"} <= set(_interface())
    for store in built:
        assert isinstance(store, PoolBackend)


@pytest.mark.parametrize("cls", [AsyncPoolStore, FallbackPoolStore])
def test_each_store_writes_out_every_method_with_the_declared_signature(cls):
    """Explicit implementations, no forwarding: a method inherited from the Protocol's ``...`` body, or a
    parameter renamed, reordered or given another default, fails here rather than at the first outage."""
    assert "__getattr__" not in vars(cls)
    for name in _interface():
        declared, actual = inspect.getattr_static(PoolBackend, name), inspect.getattr_static(cls, name)
        assert actual is not declared, f"{cls.__name__}.{name} is not implemented"
        if isinstance(declared, property):
            assert isinstance(actual, property), f"{cls.__name__}.{name} must be a property"
            continue
        want, got = inspect.signature(declared), inspect.signature(actual)
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in want.parameters.values()], f"{cls.__name__}.{name}{got}"


def test_a_store_without_fallback_reports_none_and_cannot_start_offline():
    store = build_store(ShardSettings.from_settings({}))
    assert store.fallback_state is None and store.snapshot_proxies("default") == []
    down = PoolUnreachable("cannot reach Redis at redis://127.0.0.1:1/0")
    with pytest.raises(PoolUnreachable):
        asyncio.run(store.start_offline(down))


def test_an_unreachable_redis_raises_the_typed_outage_and_an_error_reply_does_not():
    store = AsyncPoolStore(redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1))
    with pytest.raises(PoolUnreachable, match=r"cannot reach Redis at redis://127\.0\.0\.1:1/0"):
        asyncio.run(store.ping())
    broken = PoolStore(fakeredis.FakeRedis(decode_responses=True))
    broken.client.set("{proxy_shard:default}:proxies", "not a hash")
    with pytest.raises(PoolBackendError, match="answered with an error") as caught:
        broken.pool_size("default")
    assert not isinstance(caught.value, PoolUnreachable)
