"""``BUSY`` and ``LOADING`` answers are transient: calls wait them out, requests never fail on them.

BUSY comes from a real redis-server running another client's slow script past ``lua-time-limit``
(``busy-reply-threshold`` on 7.x). LOADING comes from a small RESP proxy in front of a real
redis-server that answers ``-LOADING ...`` to the next N script calls it sees, as a restarting Redis
does, and passes everything else through.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest
import redis
import redis.asyncio
import redis.backoff
import redis.retry
from lease_checks import hold_and_release

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, PoolStore
from scrapy_proxy_shard.exceptions import PoolBusy
from scrapy_proxy_shard.modes.connection import async_client, sync_client
from scrapy_proxy_shard.modes.factory import build_store
from scrapy_proxy_shard.settings import ShardSettings

pytestmark = pytest.mark.redis_server

PROXIES = [f"http://10.0.0.{i}:8080" for i in range(1, 9)]
#: A script that keeps Redis busy for 400 ms of its own clock (TIME), whatever the machine's load.
BUSY_LOOP = """
local t = redis.call('TIME')
local start = tonumber(t[1]) * 1000000 + tonumber(t[2])
while true do
  local n = redis.call('TIME')
  if tonumber(n[1]) * 1000000 + tonumber(n[2]) - start > tonumber(ARGV[1]) then return 1 end
