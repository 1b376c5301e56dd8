"""Engine benchmark: lease+release throughput against its ceiling, bytes per call, memory per proxy.

    python benchmarks/bench_engine.py [--quick] [--seconds S] [--processes N] [--repeat R]
    python benchmarks/bench_engine.py --client-cpu [--cpu-rounds R] [--cpu-cycles C]

One run starts its own throwaway redis-server (``RedisServer``), builds pools of 500, 10,000 and
100,000 proxies, and prints one report:

* throughput: lease one slot + release it (outcome ok, min_interval 0) with the blocking
  ``PoolStore`` over ``redis.Redis(decode_responses=True)``, for 1 process and for N OS processes
  (each with its own client), the N processes either on N distinct sites or all on one shared site;
* the ceiling, measured with the same client shape and process count: a registered ``return 1``
  script, one call per round trip, and two calls per cycle (a cycle is two round trips);
* the same in one process with ``--tasks`` asyncio tasks (default 64) sharing one ``AsyncPoolStore``
  over ``redis.asyncio.Redis(decode_responses=True)`` (what the middlewares use), against its own
  ceiling: the same tasks calling ``return 1`` on the same client, slices interleaved;
* bytes Redis sends and receives per lease and per release (``INFO stats`` net byte counters) and
  the server CPU per call (``INFO commandstats``), at every pool size;
* redis-server ``used_memory`` per proxy (``INFO memory`` deltas, cross-checked by MEMORY USAGE);
* Redis time per lease + release against a reference measured in the same run, at every pool size: a
  minimal two-script ZSET lease doing the same job (lease: ``ZRANGEBYSCORE ready -inf now LIMIT 0 1``,
  ``ZADD`` the member at now + ttl, record the token; release: check the token, ``ZADD`` the member back
  at now, delete the record), on a ZSET of the same members, its rounds interleaved with ours;
* client CPU per lease + release (``time.process_time`` of the client process / cycles: redis-server's
  CPU left out), ours (``PoolStore``) against the reference's two scripts called the way a minimal client
  would (redis-py ``register_script``), in alternating rounds in one fresh process, on the 500-proxy
  pool (``--client-cpu``: only this section, on a pool of its own).

Within one process configuration, the ceiling and every pool size are timed in short interleaved
slices (each figure gets ``--seconds`` in all), so a machine whose speed drifts (other work, CPU
steal) slows them alike and their ratios stay meaningful; ``--repeat`` runs that schedule again and
averages. The proxy URLs are ``http://10.<a>.<b>.<c>:8080`` strings that are never contacted; every
octet has three digits so every URL, and hence every reply, has the same length at every pool size.
The first lease on a site starts building the site's ZSET, one page of 1,000 proxies per call (so
no call blocks Redis for O(N)); the build is completed before timing and the first lease's cost is
reported separately.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import queue
import secrets
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, PoolStore

SIZES = (500, 10_000, 100_000)
NAMESPACE = "bench"
LEASE_TTL = 30.0  # seconds; far longer than a cycle, so no lease ever expires while held
LATENCY = 0.05  # seconds reported with every ok release, as the middleware does (feeds the EWMA)
SCALE_TARGET = 0.8  # cycles/s at the largest pool / cycles/s at the smallest
CEILING_TARGET = 0.7  # (2 x cycles/s) / trivial calls/s
BYTES_TOLERANCE = 1.0  # bytes per call the largest and smallest pool may differ by
MEMORY_TARGET = 1.25  # per-proxy memory at the largest pool / at the second smallest: linear growth
BYTES_BATCH = 400  # leases held at once while counting bytes (then released)
TRIVIAL_SCRIPT = "return 1"
# The reference: the least a ZSET lease can do per cycle (KEYS: ready ZSET, held-records hash).
REFERENCE_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local found = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
if #found == 0 then return {'WAIT'} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), found[1])
redis.call('HSET', KEYS[2], found[1], ARGV[2])
return {'OK', found[1], ARGV[2]}
"""
REFERENCE_RELEASE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 'STALE' end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 'OK'
"""
REFERENCE_TARGET = 1.6  # Redis time per lease+release / the reference's, same run
CYCLE_TARGET_US = 30.0  # Redis time per lease+release, us (issue 10)
# The reference's cycle where issue 10 set CYCLE_TARGET_US (16-21 us measured there): a machine whose
# reference costs more is slower, and the absolute target is scaled by the ratio (see the report).
ISSUE_REFERENCE_US = (16.0, 21.0)
CLIENT_CPU_TARGET = 1.0  # client CPU per cycle / the reference's (issue 24): no more than a minimal client
CLIENT_CPU_SIZE = 500  # proxies of the client CPU measurement's pool (one site)
CLIENT_CPU_BLOCK = 100  # cycles timed in a row before the other side's turn (a round alternates blocks)


# --- worker processes -----------------------------------------------------------------------------

def _make_op(kind: str, client: redis.Redis, pool: str, site: str):
    """The unit of work one process repeats: a lease+release cycle, or 1 or 2 trivial calls."""
    if kind == "cycle":
        store = PoolStore(client, namespace=NAMESPACE, host_id=f"bench-{os.getpid()}")

        def cycle() -> None:
            lease = store.lease(pool, site, ttl=LEASE_TTL)
            if not isinstance(lease, Lease):
                raise RuntimeError(f"lease on {pool}/{site} found no free slot: {lease}")
            result = store.release(lease, outcome="ok", latency=LATENCY, min_interval=0.0)
            if result.status != "ok":
                raise RuntimeError(f"release on {pool}/{site} answered {result.status!r}")

        return cycle
    script = client.register_script(TRIVIAL_SCRIPT)
    trivial_keys = [keys.pool_prefix(NAMESPACE, pool)]
    if kind == "trivial1":
        return lambda: script(keys=trivial_keys)
    if kind == "trivial2":
        def two() -> None:
            script(keys=trivial_keys)
            script(keys=trivial_keys)

        return two
    raise ValueError(kind)


def _worker(jobs: list[tuple[str, str, str]], url: str, warmup: float, seconds: float, slice_s: float,
            barrier: Any, results: Any) -> None:
    """Time every job of ``jobs`` in this process, interleaved in slices of ``slice_s`` seconds.

    Interleaving makes every figure (the ceiling and each pool size) see the same conditions, so
    their ratios hold even when the machine's speed drifts during the run.
    """
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        ops = [_make_op(kind, client, pool, site) for kind, pool, site in jobs]
        for op in ops:
            deadline = time.perf_counter() + warmup
            while time.perf_counter() < deadline:
                op()
        barrier.wait(timeout=120)  # every process starts its timed windows together
        counts = [0] * len(ops)
        spent = [0.0] * len(ops)
        t0 = now = time.perf_counter()
        slot = 0
        for sweep in range(max(1, round(seconds / slice_s))):
            for i in (*range(sweep % len(ops), len(ops)), *range(sweep % len(ops))):
                slot += 1
                end = t0 + slot * slice_s  # a shared schedule: processes switch jobs together
                op, count, start = ops[i], 0, now
                while now < end:
                    op()
                    count += 1
                    now = time.perf_counter()
                counts[i] += count
                spent[i] += now - start
        results.put((counts, spent, None))
    except Exception as exc:  # reported by the parent, which fails the run
        barrier.abort()
        results.put(([], [], f"{type(exc).__name__}: {exc}"))
    finally:
        client.close()


@dataclass
class Rate:
    total: float  # operations/s, summed over the processes
    per_process: list[float]


def measure(ctx: Any, url: str, jobs: list[list[tuple[str, str, str]]], warmup: float, seconds: float,
            slice_s: float) -> list[Rate]:
    """One process per entry of ``jobs`` (its list of (kind, pool, site)); one Rate per job index."""
    barrier = ctx.Barrier(len(jobs))
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(own, url, warmup, seconds, slice_s, barrier, results),
                         daemon=True)
             for own in jobs]
    for proc in procs:
        proc.start()
    try:
        out = [results.get(timeout=len(jobs[0]) * (warmup + seconds) + 180) for _ in procs]
    except queue.Empty:
        raise RuntimeError("a worker process gave no result") from None
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    errors = [err for _, _, err in out if err]
    if errors:
        raise RuntimeError(f"worker failed: {errors[0]}")
    rates = []
    for i in range(len(jobs[0])):
        own = sorted(counts[i] / spent[i] for counts, spent, _ in out)
        rates.append(Rate(sum(own), own))
    return rates


# --- one process, many asyncio tasks --------------------------------------------------------------

def _async_worker(url: str, jobs: list[tuple[str, str, str]], tasks: int, warmup: float, seconds: float,
                  slice_s: float, results: Any) -> None:
    """``tasks`` asyncio tasks on one ``AsyncPoolStore`` (one client), every job of ``jobs`` in turn in
    interleaved slices; puts (ops/s per job, None) or ([], error)."""

    async def run() -> list[float]:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True, max_connections=tasks + 8)
        try:
            store = AsyncPoolStore(client, namespace=NAMESPACE, host_id=f"bench-async-{os.getpid()}")
            script = client.register_script(TRIVIAL_SCRIPT)

            def make(kind: str, pool: str, site: str) -> Any:
                if kind == "trivial1":
                    trivial_keys = [keys.pool_prefix(NAMESPACE, pool)]
                    return lambda: script(keys=trivial_keys)

                async def cycle() -> None:
                    lease = await store.lease(pool, site, ttl=LEASE_TTL)
                    if not isinstance(lease, Lease):
                        raise RuntimeError(f"async lease on {pool}/{site} found no free slot: {lease}")
                    result = await store.release(lease, outcome="ok", latency=LATENCY, min_interval=0.0)
                    if result.status != "ok":
                        raise RuntimeError(f"async release on {pool}/{site} answered {result.status!r}")

                return cycle

            ops = [make(*job) for job in jobs]

            async def window(op: Any, until: float) -> int:
                async def task() -> int:
                    n = 0
                    while time.perf_counter() < until:
                        await op()
                        n += 1
                    return n

                return sum(await asyncio.gather(*(task() for _ in range(tasks))))

            for op in ops:
                await window(op, time.perf_counter() + warmup)
            counts, spent = [0] * len(ops), [0.0] * len(ops)
            for sweep in range(max(1, round(seconds / slice_s))):
                for i in (*range(sweep % len(ops), len(ops)), *range(sweep % len(ops))):
                    start = time.perf_counter()
                    counts[i] += await window(ops[i], start + slice_s)
                    spent[i] += time.perf_counter() - start  # includes the slowest task's last op
            return [c / t for c, t in zip(counts, spent, strict=True)]
        finally:
            await client.aclose()

    try:
        results.put((asyncio.run(run()), None))
    except Exception as exc:  # reported by the parent, which fails the run
        results.put(([], f"{type(exc).__name__}: {exc}"))


def measure_async(ctx: Any, url: str, jobs: list[tuple[str, str, str]], tasks: int, warmup: float,
                  seconds: float, slice_s: float) -> list[float]:
    """ops/s of each job of ``jobs`` with ``tasks`` asyncio tasks in one fresh process."""
    results = ctx.Queue()
    proc = ctx.Process(target=_async_worker, args=(url, jobs, tasks, warmup, seconds, slice_s, results),
                       daemon=True)
    proc.start()
    try:
        rates, error = results.get(timeout=len(jobs) * (warmup + seconds) + 180)
    except queue.Empty:
        raise RuntimeError("the asyncio worker process gave no result") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    if error:
        raise RuntimeError(f"asyncio worker failed: {error}")
    return rates


# --- pools, one-off costs and memory --------------------------------------------------------------

def proxy_urls(size: int) -> list[str]:
    """Distinct fixed-width proxy URLs (never contacted): http://10.1ab.1cd.1ef:8080."""
    if size > 1_000_000:
        raise ValueError("at most 1,000,000 proxies")
    return [f"http://10.{100 + i // 10_000}.{100 + i // 100 % 100}.{100 + i % 100}:8080"
            for i in range(size)]


