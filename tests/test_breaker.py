"""The site circuit breaker's state machine on the engine, run against fakeredis, a real redis-server and
the Redis Cluster (the contract suite's ``backend``; on fakeredis ``clock`` moves time without sleeping).

Closed → open after ``threshold`` quarantines from ``min_proxies`` distinct proxies with no success in
between; open → half-open after the cool-off; half-open → closed on a probe answered fine, → open
again (twice as long, capped) on a probe banned or a round of probes without a verdict.
"""

from __future__ import annotations

import pytest
import test_engine_contract

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.breaker import BreakerOptions
from scrapy_proxy_shard.engine.store import Lease, LeaseWait
from scrapy_proxy_shard.exceptions import PoolBackendError

POOL = "main"
SITE = "down.example"
URLS = [f"http://10.0.1.{i}:8000" for i in range(1, 9)]
#: Quarantines long enough to outlast every test; cool-offs short enough to wait through.
LONG_BANS = BanOptions(ttl=60, max_ttl=60, jitter=0.0, strike_window=60, dead_ttl=60)
#: The contract suite's clock fixture (controlled on fakeredis, the wall clock on real servers).
clock = test_engine_contract.clock
BREAKER = BreakerOptions(threshold=5, min_proxies=3, window=60, cooloff=0.5, max_cooloff=1.6, probes=2)


@pytest.fixture
def hosts(make_store):
    """Three hosts on one pool, with the breaker on."""
    stores = [make_store(f"host-{i}", bans=LONG_BANS, breakers=BREAKER) for i in range(3)]
    stores[0].add_proxies(POOL, URLS)
    return stores


def lease_ok(store, site=SITE, **kw) -> Lease:
    kw.setdefault("ttl", 5)
    result = store.lease(POOL, site, **kw)
    assert isinstance(result, Lease), result
    return result


def ban_through(store, n, site=SITE, reason="http_403"):
    """Lease n proxies at once, then release each with a ban: the releases' breaker events."""
    leases = [lease_ok(store, site) for _ in range(n)]
    return [store.release(lease, outcome="ban", reason=reason) for lease in leases]


def sstat(store, name, site=SITE):
    return int(store.site_counters(POOL, [site]).get(site, {}).get(name, 0))


def open_breaker(hosts):
    results = ban_through(hosts[0], 5)
    assert [r.breaker.kind if r.breaker else None for r in results] == [None] * 4 + ["opened"]
    return results


def test_opens_after_threshold_quarantines_from_distinct_proxies_with_evidence(hosts):
    store = hosts[0]
    results = ban_through(store, 3, reason="http_403") + ban_through(store, 2, reason="http_429")
    assert all(r.ban_until for r in results)  # each of the five was quarantined
    event = results[-1].breaker
    assert event.kind == "opened"
    assert (event.bans, event.proxies, event.window) == (5, 5, 60.0)
    assert event.reasons == {"http_403": 3, "http_429": 2}
    assert event.cooloff == pytest.approx(0.5)
    wait = store.lease(POOL, SITE, ttl=5)
    assert isinstance(wait, LeaseWait) and wait.reason == "breaker"
    assert 0 < wait.wait <= 0.5
    state = store.breaker(POOL, SITE)
    assert state.state == "open" and state.trips == 1 and state.probes == 2
    assert sstat(store, schema.BREAKER_OPENED) == 1
    assert len([b for b in store.bans(POOL) if b.scope == SITE]) == 5


def test_many_quarantines_of_one_or_two_proxies_never_open_it(make_store, clock):
    store = make_store(bans=BanOptions(ttl=0.05, max_ttl=0.05, jitter=0.0, strike_window=60),
                       breakers=BREAKER)
    store.add_proxies(POOL, URLS[:2])
    kinds = []
    for _ in range(8):  # eight quarantines, from two proxies: one proxy's (or two) bad luck, not the site
        result = store.lease(POOL, SITE, ttl=5)
        while isinstance(result, LeaseWait):
            clock.sleep(result.wait + 0.01)
            result = store.lease(POOL, SITE, ttl=5)
        released = store.release(result, outcome="ban", reason="http_403")
        assert released.ban_until is not None
        kinds.append(released.breaker)
    assert kinds == [None] * 8
    assert store.breaker(POOL, SITE) is None
    assert sstat(store, schema.QUARANTINES) == 8


