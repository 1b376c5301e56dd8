"""The plugin's scrapy-playwright contexts (crawl/contexts.py): reuse per proxy, retirement on a
quarantine, the LRU bound, sessions, pages the spider holds; and the lease of a held page (runtime).

Fakes stand for scrapy-playwright's handler (``context_wrappers``), its contexts and pages; the
real browser runs in tests/test_browser_end_to_end.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from scrapy import Request
from scrapy.http import HtmlResponse
from test_handlers import AUTH_PROXY, PLAYWRIGHT
from test_middlewares import PAGE, Harness

from scrapy_proxy_shard.crawl.contexts import BrowserContexts
from scrapy_proxy_shard.crawl.handlers import context_name


class FakePage:
    def __init__(self, context):
        self.context = context
        self.closed = False
        self.listeners = []

    def on(self, event, callback):
        assert event == "close"
        self.listeners.append(callback)

    def is_closed(self):
        return self.closed

    async def close(self):
        self.closed = True
        self.context.pages.remove(self)
        for callback in self.listeners:
            callback(self)


class FakeContext:
    def __init__(self, handler, name):
        self.handler, self.name = handler, name
        self.pages = []
        self.closed = False

    def new_page(self):
        page = FakePage(self)
        self.pages.append(page)
        return page

    async def close(self):
        self.closed = True
        self.handler.closed.append(self.name)
        self.handler.context_wrappers.pop(self.name, None)


class FakeHandler:
    """scrapy-playwright's handler as the contexts see it: ``context_wrappers`` by name."""

    def __init__(self):
        self.context_wrappers = {}
        self.closed = []

    def download(self, request):
        """What scrapy-playwright does with a bound request: the context by name, made on first use."""
        name = request.meta["playwright_context"]
        if name not in self.context_wrappers:
            assert request.meta["playwright_context_kwargs"]["proxy"]["server"]
            self.context_wrappers[name] = SimpleNamespace(context=FakeContext(self, name))
        page = self.context_wrappers[name].context.new_page()
        if request.meta.get("playwright_include_page"):
            request.meta["playwright_page"] = page
        return page


class Stats:
    def __init__(self):
        self.values = {}

    def inc_value(self, key, n=1):
        self.values[key] = self.values.get(key, 0) + n

    def get(self, key):
        return self.values.get(f"proxy_shard/browser/{key}", 0)


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def lease(n, site="shop.example", pool="default"):
    return SimpleNamespace(proxy_id=f"p{n}", proxy_url=f"http://u:pw{n}@10.0.0.{n}:3128", site=site, pool=pool)


def contexts(max_contexts=8, store=None, clock=None, session_ttl=60.0, hard=False):
    handler, stats = FakeHandler(), Stats()
    made = BrowserContexts(None, store=lambda: store, max_contexts=max_contexts, session_ttl=session_ttl,
                           stats=stats, handlers=lambda: [handler], clock=clock or Clock(), hard=hard)
    return made, handler, stats


async def fetch(ctxs, handler, n, *, session=None, keep=False, site="shop.example", close=True):
    """Bind, download (a page made and, unless kept, closed) and finish one request through proxy ``n``."""
    request = Request(f"https://{site}/{n}", meta={"playwright": True, "playwright_include_page": keep})
    await ctxs.bind(request, lease(n, site), session)
    page = handler.download(request)
    if not keep and close:
        await page.close()
    return request, page


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_context_per_proxy_reused_and_bound_with_its_credentials():
    async def scenario():
        ctxs, handler, stats = contexts()
        first, _ = await fetch(ctxs, handler, 1)
        ctxs.finished(first)
        again, _ = await fetch(ctxs, handler, 1)
        other, _ = await fetch(ctxs, handler, 2)
        assert first.meta["playwright_context"] == again.meta["playwright_context"]
        assert first.meta["playwright_context"] == context_name("p1", lease(1).proxy_url)
        assert other.meta["playwright_context"] == context_name("p2", lease(2).proxy_url)
        assert other.meta["playwright_context_kwargs"]["proxy"] == {"server": "http://10.0.0.2:3128",
                                                                    "username": "u", "password": "pw2"}
        assert len(handler.context_wrappers) == 2 and stats.get("contexts") == 2

    asyncio.run(scenario())


