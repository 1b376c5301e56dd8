"""What the crawlers of one process share: one in-memory engine, and one identity towards Redis.

Scrapy runs several crawlers in one process (``AsyncCrawlerProcess``/``CrawlerProcess``/
``CrawlerRunner`` with two spiders). Each crawler has its own runtime and store, but the proxies they
use are the same exits, so whatever arbitrates them must be one:

- **One engine per process.** The embedded engine (fakeredis running the Lua scripts) and the local
  engine of the hybrid fallback live on an in-memory server shared by every crawler of the process
  that runs the same kind of engine on the same namespace (``shared_engine``): two spiders in one
  process lease from one state, so one exit never serves one site twice at once between them. Each
  crawler keeps its own client on it (its host id, its stats hooks); the server is refcounted and
  dropped when the last crawler using it closes (a later crawl of the process starts afresh, as a
  new process would).
- **One instance token per process** (``INSTANCE_TOKEN``): heartbeats carry it, so Redis can tell
  another *process* using the same host id (refused at open, see ``crawl/health.py``) from another
  crawler of this process that was given the same id on purpose (one host: shared engines, one
  heartbeat record, left only when its last crawler closes: ``host_users``). A forked child rolls
  its own token (``os.register_at_fork``): forked workers given one configured id are told apart too.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

from scrapy_proxy_shard.engine.store import AsyncPoolStore

if TYPE_CHECKING:
    import fakeredis

#: This process's instance token (random; never a credential): see the module docstring.
INSTANCE_TOKEN = secrets.token_hex(8)


def instance_token() -> str:
    """This process's instance token now (read it through this: a fork re-rolls it)."""
    return INSTANCE_TOKEN


def _reroll_in_child() -> None:
    """A forked child is another process: its own token, and none of its parent's host users."""
    global INSTANCE_TOKEN
    INSTANCE_TOKEN = secrets.token_hex(8)
    _host_users.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_reroll_in_child)

_lock = threading.Lock()
_servers: dict[tuple[str, str], list] = {}  # (kind, namespace) -> [FakeServer, users]
_host_users: dict[str, int] = {}  # host id -> crawlers of this process heartbeating as it


def acquire_server(kind: str, namespace: str) -> fakeredis.FakeServer:
    """The in-memory server of ``kind`` (``embedded``, ``static``, ``fallback``) for ``namespace``,
    created on first use; each call must be paired with one ``release_server``."""
    import fakeredis  # only the embedded engine and the fallback's local slice need it

    with _lock:
        entry = _servers.get((kind, namespace))
        if entry is None:
            entry = _servers[(kind, namespace)] = [fakeredis.FakeServer(), 0]
        entry[1] += 1
        return entry[0]


def release_server(kind: str, namespace: str, server: Any) -> bool:
    """Drop one use of the server; True when it was the last (the server and its state are gone)."""
    with _lock:
        entry = _servers.get((kind, namespace))
        if entry is None or entry[0] is not server:
            return False
        entry[1] -= 1
        if entry[1] > 0:
            return False
        del _servers[(kind, namespace)]
        return True


def server_users(kind: str, namespace: str) -> int:
    """How many open stores use the shared server of (kind, namespace) now (0: none exists)."""
    with _lock:
        entry = _servers.get((kind, namespace))
        return entry[1] if entry is not None else 0


#: What messages call each in-process engine (its ``where``): never its fakeredis address, which reads
#: as if a Redis server were used (and so as if other hosts shared it).
ENGINE_LABELS = {
    "embedded": "the embedded engine (in-process, not shared with other hosts)",
    "static": "the static engine (in-process, this host's slice, not shared with other hosts)",
    "fallback": "the local fallback engine (in-process, this host's slice, not shared with other hosts)",
}


def engine_label(kind: str) -> str:
    return ENGINE_LABELS.get(kind, f"the {kind} engine (in-process, not shared with other hosts)")


class SharedEngineStore(AsyncPoolStore):
    """A store on the process's shared in-memory server; closing it gives its use of the server back."""

    def __init__(self, kind: str, *, namespace: str = "proxy_shard", **kwargs: Any) -> None:
        import fakeredis

        self._shared: tuple | None = (kind, namespace, acquire_server(kind, namespace))
        try:
            client = fakeredis.FakeAsyncRedis(server=self._shared[2], decode_responses=True)
            super().__init__(client, namespace=namespace, engine_label=engine_label(kind), **kwargs)
        except BaseException:
            release_server(*self._shared)
            raise

    async def aclose(self) -> None:
        shared, self._shared = self._shared, None
        try:
            await super().aclose()
        finally:
            if shared is not None:
                release_server(*shared)


def shared_engine(kind: str, **store_kwargs: Any) -> SharedEngineStore:
    """A store of this crawler on the process's in-memory engine of ``kind`` for its namespace."""
    return SharedEngineStore(kind, **store_kwargs)


def join_host(host_id: str) -> None:
    """A crawler of this process starts heartbeating as ``host_id``."""
    with _lock:
        _host_users[host_id] = _host_users.get(host_id, 0) + 1


def leave_host(host_id: str) -> bool:
    """A crawler stops heartbeating as ``host_id``; True when no other crawler of the process still
    does (the host may leave the pools' host lists now)."""
    with _lock:
        left = _host_users.get(host_id, 0) - 1
        if left > 0:
            _host_users[host_id] = left
            return False
        _host_users.pop(host_id, None)
        return True
