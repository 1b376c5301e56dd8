"""Lease and release as Redis Functions (``scripts.function_library``), with EVALSHA where there are none.

On Redis >= 7.0 a plain client calls the hot path by FCALL: the library is loaded by the first call
that misses it (a new server, a restart, FUNCTION FLUSH), and its helpers are defined once. Redis 6.2,
an ACL that refuses FCALL, a Cluster client and ``functions=False`` use EVALSHA. Either way the
answers are the same: the contract suite (tests/test_engine_contract.py) runs on fakeredis and 7.x
(Functions) and on 6.2 and the Cluster (EVALSHA).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import redis
import redis.asyncio

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import store as store_module
from scrapy_proxy_shard.engine.scripts import FUNCTION_OPS, function_library, script_source
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, PoolStore

POOL = "main"
URLS = [f"http://10.4.0.{i}:8000" for i in range(1, 4)]


def _calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far (INFO commandstats): evalsha, fcall, function|load."""
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
            for name in ("evalsha", "fcall", "function|load")}


def _cycle(store: PoolStore, site: str = "a.example") -> str:
    lease = store.lease(POOL, site, ttl=5)
    assert isinstance(lease, Lease), lease
    return store.release(lease, outcome="ok", latency=0.01).status


def _libraries(client: redis.Redis) -> list[str]:
    """Names of the libraries loaded (FUNCTION LIST, RESP2: flat name/value lists)."""
    entries = client.execute_command("FUNCTION", "LIST")
    return [entry["library_name"] if isinstance(entry, dict) else entry[entry.index("library_name") + 1]
            for entry in entries]


def _has_functions(binary) -> bool:
    return not binary.line.startswith("6.")


@pytest.fixture
def fn_server(request, redis_servers):
    """The newest redis-server line (``redis_binary`` asked for dynamically is not parametrised): 7.x on
    CI, which requires it. Flushed, with no library loaded."""
    binary = request.getfixturevalue("redis_binary")
    if not _has_functions(binary):  # only where no 7.x is installed: CI=true refuses to run without one
        pytest.skip(f"redis-server {binary.line} has no Functions; install Redis 7.x")
    return redis_servers(binary)


@pytest.fixture
def fn_redis(fn_server):
    client = redis.Redis.from_url(fn_server.url, decode_responses=True)
    client.flushall()
    client.function_flush()
    yield client
    client.close()


def test_the_library_is_the_hot_path_operations_named_after_their_code():
    library = function_library()
    assert library.source.startswith(f"#!lua name={library.name}\n")
    digest = library.name.rsplit("_", 1)[1]
    assert len(digest) == 12
    assert library.functions == {op: f"psh_{digest}_{op}" for op in FUNCTION_OPS}
    for op in FUNCTION_OPS:  # the body each function runs is the script's own
        body = script_source(op).split(f"-- ==== {op}.lua ====\n", 1)[1]
        assert f"-- ==== {op}.lua ====" in library.source
        assert body.strip().splitlines()[-1] in library.source
        assert f"redis.register_function('{library.functions[op]}', op_{op})" in library.source


def test_lease_and_release_go_by_fcall_where_redis_has_functions(real_redis, redis_binary):
    store = PoolStore(real_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, URLS)
    if _has_functions(redis_binary):
        real_redis.function_flush()
    before = _calls(real_redis)
    assert _cycle(store) == "ok"
    assert _cycle(store) == "ok"
    after = _calls(real_redis)
    if _has_functions(redis_binary):
        assert after["fcall"] - before["fcall"] == 5  # one missed the library, then four calls
        assert after["function|load"] - before["function|load"] == 1
        assert after["evalsha"] == before["evalsha"]
        assert _libraries(real_redis) == [function_library().name]
    else:  # 6.2: the first FCALL is refused as an unknown command, EVALSHA from then on
        assert after["evalsha"] - before["evalsha"] >= 4  # (+ NOSCRIPT answers while the scripts load)
        assert store._functions is None


def test_a_server_that_lost_the_functions_loads_them_again(fn_redis, caplog):
    store = PoolStore(fn_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, URLS)
    before = _calls(fn_redis)
    with caplog.at_level(logging.INFO, logger=store_module.__name__):
        lease = store.lease(POOL, "a.example", ttl=5)
        fn_redis.function_flush()  # between a lease and its release
        assert store.release(lease, outcome="ok").status == "ok"
        fn_redis.function_flush()
        assert _cycle(store) == "ok"
    after = _calls(fn_redis)
    assert store._functions is not None
    assert after["evalsha"] == before["evalsha"]
    assert after["function|load"] - before["function|load"] == 3  # at first use, then after each flush
    loaded = [r.getMessage() for r in caplog.records if "loaded the lease/release Functions" in r.getMessage()]
    assert len(loaded) == 3 and function_library().name in loaded[0]


