"""The store's call plumbing: the requests a plan yields (``_Script``, ``_Command``, ``_Continue``) and how
each reaches Redis: key prefixes and per-(pool, site) KEYS templates, the command a script call sends
(FCALL or EVALSHA) and its recovery after an error reply, lease calls in doubt and their settling,
the pauses of a BUSY / LOADING episode (see ``store.py``'s docstring) and the store's errors; and the
conversions every operation shares (seconds to the scripts' ms, reasons, replies). ``_Calls`` is the
mixin of ``store._StoreBase`` that carries the per-call methods; the stores' drivers live in
``store.py``."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import redis

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.scripts import FunctionLibrary
from scrapy_proxy_shard.exceptions import PoolBackendError, PoolBusy, PoolUnreachable

#: The store's logger, shared by every module of it: records keep the name they had before the store
#: was split into modules (``scrapy_proxy_shard.engine.store``).
logger = logging.getLogger("scrapy_proxy_shard.engine.store")
#: Lease calls in doubt kept at most (each is a slot that frees itself at its lease TTL anyway).
MAX_IN_DOUBT = 10_000
#: Longest time argument the scripts accept (366 days, MAX_MS in lua/_lib.lua); checked here first so a
#: bad value is a clear ValueError naming the argument rather than a Redis error reply.
MAX_SECONDS = 366 * 86400.0
MAX_MS = 366 * 86400 * 1000
#: Slots per proxy and site the scripts take (MAX_CONCURRENCY in lua/_lib.lua).
MAX_CONCURRENCY = 1000
#: Longest site, host or session id the scripts keep in their records, in bytes.
MAX_NAME_BYTES = 200
REASON_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-:.")
#: Pause before resending a request Redis answered BUSY or LOADING: BUSY_BASE x 2^(attempt-1), at most
#: BUSY_CAP, of which a random half is jitter (so hosts that met the same stall do not retry in step).
BUSY_BASE = 0.01
BUSY_CAP = 0.25
#: Default longest time one call waits BUSY / LOADING out before raising ``PoolBusy``.
BUSY_WAIT = 5.0
#: Where the pool's P:proxies key sits in lease.lua's KEYS (a lease call in doubt names its pool by it).
_LEASE_PROXIES_AT = keyset.ROLES["lease"].index(keys.PROXIES)


# --- requests a plan yields -------------------------------------------------------------------------

class _Script(NamedTuple):
    """A Lua script call: the script's name, its KEYS (str, or bytes the client encoded) and its ARGV."""

    name: str
    keys: Sequence[Any]
    args: Sequence[Any]


class _Command(NamedTuple):
    args: tuple[Any, ...]


Plan = Generator[Any, Any, Any]


class _Continue:
    """What a one-request operation's reply handler returns when the call goes on as a plan (a lease
    that met a pool to migrate): the store drives ``plan`` to its end."""

    __slots__ = ("plan",)

    def __init__(self, plan: Plan) -> None:
        self.plan = plan


#: Per-store caches of per-(pool, site) work are emptied when they reach this many entries.
CACHE_ENTRIES = 4096
#: The KEYS whose lists lease and release build from a per-(pool, site) template (see ``_call_keys``).
_TEMPLATED = ("lease", "release")


def _is_cluster(client: Any) -> bool:
    import redis.asyncio.cluster
    import redis.cluster

    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def _fcall_failed(exc: redis.ResponseError, where: str) -> str:
    """What to do after an error reply to FCALL: "load" the library (the server does not have it: a new
    server, a restart without persistence, FUNCTION FLUSH) or use "evalsha" from now on (Redis < 7.0,
    a server or proxy without Functions, an ACL that refuses FCALL). Any other error is the
    function's own reply, the caller's to see: raised again."""
    text = str(exc)
    if text.startswith("Function not found"):
        return "load"
    lowered = text.lower()
    if isinstance(exc, redis.exceptions.NoPermissionError) or ("unknown command" in lowered and "fcall" in lowered):
        logger.info("proxy_shard: %(where)s runs no Functions (%(e)s): lease and release use EVALSHA",
                    {"where": where, "e": exc})
        return "evalsha"
    raise exc


def _loaded(library: FunctionLibrary, where: str) -> str:
    """FUNCTION LOAD succeeded: say so once (an operator sees the library in FUNCTION LIST). ``where``:
    "Redis at <url>", or an in-process engine's label (never its fakeredis address)."""
    logger.info("proxy_shard: loaded the lease/release Functions library %(name)s into %(where)s",
                {"name": library.name, "where": where})
    return "fcall"


