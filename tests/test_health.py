"""Cluster-wide health: heartbeats, host expiry, load buckets, slot states, quarantine lengths, the
crawl-side monitor and its log line. Store-level tests run on fakeredis and a real redis-server."""

from __future__ import annotations

import asyncio
import logging
import time

import fakeredis
import pytest
from scrapy import Request, Spider
from scrapy.http import HtmlResponse
from scrapy.utils.misc import build_from_crawler
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.crawl.health import HostMonitor
from scrapy_proxy_shard.crawl.logstats import PoolLogStats, pool_summary
from scrapy_proxy_shard.engine.store import Beat, Lease, PoolStore
from scrapy_proxy_shard.exceptions import PoolBackendError, SettingError
from scrapy_proxy_shard.middlewares import BanDetectionMiddleware, ProxyShardMiddleware
from scrapy_proxy_shard.ops.snapshot import read_pool
from scrapy_proxy_shard.settings import ShardSettings

POOL = "main"
URLS = ["http://u1:Pa55word@10.0.0.1:3128", "http://10.0.0.2:3128", "http://10.0.0.3:3128"]


@pytest.fixture
def admin(make_store):
    store = make_store("admin")
    store.add_proxies(POOL, URLS)
    return store


def test_heartbeat_registers_the_host_and_it_ages_out_after_its_ttl(make_store, admin):
    a, b = make_store("host-a"), make_store("host-b")
    beat = a.heartbeat(POOL, ttl=0.3, info={"spider": "shop", "pid": 1})
    assert isinstance(beat, Beat) and beat.proxies == 3 and beat.live_hosts == 1
    b.heartbeat(POOL, ttl=30)
    assert [h.host for h in admin.hosts(POOL)] == ["host-a", "host-b"]
    assert admin.hosts(POOL)[0].info == {"spider": "shop", "pid": 1}
    a.release(a.lease(POOL, "a.example", ttl=5), outcome="ok")
    time.sleep(0.4)
    assert [h.host for h in admin.hosts(POOL)] == ["host-b"]
    assert admin.live_hosts() == ["host-b"]
    # The next beat of any host forgets the dead one with its counters: memory stays bounded.
    assert "host-a:l" in admin.counters(POOL, "hstats")
    b.heartbeat(POOL, ttl=30)
    assert not any(k.startswith("host-a:") for k in admin.counters(POOL, "hstats"))


def test_leave_takes_the_host_out_at_once(make_store, admin):
    a = make_store("host-a")
    a.heartbeat(POOL, ttl=30)
    a.release(a.lease(POOL, "a.example", ttl=5), outcome="ok")
    assert a.leave(POOL) is True
    assert admin.hosts(POOL) == [] and a.leave(POOL) is False
    assert admin.counters(POOL, "hstats") == {}


def test_beats_record_leases_per_minute_without_touching_the_request_path(make_store, admin):
    a = make_store("host-a")
    a.heartbeat(POOL, ttl=30)
    for _ in range(3):
        a.release(a.lease(POOL, "a.example", ttl=5), outcome="ok")
    a.heartbeat(POOL, ttl=30)
    a.release(a.lease(POOL, "b.example", ttl=5), outcome="error")
    beat = a.heartbeat(POOL, ttl=30)
    assert (beat.leases, beat.ok, beat.errors, beat.bans) == (4, 3, 1, 0)
    assert beat.sites == {"a.example": (3, 3), "b.example": (3, 3)}
    host = admin.hosts(POOL)[0]
    assert sum(host.load.values()) == 4 and host.leases == 4
    assert all(start % 60 == 0 for start in host.load)
    snap = read_pool(admin, POOL)
    assert snap.recent_load(host) == 4 and snap.load_share(host) == 1.0


