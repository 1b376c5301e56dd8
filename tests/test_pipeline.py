"""The asyncio store's pipelined script connection (``engine/pipeline.py``, ``PROXY_SHARD_REDIS_PIPELINE``).

Against a real redis-server: replies go to their own callers under 64 concurrent tasks, error replies
fail only their own call with redis-py's exception class, a connection killed with calls in flight
fails those calls (ConnectionError) and the next call connects again, a reply slower than
``socket_timeout`` fails with TimeoutError and is never handed to a later call, and a script the server
lost (SCRIPT FLUSH) is loaded again.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import fakeredis
import pytest
import redis
import redis.asyncio
import redis.asyncio.sentinel
from lease_checks import hold_and_release
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from scrapy_proxy_shard.engine.pipeline import ScriptPipeline, pipeline_for
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease
from scrapy_proxy_shard.modes.connection import async_client
from scrapy_proxy_shard.modes.factory import build_store
from scrapy_proxy_shard.settings import ShardSettings

POOL = "main"
URLS = [f"http://10.4.0.{i}:8000" for i in range(1, 9)]
#: An error reply carrying its caller's tag (a script's error_reply is a plain ResponseError).
FAIL = "return redis.error_reply('ERR failed ' .. ARGV[1])"


def _client(server, **kwargs) -> redis.asyncio.Redis:
    kwargs.setdefault("retry", Retry(NoBackoff(), 0))  # no resend: the failure itself is under test
    return redis.asyncio.Redis.from_url(server.url, decode_responses=True, **kwargs)


def _pipe(client) -> ScriptPipeline:
    pipe = pipeline_for(client)
    assert pipe is not None
    return pipe


async def _kill_mid_flight(pipe: ScriptPipeline, admin: redis.Redis, blpop_timeout: int) -> tuple[str, list]:
    """Queue a BLPOP (it holds the connection: everything pipelined behind it waits in the server) and
    ten ECHOs on ``pipe``, check none is answered yet, then kill the connection from ``admin``.
    Returns the killed connection's id and the calls (futures)."""
    conn_id = await pipe.execute(("CLIENT", "ID"))
    calls = [asyncio.ensure_future(pipe.execute(("BLPOP", "pipeline:never", blpop_timeout)))]
    calls += [asyncio.ensure_future(pipe.execute(("ECHO", f"m{i}"))) for i in range(10)]
    await asyncio.sleep(0.2)
    assert not any(call.done() for call in calls)
    await asyncio.to_thread(admin.execute_command, "CLIENT", "KILL", "ID", conn_id)
    return conn_id, calls


def _sleep_redis(url: str, seconds: float) -> threading.Thread:
    """DEBUG SLEEP from another client; returns 0.3 s after sending it (a loaded machine may take a
    while to get the command to the server: the caller's sleep must outlast that margin)."""
    other = redis.Redis.from_url(url, decode_responses=True)
    thread = threading.Thread(target=lambda: (other.execute_command("DEBUG", "SLEEP", seconds), other.close()),
                              daemon=True)
    thread.start()
    time.sleep(0.3)
    return thread


def test_replies_reach_their_callers_under_64_tasks_with_error_replies_mixed_in(redis_server):
    async def scenario() -> tuple[int, int]:
        client = _client(redis_server)
        pipe = _pipe(client)
        ok = failed = 0

        async def worker(n: int) -> None:
            nonlocal ok, failed
            rng = random.Random(n)
            for i in range(40):
                tag = f"{n}-{i}-é"
                if rng.random() < 0.3:
                    with pytest.raises(redis.ResponseError) as caught:
                        await pipe.execute(("EVAL", FAIL, 0, tag))
                    assert str(caught.value) == f"failed {tag}"
                    failed += 1
                else:
                    assert await pipe.execute(("EVAL", "return {ARGV[1], tonumber(ARGV[2]) + 1}", 0, tag, i)) \
                        == [tag, i + 1]
                    ok += 1
                if rng.random() < 0.2:
                    await asyncio.sleep(0)

        try:
            await asyncio.gather(*(worker(n) for n in range(64)))
            return ok, failed
        finally:
            await pipe.aclose()
            await client.aclose()

    ok, failed = asyncio.run(scenario())
    assert ok + failed == 64 * 40 and ok and failed