def test_one_burst_of_bans_probes_soon_and_a_rejected_probe_opens_it_for_the_cool_off(make_store, clock):
    """Evidence that is one burst (every request sent before the first rejection was answered) opens the
    breaker for BREAKER_BURST_MS only; its probe rejected too, the site rejects fresh requests: open for
    the cool-off it cut short, doubling from there. Evidence with a request sent after a rejection opens
    it for the cool-off at once."""
    breaker = BreakerOptions(threshold=3, min_proxies=3, window=60, cooloff=2, max_cooloff=60, probes=1)
    store = make_store(bans=LONG_BANS, breakers=breaker)
    store.add_proxies(POOL, URLS)
    leases = [lease_ok(store) for _ in range(4)]
    clock.sleep(0.05)
    burst = [store.release(lease, outcome="ban", reason="http_429") for lease in leases]
    assert [r.breaker.kind if r.breaker else None for r in burst] == [None, None, "opened", "spared"]
    assert burst[2].breaker.cooloff == pytest.approx(1.0)
    clock.sleep(1.05)
    probe = lease_ok(store)
    assert store.release(probe, outcome="ban", reason="http_429").breaker.cooloff == pytest.approx(2.0)
    clock.sleep(2.05)
    probe = lease_ok(store)
    assert store.release(probe, outcome="ban", reason="http_429").breaker.cooloff == pytest.approx(4.0)
    # a site that goes on rejecting: the second wave was sent after the first was answered
    other = "other.example"
    first = [lease_ok(store, other) for _ in range(2)]
    clock.sleep(0.05)
    assert [store.release(lease, outcome="ban", reason="http_429").breaker for lease in first] == [None, None]
    opened = store.release(lease_ok(store, other), outcome="ban", reason="http_429").breaker
    assert opened.kind == "opened" and opened.cooloff == pytest.approx(2.0)


def test_a_success_between_bans_means_the_site_does_not_reject_everyone(hosts):
    store = hosts[0]
    assert [r.breaker for r in ban_through(store, 4)] == [None] * 4
    store.release(lease_ok(store), outcome="ok")
    assert [r.breaker for r in ban_through(store, 3)] == [None] * 3  # the count starts again
    assert store.breaker(POOL, SITE) is None


def test_open_blocks_leases_on_every_host_and_other_sites_are_unaffected(hosts):
    in_flight = [lease_ok(h) for h in hosts[1:]]  # leased before the breaker opens
    open_breaker(hosts)
    for host in hosts:
        wait = host.lease(POOL, SITE, ttl=5)
        assert isinstance(wait, LeaseWait) and wait.reason == "breaker", host.host_id
        assert isinstance(host.lease(POOL, "other.example", ttl=5), Lease)
    # Requests already in flight finish normally (an "ok" that started before it opened closes nothing).
    assert hosts[1].release(in_flight[0], outcome="ok").breaker is None
    assert hosts[2].lease(POOL, SITE, ttl=5).reason == "breaker"


def test_bans_while_open_charge_no_strike_and_one_host_opens_it(hosts):
    in_flight = [lease_ok(h) for h in hosts for _ in range(1)]  # one request in flight per host
    open_breaker(hosts)
    started = sstat(hosts[0], schema.QUARANTINES)
    results = [h.release(lease, outcome="ban", reason="http_403") for h, lease in zip(hosts, in_flight, strict=True)]
    assert [r.breaker.kind for r in results] == ["spared"] * 3  # nobody opens it a second time
    assert all(r.ban_until is None and r.strikes == 0 for r in results)
    assert sstat(hosts[0], schema.QUARANTINES) == started
    assert sstat(hosts[0], schema.BREAKER_OPENED) == 1
    assert sstat(hosts[0], schema.BREAKER_SPARED) == 3
    banned = {b.proxy_id for b in hosts[0].bans(POOL) if b.scope == SITE}
    assert not banned & {lease.proxy_id for lease in in_flight}


def test_a_dead_proxy_is_still_quarantined_while_open(hosts):
    lease = lease_ok(hosts[0])
    open_breaker(hosts)
    result = hosts[0].release(lease, outcome="dead", reason="connection_refused")
    assert result.ban_until is not None and result.breaker is None  # the proxy's fault, not the site's


def test_half_open_lets_one_probe_at_a_time_and_a_fine_probe_closes_it(hosts, clock):
    open_breaker(hosts)
    clock.sleep(0.55)
    probe = lease_ok(hosts[1])
    assert hosts[1].breaker(POOL, SITE).state == "half"
    for host in hosts:  # one probe at a time, on every host
        wait = host.lease(POOL, SITE, ttl=5)
        assert isinstance(wait, LeaseWait) and wait.reason == "breaker"
        assert wait.wait <= 5.0
    closed = hosts[1].release(probe, outcome="ok")
    assert closed.breaker.kind == "closed"
    assert hosts[0].breaker(POOL, SITE) is None
    again = [(h, lease_ok(h)) for h in hosts]  # leasing as usual, on every host
    assert len({lease.proxy_id for _, lease in again}) == 3
    assert sstat(hosts[0], schema.BREAKER_CLOSED) == 1
    # The evidence was forgotten: three more quarantines (eight in all) do not re-open it.
    assert [h.release(lease, outcome="ban", reason="http_403").breaker for h, lease in again] == [None] * 3