def test_a_host_beats_only_in_pools_it_used_unless_told(make_store, admin):
    a = make_store("host-a")
    assert a.heartbeat(POOL, ttl=30, always=False) is None
    assert admin.hosts(POOL) == []
    a.release(a.lease(POOL, "a.example", ttl=5), outcome="ok")
    assert a.heartbeat(POOL, ttl=30, always=False) is not None
    assert [h.host for h in admin.hosts(POOL)] == ["host-a"]


def test_pool_status_tells_every_slot_state_and_who_holds_it(make_store, admin):
    a, b = make_store("host-a"), make_store("host-b")
    leased = a.lease(POOL, "a.example", ttl=30)
    cooled = b.lease(POOL, "a.example", ttl=30)
    b.release(cooled, min_interval=60)
    session = b.lease(POOL, "a.example", ttl=30, session_id="cart-1")
    assert isinstance(session, Lease)
    admin.ban(POOL, cooled.proxy_id, site="a.example", ttl=60, reason="manual")
    status = admin.pool_status(POOL, "a.example", detail=True)
    assert (status.slots, status.free, status.leased, status.session, status.cooling, status.banned) == \
        (3, 0, 1, 1, 0, 1)
    assert status.held_by_host == {"host-a": 1, "host-b": 1}
    by_id = {s.proxy_id: s for s in status.busy}
    assert by_id[leased.proxy_id].state == "leased" and by_id[leased.proxy_id].host == "host-a"
    assert by_id[session.proxy_id].session_id == "cart-1" and by_id[session.proxy_id].uses == 1
    assert by_id[cooled.proxy_id].state == "banned"
    admin.unban(POOL, cooled.proxy_id, site="a.example")  # lifts its rest too: usable at once
    assert admin.pool_status(POOL, "a.example").free == 1
    assert admin.pool_status(POOL, "never.example") is None


def test_quarantine_lengths_give_the_mean_time_to_recovery(make_store, admin):
    admin.ban(POOL, URLS[0], site="a.example", ttl=100)
    admin.ban(POOL, URLS[1], ttl=50)
    snap = read_pool(admin, POOL)
    assert snap.quarantines_started == 2
    assert snap.quarantine_seconds == pytest.approx(150, abs=0.01)
    assert snap.mean_quarantine == pytest.approx(75, abs=0.01)
    assert len(snap.dead_ids) == 1 and len(snap.banned_ids) == 1 and snap.active == 2
    admin.unban(POOL, URLS[0], site="a.example")  # served ~0 s of its 100
    snap = read_pool(admin, POOL)
    assert snap.quarantine_seconds == pytest.approx(50, abs=0.5)
    assert len(snap.banned_ids) == 0


def test_banned_responses_and_quarantines_are_counted_apart(make_store, admin):
    a = make_store("host-a")
    first, second = a.lease(POOL, "a.example", ttl=5), a.lease(POOL, "a.example", ttl=5)
    a.release(first, outcome="ban", reason="http_403")
    a.release(second, outcome="ok", latency=0.2)
    third = a.lease(POOL, "a.example", ttl=5)
    a.release(third, outcome="dead", reason="timeout")
    snap = read_pool(admin, POOL)
    site = snap.site_outcomes("a.example")
    assert (site.leases, site.ok, site.banned) == (3, 1, 2)
    assert site.success_ratio == pytest.approx(1 / 3)
    assert snap.bans_by_site_reason() == {("a.example", "http_403"): 1, ("*", "timeout"): 1}
    assert snap.latency_mean == pytest.approx(0.2)


def test_drained_proxies_do_not_count_as_banned(make_store, admin):
    admin.ban(POOL, URLS[0], site="a.example", ttl=100)
    admin.remove_proxies(POOL, [URLS[0]])
    snap = read_pool(admin, POOL)
    assert snap.proxies == 2 and snap.banned_ids == set() and snap.running_bans == []


# --- settings ----------------------------------------------------------------------------------------

