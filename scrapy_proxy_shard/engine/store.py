"""The pool store: the only code that talks to Redis.

Every operation is written once, as a *plan*: a generator that yields Redis requests (a Lua script
call or a plain command) and receives their decoded replies. ``PoolStore`` runs plans with a
blocking client (CLI, exporter, benchmarks); ``AsyncPoolStore`` runs the very same plans with
``redis.asyncio`` (the Scrapy middlewares). The state changes themselves live in the Lua scripts of
``lua/`` (one atomic round trip each); see ``lua/_lib.lua`` for the key layout.

Times in this API are seconds (floats); the scripts work in integer milliseconds of the Redis clock.

``BUSY`` (another client's script runs past ``busy-reply-threshold``) and ``LOADING`` (Redis is
loading its dataset) answers are transient: the store sends the same request again after a capped
exponential backoff with jitter (``BUSY_BASE`` doubling up to ``BUSY_CAP``), for up to ``busy_wait``
seconds per call, then raises ``PoolBusy`` (a stall: the fallback store and the runtime wait on by
their own rules). Neither answer ran the command, so a lease script sent again cannot lease twice
(and the scripts memoise by token anyway). Every retry calls ``on_busy_retry``; an episode is logged
once when it starts (WARNING) and once when Redis answers again (INFO).

The plans are split by concern, as redis-py splits its commands into mixins: ``store_lease.py`` (lease,
release, breaker, hold), ``store_admin.py`` (bans, adding and removing proxies, migration),
``store_views.py`` (read-only views), ``store_hosts.py`` (heartbeats, live hosts) and
``store_calls.py`` (the requests a plan yields and how they reach Redis); the records they return are
in ``records.py``. This module composes them into ``PoolStore`` and ``AsyncPoolStore`` and exports
what the rest of the package imports from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import redis
import redis.asyncio

from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.breaker import BreakerOptions
from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.engine.pipeline import direct_scripts_for, pipeline_for
from scrapy_proxy_shard.engine.proxies import Proxy, mask
from scrapy_proxy_shard.engine.records import (
    AddResult,
    BanRecord,
    BanResult,
    Beat,
    BusySlot,
    HostRecord,
    Lease,
    LeaseWait,
    ProxyRecord,
    ReleaseResult,
    SiteStatus,
)
from scrapy_proxy_shard.engine.scripts import function_library, register_all
from scrapy_proxy_shard.engine.store_admin import _Admin
from scrapy_proxy_shard.engine.store_calls import (
    BUSY_WAIT,
    Plan,
    _Calls,
    _Continue,
    _decode,
    _describe,
    _is_cluster,
    _key_encoder,
    _ms,
    _name,
    _Script,
)
from scrapy_proxy_shard.engine.store_gateway import _Gateway
from scrapy_proxy_shard.engine.store_hosts import _Hosts
from scrapy_proxy_shard.engine.store_lease import _Leasing
from scrapy_proxy_shard.engine.store_links import (
    LINK_EVIDENCE,
    LINK_KEEP,
    LINK_MAX_GROUP,
    LINK_PROXIES,
    LINK_SETTLE,
    LINK_SPAN,
    LINK_VETO,
    SiteLinks,
    _Links,
)
from scrapy_proxy_shard.engine.store_views import _Views
from scrapy_proxy_shard.engine.tiers import TierOptions, TierState, _Tiers
from scrapy_proxy_shard.exceptions import PoolBackendError

#: What other modules import from here (the records and constants moved out are re-exported).
__all__ = [
    "BUSY_WAIT",
    "AddResult",
    "AsyncPoolStore",
    "BanRecord",
    "BanResult",
    "Beat",
    "BusySlot",
    "HostRecord",
    "Lease",
    "LeaseWait",
    "PoolBackend",
    "PoolStore",
    "ProxyRecord",
    "ReleaseResult",
    "SiteStatus",
]


_UNSET = object()  # no value cached yet (see ``_StoreBase.__init__``)


class _StoreBase(_Leasing, _Admin, _Views, _Hosts, _Tiers, _Gateway, _Links, _Calls):
    """Plans shared by both stores. Subclasses supply ``_drive`` (sync or async).

    Composed of one mixin per concern, each in its own module: ``_Leasing`` (store_lease.py), ``_Admin``
    (store_admin.py), ``_Views`` (store_views.py), ``_Hosts`` (store_hosts.py), ``_Links`` (store_links.py) and
    the per-call plumbing
    ``_Calls`` (store_calls.py); this class holds the state they share (``__init__``)."""

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "proxy_shard",
        host_id: str = "local",
        bans: BanOptions | None = None,
        ewma_alpha: float = 0.2,
        random_source: Callable[[], float] = random.random,
        token_factory: Callable[[], str] = lambda: secrets.token_hex(8),
        url_for_errors: str | None = None,
        on_settled: Callable[[str], None] | None = None,
        busy_wait: float = BUSY_WAIT,
        on_busy_retry: Callable[[], None] | None = None,
        site_idle_ttl: float = 3600.0,
        breakers: BreakerOptions | Callable[[str], BreakerOptions | None] | None = None,
        functions: bool = True,
        engine_label: str | None = None,
    ) -> None:
        self.client = client
        self.namespace = keys.check_name("namespace", namespace)
        self.host_id = _name(host_id, "host_id")
        if "|" in host_id:  # the scripts' records are "|"-separated
            raise ValueError(f"host_id ({host_id!r}) must not contain '|'")
        self.bans_options = _checked_bans(bans or BanOptions())
        if not 0.0 <= float(ewma_alpha) <= 1.0:
            raise ValueError(f"ewma_alpha ({ewma_alpha!r}) must be a weight from 0 to 1")
        self.ewma_alpha = ewma_alpha
        self._random = random_source
        self._token = token_factory
        self._scripts = register_all(client)
        #: The hot path's Redis Functions (``scripts.function_library``), or None: EVALSHA only. Off for
        #: Cluster clients (redis-py asks the server for an FCALL's keys on every call) and after a
        #: server showed it has no Functions or refused to load them (``_fcall_failed``, ``_load_failed``).
        self._functions = function_library() if functions and not _is_cluster(client) else None
        #: Where the engine runs, for messages: a Redis URL (password masked), or ``engine_label`` for
        #: an in-process engine (modes/process.py), whose fakeredis address would read as a Redis server.
        self._where = engine_label or (mask(url_for_errors) if url_for_errors else _describe(client))
        #: The same as a noun phrase: "Redis at <url>", or the in-process engine's label.
        self._location = engine_label or f"Redis at {self._where}"
        #: Lease calls whose reply was lost (timeout, broken connection): token -> (pool prefix, site,
        #: session id). The script may have run, or may still run; ``abandon.lua`` settles each at the
        #: next call.
        self._in_doubt: dict[str, tuple[str, str, str]] = {}
        self._settling: set[str] = set()
        self._on_settled = on_settled
        self.busy_wait = max(0.0, float(busy_wait))
        self._on_busy_retry = on_busy_retry
        self._busy_since: float | None = None  # first BUSY/LOADING answer of the current episode
        self._busy_retries = 0  # retries in the current episode
        #: A site's state (its ready slots) expires this long after its last hold ends.
        self.site_idle_ms = _ms(site_idle_ttl, "site_idle_ttl")
        if self.site_idle_ms < 1000:
            raise ValueError(f"site_idle_ttl ({site_idle_ttl!r}) must be at least 1 second")
        #: The site circuit breaker's options per site (None: off), as release.lua's packed argument.
        self._breakers = breakers
        # Per-call work done once (the hot path: lease + release, see ``_call_keys``).
        self._prefixes: dict[str, str] = {}  # pool -> its key prefix
        self._key_templates: dict[tuple[str, str, str], tuple | None] = {}
        self._encode_key = _key_encoder(client)
        self._packed: dict[int, tuple[BreakerOptions, str]] = {}  # id(options) -> (options, packed)
        self._quiet_ban: tuple[BanOptions, tuple] | None = None  # (options, a non-ban release's ban args)
        self._alpha_repr: tuple[Any, str] = (_UNSET, "")  # (ewma_alpha, release.lua's repr of it)
        self._share_repr: tuple[Any, str] = (_UNSET, "")  # (margin_prior given, release.lua's repr of it)


def _checked_bans(opts: BanOptions) -> BanOptions:
    """Quarantine lengths the scripts can hold (release.lua trusts its arguments): every TTL at least 1 ms
    and at most 366 days, a jitter from 0 to 1, a strike window from 0."""
    for name in ("ttl", "max_ttl", "dead_ttl", "strike_window"):
        if _ms(getattr(opts, name), f"BanOptions.{name}") < (0 if name == "strike_window" else 1):
            raise ValueError(f"BanOptions.{name} ({getattr(opts, name)!r}) must be at least 1 ms")
    if not 0.0 <= float(opts.jitter) <= 1.0:
        raise ValueError(f"BanOptions.jitter ({opts.jitter!r}) must be a share from 0 to 1")
    return opts


class PoolStore(_StoreBase):
    """Blocking store (redis.Redis / redis.RedisCluster): CLI, exporter, benchmarks, tests.

    On a plain ``redis.Redis`` its script calls skip redis-py's generic command path
    (``engine/pipeline.py`` ``DirectScripts``: packed once, same connection pool and retry policy)."""

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self._direct = direct_scripts_for(client)

    def _drive(self, plan: Plan, *, settle: bool = True) -> Any:
        if settle and self._in_doubt:
            with contextlib.suppress(PoolBackendError):  # still unreachable: settle on a later call
                self._drive(self._settle_plan(), settle=False)
        try:
            request = next(plan)
            while True:
                request = plan.send(_decode(self._call(request)))
        except StopIteration as stop:
            return stop.value

    def _call(self, request: Any) -> Any:
        """One request, sent again while Redis answers BUSY or LOADING (see the module docstring)."""
        try:
            reply = self._execute(request)
        except redis.RedisError as exc:
            return self._call_again(request, exc)
        if self._busy_since is not None:
            self._busy_over()
        return reply

    def _call_again(self, request: Any, exc: redis.RedisError) -> Any:
        """``_call`` after its first attempt failed with ``exc``: the pause, then the request again while
        Redis answers BUSY or LOADING."""
        attempt, first = 1, time.monotonic()
        time.sleep(self._retry_pause(request, exc, attempt, first))
        while True:
            try:
                reply = self._execute(request)
            except redis.RedisError as again:
                attempt += 1
                time.sleep(self._retry_pause(request, again, attempt, first))
                continue
            self._busy_over()
            return reply

    def _run(self, build: Callable[..., Any], done: Callable[..., Any], *args: Any) -> Any:
        """A one-request operation (lease, release): ``build(*args)`` makes the request, ``done(reply,
        request, *args)`` reads its reply (or returns ``_Continue`` with a plan to drive on). ``_call``
        inlined (the hot path)."""
        if self._in_doubt:
            with contextlib.suppress(PoolBackendError):  # still unreachable: settle on a later call
                self._drive(self._settle_plan(), settle=False)
        request = build(*args)
        try:
            reply = self._execute(request)
        except redis.RedisError as exc:
            reply = self._call_again(request, exc)
        else:
            if self._busy_since is not None:
                self._busy_over()
        out = done(_decode(reply), request, *args)
        if type(out) is _Continue:
            return self._drive(out.plan, settle=False)
        return out

    def _execute(self, request: Any) -> Any:
        if type(request) is not _Script:
            return self.client.execute_command(*request.args)
        send = self._direct.execute if self._direct is not None else self._generic
        command = self._script_command(request)
        try:
            return send(command)
        except redis.ResponseError as exc:
            steps = self._script_recovery(request, command, exc)
        try:
            how, what = next(steps)
            while True:
                try:
                    reply = send(what) if how == "send" else getattr(self.client, how)(*what)
                except redis.ResponseError as exc:
                    how, what = steps.throw(exc)
                else:
                    how, what = steps.send(reply)
        except StopIteration as stop:
            return stop.value

    def _generic(self, args: tuple) -> Any:
        return self.client.execute_command(*args)


@runtime_checkable
class PoolBackend(Protocol):
    """What the crawl (runtime, health monitor) calls on a store: the one interface both the plain
    ``AsyncPoolStore`` and the outage-surviving ``modes.fallback.FallbackPoolStore`` implement.

    Declared, not probed: the runtime calls exactly these, so a store that lacks one fails at
    definition (``tests/test_engine_contract.py`` checks both against this list, signatures included)
    rather than at the first outage. Every method is awaited; connection problems raise
    ``PoolUnreachable``, error replies ``PoolBackendError``.
    """

    host_id: str

    @property
    def where(self) -> str:
        """Where the shared pool lives, for messages (a Redis URL, password masked)."""
        ...

    @property
    def redis_client(self) -> Any:
        """The client of the shared Redis (the eviction-policy check at start reads its CONFIG)."""
        ...

    @property
    def fallback_state(self) -> str | None:
        """None: no local fallback. Else ``redis``, ``fallback`` (local slice) or ``grace``."""
        ...

    def snapshot_proxies(self, pool: str) -> list[Proxy]:
        """The proxies of ``pool`` as last seen in Redis by this process ([] when it keeps no copy)."""
        ...

    def snapshot_bans(self, pool: str) -> list[BanRecord]:
        """The quarantines of ``pool`` as last seen in Redis by this process ([] when it keeps no copy):
        a pool Redis lost is restored with those still running."""
        ...

    async def start_offline(self, reason: BaseException) -> None: ...

    async def ping(self) -> bool: ...

    async def add_proxies(self, pool: str, proxies: Iterable[Proxy | str]) -> AddResult: ...

    async def restore_pool(self, pool: str, proxies: Iterable[Proxy | str], *, warmup: float = 0.0) -> int: ...

    async def ban(self, pool: str, proxy: str, *, site: str | None = None, reason: str = "manual",
                  ttl: float | None = None) -> BanResult:
        """Quarantine ``proxy`` on ``site`` (every site when None) for every host."""
        ...

    async def pool_size(self, pool: str) -> int: ...

    async def lease(self, pool: str, site: str, *, ttl: float, concurrency: int = 1,
                    session_id: str | None = None, session_ttl: float = 600.0,
                    spacing: float = 0.0, spread: float = 0.0) -> Lease | LeaseWait: ...

    async def wait_for_release(self, pool: str, site: str, timeout: float) -> bool: ...

    async def release(self, lease: Lease, *, outcome: str = "ok", latency: float | None = None,
                      min_interval: float = 0.0, reason: str | None = None,
                      session_ttl: float = 600.0, ban_ttl: float | None = None,
                      rest_after_response: float = 0.0, randomize_interval: bool = False,
                      autothrottle: AutothrottleOptions | None = None, rate_ban: bool = False,
                      retry_after: float | None = None,
                      arrival_guard: tuple[float, float | None] | None = None,
                      rest_min: float | None = None, margin_prior: float = 0.0) -> ReleaseResult:
        """Give a slot back: free again at max(lease start + min_interval + the arrival guard's shift,
        now + rest_after_response)."""
        ...

    async def end_session(self, pool: str, site: str, session_id: str, *, min_interval: float = 0.0) -> bool: ...

    async def tier_step(self, tiers: Sequence[str], site: str, *, counts: Sequence[int] = (), breaker_tier: int = -1,
                        probe_answer: str = "", probe_tier: int = -1, claim: bool = False,
                        options: TierOptions | None = None, probe_ttl: float = 60.0,
                        idle: float = 3600.0) -> TierState:
        """One step of a site's tier on a tier list (engine/tiers.py): report answers, take a due probe."""
        ...

    async def gateway_rotate(self, pool: str, proxy_id: str, site: str, sent_url: str, *, rotations: int,
                             window: float) -> Any: ...

    async def gateway_exit(self, pool: str, proxy_id: str, sent_url: str, ip: str, *, ttl: float) -> Any: ...

    async def site_link(self, pool: str, site: str, proxy_id: str, *, quarantine: float, known: str = "",
                        evidence: float = LINK_EVIDENCE, max_group: int = LINK_MAX_GROUP,
                        keep: float = LINK_KEEP, proxies: int = LINK_PROXIES, start: float = 0.0,
                        rested_from: str = "", veto: float = LINK_VETO, span: float = LINK_SPAN,
                        overlapped: str = "", settle: float = LINK_SETTLE) -> SiteLinks | None:
        """Report a rate-ban quarantine of ``proxy_id`` on ``site`` (0 s: only read): the evidence that two
        sites share a blacklist (store_links.py); the pool's learned site groups when not ``known``. None
        while Redis is away (the local fallback learns nothing)."""
        ...

    async def in_flight(self, pool: str, proxy_id: str, sites: list[str], since: float) -> list[str]:
        """Which of ``sites`` ``proxy_id`` is in flight on, leased by any host at or before ``since``."""
        ...

    async def pools(self) -> list[str]: ...

    async def heartbeat(self, pool: str, *, ttl: float, info: dict[str, Any] | None = None, always: bool = True,
                        bucket: float = 60.0, keep: float = 3600.0, token: str = "") -> Beat | None: ...

    async def leave(self, pool: str, token: str = "") -> bool: ...

    async def aclose(self) -> None: ...