def test_a_quarantine_retires_the_proxys_context_closed_once_its_page_is_done():
    async def scenario():
        ctxs, handler, stats = contexts()
        busy, page = await fetch(ctxs, handler, 1, close=False)  # downloading: a page open, not finished
        old = busy.meta["playwright_context"]
        ctxs.proxy_banned("p1", "shop.example")
        await settle()
        assert handler.closed == []  # a page in use: never closed under it
        fresh, _ = await fetch(ctxs, handler, 1)  # the quarantine over (or a retry here): a new context
        assert fresh.meta["playwright_context"] == f"{old}:2"
        await page.close()
        ctxs.finished(busy)
        await settle()
        assert handler.closed == [old] and stats.get("closed/retired") == 1
        assert stats.get("retired/quarantined") == 1

    asyncio.run(scenario())


def test_the_bound_closes_the_least_recently_used_idle_context_never_one_in_use():
    async def scenario():
        ctxs, handler, stats = contexts(max_contexts=2)
        for n in (1, 2):
            request, _ = await fetch(ctxs, handler, n)
            ctxs.finished(request)
        again, _ = await fetch(ctxs, handler, 1)  # p1 used last now; p2 is the least recently used
        ctxs.finished(again)
        third, _ = await fetch(ctxs, handler, 3)
        assert handler.closed == [context_name("p2", lease(2).proxy_url)] and stats.get("closed/lru") == 1
        # Every context in use (p1 and p3 downloading): the next one is made past the bound, none closed.
        await fetch(ctxs, handler, 1, close=False)
        await fetch(ctxs, handler, 4, close=False)
        assert len(handler.context_wrappers) == 3 and stats.get("over_bound") == 1
        ctxs.finished(third)  # p3 idle now: closed, back at the bound
        await settle()
        assert context_name("p3", lease(3).proxy_url) in handler.closed and len(handler.context_wrappers) == 2

    asyncio.run(scenario())


def test_the_bound_closes_a_sessions_context_only_when_no_proxys_context_is_idle_or_busy():
    async def scenario():
        ctxs, handler, stats = contexts(max_contexts=2)
        session, _ = await fetch(ctxs, handler, 1, session="cart")
        ctxs.finished(session)
        plain, _ = await fetch(ctxs, handler, 2)
        ctxs.finished(plain)
        third, _ = await fetch(ctxs, handler, 3)  # the session's context is the least recently used
        assert handler.closed == [plain.meta["playwright_context"]] and stats.get("closed/lru") == 1
        await fetch(ctxs, handler, 4)  # p3 in use frees up soon: past the bound, the session's stays
        assert session.meta["playwright_context"] not in handler.closed and stats.get("over_bound") == 1
        ctxs.finished(third)
        await settle()  # back at the bound: p3 closed, not the session's
        assert handler.closed[-1] == third.meta["playwright_context"]
        other, _ = await fetch(ctxs, handler, 5, session="cart-2")
        ctxs.finished(other)
        await settle()
        assert session.meta["playwright_context"] not in handler.closed
        # Only sessions' contexts idle and none of a proxy in use: the least recently used session's goes
        for name in list(handler.context_wrappers):
            if ":s" not in name:
                for page in list(handler.context_wrappers[name].context.pages):
                    await page.close()
        ctxs._bound.clear()
        for ctx in ctxs._contexts.values():
            ctx.users = 0
        await fetch(ctxs, handler, 6, session="cart-3")
        assert session.meta["playwright_context"] in handler.closed and stats.get("closed/lru_session") >= 1

    asyncio.run(scenario())


