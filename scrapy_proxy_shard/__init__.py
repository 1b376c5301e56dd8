"""scrapy-proxy-shard: many Scrapy processes on many hosts sharing one proxy pool through Redis.

Every request leases a proxy slot for its site atomically (one Lua script, one round trip), so no
two hosts send from one IP to one site at the same moment; bans are quarantined for every host at
once; sticky sessions keep one IP for a session's lifetime.
"""

from scrapy_proxy_shard._version import __version__
from scrapy_proxy_shard.engine.proxies import Proxy, make_proxy, mask, parse_proxy, proxy_id
from scrapy_proxy_shard.engine.store import AsyncPoolStore, Lease, LeaseWait, PoolBackend, PoolStore, ReleaseResult
from scrapy_proxy_shard.exceptions import (
    NoProxyAvailable,
    PoolBackendError,
    PoolExhausted,
    PoolUnreachable,
    ProxyBanned,
    ProxyShardError,
    ProxyURLError,
    RequestKept,
    SettingError,
    UnknownPoolError,
)
from scrapy_proxy_shard.settings import ShardSettings

__all__ = [
    "AsyncPoolStore",
    "Lease",
    "LeaseWait",
    "NoProxyAvailable",
    "PoolBackend",
    "PoolBackendError",
    "PoolExhausted",
    "PoolStore",
    "PoolUnreachable",
    "Proxy",
    "ProxyBanned",
    "ProxyShardError",
    "ProxyURLError",
    "ReleaseResult",
    "RequestKept",
    "SettingError",
    "ShardSettings",
    "UnknownPoolError",
    "__version__",
    "make_proxy",
    "mask",
    "parse_proxy",
    "proxy_id",
]