def test_a_killed_connection_fails_the_calls_in_flight_and_the_next_call_reconnects(redis_server):
    admin = redis.Redis.from_url(redis_server.url, decode_responses=True)
    admin.delete("pipeline:never")

    async def scenario() -> list:
        client = _client(redis_server)
        pipe = _pipe(client)
        try:
            conn_id, calls = await _kill_mid_flight(pipe, admin, 0)
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert await pipe.execute(("ECHO", "after")) == "after"
            assert await pipe.execute(("CLIENT", "ID")) != conn_id
            return outcomes
        finally:
            await pipe.aclose()
            await client.aclose()

    try:
        outcomes = asyncio.run(scenario())
    finally:
        admin.close()
    assert all(isinstance(o, redis.ConnectionError) for o in outcomes), outcomes


def test_the_clients_retry_policy_resends_calls_lost_with_a_killed_connection(redis_server):
    """The store's policy (one immediate resend, ``modes.connection``): the same kill costs nothing."""
    admin = redis.Redis.from_url(redis_server.url, decode_responses=True)
    settings = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": redis_server.url})

    async def scenario() -> tuple[list, bool]:
        client = async_client(settings)
        pipe = _pipe(client)
        try:
            conn_id, calls = await _kill_mid_flight(pipe, admin, 1)
            outcomes = await asyncio.gather(*calls)  # resent once on a new connection
            return outcomes, await pipe.execute(("CLIENT", "ID")) != conn_id
        finally:
            await pipe.aclose()
            await client.aclose()

    try:
        admin.delete("pipeline:never")
        assert asyncio.run(scenario()) == ([None, *(f"m{i}" for i in range(10))], True)
    finally:
        admin.close()