def _load_failed(exc: redis.ResponseError, library: FunctionLibrary, where: str) -> str:
    """What to do after an error reply to FUNCTION LOAD: "fcall" (another client loaded the same
    library first) or "evalsha" (the server will not load it: no Functions, an ACL, a Lua limit of a
    Redis-compatible server). BUSY, LOADING and OOM are transient: raised again, for ``_call``."""
    text = str(exc)
    if "already exists" in text and library.name in text:
        return "fcall"
    if text.startswith(("BUSY", "OOM")) or isinstance(exc, redis.BusyLoadingError):
        raise exc
    logger.warning("proxy_shard: %(where)s refused to load the lease/release Functions (%(e)s); lease and "
                   "release use EVALSHA", {"where": where, "e": exc})
    return "evalsha"


class _Calls:
    """Per-call plumbing of both stores (mixed into ``store._StoreBase``, whose ``__init__`` sets the
    state it reads): key prefixes and templates, sending a script, lease calls in doubt, BUSY pauses."""

    def prefix(self, pool: str) -> str:
        cached = self._prefixes.get(pool) if type(pool) is str else None
        if cached is not None:
            return cached
        made = keys.pool_prefix(self.namespace, keys.check_name("pool", pool))
        if len(self._prefixes) >= CACHE_ENTRIES:
            self._prefixes.clear()
        self._prefixes[pool] = made
        return made

    def _call_keys(self, name: str, prefix: str, site: str, session: str, token: str) -> list:
        """``keyset.script_keys(name, prefix, site, session=..., token=...)``, from a template made once
        per (script, pool, site): its fixed keys already encoded the way the client would encode them,
        the memo and session keys filled in."""
        entry = self._key_templates.get((name, prefix, site), False)
        if entry is False:
            entry = self._key_template(name, prefix, site)
        if entry is None:
            return keyset.script_keys(name, prefix, site, session=session, token=token)
        template, memo_at, memo_head, session_at, session_head = entry
        out = template.copy()
        out[memo_at] = memo_head + token
        if session_at >= 0:
            out[session_at] = session_head + session
        return out

    def _key_template(self, name: str, prefix: str, site: str) -> tuple | None:
        """The template ``_call_keys`` fills in, checked against ``keyset`` (None: build every call's
        keys with ``keyset.script_keys``, e.g. a script whose KEYS have another shape)."""
        token, session = "\x00token", "\x00session"
        names = keyset.script_keys(name, prefix, site, session=session, token=token)
        memo_head, session_head = keys.memo_key(prefix, name, ""), keys.session_key(prefix, site, "")
        memo_at = [i for i, key in enumerate(names) if key == memo_head + token]
        session_at = [i for i, key in enumerate(names) if key == session_head + session]
        entry = None
        if (name in _TEMPLATED and len(memo_at) == 1 and len(session_at) <= 1
                and not any(token in key or session in key
                            for i, key in enumerate(names) if i not in memo_at + session_at)):
            template = [key if i in memo_at + session_at else self._encode_key(key) for i, key in enumerate(names)]
            entry = (template, memo_at[0], memo_head, session_at[0] if session_at else -1, session_head)
        if len(self._key_templates) >= CACHE_ENTRIES:
            self._key_templates.clear()
        self._key_templates[(name, prefix, site)] = entry
        return entry

    # --- sending a script (both stores: ``_execute`` sends the first command, drives the rest) ----
    def _script_command(self, request: _Script) -> tuple:
        """The command a script call tries first: FCALL of the hot path's function while this store
        uses Functions, else EVALSHA straight away (what redis-py's Script does, less its per-call
        work)."""
        library = self._functions
        if library is not None and request.name in library.functions:
            names = request.keys
            return ("FCALL", library.functions[request.name], len(names), *names, *request.args)
        return self._evalsha_command(request)

    def _evalsha_command(self, request: _Script) -> tuple:
        names = request.keys
        return ("EVALSHA", self._scripts[request.name].sha, len(names), *names, *request.args)

    def _script_recovery(self, request: _Script, sent: tuple, exc: redis.ResponseError) -> Plan:
        """What still gets a script call run after an error reply to ``sent`` (its first command).

        Kept off the hot path, and one plan for both stores: each step is ``("send", command)``
        (through the store's sender) or ``(client method, args)`` (``execute_command`` for FUNCTION
        LOAD, ``script_load``); the driver sends back the reply or throws the error reply in. A server
        without the library gets it loaded (once); one without Functions turns them off for this
        store (EVALSHA from then on); a server that lost the script (restart, SCRIPT FLUSH) gets it
        loaded again, as redis-py's Script does. Any other error is the script's own reply: raised."""
        script = self._scripts[request.name]
        if sent[0] == "FCALL":
            library = self._functions
            step = _fcall_failed(exc, self._location)  # raises the function's own error reply
            if step == "load" and library is not None:
                try:
                    yield "execute_command", ("FUNCTION", "LOAD", library.source)
                except redis.ResponseError as load_exc:
                    step = _load_failed(load_exc, library, self._location)
                else:
                    step = _loaded(library, self._location)
            if step == "fcall":
                return (yield "send", sent)
            self._functions = None
            try:
                return (yield "send", self._evalsha_command(request))
            except redis.exceptions.NoScriptError:
                pass
        elif not isinstance(exc, redis.exceptions.NoScriptError):
            raise exc
        script.sha = yield "script_load", (script.script,)
        return (yield "send", self._evalsha_command(request))

    # --- plumbing --------------------------------------------------------------------------------
    def _note_in_doubt(self, request: Any, exc: Exception) -> None:
        """Remember a lease call whose outcome is unknown: it may hold a slot for nobody."""
        lost = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
        if lost and isinstance(request, _Script) and request.name == "lease" and len(self._in_doubt) < MAX_IN_DOUBT:
            proxies_key = request.keys[_LEASE_PROXIES_AT]
            if isinstance(proxies_key, bytes):  # a templated key, encoded for the client
                proxies_key = proxies_key.decode()
            prefix = proxies_key.rpartition(":")[0]  # "<prefix>:proxies"
            self._in_doubt[request.args[3]] = (prefix, request.args[0], request.args[5])

    def _settle_plan(self) -> Plan:
        """Give back (or bar) every lease call in doubt; each one settled is forgotten."""
        for token, (prefix, site, sid) in list(self._in_doubt.items()):
            if token in self._settling:  # another call (asyncio) is settling it right now
                continue
            self._settling.add(token)
            try:
                reply = yield _Script("abandon", keyset.script_keys("abandon", prefix, site, session=sid, token=token),
                                      (site, token, sid))
            finally:  # also when the call failed: the token stays in doubt for a later call
                self._settling.discard(token)
            if self._in_doubt.pop(token, None) is not None and self._on_settled is not None:
                self._on_settled(str(reply[0]).lower())

    def _retry_pause(self, request: Any, exc: redis.RedisError, attempt: int, first: float) -> float:
        """After ``request`` failed with ``exc``: the pause before sending it again when Redis answered
        BUSY or LOADING (it did not run the command), else the store's error (the call is in doubt)."""
        if not _is_busy(exc):
            self._note_in_doubt(request, exc)
            raise self._backend_error(exc) from None
        return self._busy_pause(exc, attempt, first)

    def _busy_pause(self, exc: Exception, attempt: int, first: float) -> float:
        """After a BUSY/LOADING answer: how long to pause before the call's next attempt, or raise
        ``PoolBusy`` once the call has waited ``busy_wait`` since its ``first`` such answer."""
        now = time.monotonic()
        kind = "LOADING" if isinstance(exc, redis.BusyLoadingError) else "BUSY"
        if self._busy_since is None:
            self._busy_since, self._busy_retries = now, 0
            logger.warning("proxy_shard: %(where)s answers %(kind)s (%(e)s); calls wait and retry with "
                           "backoff (up to %(s)gs each, then as a stalled Redis)",
                           {"where": self._location, "kind": kind, "e": _busy_text(exc), "s": self.busy_wait})
        waited = now - first
        if waited >= self.busy_wait:
            raise PoolBusy(f"{self._location} still answers {kind} after {now - self._busy_since:.1f}s: "
                           f"{_busy_text(exc)}", waited=now - self._busy_since)
        self._busy_retries += 1
        if self._on_busy_retry is not None:
            self._on_busy_retry()
        step = min(BUSY_CAP, BUSY_BASE * 2 ** min(attempt - 1, 20))
        return min(step / 2 + random.random() * step / 2, self.busy_wait - waited)

    def _busy_over(self) -> None:
        """Redis answered a request: end the BUSY/LOADING episode, if one ran."""
        if self._busy_since is not None:
            logger.info("proxy_shard: %(where)s answers again after %(s).2fs busy or loading "
                        "(%(n)d retries)", {"where": self._location, "s": time.monotonic() - self._busy_since,
                                            "n": self._busy_retries})
            self._busy_since = None

    def _backend_error(self, exc: Exception) -> PoolBackendError:
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return PoolUnreachable(f"cannot reach {self._location}: {exc}",
                                   timed_out=isinstance(exc, redis.TimeoutError))
        return PoolBackendError(f"{self._location} answered with an error: {exc}")


