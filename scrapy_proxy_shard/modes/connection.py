"""Redis clients from settings, the way scrapy-redis does it: a URL wins, extra parameters pass through.

``PROXY_SHARD_REDIS_URL`` (or scrapy-redis's ``REDIS_URL``) names the server;
``PROXY_SHARD_REDIS_PARAMS`` adds keyword arguments for redis-py's ``from_url`` (timeouts, TLS,
``max_connections``...). Replies are always decoded to ``str``.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

from scrapy_proxy_shard.engine.proxies import mask
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.settings import ShardSettings

_RESERVED = {"decode_responses"}
DEFAULT_PARAMS: dict[str, Any] = {
    "socket_timeout": 10,
    "socket_connect_timeout": 5,
    "health_check_interval": 30,
    "retry_on_timeout": True,
}


def redis_url_of(settings: ShardSettings) -> str:
    if not settings.redis_url:
        raise SettingError(
            "PROXY_SHARD_REDIS_URL is not set (nor REDIS_URL): point every host at one Redis, "
            "e.g. PROXY_SHARD_REDIS_URL = 'redis://127.0.0.1:6379/0'"
        )
    url = settings.redis_url
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise SettingError(
            f"PROXY_SHARD_REDIS_URL ({mask(url)!r}) must start with redis://, rediss:// or unix://"
        )
    return url


def client_params(settings: ShardSettings) -> dict[str, Any]:
    params = {**DEFAULT_PARAMS, **dict(settings.redis_params)}
    bad = _RESERVED & set(params)
    if bad:
        raise SettingError(f"PROXY_SHARD_REDIS_PARAMS: {sorted(bad)} is set by scrapy-proxy-shard itself")
    params["decode_responses"] = True
    return params


def async_client(settings: ShardSettings):
    """An asyncio Redis client (for the Scrapy middlewares): plain, Cluster or Sentinel-managed."""
    if settings.redis_sentinels:
        return _sentinel(redis.asyncio.sentinel.Sentinel, settings)
    if settings.redis_cluster:
        return _build(redis.asyncio.cluster.RedisCluster, settings)
    return _build(redis.asyncio.Redis, settings)


def sync_client(settings: ShardSettings):
    """A blocking Redis client (for the CLI, the exporter and scripts): plain, Cluster or Sentinel."""
    if settings.redis_sentinels:
        return _sentinel(redis.sentinel.Sentinel, settings)
    if settings.redis_cluster:
        return _build(redis.cluster.RedisCluster, settings)
    return _build(redis.Redis, settings)


def _sentinel(cls, settings: ShardSettings):
    """The current master named PROXY_SHARD_REDIS_SENTINEL_MASTER, found through the sentinels; the
    client follows a failover by asking them again."""
    params = client_params(settings)
    sentinel = cls(list(settings.redis_sentinels), sentinel_kwargs={"socket_timeout": params.get("socket_timeout")},
                   **params)
    return sentinel.master_for(settings.redis_sentinel_master)


def _build(cls, settings: ShardSettings):
    url = redis_url_of(settings)
    try:
        return cls.from_url(url, **client_params(settings))
    except (TypeError, ValueError) as exc:
        raise SettingError(
            f"PROXY_SHARD_REDIS_URL ({mask(url)!r}) / PROXY_SHARD_REDIS_PARAMS rejected by redis-py: {exc}"
        ) from None