def pool_name(size: int) -> str:
    return f"p{size:07d}"  # fixed width: request sizes do not depend on the pool either


@dataclass
class PoolSetup:
    size: int
    pool: str
    prefix: str
    add_seconds: float = 0.0
    pool_bytes_info: float = 0.0  # used_memory delta per proxy for the pool itself
    pool_bytes_usage: float = 0.0  # MEMORY USAGE of its hashes per proxy
    site_bytes_info: float = 0.0  # used_memory delta per proxy for one site's ZSET
    site_bytes_usage: float = 0.0
    first_lease_ms: list[float] = field(default_factory=list)
    stats_bytes: float = 0.0  # MEMORY USAGE of pstats per proxy that was ever leased
    stats_proxies: int = 0

    @property
    def reference_keys(self) -> list[str]:
        """The reference's ready ZSET and held-records hash (under the pool's hash tag)."""
        return [f"{self.prefix}:refready", f"{self.prefix}:refheld"]


def used_memory(admin: redis.Redis) -> int:
    return int(admin.info("memory")["used_memory"])


def memory_usage(admin: redis.Redis, key: str) -> int:
    return int(admin.memory_usage(key, samples=0) or 0)


def first_lease(store: PoolStore, pool: str, site: str) -> float:
    """Lease once on a new site (starts learning the pool: one page of 128 slots per call),
    release; the first lease's round trip in ms. Then lease until the build is complete, so the
    timed cycles measure the steady state."""
    start = time.perf_counter()
    lease = store.lease(pool, site, ttl=LEASE_TTL)
    elapsed = time.perf_counter() - start
    if not isinstance(lease, Lease):
        raise RuntimeError(f"first lease on {pool}/{site}: {lease}")
    store.release(lease, outcome="ok")
    prefix = store.prefix(pool)

    def learning() -> bool:  # the site has not learnt every proxy of the pool yet
        pool_seq = int(store.client.hget(keys.sub_key(prefix, keys.META), "seq") or 0)
        return int(store.client.hget(f"{prefix}:{keys.SITE}:{site}", "seq") or 0) < pool_seq

    while learning():
        lease = store.lease(pool, site, ttl=LEASE_TTL)
        if isinstance(lease, Lease):
            store.release(lease, outcome="ok")
    return elapsed * 1000


