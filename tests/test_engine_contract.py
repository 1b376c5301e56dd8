"""The lease engine's contract, run against fakeredis and a real redis-server alike.

TTLs are shortened to fractions of a second instead of sleeping through real ones, and on
fakeredis the tests that wait do not sleep at all: ``clock`` controls the time fakeredis reads.
"""

from __future__ import annotations

import time

import pytest
from engine_clock import Clock, make_clock

from scrapy_proxy_shard.engine.sites import SiteMap
from scrapy_proxy_shard.engine.store import Lease, LeaseWait
from scrapy_proxy_shard.exceptions import SettingError, UnknownPoolError

POOL = "main"
URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://user:Pa55word@10.0.0.3:8000"]


@pytest.fixture
def clock(request, monkeypatch) -> Clock:
    """A controlled clock on the fakeredis backend (this test's server only lives as long as it), real
    time on real servers."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    return make_clock(params.get("backend") == "fakeredis", monkeypatch)


def _redis_time(backend) -> float:
    reply = backend.time()
    if isinstance(reply, dict):  # a cluster client answers per node
        reply = next(iter(reply.values()))
    return reply[0] + reply[1] / 1e6


def test_the_clock_is_controlled_on_fakeredis_only(backend, clock):
    """Guards the fixture: if fakeredis stopped reading the patched clock, the timing tests below would
    pass on fakeredis only by the luck of wall-clock speed; here a 100 s jump would not show."""
    before = _redis_time(backend)
    clock.sleep(100.0 if clock.controlled else 0.01)
    elapsed = _redis_time(backend) - before
    if clock.controlled:
        assert elapsed == pytest.approx(100.0, abs=0.01)
    else:
        assert 0.005 < elapsed < 5.0


@pytest.fixture
def pool(store):
    store.add_proxies(POOL, URLS)
    return store


def lease_ok(store, site="a.example", **kw) -> Lease:
    kw.setdefault("ttl", 5)
    result = store.lease(POOL, site, **kw)
    assert isinstance(result, Lease), result
    return result


def test_least_recently_used_rotation(pool, clock):
    seen = []
    for _ in range(6):
        result = pool.lease(POOL, "a.example", ttl=5)
        while isinstance(result, LeaseWait):
            clock.sleep(result.wait)
            result = pool.lease(POOL, "a.example", ttl=5)
        seen.append(result.proxy_id)
        pool.release(result, min_interval=0.01)
        # Redis time is whole ms: two slots free in the same ms tie, and the tie goes by member name,
        # not by age (CI on a redis-cluster once leased the same proxy twice in a row)
        clock.sleep(0.002)
    assert seen[:3] == seen[3:]
    assert len(set(seen[:3])) == 3


def test_one_proxy_serves_one_request_per_site_but_many_sites(pool):
    held = {lease_ok(pool).proxy_id for _ in range(3)}
    assert len(held) == 3
    wait = pool.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.reason == "held"
    assert 4.0 < wait.wait <= 5.0  # until the earliest lease expires, unless released sooner
    other = {lease_ok(pool, "b.example").proxy_id for _ in range(3)}
    assert other == held  # the same IPs serve another site at the same time


def test_site_concurrency_gives_that_many_slots(pool):
    leases = [lease_ok(pool, concurrency=2) for _ in range(6)]
    per_proxy = {}
    for lease in leases:
        per_proxy[lease.proxy_id] = per_proxy.get(lease.proxy_id, 0) + 1
    assert sorted(per_proxy.values()) == [2, 2, 2]
    assert isinstance(pool.lease(POOL, "a.example", ttl=5, concurrency=2), LeaseWait)


def test_min_interval_paces_a_slot_and_wait_says_how_long(store, clock):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    store.release(lease, min_interval=0.3)
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"
    assert 0.2 < wait.wait <= 0.3
    clock.sleep(wait.wait + 0.02)
    assert lease_ok(store).proxy_id == lease.proxy_id


def test_dead_holder_lease_expires_and_stale_release_is_a_counted_no_op(store, clock):
    store.add_proxies(POOL, URLS[:1])
    first = lease_ok(store, ttl=0.2)
    clock.sleep(0.25)
    second = lease_ok(store, ttl=5)
    assert second.proxy_id == first.proxy_id
    result = store.release(first)  # late: someone else holds the slot now
    assert result.status == "stale"
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # still held by `second`
    assert store.release(second).status == "ok"
    assert store.counters(POOL)["stale"] == 1


def test_release_of_expired_unclaimed_lease_reports_expired(store, clock):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store, ttl=0.1)
    clock.sleep(0.15)
    assert store.release(lease).status == "expired"
    assert store.counters(POOL)["expired"] == 1


def test_ban_quarantines_on_that_site_only_and_expires_by_itself(store, clock):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    result = store.release(lease, outcome="ban", reason="http_403")
    assert result.status == "ok" and result.strikes == 1
    assert 0.25 < result.ban_until - result.now <= 0.3 + 1e-6
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert lease_ok(store, "b.example").proxy_id == lease.proxy_id  # other sites unaffected
    clock.sleep(0.32)
    assert lease_ok(store).proxy_id == lease.proxy_id  # back without any reaper


def test_ban_escalates_doubling_and_caps(store, clock):
    store.add_proxies(POOL, URLS[:1])
    pid = lease_ok(store).proxy_id
    durations = []
    for _ in range(4):
        now = clock.time()
        res = store.ban(POOL, pid, site="x.example", reason="captcha")
        durations.append((res.until - now, res.strikes))
        clock.sleep(res.until - clock.time() + 0.02)
    strikes = [s for _, s in durations]
    assert strikes == [1, 2, 3, 4]
    lengths = [round(d, 1) for d, _ in durations]
    assert lengths[0] == pytest.approx(0.3, abs=0.06)
    assert lengths[1] == pytest.approx(0.6, abs=0.06)
    assert lengths[2] == pytest.approx(1.2, abs=0.06)
    assert lengths[3] == pytest.approx(1.2, abs=0.06)  # capped at max_ttl


def test_a_retry_after_quarantine_is_exact_until_the_sites_word_proves_wrong(store, clock):
    """release(retry_after=...): the site's Retry-After is the length, with no jitter and never past
    the ban cap (max_ttl 1.2 s here), whatever the strike, as long as the IP came back clean for a
    while (here: longer than its quarantine). Banned again within one quarantine length of its
    return, the IP gets the usual escalation (ttl 0.3 s doubling per strike, capped)."""
    store.add_proxies(POOL, URLS[:1])
    seen = []

    def ban(told, back_after):
        res = store.release(lease_ok(store), outcome="ban", reason="http_429", retry_after=told)
        seen.append((round(res.ban_until - res.now, 3), res.strikes))
        clock.sleep(res.ban_until - res.now + back_after)

    ban(0.5, 0.6)  # back clean for longer than its quarantine
    ban(0.2, 0.25)
    ban(60, 0.02)  # capped at 1.2 s; then banned again right after its return
    ban(0.1, 0.02)  # the word proved wrong: the ladder, strike 4 = 0.3 x 8 capped at 1.2 s
    ban(0.1, 0.0)
    assert seen == [(0.5, 1), (0.2, 2), (1.2, 3), (1.2, 4), (1.2, 5)]  # not 0.1: the ladder


def test_a_retry_after_proved_short_still_bounds_the_quarantine_from_below(store, clock):
    """Banned again right after the site's Retry-After (after one clean answer: a new first strike,
    from the site's brief rest of 1 s), the IP rests no less than what the site said this time."""
    store.add_proxies(POOL, URLS[:1])
    first = store.release(lease_ok(store), outcome="ban", reason="http_429", retry_after=0.2)
    clock.sleep(first.ban_until - first.now + 0.05)
    store.release(lease_ok(store), outcome="ok")
    again = store.release(lease_ok(store), outcome="ban", reason="http_429", retry_after=1.2)
    assert again.strikes == 1
    assert again.ban_until - again.now == pytest.approx(1.2, abs=0.01)  # not the brief rest


