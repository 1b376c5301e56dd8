"""The plugin's scrapy-playwright browser contexts in one crawler: which one a leased request uses,
and when one is closed (issue 22).

A browser request is bound to a context of its leased proxy (crawl/browser.py): the proxy's current
one, or for a sticky ``meta['session_id']`` the session's own (cookies and storage stay with the IP
for the session's life). A context is *in use* while a request bound to it is in flight, while a
``playwright_include_page`` page of it is open (the spider closes it later), or while any page of it
is open; a context in use is never closed. A context is closed:

- when its proxy is quarantined (a ban judged on this host, at once; on another host, at the next
  sweep of the pool's quarantines, every ``SWEEP_INTERVAL`` seconds), removed from the pool, or its
  URL changed (a password rotation): *retired*, it takes no new request and is closed once idle;
- when the session it belongs to ends (``meta['proxy_shard_end_session']``), is rebound to another
  proxy, or lay unused for ``PROXY_SHARD_SESSION_TTL`` (the engine forgets it then too);
- when the plugin's contexts reach the bound and one more is needed: the least recently used idle
  one (a session's only when no proxy's context is idle or busy: those free up soon). The bound is
  ``PLAYWRIGHT_MAX_CONTEXTS`` less the contexts that are not the plugin's (a user's
  ``PLAYWRIGHT_CONTEXTS``); with every context in use, the request waits (holding its lease, before
  its download) until one is idle.
  scrapy-playwright itself would wait for a free context inside its context lock, where the
  requests bound to open contexts queue too: a stall until a download timed out. Without
  ``PLAYWRIGHT_MAX_CONTEXTS`` the bound is ``DEFAULT_MAX_CONTEXTS``, and a context all of whose
  peers are in use is made past it (closed first once idle).

Each new context gets a name never used before in the process (``<proxy context>``, then
``<proxy context>:2``...; a session's ``<proxy context>:s<hash>``), so a request is never bound to a
context scrapy-playwright is still closing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from scrapy import Request

from scrapy_proxy_shard.crawl import browser
from scrapy_proxy_shard.crawl.handlers import _CONTEXT_KEY, CONTEXT_PREFIX, context_name
from scrapy_proxy_shard.engine.proxies import send_url

logger = logging.getLogger(__name__)

STATS = "proxy_shard/browser"
#: The bound on the plugin's contexts when PLAYWRIGHT_MAX_CONTEXTS is not set.
DEFAULT_MAX_CONTEXTS = 32
#: Seconds between two reads of the pools' quarantines and proxies (only while contexts exist).
SWEEP_INTERVAL = 5.0


@dataclass
class _Context:
    name: str
    base: str  # the proxy's first context name: proxy id + URL hash
    proxy_id: str
    pool: str
    site: str | None  # a session's site (None: the proxy's context, every site)
    session: str | None  # a session's key (hash)
    users: int = 0  # bound requests in flight
    kept: int = 0  # playwright_include_page pages the spider holds
    used: float = 0.0  # clock of the last bind or release
    retired: bool = False
    watched: Any = None  # the Playwright context whose request events feed _Page records


@dataclass
class _Page:
    """What the browser sent for one bound request (crawl/contexts.py ``settled``): its page's requests
    not yet answered, the loop time the last one was answered, and whether one failed."""

    url: str
    page: Any = None  # the Playwright page, once its document request was seen
    pending: int = 0
    settled: float | None = None
    failed: bool = False


def session_key(site: str, session_id: str) -> str:
    """A session's part of a context name (keyed hash: the session id never appears)."""
    return hashlib.blake2b(f"{site}\0{session_id}".encode(), digest_size=4, key=_CONTEXT_KEY).hexdigest()


