"""Site groups learned from bans (issue 20): two sites behind one blacklist are found out by the crawl.

The engine (site_link.lua) on every backend: one proxy's coinciding bans never link; a second distinct
proxy's do, within the evidence window and while the first quarantine runs; links are transitive and
bounded. The crawl (crawl/links.py): rate bans are reported, hard blocks are not, and the learned map
changes which key a request leases under, on this host and (at its heartbeat) on another.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import pytest
from scrapy import Request
from test_middlewares import PAGE, PROXIES, Harness, _next_ms, run

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.records import Lease
from scrapy_proxy_shard.engine.sites import SiteMap

POOL = "main"
URLS = [f"http://10.7.0.{i}:3128" for i in range(1, 6)]


def _ids(store) -> list[str]:
    return [p.id for p in store.list_proxies(POOL)]


def _groups(store) -> dict[str, str]:
    return store.site_link(POOL, "-", "", quarantine=0).groups


def _mark(store, site: str, pid: str, mark: str) -> None:
    """The proxy's last answer on the site as release.lua records it (site_mark): ``c`` clean, ``f<ms>``
    a brief quarantine after a clean answer, ``g<ms>`` one after a ban, ``b`` a hard block."""
    store.client.hset(schema.site_part(store.prefix(POOL), schema.PACE, site), f"p:{pid}", mark)


def _banned(store, site: str, pid: str, *, after_clean: bool = True, **kwargs):
    """A rate ban of ``pid`` on ``site`` as the crawl reports it: after the release wrote its mark."""
    _mark(store, site, pid, "f15000" if after_clean else "g15000")
    kwargs.setdefault("span", 0)  # the tests' evidence comes within a burst (see the span's own test)
    return store.site_link(POOL, site, pid, quarantine=kwargs.pop("quarantine", 30), **kwargs)


def test_three_proxies_banned_on_one_site_while_quarantined_on_the_other_link_them(store):
    store.add_proxies(POOL, URLS)
    p1, p2, p3, p4 = _ids(store)[:4]
    # one proxy, banned on a then b, then again: its own coincidences never link
    for _ in range(3):
        for site in ("a.example", "b.example"):
            assert _banned(store, site, p1).linked is None
    # bans that follow bans (a site rejecting every IP at once) are no evidence
    for pid in (p2, p3):
        for site in ("a.example", "b.example", "a.example"):
            assert _banned(store, site, pid, after_clean=False).linked is None
    assert _groups(store) == {}
    # a ban with no quarantine elsewhere: nothing
    assert _banned(store, "c.example", p4).linked is None
    # clean-then-banned on b while quarantined on a: p2 and p3 add to p1's evidence, the third links
    assert _banned(store, "b.example", p2).linked is None
    paces = [schema.pace_key(store.prefix(POOL), site) for site in ("a.example", "b.example")]
    for key in paces:  # the votes of the bans that link them raised their intervals
        store.client.hset(key, "iv", "4500.000")
    links = _banned(store, "b.example", p3)
    assert links.linked == ("a.example", "b.example")
    assert store.client.exists(*paces) == 0  # forgotten: the group learns its own from the start
    assert links.groups == {"b.example": "a.example"} and links.version == "1"
    # a caller who knows the version gets no map; a linked site resolves to its group in later evidence
    assert store.site_link(POOL, "-", "", quarantine=0, known="1").groups is None
    for pid in (p1, p2, p4):  # each: quarantined on b (= group a), then clean-then-banned on c
        _banned(store, "b.example", pid)
        _banned(store, "c.example", pid)
    assert _groups(store) == {"b.example": "a.example", "c.example": "a.example"}


def test_a_ban_spared_by_the_breaker_counts_when_the_proxy_answered_clean_before(store):
    store.add_proxies(POOL, URLS)
    ids = _ids(store)[:3]
    for pid in ids:
        store.site_link(POOL, "a.example", pid, quarantine=30)
        _mark(store, "b.example", pid, "c")  # the spared ban wrote no mark: the clean answer's stays
        links = store.site_link(POOL, "b.example", pid, quarantine=15, span=0)
    assert links.linked == ("a.example", "b.example")


def test_evidence_counts_only_while_the_first_quarantine_runs_and_within_the_window(store):
    store.add_proxies(POOL, URLS)
    p1, p2, p3, p4 = _ids(store)[:4]
    _banned(store, "a.example", p1, quarantine=0.05)
    time.sleep(0.1)
    _banned(store, "b.example", p1)  # the a quarantine is over: no evidence
    for pid in (p2, p3):
        _banned(store, "a.example", pid)
        _banned(store, "b.example", pid)  # evidence for (a, b): 2 of 3
    assert _groups(store) == {}
    time.sleep(0.1)
    _banned(store, "a.example", p4)
    links = _banned(store, "b.example", p4, evidence=0.05)  # p2's and p3's evidence is too old
    assert links.linked is None and links.groups == {}
    for pid in (p1, p2):  # with p4's, within the window: the third links
        _banned(store, "a.example", pid, after_clean=False)
        links = _banned(store, "b.example", pid, evidence=60)
    assert links.linked == ("a.example", "b.example")


def test_a_learned_group_stays_within_its_bound(store):
    store.add_proxies(POOL, URLS)
    ids = _ids(store)[:3]

    def link(x, y):
        for pid in ids:
            _banned(store, x, pid, max_group=3)
            _banned(store, y, pid, max_group=3)

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


async def _answer(h, request, status=200, headers=None):
    """Answer ``request`` (released a ms after its lease) through both middlewares; its proxy's id."""
    await _next_ms()
    await h.respond(request, status=status, body=PAGE if status == 200 else b"no", headers=headers)
    return request.meta["proxy_shard_proxy_id"]


