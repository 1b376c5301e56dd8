"""scrapy-impersonate requests through the leased proxy only (crawl/impersonate.py), on fakeredis.

The end-to-end proof is tests/test_impersonate_end_to_end.py (the site's log); here: what is refused,
what the guard sets, and which handler classes get the checks.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from scrapy import Request
from scrapy.downloadermiddlewares.httpproxy import HttpProxyMiddleware
from scrapy.settings import Settings
from scrapy.utils.misc import build_from_crawler
from test_middlewares import Harness

from scrapy_proxy_shard.crawl import handlers, impersonate
from scrapy_proxy_shard.crawl.handlers import HandlerMap
from scrapy_proxy_shard.middlewares import ProxyShardGuardMiddleware, RequestNotLeased

IMPERSONATE = "scrapy_impersonate.ImpersonateDownloadHandler"
AUTH_PROXY = "http://alice:S3cret@10.9.0.1:3128"
HAS_IMPERSONATE = importlib.util.find_spec("scrapy_impersonate") is not None


@pytest.fixture(autouse=True)
def trusted_release(monkeypatch):
    monkeypatch.setattr(handlers, "_impersonate_version", lambda: "1.10.1")


@pytest.mark.parametrize("meta", [
    {"impersonate_args": {"proxy": None}},
    {"impersonate_args": {"proxy": "http://other.example:1"}},
    {"impersonate_args": {"proxies": {"all": ""}}},
    {"impersonate_args": {"proxy_auth": ("bob", "x")}},
    {"impersonate_args": "proxy"},
    {"impersonate_curl_options": {"NOPROXY": "*"}},
    {"impersonate_curl_options": {"noproxy": "shop.example"}},
    {"impersonate_curl_options": {"proxy": ""}},
    {"impersonate_curl_options": {"PRE_PROXY": "socks5://x:1"}},
    {"impersonate_curl_options": {"unix_socket_path": "/tmp/s"}},
    {"impersonate_curl_options": [("PROXY", "")]},
])
def test_a_proxy_of_the_requests_own_for_curl_is_a_problem(meta):
    assert impersonate.request_problem({"impersonate": "chrome", **meta})
    assert impersonate.request_problem(meta) is None  # without meta['impersonate']: Scrapy's HTTP/1.1


@pytest.mark.skipif(not HAS_IMPERSONATE, reason="curl_cffi's CurlOpt (scrapy-impersonate is a test extra)")
def test_curl_options_given_as_curlopt_or_int_are_recognised():
    from curl_cffi import CurlOpt

    for key in (CurlOpt.PROXY, int(CurlOpt.NOPROXY)):
        assert impersonate.request_problem({"impersonate": "chrome", "impersonate_curl_options": {key: "*"}})
    ok = {"impersonate": "chrome", "impersonate_curl_options": {CurlOpt.TIMEOUT_MS: 1000, CurlOpt.NOPROXY: ""}}
    assert impersonate.request_problem(ok) is None


def test_other_args_and_options_pass_and_the_guard_pins_noproxy():
    meta = {"impersonate": "chrome", "impersonate_args": {"verify": False},
            "impersonate_curl_options": {"RESOLVE": ["a:1:127.0.0.1"]}}
    mine = meta["impersonate_curl_options"]
    assert impersonate.request_problem(meta) is None
    impersonate.pin_proxy(meta)
    assert meta["impersonate_curl_options"] == {"RESOLVE": ["a:1:127.0.0.1"], "NOPROXY": ""}
    assert mine == {"RESOLVE": ["a:1:127.0.0.1"]}  # a new dict: copies of the request share the old one
    assert impersonate.request_problem(meta) is None  # a retry of the pinned request is not refused


def _guarded(h):
    return build_from_crawler(ProxyShardGuardMiddleware, h.crawler), HttpProxyMiddleware.from_crawler(h.crawler)


def test_lease_middleware_refuses_and_guard_pins_and_rechecks():
    h = Harness({"DOWNLOAD_HANDLERS": {"http": IMPERSONATE, "https": IMPERSONATE}}, proxies=[AUTH_PROXY])
    guard, httpproxy = _guarded(h)

    async def scenario():
        await h.open()
        with pytest.raises(RequestNotLeased, match="impersonate_args"):
            await h.lease_mw.process_request(Request("https://shop.example/1", meta={
                "impersonate": "chrome", "impersonate_args": {"proxy": None}}))
        request = Request("https://b.example/2", meta={"impersonate": "chrome"})
        await h.lease_mw.process_request(request)
        httpproxy.process_request(request)
        guard.process_request(request)
        late = Request("https://c.example/3", meta={"impersonate": "chrome"})
        await h.lease_mw.process_request(late)
        late.meta["impersonate_curl_options"] = {"PROXY": ""}  # a middleware between 610 and 950
        with pytest.raises(RequestNotLeased, match="PROXY"):
            guard.process_request(late)
        plain = Request("https://d.example/4")  # no meta['impersonate']: Scrapy's HTTP/1.1 downloads it
        await h.lease_mw.process_request(plain)
        guard.process_request(plain)
        return request, plain

    request, plain = asyncio.run(scenario())
    assert request.meta["impersonate_curl_options"] == {"NOPROXY": ""}
    assert request.meta["proxy"] == "http://10.9.0.1:3128"  # the credentials: Proxy-Authorization, to curl
    assert request.headers.get("Proxy-Authorization", b"").startswith(b"Basic ")
    assert "impersonate_curl_options" not in plain.meta
    assert h.stat("impersonate_refused") == 1


def test_a_users_own_proxy_with_impersonate_is_pinned_too():
    h = Harness({"DOWNLOAD_HANDLERS": {"https": IMPERSONATE}})
    guard, _ = _guarded(h)

    async def scenario():
        await h.open()
        request = Request("https://shop.example/", meta={"impersonate": "chrome", "proxy": "http://mine.example:1"})
        await h.lease_mw.process_request(request)
        guard.process_request(request)
        return request

    request = asyncio.run(scenario())
    assert h.runtime.lease_of(request) is None and request.meta["impersonate_curl_options"] == {"NOPROXY": ""}


@pytest.mark.skipif(not HAS_IMPERSONATE, reason="needs scrapy-impersonate (a test extra)")
def test_a_declared_subclass_or_a_re_export_gets_the_checks():
    for path in (IMPERSONATE, "scrapy_impersonate.handler.ImpersonateDownloadHandler"):
        assert HandlerMap(Settings({"DOWNLOAD_HANDLERS": {"https": path}})).handlers["https"].family == "impersonate"
    sub = f"{__name__}.MyImpersonate"
    hmap = HandlerMap(Settings({"DOWNLOAD_HANDLERS": {"https": sub}}), (sub,))
    assert hmap.handlers["https"].kind == "proxy" and hmap.handlers["https"].family == "impersonate"
    assert hmap.route(Request("https://a.example/", meta={"impersonate": "chrome"})).family == "impersonate"
    plain = HandlerMap(Settings({"DOWNLOAD_HANDLERS": {}}))
    assert plain.handlers["https"].family == ""


if HAS_IMPERSONATE:
    from scrapy_impersonate import ImpersonateDownloadHandler

    class MyImpersonate(ImpersonateDownloadHandler):
        pass