def build_pool(admin: redis.Redis, store: PoolStore, size: int, sites: list[str]) -> PoolSetup:
    pool = pool_name(size)
    setup = PoolSetup(size, pool, keys.pool_prefix(NAMESPACE, pool))
    urls = proxy_urls(size)
    before = used_memory(admin)
    start = time.perf_counter()
    result = store.add_proxies(pool, urls)
    setup.add_seconds = time.perf_counter() - start
    if result.added != size:
        raise RuntimeError(f"{pool}: added {result.added} proxies, expected {size}")
    after_pool = used_memory(admin)
    setup.pool_bytes_info = (after_pool - before) / size
    setup.pool_bytes_usage = sum(memory_usage(admin, keys.sub_key(setup.prefix, name))
                                 for name in (keys.PROXIES, keys.TAGS, keys.ORDER)) / size
    setup.first_lease_ms.append(first_lease(store, pool, sites[0]))
    setup.site_bytes_info = (used_memory(admin) - after_pool) / size
    setup.site_bytes_usage = memory_usage(admin, f"{setup.prefix}:ready:{sites[0]}") / size
    for site in sites[1:]:
        setup.first_lease_ms.append(first_lease(store, pool, site))
    return setup


def build_reference(admin: redis.Redis, setup: PoolSetup) -> None:
    """The reference's ZSET: one slot per proxy of the pool, members named like ours ("<id>/0")."""
    ids = admin.zrange(keys.sub_key(setup.prefix, keys.ORDER), 0, -1)
    ready = setup.reference_keys[0]
    for start in range(0, len(ids), 10_000):
        admin.zadd(ready, {f"{pid}/0": 0 for pid in ids[start:start + 10_000]})
    if admin.zcard(ready) != setup.size:
        raise RuntimeError(f"{setup.pool}: the reference ZSET holds {admin.zcard(ready)} members, "
                           f"expected {setup.size}")


def counters_memory(admin: redis.Redis, setup: PoolSetup) -> None:
    """Per-proxy counters (``pstats``) grow with the proxies ever leased: bytes per such proxy."""
    key = keys.sub_key(setup.prefix, "pstats")
    ids = {name.rpartition(":")[0] for name in admin.hkeys(key)}
    setup.stats_proxies = len(ids)
    setup.stats_bytes = memory_usage(admin, key) / max(1, len(ids))


# --- bytes and server CPU per call ----------------------------------------------------------------

@dataclass
class CallCost:
    """Bytes are summed over every round; server CPU per call is the median of the rounds (robust
    to the rounds disturbed by anything else running on the machine)."""

    calls: int = 0
    out_bytes: int = 0
    in_bytes: int = 0
    round_usec: list[float] = field(default_factory=list)

    def add(self, calls: int, sample: tuple[int, int, int]) -> None:
        self.calls += calls
        self.out_bytes += sample[0]
        self.in_bytes += sample[1]
        self.round_usec.append(sample[2] / calls)

    @property
    def out_per_call(self) -> float:
        return self.out_bytes / self.calls

    @property
    def in_per_call(self) -> float:
        return self.in_bytes / self.calls

    @property
    def usec_per_call(self) -> float:
        return statistics.median(self.round_usec)

    def paired_ratio(self, other: CallCost) -> float:
        """Median over the rounds of this cost / the other's in the same round (adjacent in time)."""
        return statistics.median(a / b for a, b in zip(self.round_usec, other.round_usec, strict=True))


class Counter:
    """Server counters over a stretch of calls: CONFIG RESETSTAT, the calls, then INFO.

    The byte counters then hold the RESETSTAT exchange plus the calls; the exchange alone is
    measured once (``calibrate``) and subtracted.
    """

    def __init__(self, admin: redis.Redis) -> None:
        self.admin = admin
        self.base = (0, 0)
        self.start()
        self.base = self.stop()[:2]

    def start(self) -> None:
        self.admin.config_resetstat()

    def stop(self) -> tuple[int, int, int]:
        stats = self.admin.info("stats")
        commands = self.admin.info("commandstats")
        # Lease and release go by FCALL where Redis has Functions (7.0+), by EVALSHA elsewhere.
        usec = sum(int(commands.get(f"cmdstat_{name}", {}).get("usec", 0)) for name in ("evalsha", "fcall"))
        return (int(stats["total_net_output_bytes"]) - self.base[0],
                int(stats["total_net_input_bytes"]) - self.base[1], usec)


