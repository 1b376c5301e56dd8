"""Every exception scrapy-proxy-shard raises, in one place.

The tree::

    ProxyShardError                  base class; catch this to catch everything below
    ├── ProxyURLError (ValueError)   a proxy entry is malformed (names the entry, masked)
    ├── SettingError (ValueError)    a PROXY_SHARD_* setting has a bad value (names setting and value)
    ├── UnknownPoolError (KeyError)  the pool does not exist or holds no proxies
    ├── PoolBackendError             Redis answered with an error (names the Redis URL, password masked)
    │   └── PoolUnreachable          Redis cannot be reached: connection refused or lost, timeout
    │       │                        (the fallback store switches to its local slice on this one only)
    │       └── PoolBusy             Redis kept answering BUSY (a slow script) or LOADING (a restart
    │                                loading its dataset) past the store's wait: a stall, not an outage
    ├── NoProxyAvailable             no proxy became free within the wait limit
    │   └── PoolExhausted            no proxy can serve the site before the wait limit ends (every
    │                                proxy quarantined or resting there, nothing in use): failed at once
    ├── RequestKept (IgnoreRequest)  a request that could not get a proxy while the crawl closed for
    │                                proxy_pool_exhausted, put back in JOBDIR's queue for the next run
    ├── InvalidSessionId (IgnoreRequest) meta['session_id'] is not a usable session id (that request
    │                                fails to its errback; it never shares a session by accident)
    └── ProxyBanned (IgnoreRequest)  a request was banned through every proxy its retry budget allowed
                                     (reaches the request's errback, like Scrapy's HttpError)

Messages never contain proxy credentials: callers pass masked URLs.
"""

from __future__ import annotations

from scrapy.exceptions import IgnoreRequest


class ProxyShardError(Exception):
    """Base class of all scrapy-proxy-shard errors."""


class ProxyURLError(ProxyShardError, ValueError):
    """A proxy URL (or a line of a proxy list) is malformed."""


class SettingError(ProxyShardError, ValueError):
    """A PROXY_SHARD_* setting has an invalid value."""


class UnknownPoolError(ProxyShardError, KeyError):
    """The named pool does not exist, or it holds no proxies."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown pool"


class PoolBackendError(ProxyShardError):
    """Redis is unreachable or returned an error for a pool operation."""


class PoolUnreachable(PoolBackendError):
    """Redis could not be reached (connection refused or lost, timeout): an outage, not a refusal.

    A type of its own so the fallback store tells an outage (switch to the local slice) from an error
    reply (a bug or a misconfiguration: raise it) without reading messages. ``timed_out`` tells a
    silent Redis (maybe only stalled: other hosts may still use it) from a refused or lost connection.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class PoolBusy(PoolUnreachable):
    """Redis answered ``BUSY`` (another client's script runs past ``busy-reply-threshold``) or
    ``LOADING`` (it is loading its dataset) on every attempt of a call for ``waited`` seconds.

    The store waits those answers out with capped exponential backoff before raising this (neither
    answer ran the command, so a retried lease script cannot lease twice). It is a *stall*
    (``timed_out`` is True): the fallback store waits on up to ``PROXY_SHARD_FALLBACK_AFTER`` (counted
    from the episode's first answer) before using its local slice, and the runtime keeps a request
    waiting within ``PROXY_SHARD_MAX_WAIT``.
    """

    def __init__(self, message: str, *, waited: float = 0.0) -> None:
        super().__init__(message, timed_out=True)
        self.waited = waited


class HostIdTaken(ProxyShardError):
    """Another live process heartbeats in ``pool`` under this host id (another instance token).

    ``alive_until`` / ``last_beat``: that record's expiry and last heartbeat (seconds, Redis clock)."""

    def __init__(self, host_id: str, pool: str, alive_until: float, last_beat: float) -> None:
        super().__init__(f"host id {host_id!r} is in use in pool {pool!r} by another live process")
        self.host_id, self.pool, self.alive_until, self.last_beat = host_id, pool, alive_until, last_beat


class NoProxyAvailable(ProxyShardError):
    """No proxy of the pool became free for the site within the wait limit."""


class PoolExhausted(NoProxyAvailable):
    """No proxy of the pool can serve the site before the request's wait limit ends: the engine said
    when the earliest slot frees and that nothing in use can free one sooner (crawl/liveness.py)."""

    def __init__(self, message: str, *, pool: str, site: str, until: float, reason: str) -> None:
        super().__init__(message)
        self.pool, self.site, self.until, self.reason = pool, site, until, reason


class RequestKept(ProxyShardError, IgnoreRequest):
    """The crawl closed because no proxy could serve its sites (``proxy_pool_exhausted``): this request
    was not sent and was put back in the scheduler's ``JOBDIR`` queue, so the next run sends it."""


class InvalidSessionId(ProxyShardError, IgnoreRequest):
    """``meta['session_id']`` is not a non-empty printable string or integer of bounded length."""


class ProxyBanned(ProxyShardError, IgnoreRequest):
    """The response was a ban through every proxy the request's retry budget allowed."""
