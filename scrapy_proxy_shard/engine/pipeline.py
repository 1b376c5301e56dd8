"""A pipelined connection for the asyncio store's script calls (``PROXY_SHARD_REDIS_PIPELINE``).

The lease and release EVALSHA calls are the hot path of a crawl. Sent through redis-py's generic
command path, each pays for a pool checkout, the retry wrapper, per-argument encoding, the
observability hooks and one ``send`` syscall of its own. ``ScriptPipeline`` sends them on one
dedicated connection instead:

* the connection is redis-py's own (``connection_pool.make_connection()``, ``connect()``): AUTH, TLS,
  SELECT, the RESP version and the timeouts are the client's;
* each call packs its command once (RESP, by hand: ``str``/``bytes``/``int`` arguments; anything else
  goes through the client's encoder, which also refuses what redis-py refuses), queues a future and
  its bytes; the bytes queued within one event-loop tick go out in one write;
* one reader task reads the replies in order with the connection's parser and resolves the futures
  in the same order. An error reply fails only its own call, with the class redis-py raises
  (``NoScriptError``, ``BusyLoadingError``, ``ResponseError`` such as ``BUSY ...``). A broken
  connection (or a reply-level ``ConnectionError`` such as ``NOAUTH``, which redis-py also treats as
  a lost connection) fails every call in flight with ``redis.ConnectionError`` and the next call
  connects again;
* a call without a reply within the client's ``socket_timeout`` fails with ``redis.TimeoutError``,
  and so does every call queued behind it (their replies cannot come first): the connection is
  dropped, since a late reply would otherwise be taken for a later call's. One timer watches the
  oldest call; none is armed per call;
* a failed call is retried by the client's own ``retry`` policy object, exactly as
  ``Redis.execute_command`` would (connecting first outside the policy, as the pool checkout does;
  with the store's ``_AsyncPassLoading`` that is one immediate resend of a connection error or
  timeout and ``LOADING`` passed to the store's own backoff). Scripts are safe to resend (their memos).

Only a plain ``redis.asyncio.Redis`` over a stock TCP, TLS or Unix-socket connection pool qualifies
(``pipeline_for``); Cluster, Sentinel-managed and other clients (fakeredis) keep redis-py's path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection as aconnection
from redis.exceptions import BusyLoadingError, ResponseError

_POOLS = (aconnection.ConnectionPool, aconnection.BlockingConnectionPool)
_SYNC_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)
_SYNC_CONNECTIONS = (redis.Connection, redis.SSLConnection, redis.UnixDomainSocketConnection)
_CONNECTIONS = (aconnection.Connection, aconnection.SSLConnection, aconnection.UnixDomainSocketConnection)


def _stock_pool(client: Any, client_class: type, pools: tuple, connections: tuple) -> Any:
    """``client``'s connection pool when the client is exactly ``client_class`` on one of ``pools``
    making ``connections``, else None (any other client keeps its own command path)."""
    if type(client) is not client_class:
        return None
    pool = getattr(client, "connection_pool", None)
    if type(pool) not in pools or pool.connection_class not in connections:
        return None
    return pool


def pipeline_for(client: Any) -> ScriptPipeline | None:
    """A ``ScriptPipeline`` on ``client``'s server, or None when the client is not a plain
    ``redis.asyncio.Redis`` on a stock connection pool (its own command path is used then)."""
    pool = _stock_pool(client, redis.asyncio.Redis, _POOLS, _CONNECTIONS)
    return ScriptPipeline(pool) if pool is not None else None


#: Arguments ``pack_command`` keeps framed (per sender) between calls: the lease and release commands repeat
#: most of theirs (the pool's keys, the site, the host id, the constants); the cache is emptied when full.
FRAMED_ENTRIES = 4096
#: Longest argument (bytes) kept framed.
FRAMED_BYTES = 512


_PLAIN = frozenset((str, bytes, int))  # the argument types pack_command frames by hand


def pack_command(args: Sequence[Any], encoder: Any, framed: dict | None = None) -> bytes:
    """``args`` as one RESP command (an array of bulk strings), the bytes redis-py would send:
    ``str``/``bytes``/``int`` by hand, anything else through the connection's ``encoder`` (which also
    refuses what redis-py refuses: bool, None). ``framed``: a sender's cache of the bulk strings of the
    ``str``/``bytes``/``int`` arguments it sent before (only when every argument is of those very types:
    ``True`` or ``1.0`` is never taken for ``1``)."""
    if framed is not None and _PLAIN.issuperset(map(type, args)):
        parts = list(map(framed.get, args))  # the usual call: all but its tokens framed before
        missing = parts.count(None)
        if missing:
            encoding, errors = encoder.encoding, encoder.encoding_errors
            at = -1
            for _ in range(missing):
                at = parts.index(None, at + 1)
                arg = args[at]
                kind = type(arg)
                data = arg.encode(encoding, errors) if kind is str else b"%d" % arg if kind is int else arg
                bulk = parts[at] = b"$%d\r\n%b\r\n" % (len(data), data)
                if len(data) <= FRAMED_BYTES:
                    if len(framed) >= FRAMED_ENTRIES:
                        framed.clear()
                    framed[arg] = bulk
        return b"*%d\r\n%b" % (len(parts), b"".join(parts))
    encoding, errors = encoder.encoding, encoder.encoding_errors
    out = [b"*%d\r\n" % len(args)]
    append = out.append
    for arg in args:
        kind = type(arg)
        if kind is bytes:
            data = arg
        elif kind is str:
            data = arg.encode(encoding, errors)
        elif kind is int:
            data = b"%d" % arg
        else:  # float, memoryview...; bool and None raise redis.DataError, as redis-py does
            data = encoder.encode(arg)
            if type(data) is not bytes:
                data = bytes(data)
        append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


class DirectScripts:
    """The blocking store's script calls on a plain ``redis.Redis``: the command packed by
    ``pack_command`` and sent on a connection of the client's pool under the connection's own retry
    policy, as ``Redis.execute_command`` does, without its generic per-call work (argument encoding,
    command options, response callbacks, observability hooks). Used by the CLI, the exporter and scripts.

    On a plain ``ConnectionPool`` allowing at least ``HOLD_MIN_CONNECTIONS`` connections, one connection
    of the pool is checked out once and kept for the script calls of every store on that pool
    (``_Held``), as redis-py's ``single_connection_client`` keeps its own, instead of a checkout and a
    release per call. Like redis-py's, it is used as it is while busy (a connection the server closed
    meanwhile is the retry policy's, as on any connection in use), and gets the checkout's check
    (``ensure_connection``: connected, no unread data) when it was idle ``HOLD_CHECK_IDLE`` or more; a call
    that failed other than by an error reply gives it back to the pool (nothing is ever left unread on
    it); the pool's ``disconnect`` (``client.close()``) closes it like any checked-out one (the next call
    connects again); a forked child checks out one of its own. A call made while another thread uses it
    checks one out for itself, as before."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pool = client.connection_pool
        self._encoder = self.pool.get_encoder()
        self._framed: dict = {}  # pack_command's cache
        self._held = _held_for(self.pool)

    def execute(self, args: Sequence[Any]) -> Any:
        packed = pack_command(args, self._encoder, self._framed)
        held = self._held
        if held is not None and held.lock.acquire(False):
            try:
                return held.execute(self.pool, packed)
            finally:
                held.lock.release()
        pool = self.pool
        conn = pool.get_connection()
        try:
            return _send(conn, packed)
        finally:
            try:
                if getattr(conn, "should_reconnect", bool)():  # a server maintenance notice, as redis-py does
                    conn.disconnect()
            finally:
                pool.release(conn)