def measure_calls(admin: redis.Redis, store: PoolStore, setups: dict[int, PoolSetup], site: str,
                  rounds: int, evalsha_store: PoolStore | None = None
                  ) -> tuple[dict[int, tuple[CallCost, CallCost]], CallCost, dict[int, tuple[CallCost, CallCost]],
                             dict[int, tuple[CallCost, CallCost]]]:
    """Bytes and server CPU per lease, per release (every pool size) and per trivial call, and the
    same for the reference lease and release; with ``evalsha_store`` (a store with Functions off, when
    ``store`` calls lease and release by FCALL), the same again by EVALSHA (the last dict; empty without).

    Each round leases a batch of slots on every pool (all held at once), releases them, does the same
    with the reference scripts on a ZSET of as many members, then makes as many trivial calls; rounds
    interleave the pool sizes and the reference so drift hits them alike.
    """
    script = admin.register_script(TRIVIAL_SCRIPT)
    ref_lease, ref_release = admin.register_script(REFERENCE_LEASE), admin.register_script(REFERENCE_RELEASE)
    counter = Counter(admin)
    costs = {size: (CallCost(), CallCost()) for size in setups}
    by_evalsha = {size: (CallCost(), CallCost()) for size in setups} if evalsha_store is not None else {}
    reference = {size: (CallCost(), CallCost()) for size in setups}
    trivial = CallCost()
    ttl_ms = str(int(LEASE_TTL * 1000))
    for n in range(rounds):
        for size, setup in setups.items():
            batch = min(BYTES_BATCH, size)
            for one, cost in ((store, costs[size]), (evalsha_store, by_evalsha.get(size))):
                if one is None:  # no EVALSHA twin: the store itself goes by EVALSHA
                    continue
                lease_cost, release_cost = cost
                counter.start()
                leases = [one.lease(setup.pool, site, ttl=LEASE_TTL) for _ in range(batch)]
                lease_cost.add(batch, counter.stop())
                if not all(isinstance(lease, Lease) for lease in leases):
                    raise RuntimeError(f"{setup.pool}: a lease found no free slot while counting bytes")
                counter.start()
                for lease in leases:
                    one.release(lease, outcome="ok", latency=LATENCY, min_interval=0.0)
                release_cost.add(batch, counter.stop())
            ref_keys = setup.reference_keys
            counter.start()
            held = [ref_lease(keys=ref_keys, args=[ttl_ms, f"{n:08d}{i:08d}"]) for i in range(batch)]
            reference[size][0].add(batch, counter.stop())
            if not all(reply[0] == "OK" for reply in held):
                raise RuntimeError(f"{setup.pool}: a reference lease found no free slot")
            counter.start()
            answers = [ref_release(keys=ref_keys, args=[reply[1], reply[2]]) for reply in held]
            reference[size][1].add(batch, counter.stop())
            if any(answer != "OK" for answer in answers):
                raise RuntimeError(f"{setup.pool}: a reference release answered {answers[0]!r}")
        prefix = next(iter(setups.values())).prefix
        counter.start()
        for _ in range(BYTES_BATCH):
            script(keys=[prefix])
        trivial.add(BYTES_BATCH, counter.stop())
    return costs, trivial, reference, by_evalsha


def embedded_cycle_us(rounds: int = 5, cycles: int = 200) -> tuple[float, float]:
    """Median us per lease+release on fakeredis (the embedded engine), by EVALSHA and by FCALL."""
    import fakeredis

    stores = {}
    for functions in (False, True):
        client = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
        store = PoolStore(client, namespace=NAMESPACE, host_id="bench-embedded", functions=functions)
        store.add_proxies("embedded", proxy_urls(50))
        for _ in range(20):  # loads the scripts / the library
            store.release(store.lease("embedded", "solo", ttl=LEASE_TTL))
        stores[functions] = store
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for functions, store in stores.items():
            began = time.perf_counter()
            for _ in range(cycles):
                store.release(store.lease("embedded", "solo", ttl=LEASE_TTL), outcome="ok", min_interval=0.0)
            times[functions].append((time.perf_counter() - began) / cycles * 1e6)
    return statistics.median(times[False]), statistics.median(times[True])


# --- client CPU per cycle -------------------------------------------------------------------------

@dataclass
class ClientCpu:
    """Client CPU per lease+release cycle, us, round by round: ours and the reference's (same rounds)."""

    ours: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours, self.reference, strict=True)]


