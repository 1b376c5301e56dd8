"""Issue 10, engine items: per-site state follows use (an idle site costs nothing), no call costs
sites x proxies (sites learn added and removed proxies at their next lease, proxy-wide quarantines
are checked where a lease meets them), and pools written by the previous layout migrate in place.

Real redis-server where Redis's own accounting is read (INFO commandstats, key expiry); the
functional parts run on every contract backend.
"""

from __future__ import annotations

import time

import pytest

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.proxies import make_proxy
from scrapy_proxy_shard.engine.store import Lease, LeaseWait, PoolStore
from scrapy_proxy_shard.exceptions import UnknownPoolError

POOL = "main"


def urls(n: int, start: int = 0) -> list[str]:
    return [f"http://10.1.{(i // 250) % 250}.{i % 250 + 1}:8000" for i in range(start, start + n)]


def leased(result) -> Lease:
    assert isinstance(result, Lease), result
    return result


def prefix() -> str:
    return schema.pool_prefix("t", POOL)


def zadd_calls(client) -> int:
    return int(client.info("commandstats").get("cmdstat_zadd", {}).get("calls", 0))


def site_keys(client, site: str) -> list[str]:
    return [k for k in (f"{prefix()}:{schema.READY}:{site}", f"{prefix()}:{schema.SITE}:{site}") if client.exists(k)]


# --- no call scales with sites x proxies -------------------------------------------------------------

def test_adding_and_removing_a_proxy_costs_the_same_with_many_sites(real_redis):
    store = PoolStore(real_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, urls(20))
    for i in range(300):
        store.release(leased(store.lease(POOL, f"s{i}.example", ttl=5)))
    before = zadd_calls(real_redis)
    store.add_proxies(POOL, urls(1, start=20))
    store.remove_proxies(POOL, urls(1, start=3))
    store.ban(POOL, make_proxy(urls(1, start=5)[0]).id, reason="dead")  # proxy-wide
    # One ZADD for the new proxy's add number and one for the ban index, whatever the number of
    # sites (the previous layout wrote every site's ZSET: 300 x 3 ZADDs here).
    assert zadd_calls(real_redis) - before == 2


def test_adding_and_removing_many_proxies_is_paged(real_redis):
    """Add and remove send at most ADMIN_PAGE proxies per script call, so draining a big list never
    blocks Redis for one long call (removing 10,000 in one call took 44-82 ms)."""
    store = PoolStore(real_redis, namespace="t", host_id="h")

    def script_calls() -> int:
        stats = real_redis.info("commandstats")
        return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))

    store.add_proxies(POOL, urls(1, start=5000))  # the scripts are loaded (a first EVALSHA answers NOSCRIPT)
    store.remove_proxies(POOL, urls(1, start=5000))
    before = script_calls()
    assert store.add_proxies(POOL, urls(1200)).added == 1200
    assert script_calls() - before == 3
    before = script_calls()
    assert store.remove_proxies(POOL, urls(1200)) == 1200
    assert script_calls() - before == 3


def test_sites_learn_added_and_forget_removed_proxies_at_their_next_lease(store):
    store.add_proxies(POOL, urls(2))
    sites = [f"s{i}.example" for i in range(5)]
    for site in sites:
        store.release(leased(store.lease(POOL, site, ttl=5)), min_interval=60)
        store.release(leased(store.lease(POOL, site, ttl=5)), min_interval=60)
    new = make_proxy(urls(1, start=2)[0]).id
    store.add_proxies(POOL, urls(1, start=2))
    for site in sites:  # both old proxies rest 60 s: only the new one can be free
        assert leased(store.lease(POOL, site, ttl=5)).proxy_id == new
    store.remove_proxies(POOL, urls(1, start=2))
    for site in sites:
        assert isinstance(store.lease(POOL, site, ttl=5), LeaseWait)


def test_a_proxy_wide_quarantine_reaches_sites_without_a_loop_over_them(store):
    store.add_proxies(POOL, urls(2))
    ids = [make_proxy(u).id for u in urls(2)]
    for i in range(4):
        store.release(leased(store.lease(POOL, f"s{i}.example", ttl=5)), min_interval=0)
    store.ban(POOL, ids[0], reason="dead", ttl=60)
    for i in range(4):
        got = [leased(store.lease(POOL, f"s{i}.example", ttl=5)).proxy_id]
        assert got == [ids[1]]
        assert isinstance(store.lease(POOL, f"s{i}.example", ttl=5), LeaseWait)  # never the banned one


def test_a_site_learns_a_big_pool_a_page_per_lease(store):
    store.add_proxies(POOL, urls(600))
    first = leased(store.lease(POOL, "big.example", ttl=5))
    ready = store.pool_status(POOL, "big.example")
    assert ready.slots < 600  # one page learnt, not the whole pool
    store.release(first)
    for _ in range(25):  # a page (32 slots) per lease: 19 leases learn 600
        store.release(leased(store.lease(POOL, "big.example", ttl=5)))
    assert store.pool_status(POOL, "big.example").slots == 600


# --- an idle site costs nothing ----------------------------------------------------------------------

