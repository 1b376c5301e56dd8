"""Which download handler downloads a request (crawl/handlers.py), and what the lease middleware and
the guard do with it (middlewares.py, crawl/browser.py), on fakeredis."""

from __future__ import annotations

import asyncio
import base64
import re

import pytest
from scrapy import Request
from scrapy.core.downloader.handlers.http11 import HTTP11DownloadHandler
from scrapy.downloadermiddlewares.httpproxy import HttpProxyMiddleware
from scrapy.settings import Settings
from scrapy.utils.misc import build_from_crawler
from scrapy.utils.test import get_crawler
from scrapy_playwright.handler import ScrapyPlaywrightDownloadHandler
from test_middlewares import Harness

from scrapy_proxy_shard.crawl import handlers
from scrapy_proxy_shard.crawl.browser import bind
from scrapy_proxy_shard.crawl.handlers import HandlerMap, context_name
from scrapy_proxy_shard.crawl.startup import check_handlers
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.middlewares import ProxyShardGuardMiddleware, RequestNotLeased
from scrapy_proxy_shard.settings import ShardSettings

PLAYWRIGHT = "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler"
AUTH_PROXY = "http://alice:S3cret@10.9.0.1:3128"


class MyHandler(HTTP11DownloadHandler):
    pass


class MyPW(ScrapyPlaywrightDownloadHandler):
    pass


def _map(handlers=None, declared=()):
    return HandlerMap(Settings({"DOWNLOAD_HANDLERS": handlers or {}}), declared)


def _route(hmap, url, **meta):
    return hmap.route(Request(url, meta=meta))


def test_scrapy_defaults_resolve_per_scheme():
    hmap = _map()
    assert _route(hmap, "http://a.example/").kind == "proxy"
    assert _route(hmap, "https://a.example/").kind == "proxy"
    assert _route(hmap, "file:///etc/hostname").kind == "local"
    assert _route(hmap, "data:,hello").kind == "local"
    ftp = _route(hmap, "ftp://a.example/x")
    assert ftp.kind == "refused" and "FTP handler connects from this host" in ftp.reason
    assert _route(hmap, "s3://bucket/key").kind == "refused"
    hmap.check()  # Scrapy's own ftp/s3 never stop the crawl: their requests are refused one by one


def test_a_disabled_scheme_and_an_unknown_one_are_refused_per_request():
    hmap = _map({"ftp": None})
    assert "no download handler is enabled for scheme 'ftp'" in _route(hmap, "ftp://a.example/x").reason
    assert _route(hmap, "gopher://a.example/").kind == "refused"


def test_playwright_handler_downloads_only_meta_playwright_requests_with_the_browser():
    hmap = _map({"http": PLAYWRIGHT, "https": PLAYWRIGHT})
    assert _route(hmap, "https://a.example/", playwright=True).kind == "browser"
    assert _route(hmap, "https://a.example/").kind == "proxy"  # scrapy-playwright hands it to HTTP/1.1
    hmap.check()


def test_a_subclass_of_the_playwright_handler_is_a_browser_handler_declared_or_not():
    path = f"{__name__}.MyPW"
    for hmap in (_map({"https": path}), _map({"https": MyPW}), _map({"https": path}, declared=(path,))):
        assert hmap.handlers["https"].kind == "playwright"
        assert _route(hmap, "https://a.example/", playwright=True).kind == "browser"
        assert _route(hmap, "https://a.example/").kind == "proxy"
        hmap.check()


def test_a_playwright_subclass_request_is_bound_to_its_proxys_context():
    h = Harness({"DOWNLOAD_HANDLERS": {"https": f"{__name__}.MyPW"},
                 "PROXY_SHARD_PROXY_AWARE_HANDLERS": [f"{__name__}.MyPW"]}, proxies=[AUTH_PROXY])
    guard, _ = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("https://shop.example/", meta={"playwright": True})
        await h.lease_mw.process_request(request)
        guard.process_request(request)
        return request

    request = asyncio.run(scenario())
    assert request.meta["playwright_context"] == context_name(request.meta["proxy_shard_proxy_id"], AUTH_PROXY)
    assert request.meta["playwright_context_kwargs"]["proxy"]["server"] == "http://10.9.0.1:3128"