end
"""


class Stats:
    def __init__(self) -> None:
        self.values: collections.Counter = collections.Counter()

    def inc_value(self, key: str, count: int = 1, start: int = 0) -> None:
        self.values[key] += count


@pytest.fixture
def server(redis_binary):
    """A redis-server of its own (its busy threshold is lowered), stopped by PID at the end."""
    running = RedisServer(binary=redis_binary.path).start()
    admin = redis.Redis.from_url(running.url, decode_responses=True)
    admin.config_set("lua-time-limit", 10)  # the 6.2 name; 7.x aliases it to busy-reply-threshold
    yield running
    admin.close()
    running.stop()


def _start_busy_script(url: str, micros: int = 400_000) -> threading.Thread:
    """Run BUSY_LOOP from another client; return once Redis answers BUSY to others."""
    result: list = []

    def run() -> None:
        client = redis.Redis.from_url(url, socket_timeout=30)
        try:
            result.append(client.eval(BUSY_LOOP, 0, micros))
        finally:
            client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.result = result
    thread.start()
    probe = redis.Redis.from_url(url, socket_timeout=30, retry=None)
    try:
        while thread.is_alive():
            try:
                probe.ping()
            except redis.ResponseError as exc:
                assert str(exc).startswith("BUSY ")
                break
    finally:
        probe.close()
    return thread


def test_leases_wait_out_a_busy_script_sync(server):
    """Before: the first lease raised PoolBackendError ("answered with an error: BUSY ...")."""
    retries = []
    store = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), namespace="t",
                      on_busy_retry=lambda: retries.append(1))
    store.add_proxies("default", PROXIES)
    busy = _start_busy_script(server.url)
    leases = []
    for _ in range(30):
        lease = store.lease("default", "a.example", ttl=30, concurrency=4)
        assert isinstance(lease, Lease)
        leases.append(lease)
        store.release(lease)
    busy.join(10)
    assert busy.result == [1]
    assert len(leases) == 30 and retries, "no lease met the BUSY script"
    assert store._busy_since is None  # the episode ended with the first answer


def test_concurrent_async_leases_wait_out_a_busy_script(server):
    """64 asyncio tasks lease and release through a BUSY episode: no exception, every retry counted,
    and no slot leased twice (a lease script sent again after BUSY had not run)."""
    stats = Stats()
    settings = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": server.url, "PROXY_SHARD_HOST_ID": "h",
                                            "PROXY_SHARD_FALLBACK": False})

    async def scenario() -> tuple[list, list]:
        store = build_store(settings, stats)
        await store.add_proxies("default", PROXIES)
        held: set[str] = set()
        overlaps: list = []
        done: list = []

        async def worker() -> None:
            n = 0
            while n < 5 or busy.is_alive():  # keep leasing through the whole BUSY episode
                n += 1
                lease = await store.lease("default", "a.example", ttl=30, concurrency=8)
                if not isinstance(lease, Lease):
                    await asyncio.sleep(lease.wait / 2)
                    continue
                await hold_and_release(store, lease, held, overlaps)
                done.append(lease)

        # 1.5 s of BUSY: long enough that the 64 tasks (started after BUSY was seen) meet it on a
        # loaded machine too.
        busy = await asyncio.to_thread(_start_busy_script, server.url, 1_500_000)
        await asyncio.gather(*(worker() for _ in range(64)))
        await asyncio.to_thread(busy.join, 10)
        await store.aclose()
        return done, overlaps

    done, overlaps = asyncio.run(scenario())
    assert done and not overlaps
    assert stats.values["proxy_shard/redis_busy_retries"] > 0
    assert free_slots(server.url) == len(PROXIES) * 8  # every lease given back, none left behind


def free_slots(url: str) -> int:
    store = PoolStore(redis.Redis.from_url(url, decode_responses=True), namespace="proxy_shard")
    status = store.pool_status("default", "a.example")
    return status.free


# --- LOADING -------------------------------------------------------------------------------------

class LoadingProxy:
    """A TCP proxy to a real Redis speaking RESP2, answering ``-LOADING`` to the next ``arm(n)`` script
    calls (EVAL/EVALSHA/FCALL) instead of passing them on. Runs its own event loop in a thread."""

    LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.loading_left = 0
        self.answered_loading = 0
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def arm(self, count: int) -> None:
        self.loading_left = count

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            while True:
                raw, args = await _read_command(reader)
                if raw is None:
                    return
                name = args[0].upper() if args else b""
                if self.loading_left > 0 and name in (b"EVAL", b"EVALSHA", b"FCALL"):
                    self.loading_left -= 1
                    self.answered_loading += 1
                    writer.write(self.LOADING)
                else:
                    up_writer.write(raw)
                    await up_writer.drain()
                    writer.write(await _read_reply(up_reader))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            up_writer.close()
            writer.close()


async def _read_command(reader: asyncio.StreamReader) -> tuple[bytes | None, list[bytes]]:
    head = await reader.readline()
    if not head:
        return None, []
    assert head.startswith(b"*"), head
    raw, args = [head], []
    for _ in range(int(head[1:])):
        size_line = await reader.readline()
        data = await reader.readexactly(int(size_line[1:]) + 2)
        raw += [size_line, data]
        args.append(data[:-2])
    return b"".join(raw), args


async def _read_reply(reader: asyncio.StreamReader) -> bytes:
    """One whole reply, RESP2 or RESP3 (redis-py may say HELLO 3), as raw bytes."""
    line = await reader.readline()
    kind, rest = line[:1], line[1:-2]
    if kind in (b"$", b"=", b"!") and int(rest) >= 0:
        return line + await reader.readexactly(int(rest) + 2)
    if kind in (b"*", b"~", b">", b"%", b"|") and int(rest) >= 0:
        count = int(rest) * (2 if kind in (b"%", b"|") else 1)
        body = b"".join([await _read_reply(reader) for _ in range(count)])
        return line + body + (await _read_reply(reader) if kind == b"|" else b"")
    return line


@pytest.fixture
def loading_proxy(redis_server):
    redis.Redis.from_url(redis_server.url).flushall()
    proxy = LoadingProxy(redis_server.port)
    yield proxy
    proxy.stop()


def _settings(port: int, **extra) -> ShardSettings:
    return ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": f"redis://127.0.0.1:{port}/0",
                                        "PROXY_SHARD_HOST_ID": "host-a", "PROXY_SHARD_HOSTS": ["host-a"],
                                        "PROXY_SHARD_FALLBACK_WARMUP": 0, **extra})


def test_a_lease_waits_while_redis_loads_sync(loading_proxy):
    """15 LOADING answers in a row (more than redis-py 8's own 10 retries, which made the lease raise
    PoolUnreachable before): the lease waits and succeeds, and each answer is retried exactly once, by
    the store (redis-py's own retry stays out: it would have spent several answers per store attempt)."""
    retries = []
    store = PoolStore(sync_client(_settings(loading_proxy.port)), on_busy_retry=lambda: retries.append(1))
    store.add_proxies("default", PROXIES)
    loading_proxy.arm(15)
    lease = store.lease("default", "a.example", ttl=30)
    assert isinstance(lease, Lease)
    assert loading_proxy.answered_loading == 15 and len(retries) == 15
    assert store.release(lease).status == "ok"


def test_a_lease_waits_while_redis_loads_async(loading_proxy):
    stats = Stats()

    async def scenario() -> None:
        store = build_store(_settings(loading_proxy.port, PROXY_SHARD_FALLBACK=False), stats)
        assert isinstance(store, AsyncPoolStore)
        await store.add_proxies("default", PROXIES)
        loading_proxy.arm(15)
        leases = await asyncio.gather(*(store.lease("default", "a.example", ttl=30) for _ in range(4)))
        assert all(isinstance(lease, Lease) for lease in leases)
        assert len({lease.member for lease in leases}) == 4
        for lease in leases:
            await store.release(lease)
        await store.aclose()

    asyncio.run(scenario())
    assert loading_proxy.answered_loading == 15
    assert stats.values["proxy_shard/redis_busy_retries"] == 15


def test_a_call_gives_up_after_busy_wait_with_pool_busy(loading_proxy):
    """Past ``busy_wait`` the store raises PoolBusy, a stall (timed_out) naming the answer."""
    client = sync_client(_settings(loading_proxy.port))
    store = PoolStore(client, busy_wait=0.0)
    store.add_proxies("default", PROXIES)
    loading_proxy.arm(1)
    with pytest.raises(PoolBusy, match="LOADING") as caught:
        store.lease("default", "a.example", ttl=30)
    assert caught.value.timed_out and store._in_doubt == {}  # the script never ran: nothing to settle
    assert isinstance(store.lease("default", "a.example", ttl=30), Lease)


@pytest.mark.parametrize("after", [30.0, 0.0])
def test_the_fallback_treats_a_lasting_busy_redis_as_stalled(loading_proxy, after):
    """FALLBACK_AFTER 30 s: five LOADING answers are waited out on Redis (no fallback). FALLBACK_AFTER
    0: a Redis answering LOADING counts as stalled past it, so the host uses its local slice; either
    way the request gets a lease."""
    stats = Stats()

    async def scenario() -> str:
        store = build_store(_settings(loading_proxy.port, PROXY_SHARD_FALLBACK_AFTER=after), stats)
        await store.add_proxies("default", PROXIES)
        await store.release(await store.lease("default", "a.example", ttl=30))  # snapshot taken
        loading_proxy.arm(5)
        lease = await store.lease("default", "a.example", ttl=30)
        assert isinstance(lease, Lease)
        await store.release(lease)
        state = store.fallback_state
        await store.aclose()
        return state

    state = asyncio.run(scenario())
    if after:
        assert state == "redis" and stats.values["proxy_shard/redis_busy_retries"] == 5
        assert stats.values["proxy_shard/fallback/entered"] == 0
    else:
        assert state == "fallback" and stats.values["proxy_shard/fallback/entered"] == 1


@pytest.mark.parametrize("make", [sync_client, async_client])
def test_clients_keep_redis_pys_policy_but_pass_loading_on(make):
    """Same policy as a URL-built client had (one immediate retry of connection errors and timeouts),
    except LOADING, which goes straight to the store; a ``retry`` of PROXY_SHARD_REDIS_PARAMS wins."""
    client = make(_settings(1))
    retry = client.connection_pool.make_connection().retry
    assert retry._retries == 1 and isinstance(redis.ConnectionError(), retry._supported_errors)
    calls = []

    def loading():
        calls.append(1)
        raise redis.BusyLoadingError("loading")

    def lost():
        calls.append(1)
        raise redis.ConnectionError("lost")

    if make is sync_client:
        with pytest.raises(redis.BusyLoadingError):
            retry.call_with_retry(loading, lambda *a: None)
        assert len(calls) == 1
        with pytest.raises(redis.ConnectionError):
            retry.call_with_retry(lost, lambda *a: None)
        assert len(calls) == 3
    # One PROXY_SHARD_REDIS_PARAMS serves both clients: a retry of either kind is rebuilt as the kind
    # the client needs (redis-py 8.2 warns when a blocking Retry reaches an asyncio client).
    wanted = redis.asyncio.retry.Retry if make is async_client else redis.retry.Retry
    for kind in (redis.retry.Retry, redis.asyncio.retry.Retry):
        own = kind(redis.backoff.ConstantBackoff(0.25), 5, (redis.TimeoutError,))
        custom = make(ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "redis://127.0.0.1:1/0",
                                                   "PROXY_SHARD_REDIS_PARAMS": {"retry": own}}))
        got = custom.connection_pool.make_connection().retry
        assert type(got) is wanted and got._retries == 5  # (get_retries() is redis-py 6+)
        assert got._backoff.compute(3) == 0.25 and redis.TimeoutError in got._supported_errors
