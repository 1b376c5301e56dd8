"""Which lease engine a crawl uses, and which proxies it loads at start.

- ``redis``: the shared pool in Redis (``PROXY_SHARD_REDIS_URL``), with the local fallback of
  ``fallback.py`` when Redis stops answering (``PROXY_SHARD_FALLBACK``).
- ``embedded``: no Redis configured: one process, the same leases, pacing, bans and sessions, in
  memory. The in-process engine runs *the same Lua scripts* on fakeredis's in-memory server (Lua via
  lupa), so it cannot drift from the Redis semantics: the contract suite runs on both.
- ``static``: shared-nothing: each host uses only its slice of ``PROXY_SHARD_PROXIES``, by
  consistent (rendezvous) or modulo hashing over ``PROXY_SHARD_HOSTS``, in its own embedded engine.

``PROXY_SHARD_PLATFORMS`` partitions proxies between platforms (sites that must never see one IP
together) in every mode: the sites of platform ``p`` lease from pool ``<pool>.<p>``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import fakeredis

from .connection import async_client
from .exceptions import SettingError
from .proxies import make_proxy
from .settings import ShardSettings
from .sharding import partition_by_platform, slice_for
from .store import AsyncPoolStore

logger = logging.getLogger(__name__)


def embedded_client() -> fakeredis.FakeAsyncRedis:
    """A private in-memory Redis (fakeredis, Lua enabled) for one process."""
    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)


def store_kwargs(settings: ShardSettings) -> dict:
    return {"namespace": settings.namespace, "host_id": settings.host_id, "bans": settings.bans,
            "ewma_alpha": settings.latency_ewma_alpha}


def settled_counter(stats):
    """Count lease calls whose reply was lost, by how Redis settled them (``abandon.lua``):
    ``released`` (it had run: its slot is given back), ``gone``, ``barred`` (it had not run)."""
    if stats is None:
        return None
    return lambda status: stats.inc_value(f"proxy_shard/leases/abandoned/{status}")


def build_store(settings: ShardSettings, stats=None):
    """The store the runtime talks to, by ``PROXY_SHARD_MODE``."""
    if settings.mode in ("embedded", "static"):
        if settings.mode == "static" and not settings.hosts:
            raise SettingError("PROXY_SHARD_MODE 'static' needs PROXY_SHARD_HOSTS (every host id, in any order)")
        return AsyncPoolStore(embedded_client(), **store_kwargs(settings))
    where = settings.redis_url or "sentinel://{}/{}".format(
        ",".join(f"{h}:{p}" for h, p in settings.redis_sentinels), settings.redis_sentinel_master)
    primary = AsyncPoolStore(async_client(settings), url_for_errors=where, on_settled=settled_counter(stats),
                             **store_kwargs(settings))
    if not settings.fallback:
        return primary
    from .fallback import FallbackPoolStore

    return FallbackPoolStore(primary, settings, stats=stats)


def platform_pool(pool: str, platform: str) -> str:
    return f"{pool}.{platform}"


def initial_proxies(settings: ShardSettings) -> dict[str, list]:
    """What to load at spider open: ``PROXY_SHARD_PROXIES``, split by platform, and in static mode
    cut down to this host's slice."""
    out: dict[str, list] = {}
    for pool, entries in settings.proxies.items():
        proxies = {p.id: p for p in (make_proxy(e) for e in entries)}
        if settings.mode == "static":
            mine = set(slice_for(proxies, settings.hosts, settings.host_id, settings.sharding))
            proxies = {pid: p for pid, p in proxies.items() if pid in mine}
        if settings.platforms:
            for platform, ids in partition_by_platform(proxies, list(settings.platforms)).items():
                out[platform_pool(pool, platform)] = [proxies[i] for i in ids]
        out[pool] = list(proxies.values())
    return out


def platform_of(site: str, platforms: Mapping[str, tuple[str, ...]]) -> str | None:
    for platform, sites in platforms.items():
        if site in sites:
            return platform
    return None
