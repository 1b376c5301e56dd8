"""Tiered pools (issue 23 item 3): the tier step on the engine (tier.lua, fakeredis and a real redis-server)
and the crawl side (crawl/tiers.py) through both middlewares: escalation, probing down, expiry, outage."""

from __future__ import annotations

import asyncio
import time

import fakeredis
import pytest
from scrapy import Request
from scrapy.exceptions import CloseSpider
from test_middlewares import Harness

from scrapy_proxy_shard.crawl.startup import StartupGate
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.engine.tiers import TierOptions
from scrapy_proxy_shard.exceptions import PoolUnreachable, SettingError
from scrapy_proxy_shard.settings import ShardSettings

TIERS = ("dc", "resi")
DC = ["http://10.8.0.1:3128", "http://10.8.0.2:3128", "http://10.8.0.3:3128"]
RESI = ["http://10.8.1.1:3128", "http://10.8.1.2:3128"]
FAST = TierOptions(min_answers=4, ban_ratio=0.5, window=300, probe_interval=0.001, max_probe_interval=10)


@pytest.fixture(params=["fakeredis", "redis-server", "cluster"])
def store(request):
    if request.param == "fakeredis":
        return PoolStore(fakeredis.FakeRedis(decode_responses=True), namespace="t", host_id="h1")
    client = request.getfixturevalue("real_redis" if request.param == "redis-server" else "cluster_redis")
    return PoolStore(client, namespace="t", host_id="h1")


def counts(tier, leases=0, ok=0, bans=0, n=2):
    out = [0] * (3 * n)
    out[3 * tier:3 * tier + 3] = [leases, ok, bans]
    return out


def step(store, site, options=FAST, **kw):
    return store.tier_step(TIERS, site, options=options, **kw)


# --- the engine --------------------------------------------------------------------------------

def test_a_site_that_bans_the_cheap_tier_moves_up_and_other_sites_stay(store):
    assert step(store, "blocks.example").tier == 0  # a new site starts on the cheapest tier
    up = step(store, "blocks.example", counts=counts(0, leases=4, bans=4))
    assert (up.tier, up.event) == (1, "up") and up.next_probe == pytest.approx(0.001, abs=0.01)
    fine = step(store, "fine.example", counts=counts(0, leases=20, ok=20))
    assert (fine.tier, fine.event) == (0, "")
    assert store.tier_sites(TIERS) == {"blocks.example": 1, "fine.example": 0}
    dc, resi = store.tier_counts(TIERS)
    assert (dc["l"], dc["ok"], dc["ban"], dc.sites) == (24, 20, 4, 1)
    assert (resi["up"], resi.sites) == (1, 1)
    assert store.tier_lists() == [TIERS]
    # the top tier is as far as a site goes
    assert step(store, "blocks.example", counts=counts(1, leases=8, bans=8)).tier == 1


def test_too_little_evidence_or_a_low_ban_ratio_moves_nothing(store):
    assert step(store, "a.example", counts=counts(0, leases=3, bans=3)).tier == 0  # 3 answers < 4
    assert step(store, "b.example", counts=counts(0, leases=10, ok=6, bans=4)).tier == 0  # 40% < 50%
    # evidence adds up over steps (and over hosts): one more ban makes 4 of 4
    assert step(store, "a.example", counts=counts(0, leases=1, bans=1)).event == "up"


def test_answers_of_another_tier_are_not_evidence_against_the_current_one(store):
    step(store, "s.example", counts=counts(0, leases=4, bans=4))
    late = step(store, "s.example", counts=counts(0, leases=9, bans=9))  # late bans of the cheap tier
    assert (late.tier, late.answers, late.bans) == (1, 0, 0)


def test_the_breaker_opening_on_the_current_tier_moves_up_at_once(store):
    assert step(store, "s.example", breaker_tier=0).event == "up"
    assert step(store, "t.example", breaker_tier=1).tier == 0  # a breaker of another tier: not this one's