def _client_cpu_worker(url: str, pool: str, ref_keys: list[str], site: str, rounds: int, cycles: int,
                       results: Any) -> None:
    """In a fresh process: ``rounds`` rounds, each ``cycles`` of ours and as many of the reference's, in
    alternating blocks of ``CLIENT_CPU_BLOCK`` (which side goes first alternates round by round), timed
    with ``time.process_time`` (this process's CPU only, so redis-server's own work is left out). Puts
    (ours us list, reference us list, None) or ([], [], error)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        ours = _make_op("cycle", client, pool, site)
        ref_lease, ref_release = client.register_script(REFERENCE_LEASE), client.register_script(REFERENCE_RELEASE)
        ttl_ms = str(int(LEASE_TTL * 1000))

        def reference() -> None:  # a minimal client: register_script objects, a fresh token per lease
            reply = ref_lease(keys=ref_keys, args=[ttl_ms, secrets.token_hex(8)])
            if reply[0] != "OK":
                raise RuntimeError(f"reference lease found no free slot: {reply}")
            if ref_release(keys=ref_keys, args=[reply[1], reply[2]]) != "OK":
                raise RuntimeError("reference release did not answer OK")

        times: dict[str, list[float]] = {"ours": [], "reference": []}
        ops = {"ours": ours, "reference": reference}
        for name in ("ours", "reference", "ours", "reference"):  # warm-up (scripts loaded, caches filled)
            for _ in range(max(100, cycles // 10)):
                ops[name]()
        block = max(1, min(CLIENT_CPU_BLOCK, cycles))
        for n in range(rounds):
            spent = {"ours": 0.0, "reference": 0.0}
            order = ("ours", "reference") if n % 2 == 0 else ("reference", "ours")
            for done in range(0, cycles, block):  # short blocks, alternating: both sides see the same drift
                count = min(block, cycles - done)
                for name in order:
                    op = ops[name]
                    start = time.process_time()
                    for _ in range(count):
                        op()
                    spent[name] += time.process_time() - start
            for name in order:
                times[name].append(spent[name] / cycles * 1e6)
        results.put((times["ours"], times["reference"], None))
    except Exception as exc:  # reported by the parent, which fails the run
        results.put(([], [], f"{type(exc).__name__}: {exc}"))
    finally:
        client.close()


def measure_client_cpu(ctx: Any, url: str, setup: PoolSetup, site: str, rounds: int, cycles: int) -> ClientCpu:
    """Client CPU per cycle, ours (``PoolStore``) and the reference's, in one fresh process."""
    results = ctx.Queue()
    proc = ctx.Process(target=_client_cpu_worker,
                       args=(url, setup.pool, setup.reference_keys, site, rounds, cycles, results), daemon=True)
    proc.start()
    try:
        ours, ref, error = results.get(timeout=rounds * cycles * 0.01 + 180)
    except queue.Empty:
        raise RuntimeError("the client CPU worker process gave no result") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    if error:
        raise RuntimeError(f"client CPU worker failed: {error}")
    return ClientCpu(ours, ref)


def client_cpu_report(cpu: ClientCpu, rounds: int, cycles: int) -> int:
    """Print the client CPU section; returns its misses (0 or 1)."""
    print(f"\nClient CPU per lease + release cycle (time.process_time of the client process / cycles, us; "
          f"redis-server's\n  CPU excluded), ours (PoolStore, as the throughput cycle) vs the reference done the "
          f"way a minimal client\n  would (redis-py register_script on redis.Redis(decode_responses=True), a "
          f"secrets.token_hex(8) token per lease);\n  {rounds} rounds x {cycles} cycles each, in alternating blocks of "
          f"{min(CLIENT_CPU_BLOCK, cycles)}; "
          f"{CLIENT_CPU_SIZE} proxies, one site; ratio: median over the rounds of ours / the reference's")
    ratios = cpu.ratios()
    rows = []
    for name, values in (("ours", cpu.ours), ("reference", cpu.reference), ("ours / reference", ratios)):
        fmt = "{:.2f}" if name == "ours / reference" else "{:.1f}"
        rows.append([name, fmt.format(statistics.median(values)),
                     f"{fmt.format(min(values))}-{fmt.format(max(values))}",
                     ", ".join(fmt.format(v) for v in values)])
    print(table(["", "median", "min-max", "rounds"], rows))
    value = statistics.median(ratios)
    ok = value <= CLIENT_CPU_TARGET
    print(table(["check", "value", "target", ""],
                [["client CPU us ours / reference", f"{value:.2f}", f"<= {CLIENT_CPU_TARGET}", verdict(ok)]]))
    return 0 if ok else 1