def test_health_settings_defaults_and_validation():
    s = ShardSettings.from_settings({})
    assert (s.heartbeat_interval, s.host_ttl, s.logstats_interval) == (10.0, 30.0, 60.0)
    s = ShardSettings.from_settings({"PROXY_SHARD_HEARTBEAT_INTERVAL": 20})
    assert s.host_ttl == 60.0
    with pytest.raises(SettingError, match=r"PROXY_SHARD_HOST_TTL \(5.0\) must be longer"):
        ShardSettings.from_settings({"PROXY_SHARD_HEARTBEAT_INTERVAL": 10, "PROXY_SHARD_HOST_TTL": 5})
    with pytest.raises(SettingError, match="PROXY_SHARD_LOGSTATS_INTERVAL"):
        ShardSettings.from_settings({"PROXY_SHARD_LOGSTATS_INTERVAL": -1})


# --- the crawl side ------------------------------------------------------------------------------------

class ShopSpider(Spider):
    name = "shop"


def _crawler(server: fakeredis.FakeServer, **settings):
    base = {
        "PROXY_SHARD_REDIS_CLIENT": lambda: fakeredis.FakeAsyncRedis(server=server, decode_responses=True),
        "PROXY_SHARD_NAMESPACE": "t",
        "PROXY_SHARD_POOL": POOL,
        "PROXY_SHARD_MIN_INTERVAL": 0,
        "PROXY_SHARD_HOST_ID": "crawl-1",
        "PROXY_SHARD_HEARTBEAT_INTERVAL": 0.05,
        "PROXY_SHARD_LOGSTATS_INTERVAL": 0.1,
    }
    crawler = get_crawler(ShopSpider, {**base, **settings})
    crawler.spider = ShopSpider.from_crawler(crawler)
    return crawler


def test_a_crawl_registers_beats_logs_its_pool_line_and_leaves_at_close(caplog):
    server = fakeredis.FakeServer()
    admin = PoolStore(fakeredis.FakeRedis(server=server, decode_responses=True), namespace="t")
    admin.add_proxies(POOL, URLS)
    admin.add_proxies("other", URLS[1:])
    crawler = _crawler(server)
    lease_mw = build_from_crawler(ProxyShardMiddleware, crawler)
    ban_mw = build_from_crawler(BanDetectionMiddleware, crawler)
    runtime = lease_mw.runtime

    async def scenario():
        await runtime.spider_opened(crawler.spider)
        seen_at_open = [h.host for h in admin.hosts(POOL)]
        for n in range(4):
            request = Request(f"http://shop.example/{n}")
            await lease_mw.process_request(request)
            response = HtmlResponse(request.url, body=b"<html><body>ok</body></html>" * 50, request=request)
            await ban_mw.process_response(request, response)
        other = Request("http://shop.example/other", meta={"proxy_pool": "other"})
        await lease_mw.process_request(other)  # a pool the settings do not name: joined within a few beats
        await asyncio.sleep(0.6)
        host, in_other = admin.hosts(POOL)[0], [h.host for h in admin.hosts("other")]
        # The lines of the running crawl: the monitor beats on while the close gives the held lease back
        # (it leaves the pools after that), so a line logged during the close may show it free again.
        lines = [r.getMessage() for r in caplog.records if r.name == "scrapy_proxy_shard.crawl.logstats"]
        await runtime.spider_closed(crawler.spider, "finished")
        return seen_at_open, host, in_other, lines

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        seen_at_open, host, in_other, lines = asyncio.run(scenario())
    assert seen_at_open == ["crawl-1"] and in_other == ["crawl-1"]
    assert host.info["spider"] == "shop" and host.leases == 4 and host.ok == 4
    assert sum(host.load.values()) == 4
    assert admin.hosts(POOL) == [] and admin.hosts("other") == []  # left at close
    assert lines, caplog.text
    assert "crawl-1: 5 leases" in lines[-1] and "100.0% ok" in lines[-1]
    assert "pool 'main': 3 proxies, 1 hosts, free shop.example 3/3" in lines[-1]
    assert "pool 'other': 2 proxies, 1 hosts, free shop.example 1/2" in lines[-1]
    assert "Pa55word" not in caplog.text


