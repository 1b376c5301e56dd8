"""Cluster-wide health from the crawl side: every Scrapy process keeps itself on the pools' host lists.

A ``HostMonitor`` runs in each crawl (started by the runtime when the spider opens, stopped when it
closes). Every ``PROXY_SHARD_HEARTBEAT_INTERVAL`` it sends one heartbeat per pool it uses
(``host_beat.lua``): the host stays in the pool's ``hosts`` set for ``PROXY_SHARD_HOST_TTL``, the
leases it took since the previous beat go into a per-minute load bucket, and hosts that stopped
beating are forgotten. So operators see live processes (``scrapy-proxy-shard hosts``), their load
over time and their success rate, while the request path pays nothing: the per-request counters are
bumped inside the lease and release scripts that run anyway, and everything else is written here,
once per interval.

A clean close leaves at once (``host_leave.lua``); a crashed process ages out after its host TTL.
Every ``PROXY_SHARD_LOGSTATS_INTERVAL`` the monitor also writes the log line of ``logstats.py``
from the last beats.

Host ids are unique per crawler by default (``settings.crawler_host_id``). Each beat carries the
process's instance token (``modes/process.py``): when a crawl opens, a live record of its host id
holding another token — another process configured with the same ``PROXY_SHARD_HOST_ID`` — is waited
on until it expires (a restart right after a crash: the dead process's record outlives it by up to its
host TTL) and refused as soon as that record beats again (a live duplicate): one line, exit code 1.
Crawlers of one process given the same id are one host on purpose (they share its engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from scrapy_proxy_shard.crawl.logstats import PoolLogStats
from scrapy_proxy_shard.engine.store import Beat, PoolBackend
from scrapy_proxy_shard.exceptions import HostIdTaken, ProxyShardError, SettingError
from scrapy_proxy_shard.modes.process import instance_token, join_host, leave_host
from scrapy_proxy_shard.settings import ShardSettings

logger = logging.getLogger(__name__)

#: Width of a load bucket and how much load history each host keeps in Redis (bounded memory).
LOAD_BUCKET = 60.0
LOAD_KEEP = 3600.0
#: A pool this host has not used is asked again only every this many beats (few round trips per beat
#: however many pools the namespace has; a pool the host starts using is joined within that many).
IDLE_RECHECK = 6
#: How often a crawl whose host id another instance holds asks again at open (seconds, at most).
CLAIM_POLL = 0.5


def host_info(spider_name: str | None) -> dict[str, Any]:
    """What a host tells the others about itself: never a URL, never a credential."""
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "spider": spider_name or ""}


class HostMonitor:
    """Heartbeats for every pool this process uses, plus the periodic pool log line."""

    def __init__(self, store: PoolBackend, settings: ShardSettings, *, pools: Iterable[str], stats: Any = None,
                 spider_name: str | None = None, clock: Callable[[], float] | None = None,
                 on_taken: Callable[[HostIdTaken], None] | None = None,
                 on_beat: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.store = store
        self.settings = settings
        self.pools = tuple(dict.fromkeys(pools))  # always registered: the spider's and configured pools
        self.info = host_info(spider_name)
        self.logstats = PoolLogStats(stats, settings.host_id) if settings.logstats_interval > 0 else None
        self.beats: dict[str, Beat] = {}
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._stopping: asyncio.Event | None = None
        self._failing = False
        self._beats_done = 0
        self._idle: set[str] = set()
        self.token = instance_token()
        self._joined = False
        self._taken_logged = False
        self.on_taken = on_taken  # called once when the id is taken over while running (the runtime closes)
        self.on_beat = on_beat  # awaited after each pool's beat (the runtime reads what the hosts learned)
        self.stats = stats

    @classmethod
    def for_runtime(cls, runtime: Any, spider: Any, pool: str) -> HostMonitor:
        """The spider's pool is joined at once; any other pool the crawl leases from (``meta['proxy_pool']``,
        ``PROXY_SHARD_SITE_POOLS``, platforms) within a few beats of its first lease there. A pool the crawl
        only loads (``PROXY_SHARD_PROXIES``) is not joined until it leases there: ``hosts`` listed a crawl
        under such a pool, and an outage's fallback gave it a slice of a pool it does not use."""
        s: ShardSettings = runtime.settings
        return cls(runtime.store, s, pools=[pool], stats=runtime.stats,
                   spider_name=getattr(spider, "name", None), on_taken=runtime.host_id_taken,
                   on_beat=runtime.links.refresh)

    async def start(self) -> None:
        """Register at once (so ``hosts`` shows the crawl from its first second), then beat on.

        Raises ``SettingError`` when another live process heartbeats under this host id."""
        await self._claim()
        join_host(self.settings.host_id)
        self._joined = True
        if self.logstats is not None:
            self.logstats.start(self._now())
        self._stopping = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="proxy_shard heartbeat")

    async def _claim(self) -> None:
        """The first beat: wait out a dead instance's record of this host id, refuse a live one's."""
        seen: dict[str, float] = {}  # pool -> last beat of the other instance when first met
        deadline = None
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.beat(claiming=True)
            except HostIdTaken as taken:
                first = seen.setdefault(taken.pool, taken.last_beat)
                if taken.last_beat != first or (deadline is not None and loop.time() > deadline):
                    raise self._refusal(taken) from None
                if deadline is None:
                    left = max(0.0, taken.alive_until - taken.last_beat)
                    deadline = loop.time() + left + 2 * CLAIM_POLL
                    logger.warning(
                        "proxy_shard: host id %(id)r has a live heartbeat of another process in pool %(pool)r "
                        "(a restart right after a crash?): waiting up to %(s).1fs for it to expire; if it "
                        "beats again this crawl stops", {"id": self.settings.host_id, "pool": taken.pool, "s": left})
                await asyncio.sleep(CLAIM_POLL)
                continue
            if seen:
                logger.warning("proxy_shard: host id %(id)r taken over: the previous process stopped heartbeating",
                               {"id": self.settings.host_id})
            return

    def _refusal(self, taken: HostIdTaken) -> SettingError:
        return SettingError(
            f"PROXY_SHARD_HOST_ID {taken.host_id!r} is in use by another live process (it heartbeats in pool "
            f"{taken.pool!r}): give every process its own id, or leave PROXY_SHARD_HOST_ID unset "
            f"('<hostname>:<pid>' per crawler)")

    async def stop(self) -> None:
        """Stop beating and leave every pool now, so the host drops out of ``hosts`` at once."""
        task, self._task = self._task, None
        if task is not None:
            # The event ends the loop even if a library swallows the cancellation of a call in flight
            # (seen with redis clients): the task must never outlive the crawl, nor hang its close.
            self._stopping.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        joined, self._joined = self._joined, False
        if joined and not leave_host(self.settings.host_id):
            self.beats.clear()  # another crawler of this process beats as this host id: it stays
            return
        for pool in list(self.beats):
            try:
                await self.store.leave(pool, self.token)
            except ProxyShardError as exc:
                logger.warning("proxy_shard: could not leave pool %(pool)r (the host ages out by itself): %(e)s",
                               {"pool": pool, "e": exc})
        self.beats.clear()

    async def beat(self, *, claiming: bool = False) -> dict[str, Beat]:
        """One heartbeat per pool: the configured ones always, the others where this host leased.
        ``claiming`` (the first beat): ``HostIdTaken`` is raised, not logged."""
        recheck = self._beats_done % IDLE_RECHECK == 0
        self._beats_done += 1
        try:
            known = await self.store.pools()
            for pool in (*self.pools, *(p for p in known if p not in self.pools)):
                if pool in self._idle and not recheck:
                    continue
                try:
                    beat = await self.store.heartbeat(
                        pool, ttl=self.settings.host_ttl, info=self.info, always=pool in self.pools,
                        bucket=LOAD_BUCKET, keep=LOAD_KEEP, token=self.token,
                    )
                except HostIdTaken as taken:
                    if claiming:
                        raise
                    self._host_taken(taken)
                    continue
                if beat is None:
                    self._idle.add(pool)
                else:
                    self._idle.discard(pool)
                    self.beats[pool] = beat
                    if self.on_beat is not None:
                        await self.on_beat(pool)
        except HostIdTaken:
            raise
        except ProxyShardError as exc:
            if not self._failing:
                logger.warning("proxy_shard: heartbeat failed (retrying every %(s)gs): %(e)s",
                               {"s": self.settings.heartbeat_interval, "e": exc})
            self._failing = True
        else:
            if self._failing:
                logger.info("proxy_shard: heartbeat restored")
            self._failing = False
        return self.beats

    def _host_taken(self, taken: HostIdTaken) -> None:
        """Another process took this host id over while this one runs (this one's beats stopped past its
        host TTL: a stalled event loop): its record is left alone, counted. Both processes would lease
        as one host (the same fallback slice when Redis goes away, one host in ``hosts``), so this one
        stops: ``on_taken`` closes the spider (one ERROR line, written there, or here without one)."""
        if self.stats is not None:
            self.stats.inc_value("proxy_shard/host_id_taken")
        if self._taken_logged:
            return
        self._taken_logged = True
        if self.on_taken is not None:
            self.on_taken(taken)
        else:
            logger.error("proxy_shard: %(e)s since this crawl's heartbeats lapsed: give every process its own "
                         "PROXY_SHARD_HOST_ID", {"e": taken})

    async def _run(self) -> None:
        interval = self.settings.heartbeat_interval
        log_every = self.settings.logstats_interval
        next_beat = self._now() + interval
        next_log = self._now() + log_every
        while True:
            due = min(next_beat, next_log) if self.logstats is not None else next_beat
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), max(0.0, due - self._now()))
            if self._stopping.is_set():
                return
            now = self._now()
            try:
                if now >= next_beat:
                    await self.beat()
                if self.logstats is not None and now >= next_log:
                    self.logstats.log(self.beats, now)
            except Exception:  # a monitoring bug must never stop the heartbeats (nor the crawl)
                logger.exception("proxy_shard: heartbeat or log line failed")
            if now >= next_beat:
                next_beat = now + interval
            if now >= next_log:
                next_log = now + log_every

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()