def test_under_playwright_max_contexts_a_new_context_waits_for_an_idle_one():
    """scrapy-playwright would wait for a free context inside its context lock, where requests bound
    to open contexts queue too; the plugin waits before the download instead, and counts the others'."""

    async def scenario():
        ctxs, handler, stats = contexts(max_contexts=3, hard=True)
        handler.context_wrappers["mine"] = SimpleNamespace(context=FakeContext(handler, "mine"))  # a user's
        first, page = await fetch(ctxs, handler, 1, close=False)
        second, _ = await fetch(ctxs, handler, 2, close=False)
        third = asyncio.ensure_future(fetch(ctxs, handler, 3))
        await asyncio.sleep(0.05)
        assert not third.done() and stats.get("waits") == 1  # 2 of 3 are the plugin's, both in use
        await page.close()
        ctxs.finished(first)
        await asyncio.wait_for(third, 2)
        assert handler.closed == [first.meta["playwright_context"]]
        assert len(handler.context_wrappers) == 3 and second.meta["playwright_context"] in handler.context_wrappers

    asyncio.run(scenario())


def test_a_session_has_its_own_context_kept_with_its_ip_and_closed_with_the_session():
    async def scenario():
        clock = Clock()
        ctxs, handler, stats = contexts(clock=clock, session_ttl=30.0)
        a1, _ = await fetch(ctxs, handler, 1, session="cart-1")
        ctxs.finished(a1)
        a2, _ = await fetch(ctxs, handler, 1, session="cart-1")
        ctxs.finished(a2)
        b, _ = await fetch(ctxs, handler, 1, session="cart-2")
        ctxs.finished(b)
        plain, _ = await fetch(ctxs, handler, 1)
        ctxs.finished(plain)
        names = {r.meta["playwright_context"] for r in (a1, a2, b, plain)}
        assert a1.meta["playwright_context"] == a2.meta["playwright_context"] and len(names) == 3
        assert "cart" not in a1.meta["playwright_context"]  # the session id never appears
        # cart-1 rebound to proxy 2 (its proxy was quarantined): its old context goes
        moved, _ = await fetch(ctxs, handler, 2, session="cart-1")
        ctxs.finished(moved)
        await settle()
        assert handler.closed == [a1.meta["playwright_context"]] and stats.get("retired/session_rebound") == 1
        ctxs.session_ended("shop.example", "cart-1")  # meta['proxy_shard_end_session']
        await settle()
        assert moved.meta["playwright_context"] in handler.closed
        # cart-2 unused for longer than PROXY_SHARD_SESSION_TTL: closed at the next sweep
        clock.now += 31
        await ctxs.sweep()
        await settle()
        assert b.meta["playwright_context"] in handler.closed
        assert plain.meta["playwright_context"] not in handler.closed  # the proxy's own context stays
        # A session's context is not retired by a ban of its proxy on another site
        c, _ = await fetch(ctxs, handler, 3, session="s", site="other.example")
        ctxs.finished(c)
        ctxs.proxy_banned("p3", "shop.example")
        await settle()
        assert c.meta["playwright_context"] not in handler.closed
        await ctxs.close()

    asyncio.run(scenario())


def test_a_page_the_spider_holds_keeps_its_context_until_it_is_closed():
    async def scenario():
        ctxs, handler, _ = contexts(max_contexts=1)
        request, page = await fetch(ctxs, handler, 1, keep=True)
        assert ctxs.finished(request) is page  # the lease waits for the page
        released = []
        ctxs.keep(request, page, lambda: released.append(True))
        ctxs.proxy_banned("p1")
        other, _ = await fetch(ctxs, handler, 2)  # past the bound: p1's page is still open
        ctxs.finished(other)
        await settle()
        assert context_name("p1", lease(1).proxy_url) not in handler.closed and not released
        await page.close()
        await settle()
        assert released == [True] and context_name("p1", lease(1).proxy_url) in handler.closed

    asyncio.run(scenario())