def test_hosts_lists_a_crawl_only_under_the_pools_it_leases_from():
    """A pool the crawl loads (PROXY_SHARD_PROXIES) but never leases from does not list it (it did: the
    loaded pools were joined at open like the spider's own); once it leases there, it is listed."""
    server = fakeredis.FakeServer()
    admin = PoolStore(fakeredis.FakeRedis(server=server, decode_responses=True), namespace="t")
    admin.add_proxies(POOL, URLS)
    admin.add_proxies("idle", URLS[1:])
    crawler = _crawler(server, PROXY_SHARD_PROXIES={"spare": URLS[1:]}, PROXY_SHARD_LOGSTATS_INTERVAL=0)
    lease_mw = build_from_crawler(ProxyShardMiddleware, crawler)
    ban_mw = build_from_crawler(BanDetectionMiddleware, crawler)
    runtime = lease_mw.runtime

    async def fetch(request: Request) -> None:
        await lease_mw.process_request(request)
        await ban_mw.process_response(request, HtmlResponse(request.url, body=b"<html>ok</html>" * 50,
                                                            request=request))

    async def scenario():
        await runtime.spider_opened(crawler.spider)
        assert admin.pool_size("spare") == 2  # loaded at open
        for n in range(3):
            await fetch(Request(f"http://shop.example/{n}"))
        await asyncio.sleep(0.4)  # several beats, and a recheck of the idle pools
        before = {pool: [h.host for h in admin.hosts(pool)] for pool in (POOL, "spare", "idle")}
        await fetch(Request("http://shop.example/spare", meta={"proxy_pool": "spare"}))
        await asyncio.sleep(0.6)
        after = [(h.host, h.info["spider"]) for h in admin.hosts("spare")]
        await runtime.spider_closed(crawler.spider, "finished")
        return before, after

    before, after = asyncio.run(scenario())
    assert before == {POOL: ["crawl-1"], "spare": [], "idle": []}
    assert after == [("crawl-1", "shop")]
    assert admin.hosts("spare") == []  # left at close


def test_a_failing_heartbeat_warns_once_and_never_stops_the_crawl(caplog):
    class DownStore:
        calls = 0

        async def pools(self):
            DownStore.calls += 1
            raise PoolBackendError("cannot reach Redis at redis://***:***@10.0.0.9:6379/0: refused")

        async def leave(self, pool):
            raise PoolBackendError("down")

    settings = ShardSettings(host_id="h", heartbeat_interval=0.02, host_ttl=1.0, logstats_interval=0)
    monitor = HostMonitor(DownStore(), settings, pools=[POOL])

    async def scenario():
        await monitor.start()
        await asyncio.sleep(0.15)
        await monitor.stop()

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        asyncio.run(scenario())
    assert DownStore.calls >= 4
    warnings = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert len(warnings) == 1


def test_log_line_values_and_pool_summary():
    class Stats:
        values = {"proxy_shard/leases": 130, "proxy_shard/bans": 2, "proxy_shard/waits": 5,
                  "proxy_shard/wait_time": 1.25}

        def get_value(self, name, default=None):
            return self.values.get(name, default)

    stats = Stats()
    line = PoolLogStats(stats, "h1")
    stats.values["proxy_shard/leases"] = 10
    line.start(0.0)
    stats.values["proxy_shard/leases"] = 130
    sites = {f"s{i}.example": (10, i) for i in range(5)}
    values = line.values({POOL: Beat(0, 10, 2, 130, 90, 5, 5, sites)}, 60.0)
    assert values["rate"] == pytest.approx(120.0) and values["ok"] == "90.0%"
    assert values["waits"] == 5 and values["waited"] == 1.25
    assert pool_summary(POOL, Beat(0, 10, 2, 0, 0, 0, 0, sites)) == \
        "pool 'main': 10 proxies, 2 hosts, free s0.example 0/10, s1.example 1/10, s2.example 2/10 (+2 sites)"