class AsyncPoolStore(_StoreBase, PoolBackend):
    """asyncio store (redis.asyncio): what the Scrapy middlewares use. Implements ``PoolBackend``
    (its methods come from ``_StoreBase``: each returns the coroutine ``_drive`` makes).

    ``pipeline`` (``PROXY_SHARD_REDIS_PIPELINE``): on a plain ``redis.asyncio.Redis``, script calls go
    through one pipelined connection of their own (``engine/pipeline.py``) instead of redis-py's
    command path; other commands, and other clients, always use the client's own path."""

    def __init__(self, client: Any, *, pipeline: bool = True, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self._pipe = pipeline_for(client) if pipeline else None

    @property
    def where(self) -> str:
        return self._where

    @property
    def redis_client(self) -> Any:
        return self.client

    @property
    def fallback_state(self) -> str | None:
        return None

    def snapshot_proxies(self, pool: str) -> list[Proxy]:
        return []

    def snapshot_bans(self, pool: str) -> list[BanRecord]:
        return []

    async def start_offline(self, reason: BaseException) -> None:
        """A store without a local fallback cannot run while Redis is down: raises ``reason``."""
        raise reason

    async def _drive(self, plan: Plan, *, settle: bool = True) -> Any:
        if settle and self._in_doubt:
            with contextlib.suppress(PoolBackendError):  # still unreachable: settle on a later call
                await self._drive(self._settle_plan(), settle=False)
        try:
            request = next(plan)
            while True:
                request = plan.send(_decode(await self._call(request)))
        except StopIteration as stop:
            return stop.value

    async def _call(self, request: Any) -> Any:
        """One request, sent again while Redis answers BUSY or LOADING (see the module docstring)."""
        try:
            reply = await self._execute(request)
        except redis.RedisError as exc:
            return await self._call_again(request, exc)
        if self._busy_since is not None:
            self._busy_over()
        return reply

    async def _call_again(self, request: Any, exc: redis.RedisError) -> Any:
        """``_call`` after its first attempt failed with ``exc`` (see ``PoolStore._call_again``)."""
        attempt, first = 1, time.monotonic()
        await asyncio.sleep(self._retry_pause(request, exc, attempt, first))
        while True:
            try:
                reply = await self._execute(request)
            except redis.RedisError as again:
                attempt += 1
                await asyncio.sleep(self._retry_pause(request, again, attempt, first))
                continue
            self._busy_over()
            return reply

    async def _run(self, build: Callable[..., Any], done: Callable[..., Any], *args: Any) -> Any:
        """A one-request operation (lease, release): see ``PoolStore._run`` (``_call`` inlined too)."""
        if self._in_doubt:
            with contextlib.suppress(PoolBackendError):  # still unreachable: settle on a later call
                await self._drive(self._settle_plan(), settle=False)
        request = build(*args)
        try:
            reply = await self._execute(request)
        except redis.RedisError as exc:
            reply = await self._call_again(request, exc)
        else:
            if self._busy_since is not None:
                self._busy_over()
        out = done(_decode(reply), request, *args)
        if type(out) is _Continue:
            return await self._drive(out.plan, settle=False)
        return out

    async def _execute(self, request: Any) -> Any:
        if type(request) is not _Script:  # the script steps are PoolStore._execute's, awaited
            return await self.client.execute_command(*request.args)
        send = self._pipe.execute if self._pipe is not None else self._generic
        command = self._script_command(request)
        try:
            return await send(command)
        except redis.ResponseError as exc:
            steps = self._script_recovery(request, command, exc)
        try:
            how, what = next(steps)
            while True:
                try:
                    reply = await (send(what) if how == "send" else getattr(self.client, how)(*what))
                except redis.ResponseError as exc:
                    how, what = steps.throw(exc)
                else:
                    how, what = steps.send(reply)
        except StopIteration as stop:
            return stop.value

    async def _generic(self, args: tuple) -> Any:
        return await self.client.execute_command(*args)

    async def aclose(self) -> None:
        if self._pipe is not None:
            await self._pipe.aclose()
        await self.client.aclose()