async def _lease_for(h, url, pid=None, *, others=200):
    """Lease ``url`` until proxy ``pid`` serves it (any proxy when None); the other proxies' leases on the
    way are answered ``others``."""
    for _ in range(12):
        request = Request(url, dont_filter=True)
        await h.lease_mw.process_request(request)
        if pid is None or request.meta["proxy_shard_proxy_id"] == pid:
            return request
        await _answer(h, request, others)
    raise AssertionError(f"{pid} never leased for {url}")


def _learner(subnet: int) -> Harness:
    """A host that learns site groups everywhere, on 6 proxies of 10.9.<subnet>.0/24."""
    return Harness({"PROXY_SHARD_LEARN_SITE_GROUPS": True}, pool="default",
                   proxies=[f"http://10.9.{subnet}.{i}:3128" for i in range(1, 7)])


def test_rate_bans_after_clean_answers_link_sites_for_every_host_hard_blocks_do_not(caplog):
    one = Harness({"PROXY_SHARD_LEARN_SITE_GROUPS": True}, pool="default")  # (auto: adaptive sites only)
    two_settings = {"PROXY_SHARD_HOST_ID": "second-host"}

    async def scenario():
        await one.open()
        one.runtime.links.span = 0.0  # the evidence below comes within one burst
        # hard blocks on both sites (403, no Retry-After) teach nothing
        for url in ("http://x-shop.test/1", "http://y-shop.test/1"):
            await _answer(one, await _lease_for(one, url), 403)
        assert one.runtime.sites.learned() == {}
        # three proxies, each answered clean on b-shop, then rate-banned (429 + Retry-After) on a-shop, then
        # on b-shop at its next request there (the shared blacklist refuses it)
        used = set()
        told = {"Retry-After": "30"}
        for i in range(3):
            pid = await _answer(one, await _lease_for(one, f"http://b-shop.test/clean-{i}"))
            assert pid not in used
            used.add(pid)
            await _answer(one, await _lease_for(one, f"http://a-shop.test/{i}", pid), 429, told)
            await _answer(one, await _lease_for(one, f"http://b-shop.test/{i}", pid), 429, told)
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


