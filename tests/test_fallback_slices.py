"""Fallback slices never overlap: the slice rule (modes/hostview.py), the order-free split, and three
fallback stores over one real Redis whose host lists were read at different moments."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis
import redis.asyncio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.engine.proxies import make_proxy, proxy_id
from scrapy_proxy_shard.engine.store import AsyncPoolStore, PoolStore
from scrapy_proxy_shard.exceptions import HostIdTaken
from scrapy_proxy_shard.modes.fallback import FallbackPoolStore
from scrapy_proxy_shard.modes.hostview import HostView, decide
from scrapy_proxy_shard.modes.sharding import assign, slice_for
from scrapy_proxy_shard.settings import ShardSettings

PROXIES = [proxy_id(f"http://10.7.{i // 250}.{i % 250}:3128") for i in range(120)]
NAMES = [f"h{i}" for i in range(8)]


# --- the split itself --------------------------------------------------------------------------------
def test_modulo_gives_the_same_split_whatever_order_the_hosts_are_listed_in():
    """Two hosts reading the same hosts in another order took overlapping modulo slices."""
    assert assign(PROXIES, ["b", "a", "c"], "modulo") == assign(PROXIES, ["a", "b", "c"], "modulo")
    assert set(slice_for(PROXIES, ["b", "a"], "a", "modulo")).isdisjoint(slice_for(PROXIES, ["a", "b"], "b", "modulo"))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), takers=st.lists(st.sampled_from(NAMES), min_size=2, max_size=5, unique=True))
def test_rendezvous_slices_are_disjoint_when_each_takers_list_holds_every_other_taker(data, takers):
    """The design's claim: X takes p iff X scores highest for p among X's list. If X's list holds Y and
    Y's holds X they cannot both take p, whatever else the lists hold (extra hosts, any order)."""
    slices = {}
    for host in takers:
        extra = data.draw(st.lists(st.sampled_from(NAMES), max_size=6), label=f"extra of {host}")
        hosts = list({*takers, *extra})
        random.Random(data.draw(st.integers(0, 9999))).shuffle(hosts)
        slices[host] = set(slice_for(PROXIES, hosts, host, "consistent"))
    for a in takers:
        for b in takers:
            assert a == b or not slices[a] & slices[b], (a, b)


def test_modulo_slices_over_differing_lists_do_overlap():
    """Why the fallback never uses modulo: a superset list moves proxies to hosts that do not know it."""
    a = set(slice_for(PROXIES, ["a", "b"], "a", "modulo"))
    b = set(slice_for(PROXIES, ["a", "b", "dead"], "b", "modulo"))
    assert a & b


# --- the rule, on a model of the Redis registry ------------------------------------------------------
class Registry:
    """host_beat.lua / host_leave.lua / host_list.lua on an integer clock (ms)."""

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self.rec: dict[str, dict] = {}  # host -> alive_until, since, read

    def beat(self, host: str, now: int) -> None:
        rec = self.rec.get(host)
        if rec is None or rec["alive_until"] <= now:
            rec = self.rec[host] = {"since": now, "read": 0}
        rec["alive_until"] = now + self.ttl

    def leave(self, host: str) -> None:
        self.rec.pop(host, None)

    def read(self, host: str, now: int) -> list[tuple[str, float, float, float]]:
        live = {h: r for h, r in self.rec.items() if r["alive_until"] > now}
        if host in live:
            live[host]["read"] = now
        return [(h, r["alive_until"], r["since"], r["read"]) for h, r in live.items()]

    def alive(self, host: str, now: int) -> bool:
        return host in self.rec and self.rec[host]["alive_until"] > now


events = st.lists(st.tuples(st.sampled_from(["beat", "read", "leave", "wait"]), st.sampled_from(NAMES[:4]),
                            st.integers(0, 30)), min_size=1, max_size=30)


@settings(max_examples=500, deadline=None)
@example(steps=[("beat", "h0", 0), ("read", "h0", 0), ("beat", "h1", 0), ("read", "h1", 0)], detect=[0] * 4, ttl=30)
@given(steps=events, detect=st.lists(st.integers(0, 20), min_size=4, max_size=4), ttl=st.integers(15, 90))
def test_hosts_that_pass_the_rule_never_share_a_proxy(steps, detect, ttl):
    """Random histories of heartbeats (joins, lapses), list reads and leaves, then Redis goes away and
    each host decides when it notices (a random delay): no proxy is in two slices."""
    registry, views, now = Registry(ttl), {}, 0
    for kind, host, dt in steps:
        now += dt if kind == "wait" else 1
        if kind == "beat":
            registry.beat(host, now)
        elif kind == "leave":  # a closing crawl (the fallback store forgets its list of that pool)
            registry.leave(host)
            views.pop(host, None)
        elif kind == "read" and host in registry.rec:  # a host reads once it has started
            views.setdefault(host, HostView()).update(now, registry.read(host, now), now, window=2 * ttl)
    slices = {}
    for i, host in enumerate(NAMES[:4]):
        if not registry.alive(host, now) and host not in views:
            continue  # never started, or left before it read anything: no fallback
        decision = decide(views.get(host), host, now + detect[i])
        if decision.hosts is not None:
            slices[host] = set(slice_for(PROXIES, decision.hosts, host, "consistent"))
    for a in slices:
        for b in slices:
            assert a == b or not slices[a] & slices[b], (a, b, steps)


def _view(rows, read_at=100.0, mono=0.0) -> HostView:
    view = HostView()
    view.update(read_at, rows, mono, window=30)
    return view