def test_a_banned_probe_reopens_it_for_twice_as_long_capped(hosts, clock):
    open_breaker(hosts)
    cooloffs = []
    for _ in range(3):
        clock.sleep(hosts[0].breaker(POOL, SITE).until - clock.time() + 0.05)
        probe = lease_ok(hosts[0])
        result = hosts[0].release(probe, outcome="ban", reason="http_403")
        assert result.breaker.kind == "reopened"
        assert result.ban_until is None  # the probe's proxy gets no strike either
        cooloffs.append(result.breaker.cooloff)
        assert hosts[2].lease(POOL, SITE, ttl=5).reason == "breaker"
    assert cooloffs == [pytest.approx(1.0), pytest.approx(1.6), pytest.approx(1.6)]  # doubling, capped
    assert sstat(hosts[0], schema.BREAKER_REOPENED) == 3
    assert hosts[0].breaker(POOL, SITE).trips == 4


def test_probes_without_a_verdict_are_limited_per_round(hosts, clock):
    open_breaker(hosts)
    clock.sleep(0.55)
    for _ in range(BREAKER.probes):  # a 404 or a network error says nothing about the site
        probe = lease_ok(hosts[0])
        assert hosts[0].release(probe, outcome="unknown").breaker is None
    wait = hosts[0].lease(POOL, SITE, ttl=5)
    assert isinstance(wait, LeaseWait) and wait.reason == "breaker"
    state = hosts[0].breaker(POOL, SITE)
    assert state.state == "open" and state.cooloff == pytest.approx(1.0)


def test_a_probe_whose_holder_died_frees_the_probe_at_its_lease_expiry(hosts, clock):
    open_breaker(hosts)
    clock.sleep(0.55)
    lease_ok(hosts[0], ttl=0.3)  # the probe's host dies: never released
    assert hosts[1].lease(POOL, SITE, ttl=5).reason == "breaker"
    clock.sleep(0.35)
    probe = lease_ok(hosts[1])
    assert hosts[1].release(probe, outcome="ok").breaker.kind == "closed"


def test_sessions_wait_too_and_a_session_lease_can_be_the_probe(hosts, clock):
    first = lease_ok(hosts[0], session_id="s1")
    hosts[0].release(first)
    open_breaker(hosts)
    wait = hosts[0].lease(POOL, SITE, ttl=5, session_id="s1")
    assert isinstance(wait, LeaseWait) and wait.reason == "breaker"
    clock.sleep(0.55)
    probe = lease_ok(hosts[0], session_id="s1")
    assert probe.proxy_id == first.proxy_id
    assert hosts[0].release(probe, outcome="ok").breaker.kind == "closed"


def test_without_breaker_options_bans_quarantine_as_always(make_store):
    store = make_store(bans=LONG_BANS)
    store.add_proxies(POOL, URLS)
    results = ban_through(store, 8)
    assert all(r.breaker is None and r.ban_until for r in results)
    assert store.breaker(POOL, SITE) is None
    assert isinstance(store.lease(POOL, "other.example", ttl=5), Lease)


@pytest.mark.parametrize("packed", ["5,3,60000", "0,3,60000,500,1000,2", "5,3,60000,500,100,2", "a,b,c,d,e,f"])
def test_a_malformed_breaker_argument_is_refused_before_any_write(make_store, backend, packed):
    store = make_store(bans=LONG_BANS)
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    store._breakers = lambda site: type("Bad", (), {"packed": lambda self: packed})()
    with pytest.raises(PoolBackendError, match="argument breaker"):
        store.release(lease, outcome="ban", reason="http_403")
    assert store.bans(POOL) == []
    assert store.breaker_options(SITE) is not None


@pytest.mark.parametrize(("told", "cool"), [
    ([0.2] * 5, 0.2),  # every ban said when the site takes the IP back: the cool-off is the longest word
    ([0.2, 0.3, 0.2, 0.2, 0.2], 0.3),
    ([0.2, 0.2, None, 0.2, 0.2], 0.5),  # one ban said nothing: the configured cool-off
    ([5.0] * 5, 0.5),  # never longer than the configured one (a probe costs one request)
])
def test_the_cooloff_follows_the_sites_retry_after_when_every_ban_gave_one(hosts, told, cool):
    leases = [lease_ok(hosts[0]) for _ in range(5)]
    results = [hosts[0].release(lease, outcome="ban", reason="http_429", retry_after=t)
               for lease, t in zip(leases, told, strict=True)]
    assert results[-1].breaker.kind == "opened"
    assert results[-1].breaker.cooloff == pytest.approx(cool)