def test_scrapy_impersonate_is_trusted_only_from_1_8_0(monkeypatch):
    for found in ("1.8.0", "1.10.1", "2.0"):
        monkeypatch.setattr(handlers, "_impersonate_version", lambda found=found: found)
        hmap = _map({"https": "scrapy_impersonate.ImpersonateDownloadHandler"})
        assert _route(hmap, "https://a.example/", impersonate="chrome").kind == "proxy", found
        hmap.check()
    for found in ("1.7.1", "1.7.0", "1.6.4", "1.8.0rc1", "garbage", None):
        monkeypatch.setattr(handlers, "_impersonate_version", lambda found=found: found)
        for path in ("scrapy_impersonate.ImpersonateDownloadHandler",
                     "scrapy_impersonate.handler.ImpersonateDownloadHandler"):
            hmap = _map({"https": path}, declared=(path,))  # declaring it does not make it safe
            assert _route(hmap, "https://a.example/").kind == "refused", found
            with pytest.raises(SettingError) as info:
                hmap.check()
            message = str(info.value)
            assert "\n" not in message and "1.8.0" in message and "upgrade" in message, message
            assert "PROXY_SHARD_PROXY_AWARE_HANDLERS" not in message
            if found is not None:
                assert f"version {found}" in message


def test_known_proxy_aware_handlers_and_aliases(monkeypatch):
    monkeypatch.setattr(handlers, "_impersonate_version", lambda: "1.8.1")
    for path in ("scrapy.core.downloader.handlers._aiohttp.AiohttpDownloadHandler",
                 "scrapy.core.downloader.handlers._httpx.HttpxDownloadHandler",
                 "scrapy.core.downloader.handlers.http.HTTPDownloadHandler",
                 "scrapy_impersonate.ImpersonateDownloadHandler"):
        hmap = _map({"https": path})
        assert _route(hmap, "https://a.example/", impersonate="chrome").kind == "proxy", path
        hmap.check()
    hmap = _map({"https": HTTP11DownloadHandler})  # a class, not a path
    assert _route(hmap, "https://a.example/").kind == "proxy"


def test_an_unknown_handler_stops_the_crawl_in_one_line_unless_declared():
    path = f"{__name__}.MyHandler"
    with pytest.raises(SettingError) as info:
        _map({"http": path}).check()
    message = str(info.value)
    assert "\n" not in message
    assert f"DOWNLOAD_HANDLERS['http'] is '{path}'" in message and "PROXY_SHARD_PROXY_AWARE_HANDLERS" in message
    _map({"http": path}, declared=(path,)).check()
    _map({"http": MyHandler}, declared=_declared([MyHandler])).check()
    with pytest.raises(SettingError, match="cannot download through a proxy"):
        _map({"https": "scrapy.core.downloader.handlers.http2.H2DownloadHandler"}).check()


def _declared(raw):
    return ShardSettings.from_settings({"PROXY_SHARD_PROXY_AWARE_HANDLERS": raw}).proxy_aware_handlers


def test_declared_handlers_setting_is_validated():
    assert _declared("a.B, c.D") == ("a.B", "c.D")
    assert _declared(None) == ()
    with pytest.raises(SettingError, match="PROXY_SHARD_PROXY_AWARE_HANDLERS entry 3"):
        _declared([3])
    # -s takes a JSON list too (a newcomer's '["x.Y"]' was kept as the path '["x.Y"]' and matched nothing)
    assert _declared('["a.B", "c.D"]') == ("a.B", "c.D")
    with pytest.raises(SettingError, match="is not a JSON list"):
        _declared('["a.B"')
    with pytest.raises(SettingError, match=re.escape("""entry 'a.B"' must be""")):
        _declared('a.B"')


def test_start_up_check_reads_the_crawlers_settings_and_a_reserved_context_name():
    h = Harness({"DOWNLOAD_HANDLERS": {"http": f"{__name__}.MyHandler"}})
    with pytest.raises(SettingError, match="MyHandler"):
        check_handlers(h.crawler)
    h = Harness({"DOWNLOAD_HANDLERS": {"http": PLAYWRIGHT},
                 "PLAYWRIGHT_CONTEXTS": {"proxy-shard:abc": {}}})
    with pytest.raises(SettingError, match="PLAYWRIGHT_CONTEXTS defines 'proxy-shard:abc'"):
        check_handlers(h.crawler)
    check_handlers(get_crawler(settings_dict={"PROXY_SHARD_ENABLED": False, "DOWNLOAD_HANDLERS": {"http": "x.Y"}}))