def test_one_probe_at_a_time_backing_off_when_banned_and_down_when_answered_fine(store):
    step(store, "s.example", counts=counts(0, leases=4, bans=4))
    time.sleep(0.005)
    first = step(store, "s.example", claim=True)
    assert first.probe and first.tier == 1
    assert not step(store, "s.example", claim=True).probe  # another host: the probe is in flight
    banned = step(store, "s.example", probe_answer="ban", probe_tier=0)
    assert (banned.event, banned.tier, banned.backoff) == ("probe_banned", 1, pytest.approx(0.002))
    time.sleep(0.005)
    assert step(store, "s.example", claim=True).probe
    down = step(store, "s.example", probe_answer="ok", probe_tier=0)
    assert (down.event, down.tier, down.next_probe) == ("down", 0, None)
    # a descent that does not hold doubles the wait before the next probe
    again = step(store, "s.example", counts=counts(0, leases=4, bans=4))
    assert (again.event, again.backoff) == ("up", pytest.approx(0.004))
    dc, _ = store.tier_counts(TIERS)
    assert (dc["probe"], dc["pban"], dc["down"]) == (2, 1, 1)


def test_a_skipped_probe_waits_one_interval_without_backing_off(store):
    slow = TierOptions(min_answers=4, probe_interval=30, max_probe_interval=600)
    step(store, "s.example", options=slow, counts=counts(0, leases=4, bans=4))
    skipped = step(store, "s.example", options=slow, probe_answer="skip", probe_tier=0)
    assert (skipped.event, skipped.backoff, skipped.tier) == ("probe_skipped", 30.0, 1)
    assert skipped.next_probe == pytest.approx(30.0, abs=0.1)
    assert not step(store, "s.example", options=slow, claim=True).probe  # not due yet


def test_an_idle_site_forgets_its_tier(store):
    step(store, "s.example", counts=counts(0, leases=4, bans=4), idle=0.05)
    assert store.tier_sites(TIERS) == {"s.example": 1}
    time.sleep(0.1)
    assert store.tier_sites(TIERS) == {}
    assert step(store, "s.example").tier == 0  # starts again on the cheapest tier