def test_jitter_shortens_within_bounds(make_store, clock):
    from scrapy_proxy_shard.settings import BanOptions

    store = make_store(bans=BanOptions(ttl=10, max_ttl=10, jitter=0.5), random_source=lambda: 1.0)
    store.add_proxies(POOL, URLS[:1])
    pid = lease_ok(store).proxy_id
    now = clock.time()
    res = store.ban(POOL, pid, site="a.example")
    assert res.until - now == pytest.approx(5.0, abs=0.1)


def test_simultaneous_ban_reports_count_one_strike(pool):
    leases = [lease_ok(pool, concurrency=3) for _ in range(3)]
    same = [lease for lease in leases if lease.proxy_id == leases[0].proxy_id]
    results = [pool.release(lease, outcome="ban", reason="http_429") for lease in same]
    assert [r.strikes for r in results] == [1] * len(same)
    assert len({r.ban_until for r in results}) == 1


def test_dead_proxy_is_quarantined_on_every_site_including_new_ones(store, clock):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    lease_ok(store, "b.example")
    store.release(lease, outcome="dead", reason="connection_refused")
    for site in ("a.example", "b.example", "never-seen.example"):
        assert isinstance(store.lease(POOL, site, ttl=5), LeaseWait), site
    clock.sleep(0.32)
    assert lease_ok(store, "never-seen.example").proxy_id == lease.proxy_id


def test_unban_returns_proxy_at_once_but_not_a_held_slot(store):
    store.add_proxies(POOL, URLS[:2])
    first = lease_ok(store)
    second = lease_ok(store)
    store.ban(POOL, first.proxy_id, site="a.example", ttl=60)
    store.ban(POOL, second.proxy_id, site="a.example", ttl=60)
    store.release(first)  # released while banned: stays quarantined
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert store.unban(POOL, first.proxy_id, site="a.example") is True
    assert store.unban(POOL, second.proxy_id, site="a.example") is True
    again = lease_ok(store)
    assert again.proxy_id == first.proxy_id  # second is still held by its running lease
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)