def _guarded(h):
    return build_from_crawler(ProxyShardGuardMiddleware, h.crawler), HttpProxyMiddleware.from_crawler(h.crawler)


@pytest.mark.parametrize("value", [None, ""])
def test_falsy_meta_proxy_is_leased_and_passes_the_guard(value):
    h = Harness()
    guard, httpproxy = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("http://shop.example/", meta={"proxy": value})
        await h.lease_mw.process_request(request)
        httpproxy.process_request(request)
        guard.process_request(request)
        return request

    request = asyncio.run(scenario())
    assert h.runtime.lease_of(request) is not None and request.meta["proxy"]
    assert h.stat("skipped") is None and h.stat("leases") == 1


def test_opt_out_is_refused_by_default_and_counted_as_direct_when_allowed(caplog):
    h = Harness()

    async def refused():
        await h.open()
        with pytest.raises(RequestNotLeased, match="PROXY_SHARD_ALLOW_DIRECT is False"):
            await h.lease_mw.process_request(Request("http://shop.example/", meta={"proxy_shard": False}))

    asyncio.run(refused())
    assert h.stat("direct_refused") == 1

    h = Harness({"PROXY_SHARD_ALLOW_DIRECT": True})
    guard, _ = _guarded(h)

    async def allowed():
        await h.open()
        request = Request("http://shop.example/", meta={"proxy_shard": False})
        await h.lease_mw.process_request(request)
        guard.process_request(request)
        return request

    request = asyncio.run(allowed())
    assert "proxy" not in request.meta and h.stat("direct") == 1
    assert "goes out DIRECT" in caplog.text


def test_a_user_proxy_nulled_after_the_lease_middleware_is_dropped_by_the_guard():
    h = Harness()
    guard, _ = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("http://shop.example/", meta={"proxy": "http://mine.example:1"})
        await h.lease_mw.process_request(request)
        guard.process_request(request)  # through its own proxy: fine
        request.meta["proxy"] = None  # a middleware between 610 and 950
        with pytest.raises(RequestNotLeased, match="no proxy was leased for it"):
            guard.process_request(request)

    asyncio.run(scenario())


def test_ftp_and_local_requests():
    h = Harness({"DOWNLOAD_HANDLERS": {"ftp": "scrapy.core.downloader.handlers.ftp.FTPDownloadHandler"}})

    async def scenario():
        await h.open()
        with pytest.raises(RequestNotLeased, match="FTP handler"):
            await h.lease_mw.process_request(Request("ftp://shop.example/file"))
        local = Request("file:///etc/hostname")
        await h.lease_mw.process_request(local)
        _guarded(h)[0].process_request(local)
        return local

    local = asyncio.run(scenario())
    assert h.runtime.lease_of(local) is None and h.stat("local") == 1 and h.stat("handler_refused") == 1


def _playwright_harness(**settings):
    return Harness({"DOWNLOAD_HANDLERS": {"http": PLAYWRIGHT, "https": PLAYWRIGHT}, **settings},
                   proxies=[AUTH_PROXY])


def test_a_playwright_request_is_bound_to_its_proxys_context_and_sends_no_proxy_header():
    h = _playwright_harness()
    guard, httpproxy = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("https://shop.example/", meta={"playwright": True,
                                                         "playwright_context_kwargs": {"locale": "de-DE"}})
        await h.lease_mw.process_request(request)
        httpproxy.process_request(request)
        assert b"Proxy-Authorization" in request.headers
        guard.process_request(request)
        return request

    request = asyncio.run(scenario())
    proxy_id = request.meta["proxy_shard_proxy_id"]
    assert request.meta["playwright_context"] == context_name(proxy_id, AUTH_PROXY)
    assert re.fullmatch(rf"proxy-shard:{proxy_id}:[0-9a-f]{{8}}", request.meta["playwright_context"])
    assert request.meta["playwright_context_kwargs"] == {
        "locale": "de-DE",
        "proxy": {"server": "http://10.9.0.1:3128", "username": "alice", "password": "S3cret"},
    }
    assert b"Proxy-Authorization" not in request.headers  # the browser would send it to the site