# --- settings ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "problem"), [
    ([], "PROXY_SHARD_TIERS is empty: name two or more pools"),
    ("", "PROXY_SHARD_TIERS is empty"),
    (["dc"], "names one pool: tiers need two or more"),
    (["dc", "resi", "dc"], "names pool 'dc' twice: list each pool once"),
    (["dc", "res i"], "'res i' is not a pool name"),
    ({"dc": 1}, "must be a list of pool names"),
])
def test_a_bad_tier_list_is_one_clear_error(value, problem):
    with pytest.raises(SettingError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        ShardSettings.from_settings({"PROXY_SHARD_TIERS": value})


def test_a_tier_list_from_the_command_line_is_split_on_commas():
    assert ShardSettings.from_settings({"PROXY_SHARD_TIERS": "dc, resi"}).tiers == ("dc", "resi")


# --- the crawl side ----------------------------------------------------------------------------

def tiered(settings=None, spidercls=None):
    base = {"PROXY_SHARD_TIERS": list(TIERS), "PROXY_SHARD_TIER_MIN_ANSWERS": 3,
            "PROXY_SHARD_BREAKER_ENABLED": False, "PROXY_SHARD_MAX_WAIT": 1}
    kwargs = {"spidercls": spidercls} if spidercls else {}
    h = Harness({**base, **(settings or {})}, proxies=DC, pool="dc", **kwargs)
    h.admin.add_proxies("resi", RESI)
    return h


async def lease(h, url, **meta):
    request = Request(url, meta=meta)
    await h.lease_mw.process_request(request)
    return request


def pool_of(request):
    return "resi" if request.meta["proxy"].startswith("http://10.8.1.") else "dc"


def test_the_cluster_escalates_for_the_blocking_site_only_and_counts_per_tier():
    h = tiered()

    async def scenario():
        await h.open()
        request = await lease(h, "http://blocks.example/1")
        assert pool_of(request) == "dc"
        for _ in range(3):  # the site bans the cheap tier; each ban retry leases again
            assert pool_of(request) == "dc"
            request = await h.respond(request, status=403, body=b"blocked")
            assert isinstance(request, Request)
            await h.lease_mw.process_request(request)
        assert pool_of(request) == "resi"  # the third ban moved the site up
        await h.respond(request)
        other = await lease(h, "http://fine.example/1")
        assert pool_of(other) == "dc"
        await h.respond(other)
        await h.runtime.spider_closed(h.spider)

    asyncio.run(scenario())
    assert h.stat("tiers/up") == 1
    assert (h.stat("tiers/dc/requests"), h.stat("tiers/dc/bans"), h.stat("tiers/dc/pages")) == (4, 3, 1)
    assert (h.stat("tiers/resi/requests"), h.stat("tiers/resi/pages")) == (1, 1)
    assert h.admin.tier_sites(TIERS) == {"blocks.example": 1, "fine.example": 0}
    dc, resi = h.admin.tier_counts(TIERS)
    assert (dc["l"], dc["ban"], dc["ok"], resi["l"], resi["ok"]) == (4, 3, 1, 1, 1)  # flushed at close


def test_another_hosts_discovery_serves_this_host():
    h = tiered()
    h.admin.tier_step(TIERS, "blocks.example", counts=[5, 0, 5, 0, 0, 0],
                      options=h.runtime.settings.tier_options)

    async def scenario():
        await h.open()
        return await lease(h, "http://blocks.example/")

    assert pool_of(asyncio.run(scenario())) == "resi"


def test_an_explicit_pool_wins_over_tiers():
    h = tiered()
    h.admin.tier_step(TIERS, "blocks.example", breaker_tier=0, options=h.runtime.settings.tier_options)

    async def scenario():
        await h.open()
        return await lease(h, "http://blocks.example/", proxy_pool="dc")

    assert pool_of(asyncio.run(scenario())) == "dc"
    assert h.stat("tiers/dc/requests") is None


def test_a_probe_answered_fine_brings_the_site_down_for_every_host():
    # (the probe is due after the first lease: long enough for a slow machine's open, within the sleep below)
    h = tiered({"PROXY_SHARD_TIER_PROBE_INTERVAL": 0.5})
    h.admin.tier_step(TIERS, "s.example", breaker_tier=0, options=h.runtime.settings.tier_options)

    async def scenario():
        await h.open()
        first = await lease(h, "http://s.example/1")
        assert pool_of(first) == "resi"
        await h.respond(first)
        await asyncio.sleep(1.1)  # the host's copy of the tier is fresh for a second (REFRESH)
        probe = await lease(h, "http://s.example/2")
        assert pool_of(probe) == "dc"
        await h.respond(probe)
        after = await lease(h, "http://s.example/3")
        assert pool_of(after) == "dc"
        await h.respond(after)

    asyncio.run(scenario())
    assert (h.stat("tiers/probes"), h.stat("tiers/down")) == (1, 1)
    assert h.admin.tier_sites(TIERS) == {"s.example": 0}


def test_a_probe_with_no_free_proxy_on_the_cheap_tier_is_skipped_and_the_request_served():
    h = tiered({"PROXY_SHARD_TIER_PROBE_INTERVAL": 0.01})
    h.admin.tier_step(TIERS, "s.example", breaker_tier=0, options=h.runtime.settings.tier_options)
    for url in DC:
        h.admin.ban("dc", url, site="s.example", reason="http_403", ttl=60)
    time.sleep(0.02)  # the probe is due

    async def scenario():
        await h.open()
        return await lease(h, "http://s.example/")

    assert pool_of(asyncio.run(scenario())) == "resi"
    assert h.stat("tiers/probes/skipped") == 1 and h.stat("tiers/probes") is None


def test_during_an_outage_a_site_keeps_its_last_tier_and_may_move_up_locally(monkeypatch):
    h = tiered()
    h.admin.tier_step(TIERS, "known.example", breaker_tier=0, options=h.runtime.settings.tier_options)

    async def scenario():
        await h.open()
        known = await lease(h, "http://known.example/")
        await h.respond(known)

        async def away(*args, **kwargs):
            raise PoolUnreachable("Redis at redis://test is away")

        monkeypatch.setattr(h.runtime.store, "tier_step", away)
        h.runtime.tiers._sites[(TIERS, "known.example")].fetched = float("-inf")  # stale: would ask Redis
        again = await lease(h, "http://known.example/")
        assert pool_of(again) == "resi"  # the last tier known, never unproxied
        await h.respond(again)
        request = await lease(h, "http://new.example/")
        assert pool_of(request) == "dc"  # never met: the cheapest tier
        for _ in range(3):
            request = await h.respond(request, status=403, body=b"blocked")
            await h.lease_mw.process_request(request)
        return request

    assert pool_of(asyncio.run(scenario())) == "resi"
    assert h.stat("tiers/offline") >= 1 and h.stat("tiers/local_up") == 1


def test_a_spider_tier_list_overrides_the_setting_and_is_checked_at_open():
    from test_middlewares import ShopSpider

    class Reversed(ShopSpider):
        proxy_tiers = ["resi", "dc"]

    h = tiered(spidercls=Reversed)

    async def scenario():
        await h.open()
        return await lease(h, "http://s.example/")

    assert pool_of(asyncio.run(scenario())) == "resi"

    class Bad(ShopSpider):
        proxy_tiers = ["resi", "resi"]

    bad = tiered(spidercls=Bad)
    with pytest.raises(CloseSpider):  # the start-up gate: one line, no request sent, exit code 1
        asyncio.run(bad.open())
    assert "spider 'shop' attribute proxy_tiers (['resi', 'resi']) names pool 'resi' twice" in str(
        StartupGate.for_crawler(bad.crawler).error)


# --- what users see: the exporter and the CLI ------------------------------------------------------

def _escalated(store):
    step(store, "blocks.example", counts=counts(0, leases=5, bans=5))
    step(store, "blocks.example", counts=counts(1, leases=3, ok=3))
    step(store, "fine.example", counts=counts(0, leases=7, ok=7))


def test_the_exporter_serves_what_each_tier_costs(real_redis):
    from scrapy_proxy_shard.ops.exporter import PoolCollector

    store = PoolStore(real_redis, namespace="t", host_id="h1")
    _escalated(store)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in PoolCollector(store).collect() if family.name.startswith("proxy_shard_tier")
               for s in family.samples}

    def value(name, pool, **labels):
        return samples[(name, tuple(sorted({"tiers": "dc>resi", "pool": pool, **labels}.items())))]

    assert value("proxy_shard_tier_sites", "dc") == 1 and value("proxy_shard_tier_sites", "resi") == 1
    assert value("proxy_shard_tier_requests_total", "dc") == 12
    assert value("proxy_shard_tier_requests_total", "resi") == 3
    assert value("proxy_shard_tier_responses_total", "resi", outcome="ok") == 3
    assert value("proxy_shard_tier_responses_total", "dc", outcome="banned") == 5
    assert value("proxy_shard_tier_changes_total", "resi", change="up") == 1


