"""The site circuit breaker in a real crawl: three `scrapy crawl` hosts, real local proxies, a real
redis-server, and the demo site, one of whose sites rejects *every* client for its first seconds and
then accepts again. What is asserted comes from the site's log (which IPs it banned, when they came
back) and from Redis, beside the hosts' stats for the breaker's openings and closings."""

from __future__ import annotations

import redis

from scrapy_proxy_shard.demo.rules import AntiBot, SiteRules
from scrapy_proxy_shard.demo.run import NAMESPACE, DemoConfig, run_demo
from scrapy_proxy_shard.demo.site import parse_blackout
from scrapy_proxy_shard.demo.sitelog import read_log
from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.store import PoolStore

DOWN = "market.test"
BLACKOUT = 6.0


def test_the_demo_site_blackout_rejects_everyone_then_nobody():
    bot, rules = AntiBot(), SiteRules(blackout=5.0, min_interval=0.0)
    first = bot.admit("127.0.0.2", DOWN, rules, "/catalog/1", now=100.0)
    bot.release(first)
    later = bot.admit("127.0.0.3", DOWN, rules, "/catalog/2", now=104.9)  # another IP, still rejected
    bot.release(later)
    after = bot.admit("127.0.0.4", DOWN, rules, "/catalog/3", now=105.0)
    assert (first.blackout, first.banned, later.blackout, later.banned) == (True, True, True, True)
    assert first.ban_style is not None and (after.blackout, after.banned) == (False, False)
    assert parse_blackout("market.test=6; shop-a.test=2.5") == {"market.test": 6.0, "shop-a.test": 2.5}


class ReadPool:
    """Reads the pool's quarantines and breaker counters while Redis still runs (``Injector``)."""

    def __init__(self) -> None:
        self.site_stats: dict[str, float] = {}
        self.bans = []
        self.breaker = None
        self.proxies = 0

    def tick(self, server, elapsed, served) -> None:
        pass

    def finish(self, server) -> None:
        store = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), namespace=NAMESPACE)
        self.site_stats = store.site_counters("datacenter").get(DOWN, {})
        self.bans = store.bans("datacenter")
        self.breaker = store.breaker("datacenter", DOWN)
        self.proxies = store.pool_size("datacenter")
        store.client.close()


def test_a_site_that_rejects_everyone_burns_at_most_five_proxies_and_the_crawl_resumes(tmp_path,
                                                                                       redis_server_env):
    pool = ReadPool()
    config = DemoConfig(
        hosts=3, pages=20, flows=0, workdir=tmp_path, progress=False, timeout=240, burnt={},
        blackout={DOWN: BLACKOUT}, injector=pool,
        settings={"PROXY_SHARD_BREAKER_COOLOFF": "2", "PROXY_SHARD_BREAKER_MAX_COOLOFF": "8",
                  "PROXY_SHARD_MAX_WAIT": "120"},
    )
    result = run_demo(config)
    report = result.format()
    s = result.summary
    entries = sorted(read_log(tmp_path / "site.log"), key=lambda e: e["start"])
    down = [e for e in entries if e["site"] == DOWN and e["path"].startswith("/catalog/")]
    assert down and any(e["blackout"] for e in down), report
    recovered_at = max(e["end"] for e in down if e["blackout"])

    # The crawl completed after the site recovered, every host exiting cleanly, with no overlap.
    assert all(h.exit_code == 0 for h in result.hosts), report
    assert not s.missing_pages and s.ok_pages == len(config.expected_pages), report
    assert s.overlaps == 0 and s.violations == 0 and result.leases_left == 0, report
    assert any(e["kind"] == "page" and e["start"] > recovered_at for e in down), report

    # From the site's log: an IP the site banned during the blackout and never saw again on it was
    # quarantined; every other banned IP came back (its ban was spared by the breaker). At most five.
    banned_ips = {e["ip"] for e in down if e["blackout"] and e["ban_style"]}
    back = {e["ip"] for e in down if e["start"] > recovered_at}
    quarantined = banned_ips - back
    assert 1 <= len(quarantined) <= 5, (sorted(quarantined), report)
    # The proxies that were not quarantined served the site again once it accepted: the pool is intact.
    assert len(back) >= 2 and not back & quarantined, report

    # Redis agrees: at most five quarantines started on the site, none on the others for the blackout,
    # no proxy lost, and the breaker is closed again.
    started = pool.site_stats.get(schema.QUARANTINES, 0)
    assert 1 <= started <= 5, (pool.site_stats, report)
    assert {b.proxy_id for b in pool.bans if b.scope == DOWN} and pool.proxies == 8, report
    assert pool.breaker is None, report

    # The breaker opened (once per episode: one host's release decided it for all) and closed.
    opened = sum(h.stats.get("proxy_shard/breaker/opened", 0) for h in result.hosts)
    closed = sum(h.stats.get("proxy_shard/breaker/closed", 0) for h in result.hosts)
    assert opened == 1 == pool.site_stats.get(schema.BREAKER_OPENED), report
    assert closed == 1 == pool.site_stats.get(schema.BREAKER_CLOSED), report
    assert sum(h.stats.get("proxy_shard/breaker/spared", 0) for h in result.hosts) >= 1, report
    warnings = [line for h in result.hosts for line in h.log_path.read_text().splitlines()
                if "circuit breaker OPEN for site market.test" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