class BrowserContexts:
    """Binds leased browser requests to contexts and closes the contexts no longer wanted."""

    def __init__(self, crawler: Any, *, store: Callable[[], Any], max_contexts: int, session_ttl: float,
                 stats: Any, hard: bool = False, handlers: Callable[[], list[Any]] | None = None,
                 clock: Callable[[], float] = time.monotonic, sweep_interval: float = SWEEP_INTERVAL) -> None:
        self.crawler = crawler
        self._store = store
        self.max_contexts = max(1, int(max_contexts))
        self.hard = hard  # PLAYWRIGHT_MAX_CONTEXTS: scrapy-playwright enforces it too
        self._freed: asyncio.Event | None = None  # set when a context may have become idle
        self.session_ttl = session_ttl
        self.stats = stats
        self._handlers = handlers or self._crawler_handlers
        self._clock = clock
        self._sweep_interval = sweep_interval
        self._contexts: OrderedDict[str, _Context] = OrderedDict()  # least recently used first
        self._current: dict[tuple[str, str | None], str] = {}  # (base, session) -> the live context
        self._sessions: dict[str, str] = {}  # session key -> its context
        self._made: dict[tuple[str, str | None], int] = {}  # contexts made per (base, session)
        self._bound: weakref.WeakKeyDictionary[Request, str] = weakref.WeakKeyDictionary()
        self._pages: weakref.WeakKeyDictionary[Request, _Page] = weakref.WeakKeyDictionary()
        self._settled: weakref.WeakKeyDictionary[Request, float] = weakref.WeakKeyDictionary()
        self._tidy_task: asyncio.Future | None = None
        self._sweeper: asyncio.Future | None = None
        self._closing: set[asyncio.Future] = set()

    @classmethod
    def from_runtime(cls, runtime: Any) -> BrowserContexts:
        settings = runtime.crawler.settings
        hard = settings.getint("PLAYWRIGHT_MAX_CONTEXTS") or 0
        return cls(runtime.crawler, store=lambda: runtime.store, max_contexts=hard or DEFAULT_MAX_CONTEXTS,
                   session_ttl=runtime.settings.session_ttl, stats=runtime.stats, hard=bool(hard))

    # --- binding -----------------------------------------------------------------------------------
    async def bind(self, request: Request, lease: Any, session_id: str | None) -> str:
        """Bind ``request`` to a context of its leased proxy (its session's with ``session_id``)."""
        base = context_name(lease.proxy_id, lease.proxy_url)
        skey = session_key(lease.site, session_id) if session_id else None
        if skey is not None:
            old = self._sessions.get(skey)
            if old is not None and old in self._contexts and self._contexts[old].base != base:
                self._retire(self._contexts[old], "session_rebound")  # the session moved to another IP
        name = self._current.get((base, skey))
        if name is None or name not in self._contexts:
            await self._make_room()
            name = self._current.get((base, skey))  # made meanwhile by another request
        if name is None or name not in self._contexts:
            name = self._new_name(base, skey)
            self._contexts[name] = _Context(name, base, lease.proxy_id, lease.pool,
                                            lease.site if skey else None, skey)
            self._current[(base, skey)] = name
            if skey is not None:
                self._sessions[skey] = name
            self.stats.inc_value(f"{STATS}/contexts")
            self._start_sweeper()
        ctx = self._contexts[name]
        ctx.users += 1
        ctx.used = self._clock()
        self._contexts.move_to_end(name)
        self._bound[request] = name
        self._pages[request] = _Page(_norm(request.url))
        self._settled.pop(request, None)
        self._watch(ctx)
        browser.bind(request.meta, lease.proxy_id, lease.proxy_url, name)
        return name

    # --- what the browser sent ---------------------------------------------------------------------
    # A bound request's lease was taken before the browser made its page, so the lease's start says
    # nothing of when its document left. The context's request events tell when the page's requests
    # were answered: each reached the site before that. The runtime paces the slot from the last one
    # (``settled``), or from the release when that is not known for sure.
    def _watch(self, ctx: _Context) -> None:
        wrapper = self._wrapper(ctx.name)
        context = getattr(wrapper, "context", None)
        if context is None or ctx.watched is context:
            return  # made by scrapy-playwright during this request's download: watched from the next
        ctx.watched = context
        name = ctx.name
        with suppress(Exception):
            context.on("request", lambda r: self._on_request(name, r))
            context.on("requestfinished", lambda r: self._on_settled(name, r, False))
            context.on("requestfailed", lambda r: self._on_settled(name, r, True))

    def _record_of(self, name: str, pw_request: Any, *, navigation: bool) -> _Page | None:
        try:
            page = pw_request.frame.page
        except Exception:  # a service worker's request: no page
            return None
        records = [rec for req, rec in list(self._pages.items()) if self._bound.get(req) == name]
        for rec in records:
            if rec.page is page:
                return rec
        if not navigation:
            return None
        url = _norm(pw_request.url)
        candidates = [rec for rec in records if rec.page is None and rec.url == url]
        if len(candidates) != 1:
            return None  # not one of ours, or ambiguous: its request is paced from the release
        candidates[0].page = page
        return candidates[0]

    def _on_request(self, name: str, pw_request: Any) -> None:
        try:
            navigation = pw_request.is_navigation_request() and pw_request.frame.parent_frame is None
        except Exception:
            navigation = False
        rec = self._record_of(name, pw_request, navigation=navigation)
        if rec is not None:
            rec.pending += 1

    def _on_settled(self, name: str, pw_request: Any, failed: bool) -> None:
        rec = self._record_of(name, pw_request, navigation=False)
        if rec is None:
            return
        rec.pending -= 1
        rec.failed = rec.failed or failed  # a failed request may still have reached the site later
        now = asyncio.get_running_loop().time()
        at = now
        with suppress(Exception):  # when the browser got the answer's last byte (its event reaches us later)
            timing = pw_request.timing
            if timing["responseEnd"] >= 0 and timing["startTime"] > 0:
                at = min(now, now - (time.time() - (timing["startTime"] + timing["responseEnd"]) / 1000))
        rec.settled = at if rec.settled is None else max(rec.settled, at)

    def settled(self, request: Request) -> float | None:
        """Loop time by which every request the browser sent for ``request`` had been answered (each
        reached the site before), or None when that is not known for sure (a context made during the
        request, a request failed or still pending, a page the spider keeps): pace from the release."""
        return self._settled.get(request)

    def _new_name(self, base: str, skey: str | None) -> str:
        key = (base, skey)
        n = self._made.get(key, 0) + 1
        self._made[key] = n
        name = base if skey is None else f"{base}:s{skey}"
        return name if n == 1 else f"{name}:{n}"

    def finished(self, request: Request) -> Any:
        """``request``'s download is over. Returns its ``playwright_include_page`` page when it is still
        open in the request's context (the lease must then wait for the page: ``keep``), else None."""
        rec = self._pages.pop(request, None)
        if rec is not None and rec.page is not None and rec.pending == 0 and not rec.failed \
                and rec.settled is not None and not request.meta.get("playwright_include_page"):
            self._settled[request] = rec.settled
        name = self._bound.pop(request, None)
        ctx = self._contexts.get(name) if name is not None else None
        if ctx is None:
            return None
        ctx.users -= 1
        ctx.used = self._clock()
        self._wake()
        page = request.meta.get("playwright_page") if request.meta.get("playwright_include_page") else None
        if page is not None and (browser._closed(page) or not self._page_of(page, ctx)):
            page = None
        if page is None:
            self._tidy()
        return page

    def keep(self, request: Request, page: Any, on_close: Callable[[], Any]) -> None:
        """The spider holds ``page`` of ``request``'s context: in use until it is closed, then
        ``on_close`` (the lease's release)."""
        name = request.meta.get("playwright_context")
        ctx = self._contexts.get(name)
        if ctx is not None:
            ctx.kept += 1
        done = False

        def closed(*_: Any) -> None:
            nonlocal done
            if done:
                return
            done = True
            if ctx is not None:
                ctx.kept -= 1
                ctx.used = self._clock()
            self._wake()
            with suppress(Exception):
                on_close()
            self._tidy()

        page.on("close", closed)
        if browser._closed(page):  # closed before the listener was added
            closed()

    # --- retiring ----------------------------------------------------------------------------------
    def proxy_banned(self, proxy_id: str, site: str | None = None, reason: str = "quarantined") -> None:
        """``proxy_id`` was quarantined (on ``site``; None: everywhere): its contexts take no new
        request and close once idle (a session's context only for a ban on its own site)."""
        for ctx in list(self._contexts.values()):
            if ctx.proxy_id == proxy_id and (ctx.site is None or site is None or ctx.site == site):
                self._retire(ctx, reason)

    def session_ended(self, site: str, session_id: str) -> None:
        name = self._sessions.get(session_key(site, session_id))
        if name is not None and name in self._contexts:
            self._retire(self._contexts[name], "session_ended")

    def _retire(self, ctx: _Context, reason: str) -> None:
        if ctx.retired:
            return
        ctx.retired = True
        self.stats.inc_value(f"{STATS}/retired/{reason}")
        if self._current.get((ctx.base, ctx.session)) == ctx.name:
            del self._current[(ctx.base, ctx.session)]
        if ctx.session is not None and self._sessions.get(ctx.session) == ctx.name:
            del self._sessions[ctx.session]
        logger.debug("proxy_shard: browser context %(name)s of proxy %(proxy)s retired (%(why)s)",
                     {"name": ctx.name, "proxy": ctx.proxy_id, "why": reason})
        self._tidy()

    # --- closing -----------------------------------------------------------------------------------
    def _tidy(self) -> None:
        """Close, in the background, the retired contexts now idle and the idle ones past the bound."""
        if self._tidy_task is None or self._tidy_task.done():
            with suppress(RuntimeError):  # no running loop: nothing was ever made
                self._tidy_task = asyncio.ensure_future(self._tidy_now())

    async def _tidy_now(self) -> None:
        for ctx in [c for c in self._contexts.values() if c.retired and self._idle(c)]:
            await self._close(ctx, "retired")
        await self._make_room(limit=self._limit())

    def _limit(self) -> int:
        """How many contexts the plugin may hold: under PLAYWRIGHT_MAX_CONTEXTS, what the others leave."""
        if not self.hard:
            return self.max_contexts
        others = sum(1 for h in self._handlers() for name in getattr(h, "context_wrappers", {})
                     if not str(name).startswith(CONTEXT_PREFIX))
        return max(1, self.max_contexts - others)

    async def _make_room(self, limit: int | None = None) -> None:
        """Close least recently used idle contexts until there is room for one more (``limit``: until
        at most ``limit`` are open). Under PLAYWRIGHT_MAX_CONTEXTS, wait for one to be idle."""
        waited = False
        while True:
            most = self._limit() - 1 if limit is None else limit
            if len(self._contexts) <= most:
                return
            victim = self._victim()
            if victim is not None:
                await self._close(victim, "retired" if victim.retired else
                                  "lru" if victim.session is None else "lru_session")
                continue
            if limit is not None:
                return
            if not self.hard:
                self.stats.inc_value(f"{STATS}/over_bound")
                return  # every context is in use: one more, past the soft bound
            if not waited:
                self.stats.inc_value(f"{STATS}/waits")
                waited = True
            if self._freed is None:
                self._freed = asyncio.Event()
            self._freed.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), 1.0)

    def _victim(self) -> _Context | None:
        """The context to close for room: a retired idle one, else the least recently used idle one
        of a proxy, else, only when no proxy's context is in use (none will be idle soon), a
        session's (its cookies and storage go with it)."""
        contexts = list(self._contexts.values())
        idle = [c for c in contexts if self._idle(c)]
        picks: list[Callable[[_Context], bool]] = [lambda c: c.retired, lambda c: c.session is None]
        if not any(c.session is None and c not in idle for c in contexts):
            picks.append(lambda c: True)
        for pick in picks:
            found = next((c for c in idle if pick(c)), None)
            if found is not None:
                return found
        return None

    def _wake(self) -> None:
        if self._freed is not None:
            self._freed.set()

    def _idle(self, ctx: _Context) -> bool:
        if ctx.users > 0 or ctx.kept > 0:
            return False
        wrapper = self._wrapper(ctx.name)
        if wrapper is None:
            return True
        try:
            return not wrapper.context.pages
        except Exception:  # a context already gone
            return True

    async def _close(self, ctx: _Context, why: str) -> None:
        self._contexts.pop(ctx.name, None)
        if self._current.get((ctx.base, ctx.session)) == ctx.name:
            del self._current[(ctx.base, ctx.session)]
        if ctx.session is not None and self._sessions.get(ctx.session) == ctx.name:
            del self._sessions[ctx.session]
        wrapper = self._wrapper(ctx.name)
        self.stats.inc_value(f"{STATS}/closed/{why}")
        if wrapper is None:
            return
        logger.debug("proxy_shard: closing browser context %(name)s (%(why)s)", {"name": ctx.name, "why": why})
        with suppress(Exception):  # closed already (the browser went away): scrapy-playwright forgets it
            await wrapper.context.close()

    def _wrapper(self, name: str) -> Any:
        for handler in self._handlers():
            wrapper = getattr(handler, "context_wrappers", {}).get(name)
            if wrapper is not None:
                return wrapper
        return None

    def _page_of(self, page: Any, ctx: _Context) -> bool:
        wrapper = self._wrapper(ctx.name)
        try:
            return wrapper is not None and page.context is wrapper.context
        except Exception:
            return False

    def _crawler_handlers(self) -> list[Any]:
        try:
            handlers = self.crawler.engine.downloader.handlers._handlers  # Scrapy's DownloadHandlers
        except (AttributeError, RuntimeError):  # RuntimeError: Scrapy 2.19's engine before the crawl starts
            return []
        return [h for h in dict.fromkeys(handlers.values()) if hasattr(h, "context_wrappers")]

    # --- sweeping ----------------------------------------------------------------------------------
    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        while self._contexts:
            await asyncio.sleep(self._sweep_interval)
            try:
                await self.sweep()
            except Exception as exc:  # Redis away: the next sweep tries again
                logger.debug("proxy_shard: browser context sweep failed: %(e)s", {"e": exc})

    async def sweep(self) -> None:
        """Retire the contexts whose proxy another host quarantined, that left the pool or changed URL,
        and the sessions' contexts unused for PROXY_SHARD_SESSION_TTL."""
        store = self._store()
        store = getattr(store, "primary", store)  # the local fallback store reads from Redis
        now = self._clock()
        wall = time.time()
        by_pool: dict[str, set[str]] = {}
        for ctx in self._contexts.values():
            if not ctx.retired:
                by_pool.setdefault(ctx.pool, set()).add(ctx.proxy_id)
        for pool, ids in by_pool.items():
            bans = getattr(store, "bans", None)
            if bans is not None:
                for ban in await bans(pool):
                    if ban.proxy_id in ids and ban.until > wall:
                        self.proxy_banned(ban.proxy_id, None if ban.scope == "*" else ban.scope,
                                          "quarantined_elsewhere")
            urls = getattr(store, "proxy_urls", None)
            if urls is not None:
                found = await urls(pool, sorted(ids))
                for ctx in list(self._contexts.values()):
                    if ctx.pool != pool or ctx.retired or ctx.proxy_id not in found:
                        continue
                    url = found[ctx.proxy_id]
                    if url is None:
                        self._retire(ctx, "removed")
                    elif context_name(ctx.proxy_id, send_url(url if isinstance(url, str) else url.decode())) \
                            != ctx.base:
                        self._retire(ctx, "url_changed")
        for ctx in list(self._contexts.values()):
            if ctx.session is not None and not ctx.retired and self._idle(ctx) and now - ctx.used > self.session_ttl:
                self._retire(ctx, "session_expired")

    async def close(self) -> None:
        """The crawl is over: stop the sweeper (scrapy-playwright closes its contexts itself)."""
        for task in (self._sweeper, self._tidy_task):
            if task is not None and not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task


def _norm(url: str) -> str:
    """A URL as scrapy-playwright matches a page's document request to the Scrapy request."""
    return url.rstrip("/")
