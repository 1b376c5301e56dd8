"""Redis clients from settings, the way scrapy-redis does it: a URL wins, extra parameters pass through.

``PROXY_SHARD_REDIS_URL`` (or scrapy-redis's ``REDIS_URL``) names the server;
``PROXY_SHARD_REDIS_PARAMS`` adds keyword arguments for redis-py's ``from_url`` (timeouts, TLS,
``max_connections``...). Replies are always decoded to ``str``.

``LOADING`` replies are retried in one place only, the store (``engine/store.py``: capped exponential
backoff, counted and logged per episode). redis-py files them under ``ConnectionError``
(``BusyLoadingError``), so its own retry policy would send them again inside each call first: for a
URL-built client that is one immediate retry (the pool's connections get no ``retry`` of the
client's, and ``retry_on_timeout`` makes ``Retry(NoBackoff(), 1)``; checked on redis-py 8.1), for a
client built with another ``retry`` up to 10 retries with pauses. So the plain and Sentinel clients
get that same policy *minus* ``LOADING`` (``_PassLoading``), unless ``PROXY_SHARD_REDIS_PARAMS`` sets
``retry`` itself. ``BUSY`` is a plain error reply to redis-py (never retried there).

A ``retry`` of ``PROXY_SHARD_REDIS_PARAMS`` serves both kinds of client (the crawl's asyncio one, the
CLI's blocking one), so it is rebuilt as the kind each client needs, with the same backoff, retry count
and errors (``same_retry_as``): redis-py 8.2 converts a blocking ``Retry`` given to an asyncio client
itself, but warns that a custom ``call_with_retry`` is lost, and redis-py 5 does not convert it at all.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff

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
        name = settings.redis_url_setting or "PROXY_SHARD_REDIS_URL"
        raise SettingError(f"{name} ({mask(url)!r}) must start with redis://, rediss:// or unix://")
    return url


def client_params(settings: ShardSettings) -> dict[str, Any]:
    params = {**DEFAULT_PARAMS, **dict(settings.redis_params)}
    bad = _RESERVED & set(params)
    if bad:
        raise SettingError(f"PROXY_SHARD_REDIS_PARAMS: {sorted(bad)} is set by scrapy-proxy-shard itself")
    params["decode_responses"] = True
    return params


class _LoadingReply(Exception):
    """Carries a ``BusyLoadingError`` through redis-py's retry loop untouched (not a RedisError)."""

    def __init__(self, error: redis.BusyLoadingError) -> None:
        super().__init__(str(error))
        self.error = error


class _PassLoading(redis.retry.Retry):
    """redis-py's retry policy, except that a ``LOADING`` reply is raised at once (to the store)."""

    def call_with_retry(self, do, fail, *args, **kwargs):
        def attempt():
            try:
                return do()
            except redis.BusyLoadingError as exc:
                raise _LoadingReply(exc) from None

        try:
            return super().call_with_retry(attempt, fail, *args, **kwargs)
        except _LoadingReply as passed:
            raise passed.error from None


class _AsyncPassLoading(redis.asyncio.retry.Retry):
    """The asyncio twin of ``_PassLoading``."""

    async def call_with_retry(self, do, fail, *args, **kwargs):
        async def attempt():
            try:
                return await do()
            except redis.BusyLoadingError as exc:
                raise _LoadingReply(exc) from None

        try:
            return await super().call_with_retry(attempt, fail, *args, **kwargs)
        except _LoadingReply as passed:
            raise passed.error from None


def pass_loading_retry(retry_cls, params: dict[str, Any]):
    """The policy redis-py gives a URL-built client's connections for ``params`` (one immediate retry
    of connection errors and timeouts when ``retry_on_timeout`` or ``retry_on_error`` is set, else
    none), as a ``retry_cls`` that leaves ``LOADING`` replies to the store."""
    return retry_cls(NoBackoff(), 1 if params.get("retry_on_timeout") or params.get("retry_on_error") else 0)


def same_retry_as(retry: Any, retry_cls: type) -> Any:
    """``retry`` as a ``retry_cls`` (``redis.retry.Retry`` or ``redis.asyncio.retry.Retry``): the same
    backoff, retry count and retried errors. Anything else (already that kind, or not a redis-py
    retry policy) is returned as it is, for redis-py to accept or reject."""
    if isinstance(retry, retry_cls):
        return retry
    other = redis.asyncio.retry.Retry if retry_cls is redis.retry.Retry else redis.retry.Retry
    if not isinstance(retry, other):
        return retry
    same = retry_cls(retry._backoff, retry._retries, tuple(retry._supported_errors))
    if hasattr(retry, "_is_retryable"):  # redis-py >= 6
        same._is_retryable = retry._is_retryable
    return same


def async_client(settings: ShardSettings):
    """An asyncio Redis client (for the Scrapy middlewares): plain, Cluster or Sentinel-managed."""
    retry = pass_loading_retry(_AsyncPassLoading, client_params(settings))
    kind = redis.asyncio.retry.Retry
    if settings.redis_sentinels:
        return _sentinel(redis.asyncio.sentinel.Sentinel, settings, kind, retry)
    if settings.redis_cluster:
        return _build(redis.asyncio.cluster.RedisCluster, settings, kind)
    return _build(redis.asyncio.Redis, settings, kind, retry)


def sync_client(settings: ShardSettings):
    """A blocking Redis client (for the CLI, the exporter and scripts): plain, Cluster or Sentinel."""
    retry = pass_loading_retry(_PassLoading, client_params(settings))
    kind = redis.retry.Retry
    if settings.redis_sentinels:
        return _sentinel(redis.sentinel.Sentinel, settings, kind, retry)
    if settings.redis_cluster:
        return _build(redis.cluster.RedisCluster, settings, kind)
    return _build(redis.Redis, settings, kind, retry)


def _params_for(settings: ShardSettings, retry_kind: type) -> dict[str, Any]:
    params = client_params(settings)
    if "retry" in params:
        params["retry"] = same_retry_as(params["retry"], retry_kind)
    return params


def _sentinel(cls, settings: ShardSettings, retry_kind: type, retry: Any = None):
    """The current master named PROXY_SHARD_REDIS_SENTINEL_MASTER, found through the sentinels; the
    client follows a failover by asking them again."""
    params = _params_for(settings, retry_kind)
    if retry is not None:
        params.setdefault("retry", retry)
    sentinel = cls(list(settings.redis_sentinels), sentinel_kwargs={"socket_timeout": params.get("socket_timeout")},
                   **params)
    return sentinel.master_for(settings.redis_sentinel_master)


def _build(cls, settings: ShardSettings, retry_kind: type, retry: Any = None):
    url = redis_url_of(settings)
    params = _params_for(settings, retry_kind)
    if retry is not None:  # not for Cluster clients: they use ``retry`` for their own topology loop
        params.setdefault("retry", retry)
    try:
        return cls.from_url(url, **params)
    except (TypeError, ValueError) as exc:
        raise SettingError(
            f"PROXY_SHARD_REDIS_URL ({mask(url)!r}) / PROXY_SHARD_REDIS_PARAMS rejected by redis-py: {exc}"
        ) from None