def test_a_link_restarts_the_groups_adaptive_pace_and_the_blacklists_bans_do_not_vote(store):
    store.add_proxies(POOL, URLS)
    ids = _ids(store)[:3]
    for pid in ids:
        _banned(store, "a.example", pid, after_clean=False)
        links = _banned(store, "b.example", pid, quarantine=15, start=3.0)
    assert links.linked == ("a.example", "b.example")
    pace = store.client.hgetall(schema.pace_key(store.prefix(POOL), "a.example"))
    assert pace["iv"] == "3000.000" and pace["bad"] == "0" and pace["vote"] == ""
    # clean answers count from the link on (the descent starts at once); the IPs' marks went with the
    # paces, so a ban votes only from an IP that answered clean on the group since
    assert pace["eff"] == pace["chg"] and not any(field.startswith("p:") for field in pace)
    assert store.client.pttl(schema.pace_key(store.prefix(POOL), "a.example")) > 6 * 86400000


@pytest.mark.parametrize(("b_lo", "iv"), [("600.000", "600.000"), (None, "3000.000"), ("5000.000", "3000.000")])
def test_a_group_starts_where_probes_proved_both_sites_clean(store, b_lo, iv):
    """Both sites' probes had proved an interval clean (``lo``): the group starts at the larger (one IP's
    requests to both now count as one site's), never above the start interval. Their learned intervals,
    raised by the blacklist's bans, are not used, nor the ones they knew to fail: each failed while the
    other site used the same IPs too. A site whose probes proved nothing leaves the group at the start
    interval."""
    store.add_proxies(POOL, URLS)
    prefix = store.prefix(POOL)
    a = {"iv": "4500.000", "lo": "450.000", "bad": "400.000"}
    store.client.hset(schema.pace_key(prefix, "a.example"), mapping=a)
    b = {"iv": "6750.000", "bad": "300.000"} | ({"lo": b_lo} if b_lo else {})
    store.client.hset(schema.pace_key(prefix, "b.example"), mapping=b)
    for pid in _ids(store)[:3]:
        _banned(store, "a.example", pid, after_clean=False)
        links = _banned(store, "b.example", pid, quarantine=15, start=3.0)
    assert links.linked == ("a.example", "b.example")
    pace = store.client.hgetall(schema.pace_key(prefix, "a.example"))
    assert (pace["iv"], pace["bad"]) == (iv, "0")
    assert not store.client.exists(schema.pace_key(prefix, "b.example"))


def test_a_clean_answer_while_resting_from_the_other_site_vetoes_the_link(store):
    store.add_proxies(POOL, URLS)
    p1, p2, p3, p4 = _ids(store)[:4]
    for pid in (p1, p2):
        _banned(store, "a.example", pid, after_clean=False)
        _banned(store, "b.example", pid)  # evidence: 2 of 3
    # p4 rests from a, yet b answered it clean: they do not share a blacklist
    assert store.site_link(POOL, "b.example", p4, quarantine=0, rested_from="a.example", veto=0.3).linked is None
    _banned(store, "a.example", p3, after_clean=False)
    assert _banned(store, "b.example", p3, veto=0.3).linked is None  # vetoed, the pending evidence gone
    assert _groups(store) == {}
    time.sleep(0.35)  # the veto lapsed: evidence counts again, from scratch
    for pid in (p1, p2, p3):
        _banned(store, "a.example", pid, after_clean=False)
        links = _banned(store, "b.example", pid, veto=0.3)
    assert links.linked == ("a.example", "b.example")


def test_independent_sites_whose_bans_coincide_are_told_apart_by_the_crawl():
    """Two independent sites, bans on both in one burst (both paced too fast at once): proxies resting
    from one answer clean on the other, which vetoes the link the coinciding bans would make."""
    h = Harness({"PROXY_SHARD_LEARN_SITE_GROUPS": True}, pool="default",
                proxies=[f"http://10.9.1.{i}:3128" for i in range(1, 7)])

    async def scenario():
        await h.open()
        h.runtime.links.span = 0.0  # would link at once without the veto
        told = {"Retry-After": "30"}
        pid = await _answer(h, await _lease_for(h, "http://one.test/1"), 429, told)
        await _answer(h, await _lease_for(h, "http://two.test/1", pid))  # resting from one.test, clean: apart
        for i in range(3):  # then bans that would link them
            other = await _answer(h, await _lease_for(h, f"http://two.test/c{i}"))
            await _answer(h, await _lease_for(h, f"http://one.test/b{i}", other), 429, told)
            await _answer(h, await _lease_for(h, f"http://two.test/b{i}", other), 429, told)
        return h.runtime.sites.learned()

    assert run(scenario()) == {}
    assert h.stat("site_groups/apart") == 1 and h.stat("site_groups/linked") is None