def test_a_library_another_host_loaded_first_is_used(fn_redis):
    store = PoolStore(fn_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, URLS)
    fn_redis.function_flush()
    fn_redis.function_load(function_library().source)  # "another host" loaded it after our FCALL missed
    send = store._direct.execute if store._direct is not None else store._generic
    missed = []

    def first_misses(args):
        if args[0] == "FCALL" and not missed:
            missed.append(args[1])
            raise redis.ResponseError("Function not found")
        return send(args)

    if store._direct is not None:
        store._direct.execute = first_misses
    else:
        store._generic = first_misses
    assert _cycle(store) == "ok"
    assert missed and store._functions is not None  # "already exists" is not a refusal


@contextlib.contextmanager
def _store_as(fn_redis, fn_server, *rules: str):
    """A store logged in as a user allowed everything but ``rules`` (ACL SETUSER), removed after."""
    fn_redis.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", *rules)
    client = redis.Redis.from_url(fn_server.url, username="limited", password="pw", decode_responses=True)
    try:
        store = PoolStore(client, namespace="t", host_id="h")
        store.add_proxies(POOL, URLS)
        yield store
    finally:
        client.close()
        fn_redis.execute_command("ACL", "DELUSER", "limited")


@pytest.mark.parametrize(("rules", "level", "said"), [
    (("-fcall", "-function"), logging.INFO, "runs no Functions"),  # FCALL refused
    (("-function",), logging.WARNING, "refused to load"),  # FCALL allowed, FUNCTION LOAD refused
])
def test_an_acl_that_refuses_functions_gets_evalsha(fn_redis, fn_server, caplog, rules, level, said):
    fn_redis.function_flush()
    with _store_as(fn_redis, fn_server, *rules) as store, \
            caplog.at_level(logging.INFO, logger=store_module.__name__):
        before = _calls(fn_redis)
        assert _cycle(store) == "ok"
        assert _cycle(store) == "ok"
        after = _calls(fn_redis)
    assert store._functions is None
    assert after["evalsha"] - before["evalsha"] >= 4
    assert [r.levelno for r in caplog.records if said in r.getMessage()] == [level]  # said once


def test_functions_off_and_cluster_clients_use_evalsha(real_redis, cluster_redis):
    off = PoolStore(real_redis, namespace="t", host_id="h", functions=False)
    off.add_proxies(POOL, URLS)
    before = _calls(real_redis)
    assert _cycle(off) == "ok"
    assert _calls(real_redis)["fcall"] == before["fcall"]
    assert PoolStore(cluster_redis, namespace="t", host_id="h")._functions is None


def test_a_function_error_reply_reaches_the_caller(fn_redis):
    """An error the function itself answers (a bad argument) is not taken for a missing library."""
    store = PoolStore(fn_redis, namespace="t", host_id="h")
    store.add_proxies(POOL, URLS)
    assert _cycle(store) == "ok"
    name = function_library().functions["release"]  # it parses its member and breaker options
    with pytest.raises(redis.ResponseError, match="argument member"):
        keys = len(keyset.ROLES["release"])
        fn_redis.fcall(name, keys, *["k"] * keys, "a.example", "no-slot", *["0"] * 14, "", *["0"] * 13)
    assert store._functions is not None and _cycle(store) == "ok"


def test_the_asyncio_store_loads_lost_functions_and_falls_back(redis_server, redis_binary):
    async def scenario() -> tuple[str, str, bool, dict]:
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            await client.flushall()
            if _has_functions(redis_binary):
                await client.function_flush()
            store = AsyncPoolStore(client, namespace="t", host_id="h")  # pipelined connection
            await store.add_proxies(POOL, URLS)
            lease = await store.lease(POOL, "a.example", ttl=5)
            assert isinstance(lease, Lease)
            if _has_functions(redis_binary):
                await client.function_flush()
            first = (await store.release(lease, outcome="ok")).status
            lease = await store.lease(POOL, "a.example", ttl=5)
            second = (await store.release(lease, outcome="ok")).status
            stats = await client.info("commandstats")
            return first, second, store._functions is not None, stats
        finally:
            await client.aclose()

    first, second, functions_on, stats = asyncio.run(scenario())
    assert (first, second) == ("ok", "ok")
    assert functions_on == _has_functions(redis_binary)
    if _has_functions(redis_binary):
        assert stats["cmdstat_function|load"]["calls"] >= 2


@pytest.mark.parametrize(("value", "on"), [(True, True), (False, False), ("False", False)])
def test_the_setting_reaches_the_crawls_store(value, on):
    from scrapy_proxy_shard.modes.factory import build_store
    from scrapy_proxy_shard.settings import ShardSettings

    settings = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "redis://127.0.0.1:1/0",
                                            "PROXY_SHARD_FALLBACK": False, "PROXY_SHARD_REDIS_FUNCTIONS": value})
    assert (build_store(settings)._functions is not None) is on  # built without connecting