def test_callers_during_an_outage_share_one_connect_attempt():
    """64 callers on a port nobody listens on: one attempt (redis-py's connect, with its own retries),
    whose error each caller gets, instead of 64 attempts in a row (each up to socket_connect_timeout)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> tuple[list, int]:
        client = redis.asyncio.Redis(port=port, decode_responses=True, retry=Retry(NoBackoff(), 0))
        pipe = _pipe(client)
        attempts = 0
        connect = pipe._conn.connect

        async def counted() -> None:
            nonlocal attempts
            attempts += 1
            await connect()

        pipe._conn.connect = counted
        outcomes = await asyncio.gather(*(pipe.execute(("ECHO", "x")) for _ in range(64)), return_exceptions=True)
        again = await asyncio.gather(pipe.execute(("ECHO", "y")), return_exceptions=True)
        await pipe.aclose()
        await client.aclose()
        return outcomes + again, attempts

    outcomes, attempts = asyncio.run(scenario())
    assert all(isinstance(o, redis.ConnectionError) for o in outcomes), outcomes
    assert attempts == 2  # the 64 shared one; a later call tries again


def test_a_reply_slower_than_socket_timeout_times_out_and_is_never_handed_to_a_later_call(redis_server):
    async def scenario() -> list:
        client = _client(redis_server, socket_timeout=0.3)
        pipe = _pipe(client)
        try:
            assert await pipe.execute(("ECHO", "warm")) == "warm"
            thread = await asyncio.to_thread(_sleep_redis, redis_server.url, 2.0)
            late = await asyncio.gather(*(pipe.execute(("ECHO", f"late{i}")) for i in range(5)),
                                        return_exceptions=True)
            await asyncio.to_thread(thread.join)
            await asyncio.sleep(0.1)  # the stale replies have had time to arrive
            fresh = [await pipe.execute(("ECHO", f"fresh{i}")) for i in range(5)]
            return [late, fresh]
        finally:
            await pipe.aclose()
            await client.aclose()

    late, fresh = asyncio.run(scenario())
    assert all(isinstance(o, redis.TimeoutError) for o in late), late
    assert fresh == [f"fresh{i}" for i in range(5)]


def test_a_cancelled_call_does_not_shift_the_replies_of_the_others(redis_server):
    async def scenario() -> list:
        client = _client(redis_server)
        pipe = _pipe(client)
        try:
            calls = [asyncio.ensure_future(pipe.execute(("ECHO", f"c{i}"))) for i in range(6)]
            await asyncio.sleep(0)
            calls[2].cancel()
            done = await asyncio.gather(*calls, return_exceptions=True)
            return [*done, await pipe.execute(("ECHO", "next"))]
        finally:
            await pipe.aclose()
            await client.aclose()

    out = asyncio.run(scenario())
    assert out[:2] == ["c0", "c1"] and isinstance(out[2], asyncio.CancelledError)
    assert out[3:] == ["c3", "c4", "c5", "next"]


def test_the_store_reloads_a_script_the_server_lost_through_the_pipeline(redis_server):
    async def scenario() -> list:
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
        await client.flushall()
        # EVALSHA's reload (Functions off; a lost library: tests/test_functions.py)
        store = AsyncPoolStore(client, namespace="t", host_id="h", functions=False)
        assert store._pipe is not None
        seen: list = []
        execute = store._pipe.execute

        async def record(args):
            try:
                reply = await execute(args)
            except redis.RedisError as exc:
                seen.append(type(exc).__name__)
                raise
            seen.append(args[0])
            return reply

        store._pipe.execute = record
        try:
            await store.add_proxies(POOL, URLS)
            await client.script_flush()
            lease = await store.lease(POOL, "a.example", ttl=5)
            assert isinstance(lease, Lease)
            await client.script_flush()
            assert (await store.release(lease, outcome="ok")).status == "ok"
            return seen
        finally:
            await store.aclose()

    seen = asyncio.run(scenario())
    assert seen[-4:] == ["NoScriptError", "EVALSHA", "NoScriptError", "EVALSHA"]


def test_64_tasks_lease_and_release_through_the_pipeline(redis_server):
    async def scenario() -> tuple[int, list]:
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
        await client.flushall()
        store = AsyncPoolStore(client, namespace="t", host_id="h")
        calls = 0
        execute = store._pipe.execute

        async def count(args):
            nonlocal calls
            calls += 1
            return await execute(args)

        store._pipe.execute = count
        held: set[str] = set()
        overlaps: list = []
        try:
            await store.add_proxies(POOL, URLS)

            async def worker() -> None:
                done = 0
                while done < 10:
                    lease = await store.lease(POOL, "a.example", ttl=30, concurrency=4)
                    if not isinstance(lease, Lease):
                        await asyncio.sleep(0.001)
                        continue
                    assert (await hold_and_release(store, lease, held, overlaps)).status == "ok"
                    done += 1

            await asyncio.gather(*(worker() for _ in range(64)))
            return calls, overlaps
        finally:
            await store.aclose()

    calls, overlaps = asyncio.run(scenario())
    assert calls >= 64 * 10 * 2 and overlaps == []


def test_packing_matches_redis_py(redis_server):
    client = _client(redis_server)
    pipe = _pipe(client)
    args = ("EVALSHA", "a" * 40, 2, b"k\x00ey", "clé", 0, -17, 2**70, 1.5, "", b"")
    assert pipe.pack(args) == b"".join(client.connection_pool.make_connection().pack_command(*args))
    with pytest.raises(redis.DataError):
        pipe.pack(("ECHO", True))


def test_only_a_plain_client_gets_a_pipeline(redis_server, tmp_path):
    assert pipeline_for(redis.asyncio.Redis.from_url(redis_server.url)) is not None
    assert pipeline_for(redis.asyncio.Redis.from_url(f"unix://{tmp_path}/redis.sock")) is not None
    assert pipeline_for(fakeredis.FakeAsyncRedis()) is None
    assert pipeline_for(redis.Redis.from_url(redis_server.url)) is None  # a blocking client
    sentinel = redis.asyncio.sentinel.Sentinel([("127.0.0.1", 1)]).master_for("mymaster")
    assert pipeline_for(sentinel) is None


@pytest.mark.parametrize(("value", "fallback", "piped"), [(True, True, True), (False, True, False),
                                                          (True, False, True), (False, False, False)])
def test_the_setting_turns_the_pipeline_off(redis_server, value, fallback, piped):
    settings = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_HOST_ID": "h",
                                            "PROXY_SHARD_REDIS_PIPELINE": value, "PROXY_SHARD_FALLBACK": fallback})

    async def scenario() -> bool:
        store = build_store(settings)
        primary = store.primary if fallback else store
        try:
            await store.add_proxies(POOL, URLS)
            lease = await store.lease(POOL, "a.example", ttl=5)
            assert isinstance(lease, Lease)
            await store.release(lease)
            return primary._pipe is not None
        finally:
            await store.aclose()

    assert asyncio.run(scenario()) is piped


# --- the blocking store's direct script calls (DirectScripts) -----------------------------------------

def test_the_blocking_store_sends_scripts_directly_and_survives_a_killed_connection(redis_server):
    """PoolStore on a plain redis.Redis: lease/release never go through execute_command; a connection
    the server killed is replaced under the client's retry policy (one resend, as redis-py would), a
    script the server lost is loaded again, and error replies keep redis-py's classes."""
    from scrapy_proxy_shard.engine.pipeline import direct_scripts_for
    from scrapy_proxy_shard.engine.store import PoolStore
    from scrapy_proxy_shard.modes.connection import sync_client

    client = sync_client(ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": redis_server.url}))
    store = PoolStore(client, namespace="direct")
    assert store._direct is not None
    store.add_proxies(POOL, URLS[:2])
    generic = []
    original = client.execute_command
    client.execute_command = lambda *args, **kw: (generic.append(args[0]), original(*args, **kw))[1]
    killer = redis.Redis.from_url(redis_server.url)
    try:
        first = store.lease(POOL, "a.example", ttl=5)
        assert isinstance(first, Lease)
        killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert store.release(first).status == "ok"  # resent on a new connection
        killer.script_flush()
        second = store.lease(POOL, "a.example", ttl=5)
        assert isinstance(second, Lease)
        assert store.release(second).status == "ok"
    finally:
        killer.close()
    assert "EVALSHA" not in generic  # SCRIPT LOAD (after the flush) may use the generic path
    with pytest.raises(redis.ResponseError, match="failed x"):
        store._direct.execute(("EVAL", FAIL, 0, "x"))
    assert direct_scripts_for(redis.Redis.from_url(redis_server.url, single_connection_client=True)) is None
    assert direct_scripts_for(fakeredis.FakeRedis()) is None


def _created(client) -> int:
    """Connections the client's pool has made (checked out or idle)."""
    return client.connection_pool._created_connections


def test_the_blocking_store_keeps_one_connection_for_its_script_calls(redis_server):
    """On a plain pool the script calls share one kept connection: no checkout per call, one connection
    for every store on the pool; other commands still take the pool's; ``close`` closes it and the next
    call connects again; a pool with little room checks one out per call, as before."""
    from scrapy_proxy_shard.engine.store import PoolStore

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        stores = [PoolStore(client, namespace="held", host_id=f"h{i}") for i in range(3)]
        stores[0].add_proxies(POOL, URLS)
        for _ in range(20):
            for store in stores:
                store.release(store.lease(POOL, "a.example", ttl=5), outcome="ok")
        assert client.ping()
        assert _created(client) == 2  # the kept one (script calls) + the one other commands take
        client.close()
        assert stores[1].release(stores[1].lease(POOL, "a.example", ttl=5)).status == "ok"
        assert _created(client) == 2
    finally:
        client.close()
    small = redis.Redis.from_url(redis_server.url, decode_responses=True, max_connections=2)
    blocking = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_server.url,
                                                                                 decode_responses=True))
    try:
        for one in (small, blocking):
            store = PoolStore(one, namespace="held", host_id="h")
            assert store._direct is not None and store._direct._held is None
            assert store.release(store.lease(POOL, "a.example", ttl=5)).status == "ok"
    finally:
        small.close()
        blocking.close()