#: Pools allowing fewer connections than this check one out per script call (see ``DirectScripts``).
HOLD_MIN_CONNECTIONS = 16
#: A kept connection idle this long (seconds) gets the checkout's check again before its next call.
HOLD_CHECK_IDLE = 1.0


class _Held:
    """The connection a pool keeps checked out for ``DirectScripts`` (one per pool; used under ``lock``).
    It does not refer to the pool (``_HELD`` holds it while the pool lives)."""

    __slots__ = ("conn", "lock", "used")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: Any = None
        self.used = 0.0  # time.monotonic() of the last call answered on ``conn``

    def execute(self, pool: Any, packed: bytes) -> Any:
        conn = self.conn
        if conn is None:
            conn = pool.get_connection()  # checked and connected, as every checkout
            self.conn = conn
        elif time.monotonic() - self.used >= HOLD_CHECK_IDLE:
            try:
                _ensure_connection(pool, conn)  # the checkout's check, on a connection kept idle a while
            except BaseException:
                self.give_back(pool)
                raise
        try:
            reply = _send(conn, packed)
        except ResponseError:  # an error reply, read in full: the connection stays usable
            self.used = time.monotonic()
            raise
        except BaseException:  # nothing is left unread on a connection kept: it goes back to the pool
            self.give_back(pool)
            raise
        self.used = time.monotonic()
        if getattr(conn, "should_reconnect", bool)():  # a server maintenance notice, as redis-py does
            conn.disconnect()
        return reply

    def give_back(self, pool: Any) -> None:
        """Return the connection to the pool; the next call checks one out."""
        conn, self.conn = self.conn, None
        if conn is not None:
            pool.release(conn)


