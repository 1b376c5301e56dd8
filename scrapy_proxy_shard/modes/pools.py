"""What every mode shares: the in-process Redis of the embedded engine, the store's arguments, the
proxies a crawl loads at start, and platform pools (``PROXY_SHARD_PLATFORMS``)."""

from __future__ import annotations

from collections.abc import Mapping

from scrapy_proxy_shard.engine.exits import unique_exits
from scrapy_proxy_shard.engine.gateway import expand_all
from scrapy_proxy_shard.engine.store import AsyncPoolStore
from scrapy_proxy_shard.modes.process import shared_engine
from scrapy_proxy_shard.modes.sharding import partition_by_platform, slice_for
from scrapy_proxy_shard.settings import ShardSettings


def embedded_store(settings: ShardSettings, kind: str | None = None) -> AsyncPoolStore:
    """A store on the process's in-memory engine (``process.py``: one per kind and namespace, shared by
    every crawler of the process): the embedded and static engines (``kind`` None: the mode), and the
    fallback's local slice (``kind`` "fallback"; it cannot use ``factory.build_store``: the factory
    builds the fallback store itself)."""
    return shared_engine(kind or settings.mode, **store_kwargs(settings))

def store_kwargs(settings: ShardSettings) -> dict:
    return {"namespace": settings.namespace, "host_id": settings.host_id, "bans": settings.bans,
            "ewma_alpha": settings.latency_ewma_alpha, "site_idle_ttl": settings.site_idle_ttl,
            "breakers": settings.breaker_for, "pipeline": settings.redis_pipeline,
            "functions": settings.redis_functions}

def settled_counter(stats):
    """Count lease calls whose reply was lost, by how Redis settled them (``abandon.lua``):
    ``released`` (it had run: its slot is given back), ``gone``, ``barred`` (it had not run)."""
    if stats is None:
        return None
    return lambda status: stats.inc_value(f"proxy_shard/leases/abandoned/{status}")

def busy_counter(stats):
    """Count requests sent again because Redis answered BUSY or LOADING (``proxy_shard/redis_busy_retries``)."""
    if stats is None:
        return None
    return lambda: stats.inc_value("proxy_shard/redis_busy_retries")

def platform_pool(pool: str, platform: str) -> str:
    return f"{pool}.{platform}"

def initial_proxies(settings: ShardSettings) -> dict[str, list]:
    """What to load at spider open: ``PROXY_SHARD_PROXIES`` or ``PROXY_SHARD_PROXIES_PATH``, split by
    platform, and in static mode cut down to this host's slice."""
    out: dict[str, list] = {}
    for pool, entries in settings.proxies.items():
        proxies = unique_exits(expand_all(entries), f"PROXY_SHARD_PROXIES[{pool!r}]")
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