def test_a_request_waiting_when_its_site_is_linked_leases_under_the_groups_key():
    h = Harness(pool="default", proxies=PROXIES[:1], settings={"PROXY_SHARD_LEASE_TTL": 30})

    async def scenario():
        await h.open()
        first = Request("http://b-shop.test/1")
        await h.lease_mw.process_request(first)
        second = Request("http://b-shop.test/2")
        waiter = asyncio.ensure_future(h.lease_mw.process_request(second))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        h.runtime.sites.learn("default", {"b-shop.test": "a-shop.test"})  # another host linked them
        await _next_ms()
        await h.respond(first)
        await asyncio.wait_for(waiter, 5)
        return second.meta["download_slot"]

    assert run(scenario()).startswith("a-shop.test|")
    assert h.stat("site_groups/regrouped_waits") == 1


def test_one_burst_of_bans_never_links_evidence_that_goes_on_does(store):
    """Independent sites that tighten their rules at once ban every proxy on all of them within a
    second, before a clean answer can veto: the linking evidence must come ``span`` after the first."""
    store.add_proxies(POOL, URLS)
    ids = _ids(store)[:4]
    for pid in ids[:3]:
        _banned(store, "a.example", pid, after_clean=False, span=0.3)
        assert _banned(store, "b.example", pid, span=0.3).linked is None
    time.sleep(0.35)  # still banned on both: the evidence goes on past the span
    _banned(store, "a.example", ids[3], after_clean=False, span=0.3)
    assert _banned(store, "b.example", ids[3], span=0.3).linked == ("a.example", "b.example")


@pytest.mark.parametrize(("learn", "linked"), [("auto", None), (True, 1)])
def test_auto_learns_from_the_adaptively_paced_sites_only(learn, linked):
    """With the rule given (a fixed interval), ``auto`` reports no ban: the user vouched for the rule."""
    h = Harness({"PROXY_SHARD_LEARN_SITE_GROUPS": learn, "PROXY_SHARD_MIN_INTERVAL": 0.001}, pool="default",
                proxies=[f"http://10.9.2.{i}:3128" for i in range(1, 7)])

    async def scenario():
        await h.open()
        h.runtime.links.span = 0.0
        told = {"Retry-After": "30"}
        for i in range(3):
            pid = await _answer(h, await _lease_for(h, f"http://b-shop.test/clean-{i}"))
            for site in ("a-shop", "b-shop"):  # the others on the way: a 404, neither clean nor a ban
                await _answer(h, await _lease_for(h, f"http://{site}.test/{i}", pid, others=404), 429, told)

    run(scenario())
    assert h.stat("site_groups/linked") == linked


def test_overlap_bans_link_once_settled_with_no_quarantine_or_clean_answer_before(store):
    """A crawl's opening wave: each proxy in flight on a when b bans it (its first request there). Three
    distinct proxies' overlap evidence links the two once it has settled, at any call, a read included."""
    store.add_proxies(POOL, URLS)
    ids = _ids(store)[:3]
    # the same bans opened both sites' circuit breakers (every proxy rejected at once)
    breakers = [schema.site_part(store.prefix(POOL), name, site) for site in ("a.example", "b.example")
                for name in (schema.BREAKER, schema.BREAKER_SEEN)]
    for key in breakers[::2]:
        store.client.hset(key, "state", "open")
    for pid in ids:
        links = store.site_link(POOL, "b.example", pid, quarantine=15, overlapped="a.example", settle=0.2)
        assert links.linked is None
    assert _groups(store) == {}  # not settled yet: a clean overlap may still veto
    time.sleep(0.25)
    links = store.site_link(POOL, "-", "", quarantine=0, settle=0.2)
    assert (links.linked, links.how) == (("a.example", "b.example"), "overlap")
    assert links.groups == {"b.example": "a.example"}
    # the group's key starts closed; b's stays (hosts that have not read the map yet lease under it)
    assert not store.client.exists(breakers[0]) and store.client.exists(breakers[2])
    # one proxy's overlaps never link, however often
    for _ in range(3):
        store.site_link(POOL, "d.example", ids[0], quarantine=15, overlapped="c.example", settle=0)
    assert store.site_link(POOL, "-", "", quarantine=0, settle=0).linked is None


