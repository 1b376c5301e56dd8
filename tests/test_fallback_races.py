"""Races of the fallback store around Redis coming back (they made the end-to-end outage crawl flaky
under load): a lease released while it is being adopted, and a host noticing Redis too late."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, LeaseWait, PoolStore
from scrapy_proxy_shard.modes import fallback
from scrapy_proxy_shard.modes.fallback import FallbackPoolStore
from scrapy_proxy_shard.settings import ShardSettings

PROXIES = [f"http://10.9.0.{i}:3128" for i in range(1, 7)]


def _store(url: str, grace: float, stats: object = None) -> FallbackPoolStore:
    settings = ShardSettings.from_settings({
        "PROXY_SHARD_REDIS_URL": url, "PROXY_SHARD_HOST_ID": "host-a", "PROXY_SHARD_HOSTS": ["host-a"],
        "PROXY_SHARD_FALLBACK_GRACE": grace, "PROXY_SHARD_FALLBACK_WARMUP": 0, "PROXY_SHARD_PROXIES": PROXIES,
        "PROXY_SHARD_REDIS_PARAMS": {"socket_connect_timeout": 1},
    })
    client = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    return FallbackPoolStore(AsyncPoolStore(client, host_id="host-a", url_for_errors=url), settings, stats=stats)


def test_a_lease_released_while_it_is_being_adopted_is_not_left_held_in_redis(redis_binary):
    """The probe adopts local leases one by one (a round trip each); a request ending meanwhile
    released only its local lease, and the Redis lease adopted a moment later was held by nobody
    until its TTL ran out."""
    server = RedisServer(binary=redis_binary.path).start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES)

        async def scenario() -> int:
            store = _store(server.url, grace=30)
            await store.release(await store.lease("default", "a.example", ttl=30))  # takes the snapshot
            server.kill()
            first = await store.lease("default", "a.example", ttl=30)
            second = await store.lease("default", "a.example", ttl=30)
            assert store.state == "fallback" and isinstance(second, Lease)
            adopting = asyncio.Event()
            real_hold = store.primary.hold

            async def slow_hold(*args, **kwargs):  # a loaded machine: the round trip takes a while
                adopting.set()
                await asyncio.sleep(0.3)
                return await real_hold(*args, **kwargs)

            store.primary.hold = slow_hold
            server.start()  # empty, same port
            await asyncio.wait_for(adopting.wait(), 15)
            await store.release(first)  # both requests end while the first is being adopted
            await store.release(second)
            while store.state == "fallback":
                await asyncio.sleep(0.05)
            admin = PoolStore(redis.Redis.from_url(server.url, decode_responses=True))
            held = admin.pool_status("default", "a.example").held
            await store.aclose()
            return held

        assert asyncio.run(scenario()) == 0
    finally:
        server.stop()


def test_a_host_in_fallback_probes_at_least_twice_per_grace_period(monkeypatch):
    """The first host to see Redis back uses it alone once its grace is over: a host still waiting
    out a 4 s probe back-off (0.5 s doubling to 5 s) then shares its slice's proxies with it."""
    nowhere = RedisServer()  # never started: nothing listens on its port
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(delay, *args, **kwargs):
        pauses.append(delay)
        return await real_sleep(0, *args, **kwargs)  # fast-forward: only the schedule matters

    async def scenario() -> None:
        store = _store(nowhere.url, grace=2)
        monkeypatch.setattr(fallback.asyncio, "sleep", recorded_sleep)
        await store.start_offline(ConnectionError("down at start"))
        while len(pauses) < 8:
            await real_sleep(0.01)
        monkeypatch.undo()
        await store.aclose()

    asyncio.run(scenario())
    assert pauses and max(pauses) <= 2 / 2, pauses


def _silent_store(url: str, after: float) -> FallbackPoolStore:
    settings = ShardSettings.from_settings({
        "PROXY_SHARD_REDIS_URL": url, "PROXY_SHARD_HOST_ID": "host-a", "PROXY_SHARD_HOSTS": ["host-a"],
        "PROXY_SHARD_FALLBACK_AFTER": after, "PROXY_SHARD_FALLBACK_WARMUP": 0,
    })
    client = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_timeout=0.3,
                                          retry=Retry(NoBackoff(), 0))
    return FallbackPoolStore(AsyncPoolStore(client, host_id="host-a", url_for_errors=url), settings)


