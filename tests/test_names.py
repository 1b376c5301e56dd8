"""Names and ids a user or a page can choose (item 13 of issue 8): pool and namespace names, sticky
session ids, site names, and proxy hosts. Each has one spelling, a bound, and a clear error otherwise;
the session-id checks run through the real middleware against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
from scrapy import Request, Spider
from scrapy.exceptions import IgnoreRequest
from scrapy.utils.misc import build_from_crawler
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.engine.proxies import make_proxy, parse_proxy
from scrapy_proxy_shard.engine.schema import MAX_SESSION_ID, check_name, check_session_id
from scrapy_proxy_shard.engine.sites import SiteMap, check_site
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.exceptions import InvalidSessionId, ProxyURLError, SettingError
from scrapy_proxy_shard.middlewares import ProxyShardMiddleware
from scrapy_proxy_shard.settings import ShardSettings

NS = "names"


# --- pool and namespace names ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pool\n", "pool\r\n", "\npool", "po ol", "", "-pool", "p" * 65, "pöol"])
def test_pool_and_namespace_names_have_one_spelling(name):
    with pytest.raises(SettingError):
        check_name("pool", name)
    with pytest.raises(SettingError, match="PROXY_SHARD_POOL"):
        ShardSettings.from_settings({"PROXY_SHARD_POOL": name})
    with pytest.raises(SettingError, match="PROXY_SHARD_NAMESPACE"):
        ShardSettings.from_settings({"PROXY_SHARD_NAMESPACE": name})


# --- sticky session ids ------------------------------------------------------------------------

@pytest.mark.parametrize("value, key", [("cart-7", "cart-7"), (7, "7"), (0, "0"), ("0", "0"), (None, None),
                                        ("x" * MAX_SESSION_ID, "x" * MAX_SESSION_ID)])
def test_session_ids_accepted(value, key):
    assert check_session_id(value) == key


@pytest.mark.parametrize("value", [False, True, {"a": 1}, ["a"], 1.5, b"cart", "", "   ", "a\nb", "tab\there",
                                   "x" * (MAX_SESSION_ID + 1), "x" * 1_000_000])
def test_session_ids_refused(value):
    with pytest.raises(InvalidSessionId, match=r"meta\['session_id'\]"):
        check_session_id(value)


class _Spider(Spider):
    name = "names"


def test_a_bad_session_id_fails_its_request_and_never_becomes_a_shared_session(redis_server, real_redis):
    admin = PoolStore(real_redis, namespace=NS)
    admin.add_proxies("default", ["10.7.0.1:3128", "10.7.0.2:3128"])
    crawler = get_crawler(_Spider, {"PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_NAMESPACE": NS,
                                    "PROXY_SHARD_HOST_ID": "names-host", "PROXY_SHARD_MIN_INTERVAL": 0})
    crawler.spider = _Spider.from_crawler(crawler)
    mw = build_from_crawler(ProxyShardMiddleware, crawler)

    async def scenario():
        await mw.runtime.spider_opened(crawler.spider)
        try:
            refused = []
            for value in (False, 0.0, {"user": 1}, "s" * 1_000_000, ""):
                request = Request("http://shop.example/p", meta={"session_id": value})
                with pytest.raises(IgnoreRequest) as info:
                    await mw.process_request(request)
                refused.append(info.value)
                assert "proxy" not in request.meta  # never sent, not even direct
            good = Request("http://shop.example/p", meta={"session_id": 0})
            await mw.process_request(good)
            assert good.meta["proxy"].startswith("http://10.7.0.")
            return refused
        finally:
            await mw.runtime.spider_closed(crawler.spider)

    refused = asyncio.run(scenario())
    assert all(isinstance(e, InvalidSessionId) for e in refused)
    assert crawler.stats.get_value("proxy_shard/invalid_session_id") == 5
    assert crawler.stats.get_value("proxy_shard/leases") == 1
    sessions = sorted(k.rsplit(":", 1)[-1] for k in real_redis.scan_iter(f"{{{NS}:default}}:session:*"))
    assert sessions == ["0"]  # only the valid integer id; no "False", no 1 MB key


# --- site names ----------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    {"PROXY_SHARD_SITES": {"*": {"concurrency": 2}}},
    {"PROXY_SHARD_SITES": {5: {"concurrency": 2}}},
    {"PROXY_SHARD_SITES": {"": {"concurrency": 2}}},
    {"PROXY_SHARD_SITE_GROUPS": {"*": ["a.com", "b.com"]}},
    {"PROXY_SHARD_SITE_GROUPS": {"g": ["a.com", "*"]}},
    {"PROXY_SHARD_SITE_GROUPS": {5: ["a.com"]}},
    {"PROXY_SHARD_SITE_POOLS": {"*": "dc"}},
    {"PROXY_SHARD_SITE_POOLS": {None: "dc"}},
])
def test_a_site_named_star_or_not_a_string_is_a_setting_error(settings):
    name = next(iter(settings))
    with pytest.raises(SettingError, match=name.replace("*", r"\*")):
        ShardSettings.from_settings(settings)


def test_sites_keep_their_documented_spelling():
    assert check_site("WWW.Shop.co.uk ", "--site") == "shop.co.uk"
    assert check_site("marketplaces", "--site") == "marketplaces"
    assert SiteMap({"market": ["a.com", "www.b.com"]}).key_for_site("b.com") == "market"
    with pytest.raises(SettingError, match="--site: invalid site"):
        check_site("*", "--site")


# --- proxy hosts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("entry, problem", [
    ("\uff11\uff12\uff17.0.0.1:3128", "non-ASCII"),          # fullwidth digits
    ("http://\uff11\uff12\uff17.0.0.1:3128", "non-ASCII"),
    ("010.000.000.001:3128", "leading zeros"),
    ("http://u:p@010.0.0.1:3128", "leading zeros"),
    ("10.1:3128", "not an IPv4 address"),
    ("167772161:3128", "not an IPv4 address"),
    ("10.0.0.1:\uff13\uff11\uff12\uff18", "port is not a number"),
])
def test_hosts_with_a_second_spelling_are_refused(entry, problem):
    with pytest.raises(ProxyURLError, match=problem):
        parse_proxy(entry)


def test_one_address_is_one_proxy_and_only_declared_sessions_make_gateway_endpoints_distinct():
    assert parse_proxy("HTTP://GW.Example.com:8000") == parse_proxy("gw.example.com:8000")
    a, b = make_proxy("http://user-a:pw@gw.example.com:8000"), make_proxy("gw.example.com:8000:user-b:pw")
    assert a.id == b.id == make_proxy("gw.example.com:8000").id  # one exit: credentials are not identity
    a = make_proxy("http://user-a:pw@gw.example.com:8000#session=a")
    b = make_proxy("gw.example.com:8000:user-b:pw#session=b")
    assert a.id != b.id and a.id != make_proxy("gw.example.com:8000").id
