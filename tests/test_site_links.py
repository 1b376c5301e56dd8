"""Site groups learned from bans (issue 20): two sites behind one blacklist are found out by the crawl.

The engine (site_link.lua) on every backend: one proxy's coinciding bans never link; a second distinct
proxy's do, within the evidence window and while the first quarantine runs; links are transitive and
bounded. The crawl (crawl/links.py): rate bans are reported, hard blocks are not, and the learned map
changes which key a request leases under, on this host and (at its heartbeat) on another.
"""

from __future__ import annotations

import asyncio
import logging
import time

from scrapy import Request
from test_middlewares import Harness, _next_ms, run

from scrapy_proxy_shard.engine.sites import SiteMap

POOL = "main"
URLS = [f"http://10.7.0.{i}:3128" for i in range(1, 6)]


def _ids(store) -> list[str]:
    return [p.id for p in store.list_proxies(POOL)]


def _groups(store) -> dict[str, str]:
    return store.site_link(POOL, "-", "", quarantine=0).groups


def test_two_proxies_banned_on_both_sites_link_them_one_does_not(store):
    store.add_proxies(POOL, URLS)
    p1, p2, p3 = _ids(store)[:3]
    # one proxy, banned on a then b, then again: its own coincidences never link
    for _ in range(2):
        for site in ("a.example", "b.example"):
            assert store.site_link(POOL, site, p1, quarantine=30).linked is None
    assert _groups(store) == {}
    # a third site banned for p2 alone, no quarantine elsewhere: nothing
    assert store.site_link(POOL, "c.example", p3, quarantine=30).linked is None
    # the second distinct proxy links them (in either order of the two sites)
    store.site_link(POOL, "b.example", p2, quarantine=30)
    links = store.site_link(POOL, "a.example", p2, quarantine=30)
    assert links.linked == ("a.example", "b.example")
    assert links.groups == {"b.example": "a.example"} and links.version == "1"
    # a caller who knows the version gets no map; a linked site resolves to its group in later evidence
    assert store.site_link(POOL, "-", "", quarantine=0, known="1").groups is None
    store.site_link(POOL, "b.example", p3, quarantine=30)  # p3: c then b (= group a)
    for site in ("c.example", "b.example"):
        store.site_link(POOL, site, p1, quarantine=30)
    assert _groups(store) == {"b.example": "a.example", "c.example": "a.example"}


def test_evidence_counts_only_while_the_first_quarantine_runs_and_within_the_window(store):
    store.add_proxies(POOL, URLS)
    p1, p2, p3 = _ids(store)[:3]
    store.site_link(POOL, "a.example", p1, quarantine=0.05)
    time.sleep(0.1)
    store.site_link(POOL, "b.example", p1, quarantine=30)  # the a quarantine is over: no evidence
    store.site_link(POOL, "a.example", p2, quarantine=30)
    store.site_link(POOL, "b.example", p2, quarantine=30)  # the first evidence for (a, b)
    assert _groups(store) == {}
    time.sleep(0.1)
    store.site_link(POOL, "a.example", p3, quarantine=30)
    links = store.site_link(POOL, "b.example", p3, quarantine=30, evidence=0.05)  # p2's evidence too old
    assert links.linked is None and links.groups == {}
    store.site_link(POOL, "b.example", p1, quarantine=30)
    assert store.site_link(POOL, "a.example", p1, quarantine=30, evidence=60).linked == ("a.example", "b.example")


def test_a_learned_group_stays_within_its_bound(store):
    store.add_proxies(POOL, URLS)
    p1, p2 = _ids(store)[:2]

    def link(x, y):
        for pid in (p1, p2):
            store.site_link(POOL, x, pid, quarantine=30, max_group=3)
            store.site_link(POOL, y, pid, quarantine=30, max_group=3)

    link("a.example", "b.example")
    link("b.example", "c.example")
    link("c.example", "d.example")  # a group of 4 would pass the bound: refused
    assert _groups(store) == {"b.example": "a.example", "c.example": "a.example"}


def test_groups_of_several_pools_are_one_map_keyed_by_the_least_key():
    sites = SiteMap({"market": ["x.com", "y.com"]})
    assert sites.key_for_host("www.y.com") == "market"
    assert sites.learn("one", {"b.test": "a.test", "market": "a.test"})
    assert sites.key_for_host("www.y.com") == "a.test"  # the host cache was dropped
    assert sites.key_for_url("http://b.test/1") == "a.test"
    assert sites.learn("two", {"c.test": "b.test", "z.test": "d.test"})
    assert sites.learned() == {"b.test": "a.test", "market": "a.test", "c.test": "a.test", "z.test": "d.test"}
    assert not sites.learn("two", {"c.test": "b.test", "z.test": "d.test"})  # nothing new
    assert sites.learn("one", {})
    assert sites.key_for_site("c.test") == "b.test"


def test_rate_bans_link_sites_for_every_host_hard_blocks_do_not(caplog):
    one = Harness(pool="default")
    two_settings = {"PROXY_SHARD_HOST_ID": "second-host"}

    async def ban(h, url, status, headers=None):
        request = Request(url, dont_filter=True)
        await h.lease_mw.process_request(request)
        proxy = request.meta["proxy_shard_proxy_id"]
        await _next_ms()
        await h.respond(request, status=status, body=b"no", headers=headers)
        return proxy

    async def lease_for(h, pid, url):
        """Lease ``url`` until ``pid`` serves it (the others rotate through)."""
        for _ in range(10):
            request = Request(url, dont_filter=True)
            await h.lease_mw.process_request(request)
            if request.meta["proxy_shard_proxy_id"] == pid:
                return request
            await _next_ms()
            await h.respond(request)
        raise AssertionError(f"{pid} never leased for {url}")

    async def scenario():
        await one.open()
        # hard blocks on both sites (403, no Retry-After) teach nothing
        for url in ("http://x-shop.test/1", "http://y-shop.test/1"):
            await ban(one, url, 403)
        assert one.runtime.sites.learned() == {}
        # two proxies, each rate-banned (429 + Retry-After) on a-shop then b-shop
        for _ in range(2):
            pid = await ban(one, "http://a-shop.test/2", 429, {"Retry-After": "30"})
            request = await lease_for(one, pid, "http://b-shop.test/2")
            await _next_ms()
            await one.respond(request, status=429, body=b"slow down", headers={"Retry-After": "30"})
        return one.runtime.sites.key_for_url("http://b-shop.test/3")

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        assert run(scenario()) == "a-shop.test"
    assert one.stat("site_groups/linked") == 1
    assert any("share a blacklist" in r.getMessage() for r in caplog.records)
    # another host on the same Redis learns the map at its heartbeat's refresh
    two = Harness(two_settings, pool="default")
    two.server = one.server

    async def other():
        two.runtime._store = None
        two.runtime._store_factory = one.runtime._store_factory
        await two.runtime.links.refresh("default")
        return two.runtime.sites.key_for_host("www.b-shop.test")

    assert asyncio.run(other()) == "a-shop.test"