class FakeStore:
    def __init__(self, bans=(), urls=None):
        self._bans, self._urls = list(bans), urls or {}

    async def bans(self, pool):
        return self._bans

    async def proxy_urls(self, pool, ids):
        return {i: self._urls.get(i) for i in ids}


def test_the_sweep_retires_contexts_of_proxies_quarantined_elsewhere_removed_or_rotated():
    async def scenario():
        import time
        store = FakeStore()
        ctxs, handler, stats = contexts(store=store)
        names = {}
        for n in (1, 2, 3, 4):
            request, _ = await fetch(ctxs, handler, n)
            ctxs.finished(request)
            names[n] = request.meta["playwright_context"]
        store._bans = [SimpleNamespace(proxy_id="p1", scope="shop.example", until=time.time() + 60),
                       SimpleNamespace(proxy_id="p4", scope="*", until=time.time() - 60)]  # over: kept
        store._urls = {"p1": lease(1).proxy_url, "p2": None, "p3": "http://u:rotated@10.0.0.3:3128",
                       "p4": lease(4).proxy_url}
        await ctxs.sweep()
        await settle()
        assert sorted(handler.closed) == sorted([names[1], names[2], names[3]])
        assert stats.get("retired/quarantined_elsewhere") == 1 and stats.get("retired/removed") == 1
        assert stats.get("retired/url_changed") == 1

    asyncio.run(scenario())


# --- the lease of a held page (runtime + middlewares, fakeredis) ----------------------------------------

def _harness():
    """A crawler with scrapy-playwright's handler declared, and the fake handler the runtime sees."""
    h = Harness({"DOWNLOAD_HANDLERS": {"https": PLAYWRIGHT}, "PROXY_SHARD_LEASE_TTL": 0.6},
                proxies=[AUTH_PROXY])
    handler = FakeHandler()
    h.runtime.browser._handlers = lambda: [handler]
    return h, handler


def test_a_held_page_keeps_its_lease_until_the_spider_closes_it():
    h, handler = _harness()

    async def scenario():
        await h.open()
        request = Request("https://shop.example/1", meta={"playwright": True, "playwright_include_page": True})
        await h.lease_mw.process_request(request)
        page = handler.download(request)
        await h.respond(request)
        assert len(h.runtime._held) == 1 and h.stat("browser/pages_held") == 1  # the spider holds the page
        second = Request("https://shop.example/2", meta={"playwright": True})
        waiting = asyncio.ensure_future(h.lease_mw.process_request(second))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the only proxy is still leased to the open page
        await page.close()
        await asyncio.wait_for(waiting, 2)
        assert second.meta["proxy_shard_proxy_id"] == request.meta["proxy_shard_proxy_id"]
        # The held page's slot was paced from its release (the close), not from its lease's start; so is
        # a page whose requests the plugin did not see (these fakes send none).
        await h.respond(second)
        assert h.stat("pacing/browser_from_release") == 2 and h.stat("pacing/browser_from_answer") is None
        # A page held past its lease: the lease expires (the safety bound), one WARNING, a stat.
        third = Request("https://shop.example/3", meta={"playwright": True, "playwright_include_page": True})
        await h.lease_mw.process_request(third)
        handler.download(third)
        await h.respond(third)
        await asyncio.sleep(0.8)
        assert h.runtime._held == {} and h.stat("browser/page_outlived_lease") == 1
        await h.runtime.spider_closed(h.spider, "finished")

    asyncio.run(scenario())


def test_a_ban_on_a_held_page_releases_at_once_and_the_retry_gets_no_page():
    h, handler = _harness()

    async def scenario():
        await h.open()
        request = Request("https://shop.example/1", meta={"playwright": True, "playwright_include_page": True})
        await h.lease_mw.process_request(request)
        page = handler.download(request)
        retry = await h.respond(request, status=403)
        assert isinstance(retry, Request) and "playwright_page" not in retry.meta
        await settle()
        assert page.closed  # the spider never sees it: closed by the plugin
        assert h.runtime._held == {} and h.stat("bans") == 1
        await h.runtime.spider_closed(h.spider, "finished")

    asyncio.run(scenario())