def test_the_cli_lists_the_tiers_and_the_sites_off_the_cheapest(redis_server, real_redis):
    from click.testing import CliRunner

    from scrapy_proxy_shard.ops.cli import cli

    _escalated(PoolStore(real_redis, namespace="t", host_id="h1"))
    env = {"PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_NAMESPACE": "t"}
    out = CliRunner().invoke(cli, ["tiers"], env=env, catch_exceptions=False).stdout
    assert "dc>resi: on 'resi' (tier 2): blocks.example" in out
    assert "fine.example" not in out
    rows = __import__("json").loads(CliRunner().invoke(cli, ["tiers", "--json"], env=env).stdout)
    assert [(r["pool"], r["requests"], r["pages"], r["bans"]) for r in rows] == [("dc", 12, 7, 5), ("resi", 3, 3, 0)]


def test_a_sticky_session_keeps_its_tier_until_it_meets_a_ban():
    h = tiered()

    async def scenario():
        await h.open()
        cart = await lease(h, "http://s.example/cart", session_id="cart-1")
        assert pool_of(cart) == "dc"
        proxy = cart.meta["proxy"]
        await h.respond(cart)
        h.admin.tier_step(TIERS, "s.example", breaker_tier=0, options=h.runtime.settings.tier_options)
        h.runtime.tiers._sites[(TIERS, "s.example")].fetched = float("-inf")
        other = await lease(h, "http://s.example/list")
        assert pool_of(other) == "resi"  # the site moved up
        await h.respond(other)
        again = await lease(h, "http://s.example/cart/pay", session_id="cart-1")
        assert again.meta["proxy"] == proxy  # the session stays on its proxy, on its tier
        retry = await h.respond(again, status=403, body=b"blocked")
        await h.lease_mw.process_request(retry)
        assert pool_of(retry) == "resi"  # banned: the session follows the site's tier

    asyncio.run(scenario())


def test_a_probe_held_by_another_host_costs_no_round_trip_per_request():
    h = tiered({"PROXY_SHARD_TIER_PROBE_INTERVAL": 0.001})
    options = h.runtime.settings.tier_options
    h.admin.tier_step(TIERS, "s.example", breaker_tier=0, options=options)
    time.sleep(0.005)
    assert h.admin.tier_step(TIERS, "s.example", claim=True, options=options).probe  # another host's probe

    async def scenario():
        await h.open()
        store = h.runtime.store
        calls = []
        real = store.tier_step

        async def counted(*args, **kwargs):
            calls.append(kwargs.get("claim"))
            return await real(*args, **kwargs)

        store.tier_step = counted
        for n in range(8):
            request = await lease(h, f"http://s.example/{n}")
            assert pool_of(request) == "resi"
            await h.respond(request)
        return calls

    assert len(asyncio.run(scenario())) == 1