@pytest.mark.parametrize("veto", ["overlap", "rested"])
def test_a_clean_overlap_or_a_clean_answer_while_resting_vetoes_overlap_evidence(store, veto):
    store.add_proxies(POOL, URLS)
    ids = _ids(store)
    for pid in ids[:2]:
        store.site_link(POOL, "b.example", pid, quarantine=15, overlapped="a.example", settle=0.2)
    if veto == "overlap":  # b answered a proxy clean while it was in flight on a: no overlap rule shared
        store.site_link(POOL, "b.example", ids[4], quarantine=0, overlapped="a.example")
    else:  # b answered a proxy clean while it rested from a
        store.site_link(POOL, "b.example", ids[4], quarantine=0, rested_from="a.example")
    for pid in ids[2:4]:
        store.site_link(POOL, "b.example", pid, quarantine=15, overlapped="a.example", settle=0.2)
    time.sleep(0.25)
    assert store.site_link(POOL, "-", "", quarantine=0, settle=0.2).linked is None
    assert _groups(store) == {}


def test_an_overlap_veto_leaves_the_quarantine_evidence_alone(store):
    """Two sites that tolerate two requests in flight from one IP may still share their strikes: a clean
    overlap vetoes overlap evidence only; bans while quarantined on the other site still link."""
    store.add_proxies(POOL, URLS)
    ids = _ids(store)
    store.site_link(POOL, "b.example", ids[4], quarantine=0, overlapped="a.example")
    for pid in ids[:3]:
        _banned(store, "a.example", pid, after_clean=False)
        links = _banned(store, "b.example", pid)
    assert (links.linked, links.how) == (("a.example", "b.example"), "quarantine")


def test_a_rate_ban_while_the_proxy_is_in_flight_on_another_site_is_overlap_evidence():
    """The crawl: a proxy this host has in flight on a-shop is rate-banned on b-shop (the shared
    blacklist counts both requests): reported as overlap evidence, and three proxies link the sites; a
    proxy in flight on one.test answered clean on two.test is reported as an overlap veto, once."""
    h = _learner(3)

    async def scenario():
        await h.open()
        h.runtime.links.settle = 0.0
        told = {"Retry-After": "30"}
        banned = []
        for i in range(3):
            first = await _lease_for(h, f"http://a-shop.test/{i}")
            banned.append(first.meta["proxy_shard_proxy_id"])
            await _answer(h, await _lease_for(h, f"http://b-shop.test/{i}", banned[-1]), 429, told)
            await _answer(h, first)
        linked = h.runtime.sites.key_for_url("http://b-shop.test/9")
        # one ban scope: the group's key (a-shop) holds back the IPs b-shop's blacklist still refuses
        ready = schema.site_part(h.admin.prefix("default"), schema.READY, "a-shop.test")
        now_ms = time.time() * 1000
        assert all(h.admin.client.zscore(ready, f"{pid}/0") > now_ms + 25000 for pid in banned)
        for i in range(2):
            first = await _lease_for(h, f"http://one.test/{i}")
            await _answer(h, await _lease_for(h, f"http://two.test/{i}", first.meta["proxy_shard_proxy_id"]))
            await _answer(h, first)
        return linked

    assert run(scenario()) == "a-shop.test"
    assert h.stat("site_groups/overlap_bans") == 3 and h.stat("site_groups/linked") == 1
    assert h.stat("site_groups/overlap_apart") == 1  # told once per pair (APART_EVERY)