def test_a_stalled_redis_is_waited_out_not_fallen_back_from(redis_binary):
    """A stall times out only the calls in flight: hosts that sent nothing keep using Redis after it.
    A host that fell back at once would use its slice locally while they lease the same proxies, so a
    timeout makes requests wait until PROXY_SHARD_FALLBACK_AFTER; with 0 the host falls back at once.
    Lease calls lost in the stall are settled when Redis answers again, concurrent callers included."""
    server = RedisServer(binary=redis_binary.path).start()
    try:
        admin = PoolStore(redis.Redis.from_url(server.url, decode_responses=True))
        admin.add_proxies("default", PROXIES[:2])

        async def scenario(after: float) -> tuple[list, str]:
            store = _silent_store(server.url, after)
            await store.release(await store.lease("default", "a.example", ttl=30))  # snapshot taken
            sleeper = redis.asyncio.Redis.from_url(server.url)
            stall = asyncio.ensure_future(sleeper.execute_command("DEBUG", "SLEEP", 1.2))
            await asyncio.sleep(0.05)
            answers = await asyncio.gather(*(store.lease("default", "a.example", ttl=30) for _ in range(2)))
            state = store.state
            await stall
            await sleeper.aclose()
            if state == "redis":  # Redis answers again: both lost lease calls are settled, once each
                await store.pool_size("default")
                await asyncio.gather(store.ping(), store.ping())
            await store.aclose()
            return answers, state

        answers, state = asyncio.run(scenario(after=30))
        assert state == "redis" and all(isinstance(a, LeaseWait) for a in answers)
        assert admin.pool_status("default", "a.example").held == 0  # nothing left held for nobody
        answers, state = asyncio.run(scenario(after=0))
        assert state == "fallback" and any(isinstance(a, Lease) for a in answers)
    finally:
        server.stop()


class _Stats:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def inc_value(self, key: str, count: float = 1) -> None:
        self.values[key] = self.values.get(key, 0) + count


async def _into_fallback(store: FallbackPoolStore, server: RedisServer) -> None:
    """Snapshot taken from Redis, then Redis killed and the store switched to its local slice."""
    await store.release(await store.lease("default", "a.example", ttl=30))  # takes the snapshot
    server.kill()
    entered = await store.lease("default", "a.example", ttl=30)
    assert store.state == "fallback" and isinstance(entered, Lease)
    await store.release(entered)


async def _until_grace(store: FallbackPoolStore) -> None:
    for _ in range(300):
        if store.state != "fallback":
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the probe never reconciled")


def test_a_lease_taken_while_the_probe_reconciles_is_adopted_before_grace(redis_binary):
    """The probe adopts the local leases in flight one round trip at a time while the store still says
    "fallback", so requests keep getting local leases meanwhile. One taken after the probe listed the
    leases to adopt was never adopted: once this host left its grace, Redis did not know that slot was
    in flight and handed it out again (CI's fault test saw a host overlap itself)."""
    server = RedisServer(binary=redis_binary.path).start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES[:2])

        async def scenario() -> tuple[list, dict]:
            stats = _Stats()
            store = _store(server.url, grace=30, stats=stats)
            await _into_fallback(store, server)
            first = await store.lease("default", "a.example", ttl=30)
            assert isinstance(first, Lease)
            adopting, go_on = asyncio.Event(), asyncio.Event()
            real_hold = store.primary.hold

            async def slow_hold(*args, **kwargs):  # the adoption round trip takes a while (a loaded machine)
                adopting.set()
                await go_on.wait()
                return await real_hold(*args, **kwargs)

            store.primary.hold = slow_hold
            server.start()  # empty, same port
            await asyncio.wait_for(adopting.wait(), 15)
            second = await store.lease("default", "a.example", ttl=30)  # mid-reconcile: still local
            assert isinstance(second, Lease) and store.state == "fallback"
            go_on.set()
            await _until_grace(store)
            other = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), host_id="host-b")
            answers = [other.lease("default", "a.example", ttl=30) for _ in range(2)]  # both slots in flight
            await store.release(first)
            await store.release(second)
            await store.aclose()
            return answers, stats.values

        answers, values = asyncio.run(scenario())
        assert all(isinstance(a, LeaseWait) for a in answers), f"Redis handed out a slot in flight: {answers}"
        assert values.get("proxy_shard/fallback/leases_adopted") == 2, values
    finally:
        server.stop()


