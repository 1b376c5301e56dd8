"""A release wakes a request sleeping for a pacing slot when the slot it gave back frees sooner
(crawl/pacewake.py; release.lua's free_at_ms)."""

from __future__ import annotations

import asyncio

import pytest

from scrapy_proxy_shard.crawl.pacewake import PacingSleepers
from scrapy_proxy_shard.engine.keyset import script_keys
from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.store import Lease, PoolStore


def run(coro):
    return asyncio.run(coro)


def test_the_request_sleeping_longest_past_the_freed_slot_is_woken_alone():
    async def scenario():
        sleepers = PacingSleepers()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        woke: dict[str, float] = {}

        async def sleep(name, seconds, site="a.test"):
            await sleepers.sleep("p", site, seconds)
            woke[name] = loop.time() - t0

        tasks = [asyncio.ensure_future(sleep("short", 0.3)), asyncio.ensure_future(sleep("long", 0.6)),
                 asyncio.ensure_future(sleep("other site", 0.6, "b.test"))]
        await asyncio.sleep(0.05)
        assert len(sleepers) == 3
        assert not sleepers.release_freed("p", "a.test", 0.7)  # frees later than both: nobody gains
        assert sleepers.release_freed("p", "a.test", 0.1)      # wakes "long" only
        await asyncio.sleep(0.05)
        assert set(woke) == {"long"} and woke["long"] < 0.2
        assert not sleepers.release_freed("p", "a.test", 0.298 - (loop.time() - t0))  # gains < 5 ms
        await asyncio.gather(*tasks)
        assert 0.29 <= woke["short"] < 0.5 and woke["other site"] >= 0.59
        assert len(sleepers) == 0 and not sleepers.release_freed("p", "a.test", 0.0)

    run(scenario())


def test_a_cancelled_sleep_leaves_nothing_behind():
    async def scenario():
        sleepers = PacingSleepers()
        task = asyncio.ensure_future(sleepers.sleep("p", "a.test", 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(sleepers) == 0

    run(scenario())


def test_a_release_says_when_its_slot_frees_and_a_probe_frees_sooner(fake_redis):
    """free_at is the slot's ready score (start + the interval it is paced with): for the probe's proxy
    the probe's lower interval, for the others the interval in force."""
    store = PoolStore(fake_redis, namespace="t", host_id="h")
    store.add_proxies("main", [f"http://10.0.0.{i}:3128" for i in range(1, 4)])
    at = AutothrottleOptions(True, start_interval=2.0, min_interval=0.1, max_interval=10.0)
    ready = script_keys("pool_status", store.prefix("main"), "a.test")[2]
    store.client.set(f"{store.prefix('main')}:waiting:a.test", "1")  # requests wait: probes may start
    seen = []
    for _ in range(6):
        lease = store.lease("main", "a.test", ttl=30)
        assert isinstance(lease, Lease)
        result = store.release(lease, outcome="ok", autothrottle=at)
        assert result.free_at == pytest.approx(store.client.zscore(ready, lease.member) / 1000)
        seen.append((result.pace_event, round(result.free_at - lease.issued_at, 3)))
        for member, _ in store.client.zrange(ready, 0, -1, withscores=True):
            store.client.zadd(ready, {member: 0})  # every slot free again now (no waiting in a unit test)
    assert ("probe", 0.5) in seen  # the probe's own slot: 2 s x 0.25
    assert all(gap in (0.5, 2.0) for _, gap in seen)


def test_a_lowering_brings_the_slots_paced_the_old_way_forward(fake_redis):
    """A probe's lowering (2 s -> 0.5 s) moves the site's idle slots, paced start + 2 s at their release,
    to start + 0.5 s; a slot in use and one in quarantine keep theirs."""
    store = PoolStore(fake_redis, namespace="t", host_id="h")
    urls = [f"http://10.0.0.{i}:3128" for i in range(1, 6)]
    store.add_proxies("main", urls)
    at = AutothrottleOptions(True, start_interval=2.0, min_interval=0.1, max_interval=10.0)
    ready = script_keys("pool_status", store.prefix("main"), "a.test")[2]
    pace = f"{store.prefix('main')}:pace:a.test"
    probe, idle1, idle2, held, banned = (store.lease("main", "a.test", ttl=30) for _ in urls)
    for lease in (idle1, idle2):
        store.release(lease, outcome="ok", autothrottle=at)
    store.release(banned, outcome="ban", reason="http_403", autothrottle=at)
    before = {lease.member: store.client.zscore(ready, lease.member) for lease in (idle1, idle2, banned)}
    for lease in (idle1, idle2):
        assert before[lease.member] / 1000 - lease.issued_at == pytest.approx(2.0, abs=0.002)
    # the probe has 3 of its 4 answers at 0.5 s: its next clean answer adopts 0.5 s for every host
    store.client.hset(pace, mapping={"probe": probe.proxy_id, "piv": "500.000", "pat": "0", "pn": "3",
                                     "pls": str(round(probe.issued_at * 1000))})
    result = store.release(probe, outcome="ok", autothrottle=at)
    assert result.pace_event == "down" and result.interval == pytest.approx(0.5)
    for lease in (idle1, idle2):
        assert store.client.zscore(ready, lease.member) / 1000 - lease.issued_at == pytest.approx(0.5, abs=0.002)
    assert store.client.zscore(ready, banned.member) == before[banned.member]  # its quarantine holds
    assert store.client.zscore(ready, held.member) > (held.issued_at + 29) * 1000  # still held: its lease