def _ensure_connection(pool: Any, conn: Any) -> None:
    """What a pool's checkout checks (``ConnectionPool.ensure_connection``, redis-py >= 6; the same steps
    inline for redis-py 5.3, whose ``get_connection`` does them itself): connected, nothing left unread,
    else connected again."""
    ensure = getattr(pool, "ensure_connection", None)
    if ensure is not None:
        ensure(conn)
        return
    conn.connect()
    try:
        if conn.can_read():
            raise redis.ConnectionError("Connection has data")
    except (redis.ConnectionError, OSError):
        conn.disconnect()
        conn.connect()
        if conn.can_read():
            raise redis.ConnectionError("Connection not ready") from None


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> its _Held
_HELD_LOCK = threading.Lock()


def _forked() -> None:
    """In a forked child: every kept connection is the parent's (its socket, its pool's books), and a
    lock may have been held by a thread the child does not have. Forget them; the pool resets itself."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    for held in list(_HELD.values()):
        held.lock = threading.Lock()
        held.conn = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _held_for(pool: Any) -> _Held | None:
    """The pool's ``_Held``, made at its first store; None for a pool that keeps per-call checkouts."""
    if type(pool) is not redis.ConnectionPool or (getattr(pool, "max_connections", 0) or 0) < HOLD_MIN_CONNECTIONS:
        return None
    with _HELD_LOCK:
        held = _HELD.get(pool)
        if held is None:
            held = _HELD[pool] = _Held()
        return held


def _send(conn: Any, packed: bytes) -> Any:
    """One packed command and its reply on ``conn``, under the connection's retry policy: the first
    attempt is made before entering it (as ``ScriptPipeline.execute`` does); a failure the policy retries
    enters it as its own first attempt's, so the policy sees the same attempts, failures and backoff."""
    retry = conn.retry
    supported = getattr(retry, "_supported_errors", None)

    def send() -> Any:
        conn.send_packed_command((packed,))  # an iterable of chunks (a bytes object would be iterated)
        return conn.read_response()

    if type(supported) is not tuple:  # a policy of another shape: all of it, as before
        return retry.call_with_retry(send, lambda _error: conn.disconnect())
    try:
        conn.send_packed_command((packed,))
        return conn.read_response()
    except supported as exc:
        first: BaseException | None = exc

    def attempt() -> Any:
        nonlocal first
        if first is not None:
            failed, first = first, None
            raise failed
        return send()

    return retry.call_with_retry(attempt, lambda _error: conn.disconnect())


def direct_scripts_for(client: Any) -> DirectScripts | None:
    """``DirectScripts`` for a plain ``redis.Redis`` on a stock connection pool, else None."""
    if getattr(client, "connection", None) is not None:
        return None  # a single_connection_client shares one connection under a lock: its own path
    pool = _stock_pool(client, redis.Redis, _SYNC_POOLS, _SYNC_CONNECTIONS)
    return DirectScripts(client) if pool is not None else None


async def _no_cleanup(*_: Any) -> None:
    """The retry policy's failure hook: a failed pipeline has already dropped its connection."""