def test_the_rule_case_by_case():
    both = [("a", 130.0, 10.0, 100.0), ("b", 130.0, 20.0, 90.0)]
    assert decide(None, "a", 0).hosts is None  # no list: a host that joins during the outage waits
    assert decide(_view(both), "a", 1).hosts == ("a", "b")
    assert decide(_view(both), "b", 1).hosts == ("a", "b")  # a read at 100 > b's registration at 20
    assert decide(_view(both), "a", 31).hosts is None  # its registration had lapsed when it noticed
    assert decide(_view(both), "c", 1).hosts is None  # not in the list it read: no heartbeat yet
    late = [("a", 130.0, 10.0, 50.0), ("b", 130.0, 60.0, 100.0)]  # a last read before b registered
    assert decide(_view(late), "b", 1).hosts is None and decide(_view(late), "a", 1).hosts == ("a", "b")
    never = [("a", 130.0, 10.0, 100.0), ("b", 130.0, 60.0, 0.0)]  # b never read: it will take nothing
    assert decide(_view(never), "a", 1).hosts == ("a", "b")
    view = _view(both)
    view.update(101.0, [("a", 131.0, 10.0, 101.0)], 1.0, window=30)  # b left: kept while in the window
    assert decide(view, "a", 2).hosts == ("a", "b")


# --- three fallback stores over one real Redis ------------------------------------------------------
def _fallback_store(url: str, host: str) -> FallbackPoolStore:
    settings = ShardSettings.from_settings({
        "PROXY_SHARD_REDIS_URL": url, "PROXY_SHARD_HOST_ID": host, "PROXY_SHARD_FALLBACK_WARMUP": 0,
        "PROXY_SHARD_SNAPSHOT_INTERVAL": 0.1, "PROXY_SHARD_REDIS_PARAMS": {"socket_connect_timeout": 1},
    })
    client = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    return FallbackPoolStore(AsyncPoolStore(client, host_id=host, url_for_errors=url), settings)


@pytest.mark.parametrize("joiner", [False, True])
def test_three_hosts_that_read_the_pool_before_registering_take_disjoint_slices(redis_binary, joiner):
    """Each host's first snapshot comes at open, before its first heartbeat: it read no host, and kept
    that list until the pool size changed, so each took the whole pool when Redis went away (the
    issue's "20 proxies over 1 hosts"). A host that registers just before the outage (``joiner``)
    has not been read by the others: it waits, and the others keep their slices."""
    server = RedisServer(binary=redis_binary.path).start()
    urls = [f"http://10.8.0.{i}:3128" for i in range(1, 31)]
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", urls)

        async def scenario():
            hosts = ["host-a", "host-b", "host-c"] + (["host-late"] if joiner else [])
            stores = [_fallback_store(server.url, h) for h in hosts]
            for store in stores:
                await store.pool_size("default")  # the runtime's look at open: the first snapshot
            for store in stores[:3]:
                await store.heartbeat("default", ttl=30)
            for _ in range(3):  # a few leases each, a snapshot interval apart
                await asyncio.sleep(0.11)
                for store in stores[:3]:
                    await store.release(await store.lease("default", "a.example", ttl=30))
            if joiner:
                await asyncio.sleep(0.11)
                await stores[3].heartbeat("default", ttl=30)  # registers, reads the list: nobody read it yet
            server.kill()
            slices = {}
            for store in stores:
                await store.lease("default", "a.example", ttl=30)
                assert store.state == "fallback"
                slices[store.host_id] = {p.id for p in store._my_slice("default")}
            for store in stores:
                await store.aclose()
            return slices

        slices = asyncio.run(scenario())
    finally:
        server.stop()
    taken = [pid for mine in slices.values() for pid in mine]
    assert len(taken) == len(set(taken)), {h: len(s) for h, s in slices.items()}
    assert all(slices[h] for h in ("host-a", "host-b", "host-c")), {h: len(s) for h, s in slices.items()}
    assert len(taken) == len(urls) or joiner
    if joiner:
        assert not slices["host-late"]


def test_a_host_whose_id_was_taken_takes_no_slice():
    both = [("a", 130.0, 10.0, 100.0), ("b", 130.0, 20.0, 90.0)]
    assert decide(_view(both), "a", 1).hosts == ("a", "b")
    taken = decide(_view(both), "a", 1, taken=True)
    assert taken.hosts is None and taken.reason == "host id taken"


class _TakenPrimary:
    """The Redis side of a fallback store: its host id was taken over by another process."""

    host_id = "w1"

    def __init__(self) -> None:
        self.taken = False

    async def heartbeat(self, pool, **kwargs):
        if self.taken:
            raise HostIdTaken("w1", pool, 130.0, 100.0)
        return None


@pytest.mark.parametrize("configured", [False, True])
def test_a_fallback_store_whose_heartbeat_was_answered_taken_takes_no_slice(configured, caplog):
    settings = ShardSettings(host_id="w1", hosts=("w1", "w2") if configured else ())
    primary = _TakenPrimary()
    store = FallbackPoolStore(primary, settings)  # type: ignore[arg-type]
    store.snapshot.proxies["default"] = [make_proxy(f"http://10.9.0.{i}:3128") for i in range(1, 21)]
    store._views["default"] = _view([("w1", 130.0, 10.0, 100.0), ("w2", 130.0, 20.0, 90.0)])
    store.clock = lambda: 1.0
    assert store._my_slice("default")  # the rule holds: it would take a slice
    store._decisions.clear()

    async def beat():
        primary.taken = True
        for _ in range(2):
            with pytest.raises(HostIdTaken):
                await store.heartbeat("default", ttl=30, token="t")

    asyncio.run(beat())
    with caplog.at_level("WARNING", logger="scrapy_proxy_shard"):
        assert store._my_slice("default") == [] and store._my_slice("other") == []
    assert store._decision("default").reason == "host id taken"
    assert sum("host id taken" in r.getMessage() for r in caplog.records) == 1