def test_site_group_shares_exclusivity_and_bans(store):
    sites = SiteMap({"marketplace": ["shop-one.example", "shop-two.example"]})
    store.add_proxies(POOL, URLS[:1])
    key_one = sites.key_for_url("https://www.shop-one.example/item/1")
    key_two = sites.key_for_url("https://shop-two.example/")
    assert key_one == key_two == "marketplace"
    lease = lease_ok(store, key_one)
    assert isinstance(store.lease(POOL, key_two, ttl=5), LeaseWait)  # one IP, one group at a time
    store.release(lease, outcome="ban", reason="http_403")
    assert isinstance(store.lease(POOL, key_two, ttl=5), LeaseWait)  # the ban counts on both
    assert isinstance(store.lease(POOL, sites.key_for_url("http://other.example/"), ttl=5), Lease)


def test_sticky_session_keeps_its_proxy_across_hosts(make_store):
    host_a, host_b = make_store("host-a"), make_store("host-b")
    host_a.add_proxies(POOL, URLS)
    first = host_a.lease(POOL, "shop.example", ttl=5, session_id="cart-1")
    host_a.release(first, min_interval=0.0)
    proxies = {first.proxy_id}
    for step in range(6):
        store = (host_a, host_b)[step % 2]
        lease = store.lease(POOL, "shop.example", ttl=5, session_id="cart-1")
        assert isinstance(lease, Lease) and not lease.rebound
        proxies.add(lease.proxy_id)
        store.release(lease)
    assert proxies == {first.proxy_id}