class ScriptPipeline:
    """Pipelined requests on one dedicated connection of a redis-py connection pool."""

    def __init__(self, pool: Any) -> None:
        self._conn = pool.make_connection()
        self._retry = self._conn.retry
        self._retried = tuple(getattr(self._retry, "_supported_errors", ()))
        self._timeout = self._conn.socket_timeout or None
        self._encoder = self._conn.encoder
        self._framed: dict = {}  # pack_command's cache
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task | None = None  # the connect attempt in progress
        self._live = False
        self._generation = 0  # bumped at each drop: a reader of an older connection stops
        self._pending: collections.deque = collections.deque()  # [future, deadline], in send order
        self._out: list[bytes] = []  # packed requests not written yet
        self._flush_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False

    # --- the call ---------------------------------------------------------------------------------
    async def execute(self, args: Sequence[Any]) -> Any:
        """Send the command ``args`` and return its reply (decoded as the client decodes)."""
        packed = self.pack(args)
        if not self._live or self._loop is not asyncio.get_running_loop():
            await self._open()  # like the pool checkout: outside the retry policy
        try:
            return await self._send(packed)
        except self._retried as exc:
            first: BaseException | None = exc

        async def attempt() -> Any:  # the failed first attempt, then resends, under the client's policy
            nonlocal first
            if first is not None:
                failed, first = first, None
                raise failed
            if not self._live or self._loop is not asyncio.get_running_loop():
                await self._open()
            return await self._send(packed)

        return await self._retry.call_with_retry(attempt, _no_cleanup)

    def pack(self, args: Sequence[Any]) -> bytes:
        """``args`` as one RESP command (an array of bulk strings)."""
        return pack_command(args, self._encoder, self._framed)

    def _send(self, packed: bytes) -> asyncio.Future:
        loop = self._loop
        future = loop.create_future()
        timeout = self._timeout
        self._pending.append((future, loop.time() + timeout if timeout else 0.0))
        self._out.append(packed)
        if self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        if timeout and self._timer is None:
            self._timer = loop.call_at(loop.time() + timeout, self._check_timeout)
        return future

    def _flush(self) -> None:
        self._flush_handle = None
        out = self._out
        if not out or not self._live:
            out.clear()
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        try:
            self._conn._writer.write(data)
        except Exception as exc:  # a transport closed under us: every call in flight is lost
            self._drop(redis.ConnectionError, f"Error while writing to {self._where()}: {exc}")

    # --- the connection ---------------------------------------------------------------------------
    async def _open(self) -> None:
        """Connect (redis-py's ``connect``: its handshake, its connect retries). Callers that arrive
        while an attempt runs share its outcome: in an outage each caller waits for one attempt, not
        for a queue of them."""
        if self._closed:
            raise redis.ConnectionError("the store's pipelined connection is closed")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a store driven from another event loop now
            self._forget()
            self._loop = loop
        if self._live:
            return
        attempt = self._connecting
        if attempt is None:
            attempt = self._connecting = loop.create_task(self._connect())
            attempt.add_done_callback(self._connected)
        await asyncio.shield(attempt)  # a cancelled caller leaves the attempt to the others

    async def _connect(self) -> None:
        await self._conn.connect()
        self._generation += 1
        self._live = True
        self._reader = self._loop.create_task(self._read(self._generation))

    def _connected(self, attempt: asyncio.Task) -> None:
        if self._connecting is attempt:
            self._connecting = None
        if not attempt.cancelled():
            attempt.exception()  # retrieved here: every waiter may have been cancelled

    async def _read(self, generation: int) -> None:
        """Read the replies of this connection in order and hand each to its call."""
        parser, pending = self._conn._parser, self._pending
        try:
            while True:
                try:
                    reply = await parser.read_response()
                except BusyLoadingError as exc:  # an error reply (LOADING): its call's only
                    reply = exc
                if generation != self._generation:
                    return
                if not pending:
                    self._drop(redis.ConnectionError, f"{self._where()} sent a reply nobody asked for")
                    return
                future = pending.popleft()[0]
                if future.done():  # its caller was cancelled: the reply is read and dropped
                    continue
                if isinstance(reply, (ResponseError, BusyLoadingError)):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except asyncio.CancelledError:  # by ``_drop``, or from outside (the event loop shutting down)
            if generation == self._generation:
                self._drop(redis.ConnectionError, f"Connection to {self._where()} closed: its reader was cancelled")
            raise
        except redis.ConnectionError as exc:  # lost, or a reply redis-py treats as a lost connection
            if generation == self._generation:
                self._drop(redis.ConnectionError, str(exc) or f"Connection to {self._where()} lost", head=exc)
        except Exception as exc:
            if generation == self._generation:
                self._drop(redis.ConnectionError, f"Error while reading from {self._where()}: {exc!r}")

    def _check_timeout(self) -> None:
        """The one timer: fail everything in flight once the oldest call has waited ``socket_timeout``."""
        self._timer = None
        if not self._pending or not self._live:
            return
        deadline = self._pending[0][1]
        loop = self._loop
        if deadline > loop.time():
            self._timer = loop.call_at(deadline, self._check_timeout)
            return
        self._drop(redis.TimeoutError, f"Timeout reading from {self._where()}")

    def _drop(self, error: type[redis.RedisError], message: str, head: BaseException | None = None) -> None:
        """Close the connection and fail every call in flight with ``error`` (the oldest with ``head``
        when given); the next call connects again."""
        self._generation += 1
        self._live = False
        pending = list(self._pending)
        self._pending.clear()
        self._out.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        self._close_transport()
        for i, (future, _) in enumerate(pending):
            if not future.done():
                future.set_exception(head if i == 0 and head is not None else error(message))

    def _close_transport(self) -> None:
        with contextlib.suppress(Exception):
            self._conn._parser.on_disconnect()
        with contextlib.suppress(Exception):
            self._conn._close()

    def _forget(self) -> None:
        """Leave a connection of another (maybe closed) event loop behind without touching its futures."""
        self._generation += 1
        self._live = False
        self._pending.clear()
        self._out.clear()
        self._flush_handle = self._timer = self._reader = self._connecting = None
        self._close_transport()

    def _where(self) -> str:
        try:
            return self._conn._host_error()
        except Exception:
            return "Redis"

    async def aclose(self) -> None:
        """Fail what is in flight, close the connection; later calls raise ``redis.ConnectionError``."""
        self._closed = True
        if self._loop is asyncio.get_running_loop():
            self._drop(redis.ConnectionError, "the store was closed")
            with contextlib.suppress(Exception):
                await self._conn.disconnect()
        else:
            self._forget()
