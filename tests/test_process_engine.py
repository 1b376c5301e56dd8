"""One engine and one identity per process (modes/process.py): the shared in-memory servers are
refcounted, host ids are unique per crawler by default, and a host id another live process heartbeats
under is refused (host_beat.lua's TAKEN; store-level tests run on fakeredis and real redis-servers).
End-to-end: tests/test_two_crawlers_one_process.py."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.crawl.health import HostMonitor
from scrapy_proxy_shard.engine.store import Lease, LeaseWait
from scrapy_proxy_shard.exceptions import HostIdTaken, SettingError
from scrapy_proxy_shard.modes import process
from scrapy_proxy_shard.modes.fallback import FallbackPoolStore
from scrapy_proxy_shard.modes.pools import embedded_store
from scrapy_proxy_shard.settings import ShardSettings, default_host_id

POOL = "main"
URLS = ["http://10.0.0.1:3128", "http://10.0.0.2:3128"]


def _settings(**overrides) -> ShardSettings:
    return ShardSettings.from_settings({"PROXY_SHARD_MODE": "embedded", "PROXY_SHARD_NAMESPACE": "pe",
                                        **overrides})


# --- the shared in-memory engine ------------------------------------------------------------------

def test_two_embedded_stores_of_a_process_share_one_state_and_the_last_close_drops_it():
    async def scenario():
        a = embedded_store(_settings(PROXY_SHARD_HOST_ID="a"))
        b = embedded_store(_settings(PROXY_SHARD_HOST_ID="b"))
        assert process.server_users("embedded", "pe") == 2
        await a.add_proxies(POOL, URLS[:1])
        first = await a.lease(POOL, "site.test", ttl=30)
        assert isinstance(first, Lease)
        # The other crawler's store sees the same pool and the slot a holds: it waits, never overlaps.
        assert await b.pool_size(POOL) == 1
        assert isinstance(await b.lease(POOL, "site.test", ttl=30), LeaseWait)
        await a.aclose()
        assert process.server_users("embedded", "pe") == 1
        assert await b.pool_size(POOL) == 1  # b still uses the server
        await b.aclose()
        assert process.server_users("embedded", "pe") == 0
        c = embedded_store(_settings())  # a later crawl of the process starts afresh
        assert await c.pool_size(POOL) == 0
        await c.aclose()
        assert process.server_users("embedded", "pe") == 0

    asyncio.run(scenario())


def test_engines_are_shared_per_kind_and_namespace_only():
    async def scenario():
        a = embedded_store(_settings())
        other_ns = embedded_store(_settings(PROXY_SHARD_NAMESPACE="other"))
        local = embedded_store(_settings(), "fallback")
        await a.add_proxies(POOL, URLS)
        assert await other_ns.pool_size(POOL) == 0 and await local.pool_size(POOL) == 0
        for store in (a, other_ns, local):
            await store.aclose()
        assert process.server_users("embedded", "pe") == process.server_users("fallback", "pe") == 0

    asyncio.run(scenario())


def test_a_closed_store_gives_its_use_back_once():
    async def scenario():
        a = embedded_store(_settings())
        b = embedded_store(_settings())
        await a.aclose()
        await a.aclose()  # a second close must not take b's use away
        assert process.server_users("embedded", "pe") == 1
        await b.aclose()

    asyncio.run(scenario())


def test_two_fallback_stores_of_a_process_use_one_local_engine():
    settings = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "redis://127.0.0.1:1/0",
                                            "PROXY_SHARD_NAMESPACE": "pe"})

    async def scenario():
        one = FallbackPoolStore(embedded_store(settings, "primary-1"), settings)
        two = FallbackPoolStore(embedded_store(settings, "primary-2"), settings)
        assert one._ensure_local() is not two._ensure_local()
        await one._ensure_local().add_proxies(POOL, URLS[:1])
        assert await two._ensure_local().pool_size(POOL) == 1
        assert process.server_users("fallback", "pe") == 2
        await one.aclose()
        await two.aclose()
        assert process.server_users("fallback", "pe") == 0

    asyncio.run(scenario())


# --- host ids -------------------------------------------------------------------------------------

def test_each_crawler_of_a_process_gets_its_own_default_host_id():
    ids = [ShardSettings.for_crawler(get_crawler(settings_dict={})).host_id for _ in range(3)]
    assert len(set(ids)) == 3 and all(i.startswith(default_host_id()) for i in ids)
    set_ = [ShardSettings.for_crawler(get_crawler(settings_dict={"PROXY_SHARD_HOST_ID": "w1"})).host_id
            for _ in range(2)]
    assert set_ == ["w1", "w1"]  # a configured id is used as given


def test_a_live_record_of_another_instance_is_taken(make_store):
    a, b = make_store("w1"), make_store("w1")
    a.heartbeat(POOL, ttl=30, token="process-a")
    a.heartbeat(POOL, ttl=30, token="process-a")  # its own record: fine
    with pytest.raises(HostIdTaken) as taken:
        b.heartbeat(POOL, ttl=30, token="process-b")
    assert taken.value.host_id == "w1" and taken.value.pool == POOL
    assert taken.value.alive_until > taken.value.last_beat
    assert b.heartbeat(POOL, ttl=30) is not None  # no token (tools, old callers): never refused
    assert not b.leave(POOL, "process-b")  # not its record: left alone
    assert [h.host for h in a.hosts(POOL)] == ["w1"]
    assert a.leave(POOL, "process-a")
    assert b.heartbeat(POOL, ttl=30, token="process-b") is not None  # the id is free again


def test_an_expired_record_of_another_instance_is_taken_over(make_store):
    a, b = make_store("w1"), make_store("w1")
    a.heartbeat(POOL, ttl=0.05, token="process-a")
    time.sleep(0.1)  # A's record expires (a crash: no leave)
    assert b.heartbeat(POOL, ttl=30, token="process-b") is not None
    with pytest.raises(HostIdTaken):
        a.heartbeat(POOL, ttl=30, token="process-a")


class _Store:
    """A store whose host id another process holds: alive until ``until``, beating ``beats``."""

    def __init__(self, beats: bool, until: float) -> None:
        self.beats, self.until, self.calls, self.left = beats, until, 0, []

    async def pools(self):
        return [POOL]

    async def heartbeat(self, pool, *, token="", **kwargs):
        self.calls += 1
        loop = asyncio.get_running_loop()
        if loop.time() < self.until:
            raise HostIdTaken("w1", pool, self.until, loop.time() if self.beats else 0.0)
        return None

    async def leave(self, pool, token=""):
        self.left.append(pool)
        return True


def test_the_monitor_refuses_a_live_duplicate_and_waits_out_a_dead_one(caplog, monkeypatch):
    monkeypatch.setattr("scrapy_proxy_shard.crawl.health.CLAIM_POLL", 0.05)
    settings = ShardSettings(host_id="w1", heartbeat_interval=0.05, host_ttl=1.0, logstats_interval=0)

    async def live():
        store = _Store(beats=True, until=asyncio.get_running_loop().time() + 60)
        monitor = HostMonitor(store, settings, pools=[POOL])
        with pytest.raises(SettingError, match="PROXY_SHARD_HOST_ID 'w1' is in use by another live process"):
            await monitor.start()
        await monitor.stop()
        return store

    async def dead():
        loop = asyncio.get_running_loop()
        store = _Store(beats=False, until=loop.time() + 0.3)
        monitor = HostMonitor(store, settings, pools=[POOL])
        await monitor.start()
        waited = loop.time() - (store.until - 0.3)
        await monitor.stop()
        return waited

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        store = asyncio.run(live())
        assert store.calls == 2 and store.left == []  # refused at its second look, nothing left
        assert 0.25 <= asyncio.run(dead()) < 1.0
    assert any("taken over" in r.getMessage() for r in caplog.records)


def test_crawlers_sharing_a_host_id_in_one_process_leave_with_the_last(make_store):
    settings = ShardSettings(host_id="shared", heartbeat_interval=0.05, host_ttl=5.0, logstats_interval=0)

    class Async:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            method = getattr(self.store, name)

            async def call(*args, **kwargs):
                return method(*args, **kwargs)
            return call

    store = make_store("shared")
    store.add_proxies(POOL, URLS)

    async def scenario():
        one = HostMonitor(Async(store), settings, pools=[POOL])
        two = HostMonitor(Async(store), settings, pools=[POOL])
        await one.start()
        await two.start()  # the same instance token: one host, not a duplicate
        await one.stop()
        assert [h.host for h in store.hosts(POOL)] == ["shared"]  # two still runs as it
        await two.stop()
        assert store.hosts(POOL) == []

    asyncio.run(scenario())



def test_a_forked_child_rolls_its_own_instance_token():
    import os
    import warnings

    settings = ShardSettings(host_id="w1", logstats_interval=0)
    parent = HostMonitor(None, settings, pools=[POOL]).token
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
        pid = os.fork()
    if pid == 0:  # the child: write its monitor's token, exit at once
        try:
            os.write(write, HostMonitor(None, settings, pools=[POOL]).token.encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child and parent and child != parent
    assert HostMonitor(None, settings, pools=[POOL]).token == parent == process.instance_token()


def test_a_crawl_whose_host_id_is_taken_over_while_running_closes_once(caplog):
    from scrapy_proxy_shard.crawl.runtime import HOST_ID_TAKEN_REASON, ShardRuntime

    class Taken(_Store):
        async def heartbeat(self, pool, *, token="", **kwargs):
            self.calls += 1
            raise HostIdTaken("w1", pool, 130.0, 100.0)

    class Engine:
        spider = object()
        reasons: list[str] = []

        async def close_spider_async(self, reason):
            self.reasons.append(reason)

    crawler = get_crawler(settings_dict={"PROXY_SHARD_HOST_ID": "w1"})
    crawler.stats.open_spider()
    crawler.engine = Engine()
    runtime = ShardRuntime.for_crawler(crawler)
    monitor = HostMonitor(Taken(beats=True, until=0), runtime.settings, pools=[POOL], stats=crawler.stats,
                          on_taken=runtime.host_id_taken)

    async def scenario():
        for _ in range(3):
            await monitor.beat()
        await runtime._taken_closer

    with caplog.at_level(logging.ERROR, logger="scrapy_proxy_shard"):
        asyncio.run(scenario())
    assert Engine.reasons == [HOST_ID_TAKEN_REASON]
    assert crawler.stats.get_value("proxy_shard/host_id_taken") == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and HOST_ID_TAKEN_REASON in errors[0] and "no fallback slice" in errors[0]