# --- helpers --------------------------------------------------------------------------------------

_MS: dict[float, int] = {}  # seconds -> ms, for the few distinct values a crawl passes (TTLs, intervals)


def _ms(seconds: float, name: str = "time") -> int:
    """Seconds to the scripts' integer ms, refusing what no script accepts (NaN, inf, > 366 days)."""
    kind = type(seconds)
    if kind is float or kind is int:
        known = _MS.get(seconds)
        if known is not None:
            return known
    value = float(seconds)
    if not math.isfinite(value) or value > MAX_SECONDS:
        raise ValueError(f"{name} ({seconds!r}) must be a finite number of seconds up to {MAX_SECONDS:g}")
    ms = max(0, round(value * 1000))
    if kind is float or kind is int:
        if len(_MS) >= CACHE_ENTRIES:
            _MS.clear()
        _MS[seconds] = ms
    return ms


def _name(value: str, what: str, empty: bool = False) -> str:
    """A site, host or session id as the scripts keep it: 1 to 200 bytes (0 to 200 with ``empty``).
    The hot path's scripts trust their arguments (lease.lua, release.lua): every one is checked here."""
    n = len(value)
    if (n > MAX_NAME_BYTES // 4 and len(value.encode()) > MAX_NAME_BYTES) or (not n and not empty):
        shown = value if n <= 40 else value[:40] + "..."
        raise ValueError(f"{what} ({shown!r}) must be {0 if empty else 1} to {MAX_NAME_BYTES} bytes")
    return value


def _latency_ms(seconds: float) -> int:
    """A response's latency as release.lua takes it: whole ms, a negative one as 0."""
    ms = seconds * 1000.0
    if 0.0 <= ms <= MAX_MS:
        return round(ms)
    if ms < 0.0:
        return 0
    raise ValueError(f"latency ({seconds!r}) must be a finite number of seconds up to {MAX_SECONDS:g}")


def _is_busy(exc: Exception) -> bool:
    """A ``BUSY`` (a script or function runs past the busy threshold) or ``LOADING`` answer: Redis did
    not run the command and will once the script ends or the dataset is loaded."""
    if isinstance(exc, redis.BusyLoadingError):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("BUSY ")


def _busy_text(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


_REASONS: dict[str, str] = {}  # a reason as given -> as the scripts take it


def _reason(reason: str) -> str:
    if type(reason) is str:
        known = _REASONS.get(reason)
        if known is not None:
            return known
    text = str(reason).strip().lower().replace(" ", "_")
    clean = "".join(ch if ch in REASON_CHARS else "_" for ch in text)[:64] or "unknown"
    if type(reason) is str:
        if len(_REASONS) >= CACHE_ENTRIES:
            _REASONS.clear()
        _REASONS[reason] = clean
    return clean


def _decode(value: Any) -> Any:
    if type(value) is list:  # a script's reply: usually flat, and already str (decode_responses)
        for item in value:
            kind = type(item)
            if kind is not str and kind is not int:
                return [_decode(v) for v in value]
        return value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {_decode(k): _decode(v) for k, v in value.items()}
    if isinstance(value, set):
        return {_decode(v) for v in value}
    return value


def _key_encoder(client: Any) -> Callable[[str], Any]:
    """How ``client`` encodes a key it sends (its own encoder), so a key encoded once is sent as is;
    identity when the client has no encoder to ask."""
    for get in (lambda: client.get_encoder(), lambda: client.connection_pool.get_encoder()):
        try:
            encoder = get()
        except (AttributeError, TypeError):
            continue
        encode = getattr(encoder, "encode", None)
        if callable(encode):
            return encode
    return lambda key: key


def _describe(client: Any) -> str:
    try:
        kwargs = client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix://{kwargs['path']}"
        return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"
    except AttributeError:
        return type(client).__name__