def test_the_sites_a_crawl_opens_together_see_each_proxy_first_far_apart(store):
    """A crawl's opening wave sent every IP to every site at once, which a shared blacklist punishes
    before anything can be learned. Each site spreads its proxies' first slots over its first interval
    at its own phase: a site's first round is not one burst, and one IP's first requests to the first
    three sites are at least 0.236 of the interval apart (golden-ratio phases)."""
    store.add_proxies(POOL, URLS)
    offsets = {}
    for site in ("a.example", "b.example", "c.example"):
        now = time.time() * 1000
        first = store.lease(POOL, site, ttl=30, spread=3.0)
        ready = store.client.zrange(schema.site_part(store.prefix(POOL), schema.READY, site), 0, -1,
                                    withscores=True)
        offsets[site] = {member: score - now for member, score in ready}
        if isinstance(first, Lease):  # the one free at once (offset ~0) is held now
            del offsets[site][f"{first.proxy_id}/0"]
        else:
            assert 0 < first.wait <= 3.0
        assert all(-50 < o < 3050 for o in offsets[site].values())
        spaced = sorted(offsets[site].values())
        assert min(b - a for a, b in itertools.pairwise(spaced)) > 3000 / len(URLS) - 50
    for x, y in itertools.combinations(offsets, 2):
        apart = [abs(offsets[x][m] - offsets[y][m]) for m in offsets[x].keys() & offsets[y].keys()]
        assert min(min(d, 3000 - d) for d in apart) > 0.236 * 3000 - 50, (x, y)
    # without a spread (no pacing), every proxy is free at once on a new site
    assert all(isinstance(store.lease(POOL, "d.example", ttl=30), Lease) for _ in URLS)


def test_overlaps_count_every_site_in_flight_and_drop_the_requests_that_never_came_back():
    """A proxy banned on d while this host had it in flight on a and b is evidence for both pairs (the
    clean overlaps veto the independent one); a request whose lease expired without an answer (a later
    middleware replaced it) is dropped, not counted as in flight for ever; a settled read links with
    the group's start interval."""
    h = Harness({"PROXY_SHARD_LEARN_SITE_GROUPS": True}, pool="default", proxies=PROXIES[:1])
    links = h.runtime.links

    def lease(site, token, issued, expires=100.0):
        made = Lease(pool="default", site=site, proxy_id="x", proxy_url="http://10.0.0.1:3128", member="x/0",
                     token=token, expires_at=expires, issued_at=issued)
        links.leased(made)
        return made

    lease("a.test", "t1", 1.0)
    lease("b.test", "t2", 2.0)
    lease("c.test", "t3", 0.5, expires=2.5)  # never came back
    later = lease("e.test", "t4", 4.0)  # sent after the banned one: not around it
    banned = Lease(pool="default", site="d.test", proxy_id="x", proxy_url="http://10.0.0.1:3128",
                   member="x/0", token="t5", expires_at=100.0, issued_at=3.0)
    assert links._enclosing(banned, now=5.0) == ["a.test", "b.test"]
    assert "t3" not in links._flying["x"]
    links.released(later)
    assert set(links._flying["x"]) == {"t1", "t2"}

    asked = []

    async def site_link(*args, **kwargs):
        asked.append(kwargs)

    async def read():
        h.runtime._store = type("S", (), {"site_link": staticmethod(site_link)})()
        links.settle = 0.0
        await links._read_settled("default", 3.0)

    asyncio.run(read())
    assert asked and asked[0]["start"] == 3.0 and asked[0]["quarantine"] == 0.0


def test_in_flight_finds_a_proxys_requests_on_other_sites_whoever_leased_them(store, make_store):
    """flying.lua: a proxy's live held records on other sites, leased by any host before a given start,
    are its requests in flight there; answered ones, expired ones, later ones and a sticky session's
    binding are not."""
    store.add_proxies(POOL, URLS[:1])
    other = make_store()  # another host on the same Redis
    pid = _ids(store)[0]
    on_a = other.lease(POOL, "a.example", ttl=30)
    time.sleep(0.002)
    mine = store.lease(POOL, "b.example", ttl=30)
    assert isinstance(on_a, Lease) and isinstance(mine, Lease)
    sites = ["a.example", "c.example", "b.example"]
    assert store.in_flight(POOL, pid, sites, mine.issued_at) == ["a.example", "b.example"]
    assert store.in_flight(POOL, pid, ["a.example"], on_a.issued_at - 0.001) == []  # sent after
    assert store.in_flight(POOL, "no-such-proxy", sites, mine.issued_at) == []
    other.release(on_a)
    assert store.in_flight(POOL, pid, ["a.example"], mine.issued_at) == []
    short = other.lease(POOL, "c.example", ttl=0.05)
    bound = other.lease(POOL, "d.example", ttl=30, session_id="s1")
    assert isinstance(short, Lease) and isinstance(bound, Lease)
    other.release(bound)  # the request is answered; the session keeps its binding
    time.sleep(0.1)
    assert store.in_flight(POOL, pid, ["c.example", "d.example"], time.time() + 1) == []
    assert store.in_flight(POOL, pid, [], mine.issued_at) == []