def test_a_kept_connection_idle_a_while_is_checked_before_use(redis_server, monkeypatch):
    """A kept connection the server closed while it sat idle is replaced before the call is sent (the
    checkout's check), even by a client that never retries; one used within HOLD_CHECK_IDLE is sent on as
    it is, and a failed call gives it back to the pool."""
    from scrapy_proxy_shard.engine import pipeline
    from scrapy_proxy_shard.engine.store import PoolStore

    client = redis.Redis.from_url(redis_server.url, decode_responses=True, retry=None)
    killer = redis.Redis.from_url(redis_server.url)
    try:
        store = PoolStore(client, namespace="idle", host_id="h")
        store.add_proxies(POOL, URLS)
        assert store.release(store.lease(POOL, "a.example", ttl=5)).status == "ok"
        held = store._direct._held
        monkeypatch.setattr(pipeline, "HOLD_CHECK_IDLE", 0.0)
        killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        time.sleep(0.05)
        assert store.release(store.lease(POOL, "a.example", ttl=5)).status == "ok"  # reconnected first
        monkeypatch.setattr(pipeline, "HOLD_CHECK_IDLE", 3600.0)
        killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        time.sleep(0.05)
        with pytest.raises(Exception):  # noqa: B017 - no retry policy: the call on the dead socket fails
            store.lease(POOL, "a.example", ttl=5)
        assert held.conn is None  # given back to the pool
        assert store.release(store.lease(POOL, "a.example", ttl=5)).status == "ok"
    finally:
        killer.close()
        client.close()