def test_a_lease_in_flight_is_adopted_even_if_its_slot_came_back_resting(redis_binary):
    """Another host reloads the lost pool first, its proxies resting PROXY_SHARD_FALLBACK_WARMUP (a
    proxy-wide quarantine): hold.lua refused to adopt this host's local lease in flight (counted
    leases_not_adopted), the request ran on, and once the rest ended Redis handed its slot out again."""
    server = RedisServer(binary=redis_binary.path).start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES[:1])

        async def scenario() -> tuple[object, object, dict]:
            stats = _Stats()
            store = _store(server.url, grace=30, stats=stats)
            await _into_fallback(store, server)
            in_flight = await store.lease("default", "a.example", ttl=30)
            assert isinstance(in_flight, Lease)
            other = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), host_id="host-b")
            real_ping = store.primary.ping

            async def ping_after_another_host_restored():  # the other host saw Redis back first
                answer = await real_ping()
                other.restore_pool("default", PROXIES[:1], warmup=0.5)  # as its runtime does
                return answer

            store.primary.ping = ping_after_another_host_restored
            server.start()  # empty, same port
            await _until_grace(store)
            while isinstance(rest := other.lease("default", "b.example", ttl=1), LeaseWait):
                await asyncio.sleep(rest.wait)  # the rest is proxy-wide: over when another site gets it
            other.release(rest)
            answer = other.lease("default", "a.example", ttl=30)  # the rest is over, the request is not
            await store.release(in_flight)
            after = other.lease("default", "a.example", ttl=30)  # released: the slot is Redis's again
            await store.aclose()
            return answer, after, stats.values

        answer, after, values = asyncio.run(scenario())
        assert isinstance(answer, LeaseWait), f"Redis handed out a slot in flight: {answer}"
        assert isinstance(after, Lease)
        assert values.get("proxy_shard/fallback/leases_adopted") == 1, values
        assert "proxy_shard/fallback/leases_not_adopted" not in values
    finally:
        server.stop()


def test_a_local_lease_that_ends_its_call_after_the_grace_is_adopted_or_given_back(redis_binary):
    """A lease call of the grace period awaits the local engine; meanwhile another call finds the
    grace over and switches the host to Redis. The first call's local lease was then handed to its
    request unadopted (only state "grace" adopted), and Redis handed the same slot to the next lease
    of this very host: two requests through one IP on one site, both from this host."""
    server = RedisServer(binary=redis_binary.path).start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES[:1])

        async def scenario() -> tuple[object, object]:
            store = _store(server.url, grace=30)
            await _into_fallback(store, server)
            server.start()  # empty, same port
            await _until_grace(store)
            assert store.state == "grace"
            asking, go_on = asyncio.Event(), asyncio.Event()
            real_lease = store.local.lease

            async def slow_local_lease(*args, **kwargs):  # the local engine answers late (a busy loop)
                asking.set()
                await go_on.wait()
                return await real_lease(*args, **kwargs)

            store.local.lease = slow_local_lease
            late = asyncio.ensure_future(store.lease("default", "a.example", ttl=30))
            await asyncio.wait_for(asking.wait(), 5)
            store._grace_until = store.clock()  # the grace ends while that call waits
            store.local.lease = real_lease
            from_redis = await store.lease("default", "a.example", ttl=30)  # switches to Redis
            assert store.state == "redis" and isinstance(from_redis, Lease)
            go_on.set()
            answer = await late
            if isinstance(answer, Lease):
                await store.release(answer)
            await store.release(from_redis)
            await store.aclose()
            return answer, from_redis

        answer, from_redis = asyncio.run(scenario())
        assert not (isinstance(answer, Lease) and answer.member == from_redis.member), \
            f"one slot handed to two requests: {answer} (local) and {from_redis} (Redis)"
    finally:
        server.stop()


def test_a_slot_that_overlapped_is_free_once_both_requests_ended_not_a_lease_ttl_later(redis_binary):
    """Another host leased this host's local slot from the restarted Redis before the probe adopted it
    (an overlap of the outage: /leases_overlapped). Redis kept the slot from everyone for the local
    lease's whole TTL (60 s in a crawl) though both requests ended at once: throughput halved for a
    minute after the outage. The local lease's release now ends its floor (lift.lua)."""
    server = RedisServer(binary=redis_binary.path).start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", PROXIES[:1])

        async def scenario() -> tuple[object, dict]:
            stats = _Stats()
            store = _store(server.url, grace=30, stats=stats)
            await _into_fallback(store, server)
            in_flight = await store.lease("default", "a.example", ttl=30)
            assert isinstance(in_flight, Lease)
            other = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), host_id="host-b")
            real_ping = store.primary.ping
            theirs = []

            async def ping_after_another_host_leased():  # the other host saw Redis back first and leased
                answer = await real_ping()
                if not theirs:
                    other.restore_pool("default", PROXIES[:1])
                    theirs.append(other.lease("default", "a.example", ttl=30))
                return answer

            store.primary.ping = ping_after_another_host_leased
            server.start()  # empty, same port
            await _until_grace(store)
            assert isinstance(theirs[0], Lease) and theirs[0].member == in_flight.member
            other.release(theirs[0])  # both requests end
            await store.release(in_flight, min_interval=0.2)
            await asyncio.sleep(0.25)
            after = other.lease("default", "a.example", ttl=30)
            await store.aclose()
            return after, stats.values

        after, values = asyncio.run(scenario())
        assert values.get("proxy_shard/fallback/leases_overlapped") == 1, values
        assert isinstance(after, Lease), f"the slot stays kept after both requests ended: {after}"
    finally:
        server.stop()