def client_cpu_only(args: argparse.Namespace) -> int:
    """``--client-cpu``: just the client CPU section, on a pool of its own."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        store = PoolStore(admin, namespace=NAMESPACE, host_id="bench-main")
        setup = build_pool(admin, store, CLIENT_CPU_SIZE, ["solo"])
        build_reference(admin, setup)
        print("scrapy-proxy-shard engine benchmark (benchmarks/bench_engine.py --client-cpu)")
        print(f"  redis-server {admin.info('server')['redis_version']}, python {platform.python_version()}, "
              f"redis-py {redis.__version__}; engine {engine_revision()}")
        admin.close()
        cpu = measure_client_cpu(ctx, server.url, setup, "solo", args.cpu_rounds, args.cpu_cycles)
    misses = client_cpu_report(cpu, args.cpu_rounds, args.cpu_cycles)
    print(f"\n{'all targets met' if not misses else f'{misses} target(s) missed'}")
    return 1 if misses else 0


# --- report ---------------------------------------------------------------------------------------

def cycle_usec(pair: tuple[CallCost, CallCost]) -> list[float]:
    """Server CPU of one lease + one release, us, round by round."""
    return [a + b for a, b in zip(pair[0].round_usec, pair[1].round_usec, strict=True)]


def engine_revision() -> str:
    """The git commit of the engine measured, and whether its files had uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "scrapy_proxy_shard/engine"],
                               cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    changed = len(dirty.splitlines())
    return f"commit {head}" + (f" + uncommitted changes in {changed} engine file(s)" if changed else "")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  " + "  ".join(str(h).rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines += ["  " + "  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def median_range(values: list[float], digits: int = 1) -> str:
    """A figure measured over several rounds: its median and, in brackets, its range."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def n0(value: float) -> str:
    return f"{value:,.0f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="short smoke run: 1 s per figure, one repetition")
    parser.add_argument("--seconds", type=float, default=None,
                        help="timed seconds per figure and repetition (default 3, or 1 with --quick)")
    parser.add_argument("--processes", type=int, default=4,
                        help="OS processes of the multi-process measurements (default 4)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="repetitions of the whole timed schedule, averaged (default 2, or 1 with --quick)")
    parser.add_argument("--tasks", type=int, default=64,
                        help="asyncio tasks of the one-process AsyncPoolStore measurement (default 64)")
    parser.add_argument("--client-cpu", action="store_true",
                        help="only the client CPU per cycle section (ours vs the reference), then exit")
    parser.add_argument("--cpu-rounds", type=int, default=7,
                        help="rounds of the client CPU section, ours and the reference alternating (default 7)")
    parser.add_argument("--cpu-cycles", type=int, default=2000,
                        help="lease+release cycles per round and side in the client CPU section (default 2000)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                        help="comma-separated pool sizes (default 500,10000,100000)")
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (1.0 if args.quick else 3.0)
    args.repeat = args.repeat or (1 if args.quick else 2)
    args.warmup = 0.1 if args.quick else 0.3  # per job and process, before its timed slices
    args.slice = 0.1 if args.quick else 0.25
    args.sizes = sorted({int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()})
    if args.processes < 2:
        parser.error("--processes must be at least 2 (1 process is always measured)")
    if len(args.sizes) < 2:
        parser.error("--sizes needs at least two sizes to compare")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_cpu:
        return client_cpu_only(args)
    nproc, sizes = args.processes, args.sizes
    small, large = sizes[0], sizes[-1]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    sites = ["solo", *(f"d{i}" for i in range(nproc)), "shared", "tasks"]
    modes = [("1", "1 proc", ["solo"]),
             ("distinct", f"{nproc} proc, distinct sites", [f"d{i}" for i in range(nproc)]),
             ("shared", f"{nproc} proc, shared site", ["shared"] * nproc)]
    revision = engine_revision()  # before the run: what the workers' scripts were read from
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    runs: list[dict[str, list[Rate]]] = []
    async_runs: list[list[float]] = []  # per repetition: `return 1` calls/s, then cycles/s per pool size

    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        store = PoolStore(admin, namespace=NAMESPACE, host_id="bench-main")
        version = admin.info("server")["redis_version"]
        malloc = admin.info("memory").get("mem_allocator", "?")
        # Load every script the run uses, so no SCRIPT LOAD lands inside a memory delta.
        store.add_proxies("warmup", proxy_urls(1))
        store.release(store.lease("warmup", "warmup", ttl=LEASE_TTL))
        admin.register_script(TRIVIAL_SCRIPT)(keys=["warmup"])
        hot_path = "FCALL (Redis Functions)" if store._functions is not None else "EVALSHA"

        setups = {size: build_pool(admin, store, size, sites) for size in sizes}
        for setup in setups.values():
            build_reference(admin, setup)

        first_pool = setups[small].pool
        for _ in range(args.repeat):
            run = {}
            for mode, _, own_sites in modes:
                jobs = [[("trivial1", first_pool, site), ("trivial2", first_pool, site),
                         *(("cycle", setups[size].pool, site) for size in sizes)] for site in own_sites]
                run[mode] = measure(ctx, server.url, jobs, args.warmup, args.seconds, args.slice)
            runs.append(run)
            async_jobs = [("trivial1", first_pool, "solo"), *(("cycle", setups[size].pool, "tasks") for size in sizes)]
            async_runs.append(measure_async(ctx, server.url, async_jobs, args.tasks, args.warmup, args.seconds,
                                            args.slice))

        rounds = 6 if args.quick else 16  # (--quick: enough rounds for a stable median of the paired ratios)
        evalsha_store = None
        if store._functions is not None:  # the same calls by EVALSHA, measured in the same rounds
            evalsha_store = PoolStore(admin, namespace=NAMESPACE, host_id="bench-evalsha", functions=False)
        costs, trivial_cost, reference, by_evalsha = measure_calls(admin, store, setups, "solo", rounds,
                                                                   evalsha_store)
        for setup in setups.values():
            counters_memory(admin, setup)
        admin.close()
        cpu_setup = setups[CLIENT_CPU_SIZE] if CLIENT_CPU_SIZE in setups else setups[small]
        client_cpu = measure_client_cpu(ctx, server.url, cpu_setup, "solo", args.cpu_rounds, args.cpu_cycles)

    elapsed = time.perf_counter() - began
    load_after = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    op_index = {"trivial1": 0, "trivial2": 1, **{size: 2 + i for i, size in enumerate(sizes)}}

    def rate(mode: str, op: Any, run: dict | None = None) -> float:
        """ops/s: of one run, or averaged over the runs (equal durations, so pooled)."""
        chosen = [run] if run is not None else runs
        return sum(r[mode][op_index[op]].total for r in chosen) / len(chosen)

    def spread(mode: str, op: Any) -> str:
        values = [v for r in runs for v in r[mode][op_index[op]].per_process]
        return f"{n0(min(values))}-{n0(max(values))}"

    print(f"scrapy-proxy-shard engine benchmark (benchmarks/bench_engine.py), {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"  redis-server {version} (malloc {malloc}), python {platform.python_version()}, redis-py "
          f"{redis.__version__}, {cpus} CPUs, {platform.system()} {platform.release()}; engine {revision}")
    print(f"  lease and release called by {hot_path}")
    print(f"  each figure: {args.seconds:g} s timed per repetition, in {args.slice:g} s slices interleaved with "
          f"the other figures of its column, x{args.repeat} repetitions averaged; {args.warmup:g} s warm-up per "
          f"job; {nproc} worker processes ({ctx.get_start_method()}); whole run {elapsed:.0f} s")
    print(f"  1-min load average before/after: {load_before:.2f} / {load_after:.2f} (the run itself adds up to "
          f"{nproc + 1}; a high 'before' means other work shared the machine)")
    if nproc + 1 > cpus:
        print(f"  note: {nproc} client processes + redis-server share {cpus} CPUs, so the {nproc}-process figures "
              "measure this saturated machine (client CPU included); the ceiling is measured the same way.")
    print(f"  a cycle: lease (ttl {LEASE_TTL:g} s) + release(outcome ok, latency {LATENCY:g} s, min_interval 0), "
          "with PoolStore over redis.Redis(decode_responses=True), one client per process.")
    print("  distinct sites: each process leases on its own site; shared site: all processes lease on one site")
    print("  (the multi-host case). Every release must answer ok or the run fails, so a slot handed out twice")
    print("  (which would make one holder's release stale) would have stopped it.")

    print("\nOne-off costs (not in the timings)")
    rows = []
    for size, setup in setups.items():
        rows.append([n0(size), f"{setup.add_seconds:.2f} s", n0(size / setup.add_seconds),
                     f"{setup.first_lease_ms[0]:.1f}",
                     f"{sum(setup.first_lease_ms) / len(setup.first_lease_ms):.1f}",
                     f"{max(setup.first_lease_ms):.1f}"])
    print(table(["pool size", "add_proxies", "proxies/s", "first lease ms (builds site ZSET)",
                 f"mean of {len(sites)} sites ms", "max ms"], rows))

    print("\nThroughput: lease+release cycles/s (a cycle = 2 round trips), summed over processes "
          "[per-process min-max]")
    rows = []
    for size in sizes:
        row = [n0(size)]
        for mode, _, _ in modes:
            cell = n0(rate(mode, size))
            if mode != "1":
                cell += f" [{spread(mode, size)}]"
            row.append(cell)
        rows.append(row)
    rows.append(["ceiling: `return 1` calls/s", *(n0(rate(mode, "trivial1")) for mode, _, _ in modes)])
    rows.append(["ceiling: 2 x `return 1` cycles/s", *(n0(rate(mode, "trivial2")) for mode, _, _ in modes)])
    print(table(["pool size", *(label for _, label, _ in modes)], rows))

    misses = 0
    rows = []

    def ratio_row(name: str, label: str, fn: Any, target: float | None) -> None:
        nonlocal misses
        value = fn(None)
        per_run = ", ".join(f"{fn(run):.2f}" for run in runs) if len(runs) > 1 else ""
        if target is None:
            rows.append([name, label, f"{value:.2f}", per_run, "info", ""])
            return
        ok = value >= target
        misses += not ok
        rows.append([name, label, f"{value:.2f}", per_run, f">= {target}", verdict(ok)])

    for mode, label, _ in modes:
        ratio_row(f"cycles/s({n0(large)}) / cycles/s({n0(small)})", label,
                  lambda run, m=mode: rate(m, large, run) / rate(m, small, run), SCALE_TARGET)
    for size in sizes:
        for mode, label, _ in modes:
            ratio_row(f"2 x cycles/s / `return 1` calls/s @ {n0(size)}", label,
                      lambda run, m=mode, z=size: 2 * rate(m, z, run) / rate(m, "trivial1", run), CEILING_TARGET)
    for mode, label, _ in modes:
        ratio_row(f"cycles/s / 2 x `return 1` cycles/s @ {n0(large)}", label,
                  lambda run, m=mode: rate(m, large, run) / rate(m, "trivial2", run), None)
    tasks_label = f"1 proc, {args.tasks} asyncio tasks"
    for i, size in enumerate(sizes):  # the asyncio figure: same target as the processes'
        value = 2 * sum(r[1 + i] for r in async_runs) / sum(r[0] for r in async_runs)
        ok = value >= CEILING_TARGET
        misses += not ok
        rows.append([f"2 x cycles/s / `return 1` calls/s @ {n0(size)}", tasks_label, f"{value:.2f}",
                     ", ".join(f"{2 * r[1 + i] / r[0]:.2f}" for r in async_runs) if len(async_runs) > 1 else "",
                     f">= {CEILING_TARGET}", verdict(ok)])
    print(f"\n{tasks_label} (AsyncPoolStore over redis.asyncio, one client; its own `return 1` ceiling with the "
          "same tasks and client)")
    print(table(["pool size", "cycles/s", "`return 1` calls/s", "2 x cycles/s / calls/s", "runs"],
                [[n0(size), n0(statistics.mean(r[1 + i] for r in async_runs)),
                  n0(statistics.mean(r[0] for r in async_runs)),
                  f"{2 * sum(r[1 + i] for r in async_runs) / sum(r[0] for r in async_runs):.2f}",
                  ", ".join(f"{2 * r[1 + i] / r[0]:.2f}" for r in async_runs)] for i, size in enumerate(sizes)]))
    print("\nRatios (value over the averaged runs; each run in brackets)")
    print(table(["ratio", "processes", "value", "runs", "target", ""], rows))

    print(f"\nPer call, server side ({rounds} rounds of {BYTES_BATCH} calls, pool sizes interleaved; bytes: INFO "
          "stats net counters over all rounds; CPU: INFO commandstats, median of the rounds)")
    rows = []
    for size in sizes:
        lease, release = costs[size]
        rows.append([n0(size), f"{lease.out_per_call:.1f}", f"{release.out_per_call:.1f}",
                     f"{lease.in_per_call:.1f}", f"{release.in_per_call:.1f}",
                     f"{lease.usec_per_call:.1f}", f"{release.usec_per_call:.1f}",
                     n0(1e6 / (lease.usec_per_call + release.usec_per_call))])
    rows.append(["`return 1`", f"{trivial_cost.out_per_call:.1f}", "",
                 f"{trivial_cost.in_per_call:.1f}", "", f"{trivial_cost.usec_per_call:.1f}", "",
                 n0(1e6 / trivial_cost.usec_per_call) + " calls/s"])
    print(table(["pool size", "lease B sent", "release B sent", "lease B recv", "release B recv",
                 "lease us CPU", "release us CPU", "server-bound cycles/s"], rows))
    checks = []
    for name, pick in (("lease bytes sent", lambda c: c[0].out_per_call),
                       ("release bytes sent", lambda c: c[1].out_per_call),
                       ("lease bytes received", lambda c: c[0].in_per_call),
                       ("release bytes received", lambda c: c[1].in_per_call)):
        values = [pick(costs[size]) for size in sizes]
        gap = max(values) - min(values)
        ok = gap <= BYTES_TOLERANCE
        misses += not ok
        checks.append([f"{name}: max - min over pool sizes", f"{gap:.1f} B", f"<= {BYTES_TOLERANCE:g} B",
                       verdict(ok)])
    for name, index in (("lease", 0), ("release", 1)):
        value = costs[small][index].paired_ratio(costs[large][index])
        ok = value >= SCALE_TARGET
        misses += not ok
        checks.append([f"{name} CPU us({n0(small)}) / us({n0(large)}), median of paired rounds", f"{value:.2f}",
                       f">= {SCALE_TARGET}",
                       verdict(ok)])
    print(table(["check", "value", "target", ""], checks))

    print("\nRedis time per lease + release (INFO commandstats, us), ours vs the two-script ZSET reference "
          "(see the\n  docstring), interleaved round by round; ratio: median over the rounds of ours / the reference "
          f"in the same round;\n  each figure: median (min-max) over the {len(trivial_cost.round_usec)} rounds")
    trivial_us = trivial_cost.usec_per_call
    rows, checks = [], []
    for size in sizes:
        ours, ref = cycle_usec(costs[size]), cycle_usec(reference[size])
        ratios = [a / b for a, b in zip(ours, ref, strict=True)]
        ratio = statistics.median(ratios)
        rows.append([n0(size), median_range(ours), median_range(ref), median_range(ratios, 2),
                     f"{statistics.median(ours) / (2 * trivial_us):.2f}",
                     f"{statistics.median(ref) / (2 * trivial_us):.2f}"])
        ok = ratio <= REFERENCE_TARGET
        misses += not ok
        checks.append([f"cycle us / reference cycle us @ {n0(size)}", f"{ratio:.2f}", f"<= {REFERENCE_TARGET}",
                       verdict(ok)])
    print(table(["pool size", "ours us", "reference us", "ours / reference", "ours / 2 x `return 1`",
                 "reference / 2 x `return 1`"], rows))
    if by_evalsha:
        print("\n  the same lease + release by EVALSHA (Functions off), same rounds: what FCALL saves")
        rows = []
        for size in sizes:
            fcall, evalsha = cycle_usec(costs[size]), cycle_usec(by_evalsha[size])
            ratios = [a / b for a, b in zip(fcall, evalsha, strict=True)]
            ref = statistics.median(cycle_usec(reference[size]))
            rows.append([n0(size), median_range(evalsha), median_range(fcall),
                         median_range(ratios, 2), f"{statistics.median(evalsha) / ref:.2f}"])
        print(table(["pool size", "EVALSHA us", "FCALL us", "FCALL / EVALSHA", "EVALSHA / reference"], rows))
    ref_us = statistics.median(statistics.median(cycle_usec(reference[size])) for size in sizes)
    issue_mid = sum(ISSUE_REFERENCE_US) / 2
    slow = ref_us > ISSUE_REFERENCE_US[1]
    budget = CYCLE_TARGET_US * max(1.0, ref_us / issue_mid)
    for size in sizes:
        value = statistics.median(cycle_usec(costs[size]))
        ok = value <= CYCLE_TARGET_US
        if not slow:
            misses += not ok
        checks.append([f"cycle us @ {n0(size)}", f"{value:.1f}", f"<= {CYCLE_TARGET_US:g}",
                       verdict(ok) + (" (info: slow machine)" if slow else "")])
        if slow:
            ok = value <= budget
            misses += not ok
            checks.append([f"cycle us @ {n0(size)}, machine-scaled", f"{value:.1f}", f"<= {budget:.1f}", verdict(ok)])
    print(table(["check", "value", "target", ""], checks))
    print(f"  `return 1` costs {trivial_us:.1f} us here. The {CYCLE_TARGET_US:g} us target was set where the reference "
          f"cycle cost {ISSUE_REFERENCE_US[0]:g}-{ISSUE_REFERENCE_US[1]:g} us;")
    if slow:
        print(f"  here it costs {ref_us:.1f} us (median over the pool sizes), so this machine is "
              f"{ref_us / issue_mid:.2f} x slower than that one\n  (midpoint {issue_mid:g} us): the absolute "
              f"target is printed for information and the machine-scaled one ({CYCLE_TARGET_US:g} us x "
              f"{ref_us / issue_mid:.2f} = {budget:.1f} us) is the check.")
    else:
        print(f"  here it costs {ref_us:.1f} us, no slower: the absolute target is the check.")

    print("\n1-process cycle anatomy, us: cycle = 2 round trips of `return 1` + server Lua work beyond `return 1`"
          "\n  + the rest (client side: packing/parsing the larger commands and replies, PoolStore)")
    rows = []
    rtt = 1e6 / rate("1", "trivial1")
    for size in sizes:
        lease, release = costs[size]
        cycle = 1e6 / rate("1", size)
        lua = lease.usec_per_call + release.usec_per_call - 2 * trivial_cost.usec_per_call
        rows.append([n0(size), f"{cycle:.0f}", f"{2 * rtt:.0f}", f"{lua:.0f}", f"{cycle - 2 * rtt - lua:.0f}"])
    print(table(["pool size", "cycle", "2 x `return 1` round trip", "extra Lua", "rest"], rows))

    print("\nredis-server memory per proxy (INFO used_memory delta; MEMORY USAGE of the keys in brackets)")
    rows = []
    for size, setup in setups.items():
        rows.append([n0(size), f"{setup.pool_bytes_info:.0f} [{setup.pool_bytes_usage:.0f}]",
                     f"{setup.site_bytes_info:.0f} [{setup.site_bytes_usage:.0f}]",
                     f"{setup.pool_bytes_info + setup.site_bytes_info:.0f}",
                     f"{setup.stats_bytes:.0f} ({n0(setup.stats_proxies)} proxies)"])
    print(table(["pool size", "pool B/proxy", "+ each site B/proxy", "pool + 1 site",
                 "+ counters B/leased proxy"], rows))
    base = sizes[1] if len(sizes) > 2 else small  # the smallest pool's hash may use the compact encoding
    per_proxy = {size: s.pool_bytes_info + s.site_bytes_info for size, s in setups.items()}
    value = per_proxy[large] / per_proxy[base]
    ok = value <= MEMORY_TARGET
    misses += not ok
    print(table(["check", "value", "target", ""],
                [[f"B/proxy (pool + 1 site) @ {n0(large)} / @ {n0(base)}", f"{value:.2f}", f"<= {MEMORY_TARGET}",
                  verdict(ok)]]))

    misses += client_cpu_report(client_cpu, args.cpu_rounds, args.cpu_cycles)

    print("\nThe embedded engine (fakeredis, also the fallback's local slice): lease+release by EVALSHA and by FCALL,"
          "\n  interleaved rounds of 200 cycles on 50 proxies, median us per cycle (information, no target)")
    evalsha_us, fcall_us = embedded_cycle_us()
    print(table(["EVALSHA us", "FCALL us", "FCALL / EVALSHA"],
                [[f"{evalsha_us:.0f}", f"{fcall_us:.0f}", f"{fcall_us / evalsha_us:.2f}"]]))

    print(f"\n{'all targets met' if not misses else f'{misses} target(s) missed'}")
    return 1 if misses else 0  # a missed target fails the run (CI and scripts see it)


if __name__ == "__main__":
    raise SystemExit(main())
