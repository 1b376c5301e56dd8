"""Which lease engine a crawl uses.

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
from typing import Any

from scrapy_proxy_shard.engine.store import BUSY_WAIT, AsyncPoolStore, PoolBackend
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.modes.connection import async_client
from scrapy_proxy_shard.modes.fallback import FallbackPoolStore
from scrapy_proxy_shard.modes.pools import busy_counter, embedded_store, settled_counter, store_kwargs
from scrapy_proxy_shard.settings import ShardSettings

logger = logging.getLogger(__name__)



def build_store(settings: ShardSettings, stats: Any = None, *, client: Any = None) -> PoolBackend:
    """The store the runtime talks to, by ``PROXY_SHARD_MODE``: the one place a crawl's store is built.

    ``client`` (``PROXY_SHARD_REDIS_CLIENT``: a Cluster/Sentinel client built by hand, fakeredis in
    tests) is used as it is, in any mode: a plain store on that client, without the local fallback
    (which needs a URL-built connection it can probe on its own terms).
    """
    if client is not None:
        return AsyncPoolStore(client, on_settled=settled_counter(stats), on_busy_retry=busy_counter(stats),
                              **store_kwargs(settings))
    if settings.mode in ("embedded", "static"):
        if settings.mode == "static" and not settings.hosts:
            raise SettingError("PROXY_SHARD_MODE 'static' needs PROXY_SHARD_HOSTS (every host id, in any order)")
        return embedded_store(settings)
    where = settings.redis_url or "sentinel://{}/{}".format(
        ",".join(f"{h}:{p}" for h, p in settings.redis_sentinels), settings.redis_sentinel_master)
    # BUSY / LOADING: each call waits up to BUSY_WAIT (then PoolBusy: the runtime keeps the request
    # waiting within MAX_WAIT); with the fallback, no longer than FALLBACK_AFTER, which then counts
    # from the episode's first answer (a Redis busy that long is a stalled Redis).
    busy_wait = min(BUSY_WAIT, settings.fallback_after) if settings.fallback else BUSY_WAIT
    primary = AsyncPoolStore(async_client(settings), url_for_errors=where, on_settled=settled_counter(stats),
                             busy_wait=busy_wait, on_busy_retry=busy_counter(stats), **store_kwargs(settings))
    if not settings.fallback:
        return primary
    return FallbackPoolStore(primary, settings, stats=stats)