def test_html_response_of_a_browser_is_judged_like_any_other():
    h, _ = _harness()

    async def scenario():
        await h.open()
        request = Request("https://shop.example/1", meta={"playwright": True})
        await h.lease_mw.process_request(request)
        response = HtmlResponse("https://shop.example/captcha?return=%2F1", body=PAGE, request=request,
                                flags=["playwright"])
        result = await h.ban_mw.process_response(request, response)
        assert isinstance(result, Request) and h.stat("bans/reason/challenge_page") == 1
        await h.runtime.spider_closed(h.spider, "finished")

    asyncio.run(scenario())


class FakePWRequest:
    """A Playwright request as the context's events give it: its frame's page, URL, timing."""

    def __init__(self, page, url, navigation=True, end_ms=-1.0):
        self.frame = SimpleNamespace(page=page, parent_frame=None)
        self.url, self.navigation = url, navigation
        self.timing = {"startTime": 0.0 if end_ms < 0 else end_ms, "responseEnd": 0.0 if end_ms >= 0 else -1.0}

    def is_navigation_request(self):
        return self.navigation


def _watched(ctx):
    """Record the listeners the plugin adds on a fake context: event -> callbacks."""
    ctx.events = {}
    ctx.on = lambda event, callback: ctx.events.setdefault(event, []).append(callback)
    return ctx


def _emit(ctx, event, request):
    for callback in ctx.events.get(event, []):
        callback(request)


def test_a_page_answered_in_full_is_settled_and_anything_unsure_is_not():
    """settled(): the time the page's last request was answered (the runtime paces from it), or None:
    paced from the release (a failed request, one still pending, a context made during the request,
    a page the spider keeps, another page's requests)."""

    async def scenario():
        import time

        ctxs, handler, _ = contexts()
        first, _ = await fetch(ctxs, handler, 1)  # makes the context: not watched during its own download
        assert ctxs.finished(first) is None and ctxs.settled(first) is None
        ctx = _watched(next(iter(handler.context_wrappers.values())).context)

        async def one(url_n, events, keep=False):
            request = Request(f"https://shop.example/{url_n}", meta={"playwright": True,
                                                                    "playwright_include_page": keep})
            await ctxs.bind(request, lease(1), None)
            page = handler.download(request)
            for event, pw in events(page):
                _emit(ctx, event, pw)
            ctxs.finished(request)
            return request

        answered = (time.time() - 0.5) * 1000  # the browser got the last byte 0.5 s ago
        full = await one(2, lambda p: [
            ("request", doc := FakePWRequest(p, "https://shop.example/2", end_ms=answered - 100)),
            ("request", img := FakePWRequest(p, "https://cdn.example/i.png", False, end_ms=answered)),
            ("requestfinished", doc), ("requestfinished", img)])
        now = asyncio.get_running_loop().time()
        assert abs(ctxs.settled(full) - (now - 0.5)) < 0.05  # the last answer, by the browser's timing
        untimed = await one(7, lambda p: [("request", d := FakePWRequest(p, "https://shop.example/7")),
                                          ("requestfinished", d)])
        assert ctxs.settled(untimed) >= now  # no timing: when the event came (later than the answer)
        failed = await one(3, lambda p: [("request", d := FakePWRequest(p, "https://shop.example/3")),
                                         ("requestfailed", d)])
        pending = await one(4, lambda p: [("request", FakePWRequest(p, "https://shop.example/4"))])
        other = await one(5, lambda p: [("request", d := FakePWRequest(p, "https://shop.example/other")),
                                        ("requestfinished", d)])
        kept = await one(6, lambda p: [("request", d := FakePWRequest(p, "https://shop.example/6")),
                                       ("requestfinished", d)], keep=True)
        assert [ctxs.settled(r) for r in (failed, pending, other, kept)] == [None] * 4
        assert len(ctx.events["request"]) == 1  # one listener per context, however many requests

    asyncio.run(scenario())