def test_an_idle_site_expires_and_comes_back_with_its_quarantines(real_redis):
    store = PoolStore(real_redis, namespace="t", host_id="h", site_idle_ttl=1.0)
    store.add_proxies(POOL, urls(3))
    baseline = set(real_redis.keys("*"))
    lease = leased(store.lease(POOL, "idle.example", ttl=0.5))
    banned = lease.proxy_id
    store.release(lease, outcome="ban", ban_ttl=120)
    assert site_keys(real_redis, "idle.example")
    assert "idle.example" in store.sites(POOL)
    time.sleep(2.2)  # hold 0.5 s + idle 1 s, with margin for Redis's expiry
    assert site_keys(real_redis, "idle.example") == []
    assert "idle.example" not in store.sites(POOL)
    assert store.pool_status(POOL, "idle.example") is None
    left = set(real_redis.keys("*")) - baseline
    kept = (":bans", ":banidx", "stats", ":counters", ":done:", ":siteidx")  # quarantines, counters, memos
    assert [k for k in left if not any(part in k for part in kept)] == []
    # The site comes back on its next lease, and its running quarantine still holds.
    got = {leased(store.lease(POOL, "idle.example", ttl=5)).proxy_id for _ in range(2)}
    assert banned not in got and len(got) == 2


def test_a_site_state_outlives_every_hold_of_its_slots(real_redis):
    """Held records live in the site's hash (declared keys only), so the site's state must not expire
    while a slot is held: a lease or a sticky session's release keeps it alive through the hold."""
    store = PoolStore(real_redis, namespace="t", host_id="h", site_idle_ttl=1.0)
    store.add_proxies(POOL, urls(2))
    plain = leased(store.lease(POOL, "a.example", ttl=30))
    for key in site_keys(real_redis, "a.example"):
        assert real_redis.pttl(key) > 30_000
    sticky = leased(store.lease(POOL, "b.example", ttl=5, session_id="s", session_ttl=60))
    store.release(sticky, min_interval=0, session_ttl=120)  # the session's slot is held 120 s from now
    keys = site_keys(real_redis, "b.example")
    assert len(keys) == 2 and all(real_redis.pttl(key) > 120_000 for key in keys)
    assert real_redis.hget(keys[1], sticky.member).endswith("|s")  # the record names its session
    # A proxy removed and added again while held: the site learns it back, and waits for the hold.
    store.remove_proxies(POOL, [plain.proxy_id])
    store.release(leased(store.lease(POOL, "a.example", ttl=5)), min_interval=60)
    store.add_proxies(POOL, urls(2)[:1] if make_proxy(urls(2)[0]).id == plain.proxy_id else urls(2)[1:])
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert store.release(plain, min_interval=0).status == "ok"
    assert leased(store.lease(POOL, "a.example", ttl=5)).proxy_id == plain.proxy_id
    again = leased(store.lease(POOL, "b.example", ttl=5, session_id="s", session_ttl=60))
    assert again.proxy_id == sticky.proxy_id and not again.rebound


# --- pools written by the previous layout --------------------------------------------------------------

def _write_previous_layout(client, store: PoolStore, n_sites: int) -> None:
    """Turn a new-layout pool into what the previous version wrote: P:sites/P:sitebuild hashes, no
    P:order, no add numbers, no P:site hashes, ready ZSETs without expiry."""
    p = prefix()
    for i in range(n_sites):
        site = f"old{i}.example"
        client.hset(f"{p}:sites", site, 1)
        # Held slots were keys of their own then: "P:lease:<site>:<member>" -> "token|host|issued|session".
        for member, record in client.hgetall(f"{p}:{schema.SITE}:{site}").items():
            if "/" in member:
                token, host, issued, expires, sid = record.split("|", 4)
                client.set(f"{p}:lease:{site}:{member}", f"{token}|{host}|{issued}|{sid}",
                           px=int(expires) - int(issued))
        client.delete(f"{p}:{schema.SITE}:{site}")
        client.persist(f"{p}:{schema.READY}:{site}")
    client.delete(f"{p}:{schema.ORDER}", f"{p}:{schema.SITEIDX}")
    client.hdel(f"{p}:{schema.META}", "layout", "seq")


def test_a_pool_of_the_previous_layout_migrates_in_place(real_redis):
    store = PoolStore(real_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, urls(1200))
    held = leased(store.lease(POOL, "old0.example", ttl=60))
    for i in range(1, 30):
        store.release(leased(store.lease(POOL, f"old{i}.example", ttl=5)))
    _write_previous_layout(real_redis, store, 30)
    p = prefix()
    got = []
    for _ in range(50):
        result = store.lease(POOL, "old0.example", ttl=60)
        if isinstance(result, Lease):
            got.append(result)
            if len(got) == 3:
                break
        else:
            assert result.reason == "pool"
    assert len(got) == 3 and held.proxy_id not in {g.proxy_id for g in got}
    assert real_redis.hget(f"{p}:{schema.META}", "layout") == schema.LAYOUT
    assert not real_redis.exists(f"{p}:sites")
    assert real_redis.zcard(f"{p}:{schema.ORDER}") == 1200
    assert real_redis.pttl(f"{p}:{schema.READY}:old7.example") > 0  # old sites now expire when idle
    assert "old7.example" in store.sites(POOL)
    # A lease the old version recorded in a key of its own (P:lease:<site>:<member>) is not seen by
    # this version: its release answers "expired", and its slot stayed held by its ready score.
    assert store.release(held).status == "expired"


@pytest.mark.parametrize("n", [0, 1])
def test_a_lost_pool_is_not_marked_as_migrated(real_redis, n):
    """A lease on a pool Redis lost must not create P:meta: add.lua's restore keys on its absence."""
    store = PoolStore(real_redis, namespace="t", host_id="h")
    if n:
        store.add_proxies(POOL, urls(n))
        real_redis.flushall()
    with pytest.raises(UnknownPoolError):
        store.lease(POOL, "a.example", ttl=5)
    assert not real_redis.exists(f"{prefix()}:{schema.META}")
    assert store.restore_pool(POOL, urls(2)) == 2