def test_another_hosts_request_in_flight_is_no_overlap_evidence_its_clean_overlap_is_a_veto():
    """Overlap evidence counts the banning host's own requests only (read across hosts, coincidental
    overlap bans linked stock nginx's independent vhosts); a clean answer on two.test while another host
    has the proxy on one.test is an overlap veto (read from Redis, every REFRESH)."""
    h = _learner(4)

    async def scenario():
        await h.open()
        h.runtime.links.settle = 0.0
        told = {"Retry-After": "30"}
        for site in ("a-shop", "one"):  # this host crawls these too (its recent sites)
            await _answer(h, await _lease_for(h, f"http://{site}.test/"))
        for i in range(3):
            there = h.admin.lease("default", "a-shop.test", ttl=30)
            await _next_ms()
            await _answer(h, await _lease_for(h, f"http://b-shop.test/{i}", there.proxy_id), 429, told)
            h.admin.release(there)
        linked = h.runtime.sites.key_for_url("http://b-shop.test/9")
        there = h.admin.lease("default", "one.test", ttl=30)
        await _next_ms()
        clean = await _lease_for(h, "http://two.test/1", there.proxy_id)
        h.runtime.links._read_at.clear()  # the clean answer that is checked across hosts (every REFRESH)
        await _answer(h, clean)
        return linked

    assert run(scenario()) == "b-shop.test"
    assert not h.stat("site_groups/overlap_bans") and not h.stat("site_groups/linked")
    assert h.stat("site_groups/overlap_apart") == 1


def test_a_host_that_reported_overlap_evidence_checks_every_clean_answer_for_vetoes():
    """After its overlap ban, this host checks every clean answer (not one each REFRESH) against every
    host's requests in flight until the evidence has settled: another host's clean overlap vetoes it.
    Independent sites (stock nginx vhosts) served from every IP at once have coincidental overlap bans."""
    h = _learner(5)
    used: set[str] = set()

    def on_a_shop():
        """Another host's request on a-shop through a proxy not used here yet."""
        kept = []
        while True:
            there = h.admin.lease("default", "a-shop.test", ttl=30)
            if there.proxy_id not in used:
                break
            kept.append(there)
        for lease in kept:
            h.admin.release(lease)
        used.add(there.proxy_id)
        return there

    async def overlapped(i, status):
        """A ban: through a proxy this host has in flight on a-shop; a clean answer: another host's."""
        if status == 200:
            there = on_a_shop()
        else:
            there = await _lease_for(h, f"http://a-shop.test/{i}")
            used.add(there.meta["proxy_shard_proxy_id"])
        pid = there.proxy_id if status == 200 else there.meta["proxy_shard_proxy_id"]
        await _next_ms()
        await _answer(h, await _lease_for(h, f"http://b-shop.test/{i}", pid), status,
                      {"Retry-After": "30"} if status == 429 else None)
        if status == 200:
            h.admin.release(there)
        else:
            await _answer(h, there)

    async def scenario():
        await h.open()
        h.runtime.links.settle = 0.5
        await overlapped(0, 429)
        assert h.runtime.links._watch["default"] > asyncio.get_running_loop().time()
        await overlapped(1, 200)  # a clean overlap: not due for a REFRESH read, checked all the same
        for i in (2, 3):
            await overlapped(i, 429)
        await asyncio.sleep(0.6)
        await h.runtime.links.refresh("default")
        return h.runtime.sites.key_for_url("http://b-shop.test/9")

    assert run(scenario()) == "b-shop.test"
    assert h.stat("site_groups/overlap_bans") == 3 and h.stat("site_groups/overlap_apart") == 1
    assert not h.stat("site_groups/linked")
