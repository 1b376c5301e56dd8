"""The site zoo's rules (benchmarks/zoo_site.py) and profiles (benchmarks/bench_zoo.py): fast, no processes."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zoo_site import Judge, ZooRules, draw_service, summarize

from scrapy_proxy_shard.demo.forward_proxy import ForwardProxy


def test_early_arrivals_are_strikes_and_the_third_bans():
    j = Judge(ZooRules(interval=1.0, strikes=3, window=60, ban=15))
    for t in (0.0, 2.0):
        v = j.admit("ip", "a.test", t)
        assert v.verdict == "ok"
        j.release("ip", v)
    for t in (2.5, 2.6):  # too soon: a strike, still answered
        v = j.admit("ip", "a.test", t)
        assert (v.verdict, v.why) == ("early", "early")
        j.release("ip", v)
    v = j.admit("ip", "a.test", 2.7)
    assert (v.verdict, v.why, v.retry_after) == ("ban", "early", 15)
    assert j.admit("ip", "a.test", 10.0).verdict == "banned"
    assert j.admit("ip", "b.test", 10.0).verdict == "ok"  # another domain, another blacklist
    assert j.admit("ip", "a.test", 17.8).verdict == "ok"  # the ban is over


def test_strikes_outside_the_window_are_forgotten():
    j = Judge(ZooRules(interval=1.0, strikes=2, window=10, ban=5))
    for t in (0.0, 0.5, 20.0, 20.5):
        v = j.admit("ip", "a.test", t)
        j.release("ip", v)
    verdicts = []
    for t in (40.0, 40.1, 40.2):  # the strikes of 0.5 and 20.5 have expired: two fresh ones to ban
        v = j.admit("ip", "a.test", t)
        verdicts.append(v.verdict)
        j.release("ip", v)
    assert verdicts == ["ok", "early", "ban"]


def test_one_strike_bans_for_the_profile_length():
    j = Judge(ZooRules(interval=0.5, strikes=1, ban=600, ban_style="403"))
    j.release("ip", j.admit("ip", "a.test", 0.0))
    v = j.admit("ip", "a.test", 0.4)
    assert (v.verdict, v.retry_after) == ("ban", 600)
    assert j.admit("ip", "a.test", 599.0).verdict == "banned"
    assert j.admit("ip", "a.test", 600.5).verdict == "ok"


def test_overlap_tolerance():
    one = Judge(ZooRules(interval=0.1, overlap=1))
    one.admit("ip", "a.test", 0.0)  # still in flight
    v = one.admit("ip", "a.test", 0.5)
    assert (v.verdict, v.why) == ("ban", "overlap")
    two = Judge(ZooRules(interval=0.1, overlap=2))
    assert two.admit("ip", "a.test", 0.0).verdict == "ok"
    assert two.admit("ip", "a.test", 0.1).verdict == "ok"  # two in flight: tolerated
    v = two.admit("ip", "a.test", 0.2)
    assert (v.verdict, v.why) == ("ban", "overlap")  # a third is not


def test_shared_blacklist_counts_arrivals_across_domains():
    j = Judge(ZooRules(interval=1.0, strikes=1, groups=(("a.test", "b.test"),)))
    j.release("ip", j.admit("ip", "a.test", 0.0))
    v = j.admit("ip", "b.test", 0.5)
    assert (v.verdict, v.group) == ("ban", "a.test+b.test")
    assert j.admit("ip", "a.test", 1.0).verdict == "banned"  # banned on both
    assert j.admit("ip", "c.test", 1.0).verdict == "ok"
    assert j.admit("other", "a.test", 1.0).verdict == "ok"


def test_rule_tightens_mid_crawl():
    j = Judge(ZooRules(interval=1.0, strikes=1, tighten_after=10, tighten_factor=1.5))
    for t in (0.0, 1.0, 2.0):  # 1 s apart: fine before the change
        v = j.admit("ip", "a.test", t)
        assert v.verdict == "ok" and v.interval == 1.0
        j.release("ip", v)
    j.release("ip", j.admit("ip", "a.test", 11.0))
    v = j.admit("ip", "a.test", 12.0)  # 1 s is now too soon: the interval is 1.5 s
    assert (v.verdict, v.interval) == ("ban", 1.5)


@pytest.mark.parametrize("spec,low,high", [("fixed:0.1", 0.1, 0.1), ("uniform:0.05:0.2", 0.05, 0.2),
                                           ("lognormal:0.08:0.8", 0.0, 3.0), ("pareto:0.04:1.5", 0.04, 3.0)])
def test_service_times(spec, low, high):
    rng = random.Random(3)
    values = [draw_service(spec, rng, cap=3.0) for _ in range(2000)]
    assert low <= min(values) and max(values) <= high
    if spec.startswith(("lognormal", "pareto")):  # heavy-tailed: the top 1% far above the median
        values.sort()
        assert values[int(0.99 * len(values))] > 3 * values[len(values) // 2]


def test_bad_rules_are_refused():
    for bad in ({"interval": 0}, {"interval": 1, "overlap": 0}, {"interval": 1, "service": "gamma:1"},
                {"interval": 1, "ban_style": "418"}):
        with pytest.raises(ValueError):
            ZooRules(**bad)
    assert ZooRules.from_json(ZooRules(interval=0.3, groups=(("a", "b"),)).to_json()).groups == (("a", "b"),)


def test_summary_counts_lost_pages_blocked_answers_and_bans():
    entries = [
        {"start": 0.0, "end": 0.1, "site": "a.test", "path": "/catalog/1", "status": 200, "kind": "page",
         "verdict": "ok"},
        {"start": 0.2, "end": 0.3, "site": "a.test", "path": "/catalog/2", "status": 200, "kind": "page",
         "verdict": "early", "why": "early"},
        {"start": 0.3, "end": 0.31, "site": "a.test", "path": "/catalog/3", "status": 429, "verdict": "ban",
         "why": "early"},
        {"start": 0.4, "end": 1.0, "site": "a.test", "path": "/catalog/3", "status": 429, "verdict": "banned"},
    ]
    s = summarize(entries, {("a.test", f"/catalog/{n}") for n in (1, 2, 3)})
    assert (s.ok_pages, s.lost, s.blocked, s.bans, s.early, s.span) == (2, 1, 2, 1, 2, 1.0)
    assert s.rate == 2.0 and s.blocked_share == 0.5


def test_forward_proxy_jitter_is_a_parameter():
    assert ForwardProxy("127.0.0.11", {}, jitter=0.02).jitter == 0.02
    with pytest.raises(ValueError):
        ForwardProxy("127.0.0.11", {}, jitter=-1)


def test_zoo_profiles_cover_the_issue():
    import bench_zoo

    profiles = bench_zoo.PROFILES
    assert len(profiles) >= 8
    zoo = [p.rules for p in profiles.values() if p.rules is not None]
    assert min(r.interval for r in zoo) <= 0.1 and max(r.interval for r in zoo) >= 2.0
    assert {r.overlap for r in zoo} == {1, 2} and {r.strikes for r in zoo} >= {1, 3}
    assert min(r.ban for r in zoo) <= 15 and max(r.ban for r in zoo) >= 600
    assert {r.service.split(":")[0] for r in zoo} == {"fixed", "uniform", "lognormal", "pareto"}
    assert any(r.groups for r in zoo) and any(r.tighten_after is not None for r in zoo)
    jitters = [p.jitter_ms for p in profiles.values()]
    assert min(jitters) == 0 and max(jitters) >= 30
    assert "nginx" in profiles


def test_drawn_profiles_stay_in_the_issues_ranges_and_repeat_by_seed():
    import bench_zoo

    drawn = bench_zoo.random_profiles(200, seed=5)
    assert [p.about for p in bench_zoo.random_profiles(200, seed=5)] == [p.about for p in drawn]
    assert [p.about for p in bench_zoo.random_profiles(3, seed=6)] != [p.about for p in drawn[:3]]
    for p in drawn:
        r = p.rules
        assert 0.1 <= r.interval <= 2.0 and 15 <= r.ban <= 600 and 0 <= p.jitter_ms <= 30
        assert 1 <= p.domains <= 3 and p.proxies - p.dead - p.slow >= 3
        assert all(d in bench_zoo.DOMAINS[:p.domains] for g in r.groups for d in g)
    kinds = {p.rules.service.split(":")[0] for p in drawn}
    assert kinds == {"fixed", "uniform", "lognormal", "pareto"}
    assert {p.rules.overlap for p in drawn} == {1, 2} and {p.rules.strikes for p in drawn} == {1, 3}
    assert any(p.rules.groups for p in drawn) and any(p.rules.tighten_after is not None for p in drawn)


def test_zoo_site_through_jittering_proxies(tmp_path):
    """End to end in one process (about 0.5 s): the site sees the proxy's IP, logs every arrival with its
    verdict, states the arrival and interval in headers, and the proxy holds each request 0..J ms."""
    import asyncio
    import time

    from demo_http import parse_response, send_raw
    from zoo_site import ZooSite, read_log

    from scrapy_proxy_shard.demo.forward_proxy import ProxyFleet, ProxySpec, site_hosts

    async def scenario():
        site = ZooSite(ZooRules(interval=0.05, strikes=1, service="fixed:0.0"), ["a.test"], 30,
                       log_path=str(tmp_path / "site.log"))
        async with site, ProxyFleet([ProxySpec("127.0.0.11")], site_hosts(site.port), jitter=0.03) as fleet:
            delays = []
            for n in range(1, 9):
                sent = time.time()
                request = f"GET http://a.test/catalog/{n} HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
                response = parse_response(await send_raw(fleet.proxies[0].port, request.encode()))
                assert response.status == 200 and b'class="price"' in response.body
                assert float(response.headers["x-zoo-interval"]) == 0.05
                delays.append(float(response.headers["x-zoo-arrival"]) - sent)
                await asyncio.sleep(0.06)
            return delays

    delays = asyncio.run(scenario())
    assert all(0 <= d < 0.03 + 0.02 for d in delays) and max(delays) - min(delays) > 0.003
    log = read_log(tmp_path / "site.log")
    assert [(e["ip"], e["verdict"], e["status"]) for e in log] == [("127.0.0.11", "ok", 200)] * 8


def test_diagnosis_names_two_slots_arriving_together_and_banned_pairs():
    import bench_zoo

    def entry(t, ip, verdict="ok", why=None, status=200):
        return {"start": t, "end": t + 0.05, "ip": ip, "site": "a.test", "group": "a.test", "path": "/catalog/1",
                "status": status, "kind": "page", "verdict": verdict, "why": why}

    entries = [entry(0.0, "x"), entry(0.004, "x", "early", "early"), entry(0.3, "x", "ban", "early", 429),
               entry(0.5, "y"), entry(30.0, "y")]
    d = bench_zoo.diagnose(entries, ZooRules(interval=0.1))
    assert (d["early_within_20ms"], d["early_gap_ms_min"], d["first_ban_s"]) == (1, 4.0, 0.3)
    assert (d["pairs"], d["banned_pairs"], d["banned_pairs_idle_last_10s"]) == (2, 1, 1)
    assert d["ok_per_10s"] == [3, 0, 0, 1]