def test_session_holds_its_ip_on_the_site_for_its_lifetime(pool):
    session = lease_ok(pool, session_id="s1", session_ttl=60)
    pool.release(session)
    others = {lease_ok(pool).proxy_id for _ in range(2)}
    assert session.proxy_id not in others  # nobody else gets the session's IP on that site
    assert isinstance(pool.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert lease_ok(pool, "b.example").proxy_id  # other sites still may use it
    assert pool.end_session(POOL, "a.example", "s1") is True
    assert lease_ok(pool).proxy_id == session.proxy_id


def test_session_waits_for_its_own_interval_then_continues(pool, clock):
    session = lease_ok(pool, session_id="s1")
    busy = pool.lease(POOL, "a.example", ttl=5, session_id="s1")
    assert isinstance(busy, LeaseWait) and busy.reason == "session"
    pool.release(session, min_interval=0.2)
    wait = pool.lease(POOL, "a.example", ttl=5, session_id="s1")
    assert isinstance(wait, LeaseWait) and 0.1 < wait.wait <= 0.2
    clock.sleep(wait.wait + 0.02)
    assert lease_ok(pool, session_id="s1").proxy_id == session.proxy_id


def test_session_expires_by_itself(pool, clock):
    session = lease_ok(pool, session_id="s1", ttl=0.1, session_ttl=0.2)
    pool.release(session, session_ttl=0.2)
    clock.sleep(0.25)
    assert pool.session_proxy(POOL, "a.example", "s1") is None
    assert len({lease_ok(pool).proxy_id for _ in range(3)}) == 3


def test_banned_session_proxy_is_rebound_and_reported(pool):
    session = lease_ok(pool, session_id="s1")
    pool.release(session, outcome="ban", reason="http_403")
    again = lease_ok(pool, session_id="s1")
    assert again.rebound is True
    assert again.proxy_id != session.proxy_id
    pool.release(again)
    third = lease_ok(pool, session_id="s1")
    assert third.proxy_id == again.proxy_id and third.rebound is False
    assert pool.counters(POOL)["rebinds"] == 1


def test_removed_proxy_drains(pool):
    held = lease_ok(pool)
    assert pool.remove_proxies(POOL, [held.proxy_id]) == 1
    seen = {lease_ok(pool).proxy_id for _ in range(2)}
    assert held.proxy_id not in seen
    assert isinstance(pool.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert pool.release(held).status == "ok"  # the running lease finishes normally
    assert isinstance(pool.lease(POOL, "a.example", ttl=5), LeaseWait)  # but is not handed out again
    assert len(pool.list_proxies(POOL)) == 2


def test_added_proxy_is_usable_at_once_on_known_sites(pool):
    for _ in range(3):
        lease_ok(pool)
    result = pool.add_proxies(POOL, ["http://10.0.0.9:8000", URLS[0]])
    assert (result.added, result.updated) == (1, 1)
    assert lease_ok(pool).masked_url == "http://10.0.0.9:8000"


def test_empty_or_unknown_pool_is_a_clear_error(store):
    with pytest.raises(UnknownPoolError, match=r"pool 'nope'.*holds no proxies"):
        store.lease("nope", "a.example", ttl=5)
    with pytest.raises(SettingError, match="invalid pool name"):
        store.lease("bad pool!", "a.example", ttl=5)


def test_counters_and_latency_are_kept_in_the_same_calls(pool):
    lease = lease_ok(pool)
    pool.release(lease, latency=0.100)
    lease = lease_ok(pool, "b.example")
    pool.release(lease, latency=0.200)
    lease2 = lease_ok(pool, "c.example")
    pool.release(lease2, outcome="error")
    stats = {r.id: r.stats for r in pool.list_proxies(POOL)}
    first = stats[lease.proxy_id]
    assert first["l"] >= 2 and first["ok"] == 2
    assert first["lat"] == pytest.approx(100 + 0.2 * (200 - 100))
    hosts = pool.counters(POOL, "hstats")
    assert hosts["host-a:l"] == 3 and hosts["host-a:ok"] == 2 and hosts["host-a:err"] == 1


def test_credentials_never_reach_key_names(pool, backend):
    lease_ok(pool, session_id="s1")
    pool.ban(POOL, URLS[2], site="a.example")
    names = " ".join(backend.scan_iter("*"))
    assert "Pa55word" not in names and "user" not in names and "10.0.0." not in names
    assert all(name.startswith(("{t:main}", "t:pools")) for name in backend.scan_iter("*"))


def test_list_proxies_masks_in_repr_only(pool):
    records = pool.list_proxies(POOL)
    assert {r.proxy.url for r in records} == set(URLS)
    assert "Pa55word" not in repr(records)


def test_a_release_wakes_a_waiter_blocked_on_the_site(store):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # a waiter: releases now announce
    assert store.wait_for_release(POOL, "a.example", 0.05) is False  # nothing released yet
    store.release(lease)
    assert store.wait_for_release(POOL, "a.example", 1.0) is True
    assert lease_ok(store).proxy_id == lease.proxy_id


# --- pacing law: a released slot is free at max(lease start + interval, release + rest) -------------------

def _wait_after(store, clock, *, latency, site="a.example", session_id=None, **pacing):
    """Lease, hold the slot ``latency`` seconds (the download), release with ``pacing``; return the
    lease and the wait the next lease on the slot (or the session) is told.

    ``clock.slack`` is the real time the calls themselves took beyond ``latency`` (0 on the controlled
    clock): on a real server the wait told shrinks by that much, so lower bounds allow for it."""
    started = time.monotonic()
    lease = lease_ok(store, site, session_id=session_id)
    clock.sleep(latency)
    store.release(lease, **pacing)
    wait = store.lease(POOL, site, ttl=5, session_id=session_id)
    clock.slack = 0.0 if clock.controlled else max(0.0, time.monotonic() - started - latency)
    return lease, wait


def test_min_interval_counts_from_the_start_of_the_previous_request(store, clock):
    """Start-to-start: a slot leased at t and released at t + 0.2 (the download) with a 0.3 s interval
    is free at t + 0.3, not t + 0.5 (the old rest-after-response law would answer a 0.3 s wait)."""
    store.add_proxies(POOL, URLS[:1])
    first, wait = _wait_after(store, clock, latency=0.2, min_interval=0.3)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"
    assert 0.0 < wait.wait <= 0.1 + 1e-6
    clock.sleep(wait.wait + 0.005)
    second = lease_ok(store)
    assert second.proxy_id == first.proxy_id
    assert 0.3 <= second.issued_at - first.issued_at < 0.45  # the site sees starts ~interval apart


def test_a_download_longer_than_the_interval_frees_the_slot_at_its_release(store, clock):
    store.add_proxies(POOL, URLS[:1])
    first, again = _wait_after(store, clock, latency=0.35, min_interval=0.3)
    assert isinstance(again, Lease) and again.proxy_id == first.proxy_id


@pytest.mark.parametrize(("latency", "interval", "rest", "low", "high"), [
    (0.0, 0.0, 0.25, 0.2, 0.25),   # rest after response only (the old meaning of MIN_INTERVAL)
    (0.2, 0.3, 0.25, 0.2, 0.25),   # both: the rest ends later than start + interval
    (0.2, 0.3, 0.05, 0.05, 0.1),   # both: start + interval ends later than the rest
])
def test_rest_after_response_is_counted_from_the_release(store, clock, latency, interval, rest, low, high):
    store.add_proxies(POOL, URLS[:1])
    _, wait = _wait_after(store, clock, latency=latency, min_interval=interval, rest_after_response=rest)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"
    assert low < wait.wait + clock.slack and wait.wait <= high + 1e-6


@pytest.mark.parametrize(("draw", "low", "high"), [(0.0, 0.15, 0.2), (0.5, 0.35, 0.4), (0.999, 0.55, 0.6)])
def test_randomized_interval_is_drawn_within_half_to_one_and_a_half(make_store, clock, draw, low, high):
    store = make_store(random_source=lambda: draw)
    store.add_proxies(POOL, URLS[:1])
    _, wait = _wait_after(store, clock, latency=0.0, min_interval=0.4, randomize_interval=True)
    assert isinstance(wait, LeaseWait) and low < wait.wait + clock.slack and wait.wait <= high + 1e-6


def test_interval_is_not_randomized_unless_asked(make_store, clock):
    store = make_store(random_source=lambda: 0.0)
    store.add_proxies(POOL, URLS[:1])
    _, wait = _wait_after(store, clock, latency=0.0, min_interval=0.4)
    assert isinstance(wait, LeaseWait) and wait.wait + clock.slack > 0.35 and wait.wait <= 0.4


def test_each_slot_is_paced_on_its_own(store, clock):
    """With site concurrency 2 the interval applies per slot: a second slot of the same proxy is free
    while the first one paces."""
    store.add_proxies(POOL, URLS[:1])
    started = time.monotonic()
    first = lease_ok(store, concurrency=2)
    store.release(first, min_interval=0.3)
    second = lease_ok(store, concurrency=2)
    assert second.proxy_id == first.proxy_id and second.member != first.member
    wait = store.lease(POOL, "a.example", ttl=5, concurrency=2)
    slack = 0.0 if clock.controlled else time.monotonic() - started  # real time the calls took
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"
    assert wait.wait + slack > 0.25 and wait.wait <= 0.3  # the first slot


def test_session_uses_are_paced_start_to_start_with_rest(pool, clock):
    first, wait = _wait_after(pool, clock, latency=0.2, session_id="s1", min_interval=0.3)
    assert isinstance(wait, LeaseWait) and wait.reason == "session" and 0.0 < wait.wait <= 0.1 + 1e-6
    clock.sleep(wait.wait + 0.005)
    second = lease_ok(pool, session_id="s1")
    assert second.proxy_id == first.proxy_id and second.issued_at - first.issued_at >= 0.3
    clock.sleep(0.2)
    pool.release(second, min_interval=0.3, rest_after_response=0.25)
    wait = pool.lease(POOL, "a.example", ttl=5, session_id="s1")
    assert isinstance(wait, LeaseWait) and 0.2 < wait.wait <= 0.25 + 1e-6


def test_ended_session_gives_its_proxy_back_when_its_pacing_ends(store, clock):
    store.add_proxies(POOL, URLS[:1])
    session = lease_ok(store, session_id="s1")
    clock.sleep(0.2)
    store.release(session, min_interval=0.3)
    assert store.end_session(POOL, "a.example", "s1", min_interval=5.0) is True  # released: its pacing counts
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and 0.0 < wait.wait <= 0.1 + 1e-6
    clock.sleep(wait.wait + 0.005)
    in_flight = lease_ok(store, session_id="s2")
    clock.sleep(0.1)
    assert store.end_session(POOL, "a.example", "s2", min_interval=0.3) is True  # in flight: start + interval
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and 0.1 < wait.wait <= 0.2 + 1e-6
    assert in_flight.proxy_id == session.proxy_id


@pytest.mark.parametrize(("guard", "expected"), [
    ((1.0, 0.05), 0.25),   # warm: 0.2 s taken, the floor 0.05: it can have arrived 0.15 s late
    ((0.1, 0.05), 0.2),    # ... by at most the cap
    ((1.0, 0.5), 0.1),     # quicker than the floor: no shift, start + interval
    ((0.1, None), 0.3),    # cold (no floor): paced from the release, whatever the cap
    ((0.0, None), 0.3),    # the guard off: a cold pair (a new connection) is still paced from the release
    ((0.0, 0.05), 0.1),    # the guard off, warm: start + interval
    (None, 0.1),           # nothing said: start + interval
])
def test_the_arrival_guard_pushes_the_next_start_back(store, clock, guard, expected):
    """release.lua ARGV[27..28]: the slot is free at start + interval + min(cap, max(0, now - start -
    floor)), or at release + interval without a floor; the wait the next lease is told shows it."""
    store.add_proxies(POOL, URLS[:1])
    _, wait = _wait_after(store, clock, latency=0.2, min_interval=0.3, arrival_guard=guard)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"
    assert expected - 0.005 < wait.wait + clock.slack and wait.wait <= expected + 0.05 + clock.slack


def test_slots_of_one_proxy_keep_the_interval_between_their_starts(store, clock):
    """SITE_CONCURRENCY > 1: the site counts arrivals per IP, so the interval is the proxy's on the site,
    not each slot's: a lease keeps the proxy's other slots the interval after its start, and a slot that
    was in flight meanwhile is free no sooner than the proxy's latest start + the interval."""
    store.add_proxies(POOL, URLS[:1])
    first = lease_ok(store, concurrency=2)
    store.release(first, min_interval=0.3)  # the release tells the site the spacing
    clock.sleep(0.31)
    a = lease_ok(store, concurrency=2)
    wait = store.lease(POOL, "a.example", ttl=5, concurrency=2)
    assert isinstance(wait, LeaseWait) and 0.25 < wait.wait <= 0.3 + 1e-6  # not both slots at once
    clock.sleep(wait.wait + 0.005)
    b = lease_ok(store, concurrency=2)
    assert {a.member, b.member} == {f"{a.proxy_id}/0", f"{a.proxy_id}/1"}
    started = time.monotonic()
    store.release(a, min_interval=0.3)  # a started 0.3 s ago, but b started just now
    wait = store.lease(POOL, "a.example", ttl=5, concurrency=2)
    slack = 0.0 if clock.controlled else time.monotonic() - started
    assert isinstance(wait, LeaseWait) and 0.25 - slack < wait.wait <= 0.3 + 1e-6


@pytest.mark.parametrize(("guard", "expected"), [
    ((0.0, None), 0.3),    # cold (a new connection): it may have arrived as late as its release
    ((1.0, 0.05), 0.25),   # warm, 0.15 s late at most: 0.15 + 0.3 - 0.2
    ((0.0, 0.05), 0.1),    # the guard off, warm: the lease's start + the interval
])
def test_a_late_use_keeps_the_ips_other_slots_the_interval_after_its_arrival(store, clock, guard, expected):
    """SITE_CONCURRENCY > 1: a use that may have reached the site late (a cold pair, the guard's shift)
    keeps the IP's other slots the spacing after when it can have arrived, not after its lease: the
    zoo's site saw an IP's cold first request and its second slot's, leased 0.227 s apart, arrive
    0.196 s apart on a 0.22 s rule (one strike banned it for minutes)."""
    store.add_proxies(POOL, URLS[:1])
    started = time.monotonic()
    first = lease_ok(store, concurrency=2, spacing=0.3)
    clock.sleep(0.2)
    store.release(first, min_interval=0.3, arrival_guard=guard)
    wait = store.lease(POOL, "a.example", ttl=5, concurrency=2, spacing=0.3)
    slack = 0.0 if clock.controlled else time.monotonic() - started - 0.2
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"
    assert expected - 0.005 < wait.wait + slack and wait.wait <= expected + 0.05 + slack


def test_the_arrival_guard_paces_a_session_and_adds_to_a_learned_interval(store, clock):
    from scrapy_proxy_shard.engine.pacing import AutothrottleOptions

    pool = store
    pool.add_proxies(POOL, URLS[:1])
    _, wait = _wait_after(pool, clock, latency=0.2, session_id="s1", min_interval=0.3, arrival_guard=(1.0, 0.05))
    assert isinstance(wait, LeaseWait) and wait.reason == "session"
    assert wait.wait + clock.slack > 0.245 and wait.wait <= 0.3 + clock.slack
    at = AutothrottleOptions(True, start_interval=0.3, min_interval=0.02, max_interval=5.0)
    _, wait = _wait_after(pool, clock, latency=0.2, site="b.example", min_interval=5.0, autothrottle=at,
                          arrival_guard=(0.1, 0.05))
    assert isinstance(wait, LeaseWait) and wait.reason == "pool"  # learned 0.3 + 0.1 (the cap), not 5.0
    assert wait.wait + clock.slack > 0.195 and wait.wait <= 0.25 + clock.slack


# release.lua trusts its arguments (engine/store_lease.py checks each before the call: the checks cost
# ~5 us of Redis time per release in the script); what a script cannot hold never reaches it.
@pytest.mark.parametrize(("guard", "message"), [((float("nan"), None), "arrival guard"),
                                                ((0.1, float("inf")), "arrival floor"),
                                                ((1e12, 0.0), "arrival guard")])
def test_release_refuses_a_bad_arrival_guard_before_any_write(store, guard, message):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    with pytest.raises(ValueError, match=message):
        store.release(lease, arrival_guard=guard)
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # still held: nothing was written
    assert store.release(lease, arrival_guard=(0.1, 0.0)).status == "ok"


@pytest.mark.parametrize("rest", [float("nan"), float("inf"), 1e12])
def test_release_refuses_a_bad_rest_before_any_write(store, rest):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    with pytest.raises(ValueError, match="rest_after_response"):
        store.release(lease, rest_after_response=rest)
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # still held: nothing was written
    assert store.release(lease, min_interval=0.0).status == "ok"  # and the token was not memoised


def test_a_quarantine_outlasts_the_pacing(store, clock):
    store.add_proxies(POOL, URLS[:1])
    lease = lease_ok(store)
    result = store.release(lease, outcome="ban", reason="http_429", min_interval=0.01)
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.wait > 0.2 and result.ban_until - result.now > 0.2


def test_hold_adopts_a_named_free_slot_only(store):
    store.add_proxies(POOL, URLS[:2])
    taken = lease_ok(store)
    other = next(r.id for r in store.list_proxies(POOL) if r.id != taken.proxy_id)
    assert isinstance(store.hold(POOL, "a.example", taken.member, ttl=5), LeaseWait)
    held = store.hold(POOL, "a.example", f"{other}/0", ttl=5)
    assert isinstance(held, Lease) and held.proxy_id == other
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # nobody else gets it
    assert store.release(held).status == "ok"
    assert store.hold(POOL, "a.example", "0000000000000000/0", ttl=5) is None


def test_hold_refuses_a_learnt_slot_whose_proxy_is_quarantined_proxy_wide(store):
    """A proxy-wide quarantine is not written into every site's ready set (a lease checks it where it
    picks the proxy), so hold must check it too: a grace-period local lease must not be adopted onto
    a proxy another host quarantined for every site. A lease in flight is still adopted (it runs)."""
    store.add_proxies(POOL, URLS[:2])
    first = lease_ok(store)
    store.release(first)  # the site has learnt both proxies; this slot is free
    store.ban(POOL, first.proxy_id, reason="dead")
    answer = store.hold(POOL, "a.example", first.member, ttl=5)
    assert isinstance(answer, LeaseWait) and answer.wait > 0.2  # the quarantine's length (FAST_BANS: 0.3 s)
    held = store.hold(POOL, "a.example", first.member, ttl=5, in_flight=True)
    assert isinstance(held, Lease)
    assert store.release(held).status == "ok"
    assert lease_ok(store).proxy_id != first.proxy_id  # the quarantine still holds for leases


def test_hold_in_flight_adopts_a_resting_slot_and_keeps_its_rest(store, clock):
    """A local lease whose request already runs is adopted even while Redis says its slot rests
    (paced, or quarantined on the site): refused, the request ran on and Redis handed the slot out
    again once the rest ended. Adopting it shortens no rest."""
    store.add_proxies(POOL, URLS[:1])
    paced = lease_ok(store)
    store.release(paced, min_interval=0.3)
    assert isinstance(store.hold(POOL, "a.example", paced.member, ttl=5), LeaseWait)  # not in flight: refused
    held = store.hold(POOL, "a.example", paced.member, ttl=5, in_flight=True)
    assert isinstance(held, Lease) and held.member == paced.member
    clock.sleep(0.35)  # the pacing is over, the adopted request is not
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert store.release(held).status == "ok"
    assert lease_ok(store).member == paced.member
    banned = lease_ok(store, "b.example")
    assert store.release(banned, outcome="ban", reason="http_403").ban_until
    held = store.hold(POOL, "b.example", banned.member, ttl=5, in_flight=True)
    assert isinstance(held, Lease)
    assert store.release(held).status == "ok"  # released early: the slot still waits for the quarantine
    assert isinstance(store.lease(POOL, "b.example", ttl=5), LeaseWait)


def test_hold_in_flight_refuses_a_slot_another_lease_holds_and_keeps_it_for_its_ttl(store, clock):
    """Another live lease holds the slot (the overlap happened during the outage): BUSY, and the slot
    is kept from everyone else until the lease in flight runs out, even if that other lease expires."""
    store.add_proxies(POOL, URLS[:1])
    other = lease_ok(store, ttl=0.2)
    answer = store.hold(POOL, "a.example", other.member, ttl=5, in_flight=True)
    assert isinstance(answer, LeaseWait) and answer.reason == "held" and answer.wait <= 0.2
    clock.sleep(0.3)  # the other lease ran out unreleased; the request in flight still runs
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.wait > 4.0
    assert store.hold(POOL, "a.example", "0000000000000000/0", ttl=5, in_flight=True) is None


def test_an_overlap_floor_outlasts_the_redis_holders_early_release(store, clock):
    """The GT push above is undone by a plain release's ZADD: the Redis holder's request ended first,
    its release readied the slot at its own pacing, and Redis handed the slot out while the local
    lease still ran (a second overlap). The floor hold leaves beside the record keeps it, and each way
    of freeing a held slot honours it: a release, a session's end, and a session's rebind."""
    store.add_proxies(POOL, URLS[:1])
    other = lease_ok(store)
    assert isinstance(store.hold(POOL, "a.example", other.member, ttl=2, in_flight=True), LeaseWait)
    assert store.release(other).status == "ok"  # no pacing: free at once, but for the floor
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and 1.5 < wait.wait <= 2.0
    clock.sleep(2.05)  # the local lease's TTL is over
    assert store.release(lease_ok(store)).status == "ok"  # the floor went with the record
    assert isinstance(store.lease(POOL, "a.example", ttl=5), Lease)

    session = lease_ok(store, "b.example", session_id="s1")
    assert isinstance(store.hold(POOL, "b.example", session.member, ttl=2, in_flight=True), LeaseWait)
    assert store.end_session(POOL, "b.example", "s1") is True
    wait = store.lease(POOL, "b.example", ttl=5)
    assert isinstance(wait, LeaseWait) and 1.5 < wait.wait <= 2.0

    bound = lease_ok(store, "c.example", session_id="s2")
    store.release(bound, session_ttl=60)
    assert isinstance(store.hold(POOL, "c.example", bound.member, ttl=2, in_flight=True), LeaseWait)
    store.ban(POOL, bound.proxy_id, site="c.example", reason="http_403", ttl=0.5)
    answer = store.lease(POOL, "c.example", ttl=5, session_id="s2")  # rebinds: frees its old slot
    assert isinstance(answer, LeaseWait) and 1.0 < answer.wait <= 2.0


def test_an_overlap_floor_ends_when_the_overlapping_leases_end_not_at_their_ttl(store, clock):
    """After an outage, a slot that overlapped stayed kept for the local lease's whole TTL (60 s in a
    crawl) though its request took 0.3 s: lift (the local lease ended) ends its part of the floor. Both
    orders of the two releases; two local leases on one slot keep the floor until both ended."""
    store.add_proxies(POOL, URLS[:1])
    other = lease_ok(store)  # the Redis holder releases first, then the local lease ends
    assert isinstance(store.hold(POOL, "a.example", other.member, ttl=30, in_flight=True, token="l1"), LeaseWait)
    assert store.release(other).status == "ok"
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # the floor holds while it runs
    store.lift(POOL, "a.example", other.member, "l1", gap=0.2)
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.wait <= 0.2  # its own pacing, not 30 s
    clock.sleep(0.25)
    second = lease_ok(store)  # the local lease ends first, then the Redis holder releases
    assert isinstance(store.hold(POOL, "a.example", second.member, ttl=30, in_flight=True, token="l2"), LeaseWait)
    store.lift(POOL, "a.example", second.member, "l2")
    assert store.release(second).status == "ok"
    third = lease_ok(store)  # two local leases overlapped the same slot: the floor waits for both
    for token in ("l3", "l4"):
        assert isinstance(store.hold(POOL, "a.example", third.member, ttl=30, in_flight=True, token=token), LeaseWait)
    assert store.release(third).status == "ok"
    store.lift(POOL, "a.example", third.member, "l3")
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and wait.wait > 25
    store.lift(POOL, "a.example", third.member, "l4")
    assert isinstance(store.lease(POOL, "a.example", ttl=5), Lease)


def test_an_overlap_floor_outlasts_a_sticky_session_that_lapses(store, clock):
    """The live record hold meets may be a sticky session's: the session's own release and its next
    use set the slot's score to now + session TTL. If the session then lapses (no end, no rebind)
    before the floor, nobody else may get the slot either (found in review)."""
    store.add_proxies(POOL, URLS[:1])
    bound = lease_ok(store, "a.example", session_id="s1", session_ttl=1)
    assert isinstance(store.hold(POOL, "a.example", bound.member, ttl=3, in_flight=True), LeaseWait)
    store.release(bound, session_ttl=1)
    clock.sleep(1.2)  # the session lapsed; the local lease in flight has about 1.8 s left
    wait = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(wait, LeaseWait) and 1.0 < wait.wait <= 1.8

    bound = lease_ok(store, "b.example", session_id="s2", session_ttl=1)
    store.release(bound, session_ttl=1)
    assert isinstance(store.hold(POOL, "b.example", bound.member, ttl=3, in_flight=True), LeaseWait)
    again = lease_ok(store, "b.example", ttl=1, session_id="s2", session_ttl=1)  # the session's next use
    assert again.member == bound.member
    clock.sleep(1.2)  # that use and the session lapse unreleased
    wait = store.lease(POOL, "b.example", ttl=5)
    assert isinstance(wait, LeaseWait) and 1.0 < wait.wait <= 1.8


def test_hold_checks_its_in_flight_flag_before_writing(store, backend):
    from scrapy_proxy_shard.engine.keyset import script_keys
    from scrapy_proxy_shard.engine.scripts import register_all

    store.add_proxies(POOL, URLS[:1])
    member = f"{store.list_proxies(POOL)[0].id}/0"
    names = script_keys("hold", store.prefix(POOL), "a.example", token="t1")
    args = ["a.example", member, 1, 5000, "t1", "host-a", 3600000, "2"]
    import redis

    with pytest.raises(redis.ResponseError, match="in flight flag"):
        register_all(backend)["hold"](keys=names, args=args)
    assert not backend.exists("{t:main}:site:a.example")  # nothing written
    args[-1] = "1"
    assert register_all(backend)["hold"](keys=names, args=args)[0] == "OK"
    assert backend.exists("{t:main}:site:a.example")


def test_a_large_pool_is_built_per_site_in_pages_yet_every_proxy_is_leasable(store, backend):
    """The first lease on a site must not scan the whole pool in one call (that blocks Redis for
    seconds at a million proxies); the build advances a page per call and misses nobody."""
    urls = [f"http://10.{i // 250}.{i % 250}.9:8080" for i in range(2300)]
    store.add_proxies(POOL, urls)
    first = lease_ok(store, "big.example")
    assert int(backend.zcard("{t:main}:ready:big.example")) < 2300  # built in pages, not at once
    seen = {first.proxy_id}
    while isinstance(result := store.lease(POOL, "big.example", ttl=30), Lease):
        seen.add(result.proxy_id)
    assert len(seen) == 2300 and result.reason == "held"
    assert store.pool_status(POOL, "big.example").slots == 2300


def test_releases_write_no_wake_up_when_nobody_waits(store, backend):
    store.add_proxies(POOL, URLS[:1])
    store.release(lease_ok(store))
    assert not backend.exists("{t:main}:freed:a.example")


def test_a_resent_release_answers_its_first_reply_and_records_once(store, clock):
    """A release sent again with the same token (a client retry) answers its first reply and records
    nothing more, whatever that reply was: ok, expired (the held record is still there, expired: it
    must not read as a release that never ran), or a ban with its quarantine fields; sticky too."""
    store.add_proxies(POOL, URLS[:2])
    lease = lease_ok(store)
    first = store.release(lease, min_interval=0.0, latency=0.05)
    assert first.status == "ok" and store.release(lease, min_interval=0.0, latency=0.05) == first
    short = lease_ok(store, ttl=0.05)
    clock.sleep(0.2)
    first = store.release(short, outcome="error")
    assert first.status == "expired" and store.release(short, outcome="error") == first
    banned = lease_ok(store)
    first = store.release(banned, outcome="ban", reason="http_403")
    assert first.ban_until and store.release(banned, outcome="ban", reason="http_403") == first
    sticky = lease_ok(store, session_id="s1", session_ttl=60)
    first = store.release(sticky, min_interval=0.0)
    assert first.status == "ok" and store.release(sticky, min_interval=0.0) == first
    counters, site = store.counters(POOL), store.site_counters(POOL)["a.example"]
    assert counters["expired"] == 1 and counters["q_started"] == 1
    assert site["ok"] == 2 and site["err"] == 1 and site["banned"] == 1