def test_a_password_rotation_binds_to_a_new_context_and_the_name_holds_no_credential():
    rotated = "http://alice:N3wPass@10.9.0.1:3128"
    old, new, again = ({}, {}, {})
    bind(old, "p1", AUTH_PROXY)
    bind(new, "p1", rotated)
    bind(again, "p1", AUTH_PROXY)
    assert old["playwright_context"] != new["playwright_context"]
    assert old["playwright_context"] == again["playwright_context"] == context_name("p1", AUTH_PROXY)
    for meta in (old, new):
        assert re.fullmatch(r"proxy-shard:p1:[0-9a-f]{8}", meta["playwright_context"])
        assert "S3cret" not in meta["playwright_context"] and "N3wPass" not in meta["playwright_context"]
        assert "alice" not in meta["playwright_context"]


def test_guard_drops_a_browser_request_bound_with_other_credentials_of_its_exit():
    h = _playwright_harness()
    guard, _ = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("https://shop.example/", meta={"playwright": True})
        await h.lease_mw.process_request(request)
        bind(request.meta, request.meta["proxy_shard_proxy_id"], "http://alice:0ld@10.9.0.1:3128")
        with pytest.raises(RequestNotLeased, match="not the context of the leased proxy"):
            guard.process_request(request)

    asyncio.run(scenario())


def test_a_playwright_request_with_a_context_of_its_own_is_refused():
    h = _playwright_harness()

    async def scenario():
        await h.open()
        for meta in ({"playwright_context": "mine"},
                     {"playwright_context_kwargs": {"proxy": {"server": "http://other:1"}}}):
            request = Request("https://shop.example/", meta={"playwright": True, **meta})
            with pytest.raises(RequestNotLeased) as info:
                await h.lease_mw.process_request(request)
            assert "S3cret" not in str(info.value)

    asyncio.run(scenario())
    assert h.stat("browser_refused") == 2 and h.stat("leases") is None


def test_guard_drops_a_leased_request_switched_to_the_browser_or_to_another_context():
    h = _playwright_harness()
    guard, _ = _guarded(h)

    async def scenario():
        await h.open()
        switched = Request("https://shop.example/1")
        await h.lease_mw.process_request(switched)
        switched.meta["playwright"] = True  # a middleware between the lease and the guard
        with pytest.raises(RequestNotLeased, match="not the context of the leased proxy"):
            guard.process_request(switched)
        await h.lease_mw.process_response(switched, _response(switched))
        await asyncio.sleep(0.002)
        moved = Request("https://shop.example/2", meta={"playwright": True})
        await h.lease_mw.process_request(moved)
        moved.meta["playwright_context"] = "default"
        with pytest.raises(RequestNotLeased, match="not the context of the leased proxy"):
            guard.process_request(moved)
        moved.meta["playwright_context"] = context_name(moved.meta["proxy_shard_proxy_id"], AUTH_PROXY)
        moved.meta["playwright_page"] = _FakePage()  # a live page of some other context
        with pytest.raises(RequestNotLeased, match="playwright_page"):
            guard.process_request(moved)

    asyncio.run(scenario())
    assert h.stat("guard/dropped") == 3


class _FakePage:
    context = object()

    def is_closed(self):
        return False


def _response(request):
    from scrapy.http import Response

    return Response(request.url, request=request)


def test_credentials_in_the_header_are_the_leased_ones():
    """Sanity of the fixture: HttpProxyMiddleware moved the leased credentials into the header the
    guard then removes for browser requests (and keeps for the HTTP handler)."""
    h = Harness(proxies=[AUTH_PROXY])
    guard, httpproxy = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("https://shop.example/")
        await h.lease_mw.process_request(request)
        httpproxy.process_request(request)
        guard.process_request(request)
        return request

    request = asyncio.run(scenario())
    assert request.headers[b"Proxy-Authorization"] == b"Basic " + base64.b64encode(b"alice:S3cret")
