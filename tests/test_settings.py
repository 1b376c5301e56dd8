import pytest
from scrapy.settings import Settings

from scrapy_proxy_shard.engine.pacing import AutothrottleOptions
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.modes.connection import async_client, client_params, redis_url_of
from scrapy_proxy_shard.settings import ShardSettings, SiteOptions


def parse(**values):
    return ShardSettings.from_settings(Settings(values))


def test_defaults_are_sane():
    s = parse()
    assert s.enabled and s.pool == "default" and s.namespace == "proxy_shard"
    assert s.lease_ttl == 210.0  # DOWNLOAD_TIMEOUT (180) + 30: a live download never loses its lease
    # the site's rule not given: adaptive pacing (AUTOTHROTTLE_ENABLED "auto"), the arrival guard off
    assert s.site_options("any.example") == SiteOptions(1, 1.0, autothrottle=AutothrottleOptions(True, 3.0, 0.1, 60.0))
    assert s.arrival_guard == 0.0
    assert parse(PROXY_SHARD_MIN_INTERVAL=1.0).site_options("any.example") == SiteOptions(1, 1.0)  # given: fixed
    assert ":" in s.host_id


def test_lease_ttl_follows_download_timeout_unless_set():
    assert parse(DOWNLOAD_TIMEOUT=20).lease_ttl == 60.0
    assert parse(DOWNLOAD_TIMEOUT=100).lease_ttl == 130.0
    assert parse(PROXY_SHARD_LEASE_TTL=15).lease_ttl == 15.0


def test_redis_url_falls_back_to_scrapy_redis_setting():
    assert parse(REDIS_URL="redis://r:6379/1").redis_url == "redis://r:6379/1"
    assert parse(REDIS_URL="redis://r:6379/1", PROXY_SHARD_REDIS_URL="redis://p:1/0").redis_url == "redis://p:1/0"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PROXY_SHARD_MIN_INTERVAL", "fast", r"PROXY_SHARD_MIN_INTERVAL \('fast'\) must be a number"),
        ("PROXY_SHARD_MIN_INTERVAL", -1, r"PROXY_SHARD_MIN_INTERVAL \(-1\) must be >= 0"),
        ("PROXY_SHARD_SITE_CONCURRENCY", 0, r"PROXY_SHARD_SITE_CONCURRENCY \(0\) must be >= 1"),
        ("PROXY_SHARD_SITE_CONCURRENCY", 1.5, r"must be a whole number"),
        ("PROXY_SHARD_BAN_JITTER", 2, r"PROXY_SHARD_BAN_JITTER \(2\) must be <= 1"),
        ("PROXY_SHARD_ENABLED", "maybe", r"PROXY_SHARD_ENABLED \('maybe'\) must be True or False"),
        ("PROXY_SHARD_POOL", "my pool", r"PROXY_SHARD_POOL: invalid pool name 'my pool'"),
        ("PROXY_SHARD_NAMESPACE", "", r"invalid namespace name"),
        ("PROXY_SHARD_REDIS_PARAMS", "[1]", r"PROXY_SHARD_REDIS_PARAMS .* must be a dict"),
        ("PROXY_SHARD_SITES", {"a.example": {"speed": 1}}, r"unknown option\(s\) \['speed'\]"),
        ("PROXY_SHARD_SITES", {"a.example": {"concurrency": "x"}}, r"PROXY_SHARD_SITES\['a.example'\].concurrency"),
        ("PROXY_SHARD_SITE_GROUPS", {"g": []}, r"PROXY_SHARD_SITE_GROUPS\['g'\] .* non-empty list"),
        ("PROXY_SHARD_HOST_ID", "a|b", r"PROXY_SHARD_HOST_ID"),
        ("PROXY_SHARD_REST_AFTER_RESPONSE", -0.5, r"PROXY_SHARD_REST_AFTER_RESPONSE \(-0.5\) must be >= 0"),
        ("PROXY_SHARD_REST_AFTER_RESPONSE", 1e10, r"PROXY_SHARD_REST_AFTER_RESPONSE \(10000000000.0\) must be <="),
        ("PROXY_SHARD_RANDOMIZE_INTERVAL", "often", r"PROXY_SHARD_RANDOMIZE_INTERVAL \('often'\) must be True or"),
        ("PROXY_SHARD_SITES", {"a.example": {"rest_after_response": "x"}},
         r"PROXY_SHARD_SITES\['a.example'\].rest_after_response \('x'\) must be a number"),
        ("PROXY_SHARD_SITES", {"a.example": {"randomize_interval": "sometimes"}},
         r"PROXY_SHARD_SITES\['a.example'\].randomize_interval \('sometimes'\) must be True or False"),
    ],
)
def test_bad_values_name_the_setting_and_value(name, value, message):
    with pytest.raises(SettingError, match=message):
        parse(**{name: value})


def test_ban_cap_must_not_be_below_base():
    with pytest.raises(SettingError, match="PROXY_SHARD_BAN_MAX_TTL"):
        parse(PROXY_SHARD_BAN_TTL=100, PROXY_SHARD_BAN_MAX_TTL=10)


def test_per_site_options_use_registrable_domain():
    s = parse(PROXY_SHARD_SITES={"www.shop.example.co.uk": {"concurrency": 2, "min_interval": 0.5}})
    assert s.site_options("example.co.uk") == SiteOptions(2, 0.5)


def test_pacing_options_default_globally_and_per_site():
    s = parse(PROXY_SHARD_MIN_INTERVAL=2, PROXY_SHARD_REST_AFTER_RESPONSE=0.5, PROXY_SHARD_RANDOMIZE_INTERVAL="True",
              PROXY_SHARD_SITES={"a.example": {"rest_after_response": 0, "randomize_interval": False},
                                 "b.example": {"min_interval": 0.25}})
    assert s.site_options("other.example") == SiteOptions(1, 2.0, 0.5, True)
    assert s.site_options("a.example") == SiteOptions(1, 2.0, 0.0, False)
    assert s.site_options("b.example") == SiteOptions(1, 0.25, 0.5, True)  # unset options: the global ones
    assert parse(PROXY_SHARD_AUTOTHROTTLE_ENABLED=False).site_options("x.example") == SiteOptions(1, 1.0, 0.0, False)


def test_redis_connection_settings():
    with pytest.raises(SettingError, match="PROXY_SHARD_REDIS_URL is not set"):
        redis_url_of(parse())
    with pytest.raises(SettingError, match=r"must start with redis://") as info:
        redis_url_of(parse(PROXY_SHARD_REDIS_URL="http://:secret@host:1"))
    assert "secret" not in str(info.value)
    params = client_params(parse(PROXY_SHARD_REDIS_PARAMS={"socket_timeout": 3}))
    assert params["socket_timeout"] == 3 and params["decode_responses"] is True
    with pytest.raises(SettingError, match="decode_responses"):
        client_params(parse(PROXY_SHARD_REDIS_PARAMS={"decode_responses": False}))
    client = async_client(parse(PROXY_SHARD_REDIS_URL="redis://127.0.0.1:1/0"))
    assert client.connection_pool.connection_kwargs["port"] == 1


@pytest.mark.parametrize(("name", "value", "message"), [
    ("PROXY_SHARD_REDIS_SENTINELS", 5, r"PROXY_SHARD_REDIS_SENTINELS \(int '5'\) must be a list"),
    # 'h:abc' might be user:password: masked whole
    ("PROXY_SHARD_REDIS_SENTINELS", ["h:26379", "h:abc"], r"SENTINELS: '\*\*\*:\*\*\*' is not host:port"),
    ("PROXY_SHARD_SITES", {5: {"concurrency": 2}}, r"PROXY_SHARD_SITES: invalid site 5"),
    ("PROXY_SHARD_SITES", {"*": {"concurrency": 2}}, r"PROXY_SHARD_SITES: invalid site '\*'"),
    ("PROXY_SHARD_SITE_POOLS", {"": "dc"}, r"PROXY_SHARD_SITE_POOLS: invalid site ''"),
    ("PROXY_SHARD_PLATFORMS", {"amazon": ["*"]}, r"PROXY_SHARD_PLATFORMS\['amazon'\]: invalid site"),
])
def test_wrong_types_and_reserved_names_are_setting_errors_not_type_errors(name, value, message):
    with pytest.raises(SettingError, match=message):
        parse(**{name: value})


def test_a_proxies_string_is_split_on_whitespace_only_so_a_comma_in_a_password_survives():
    s = parse(PROXY_SHARD_PROXIES="http://u:pa,ss@10.0.0.1:80\n 10.0.0.2:80  10.0.0.3:80:u:p,w")
    assert s.proxies == {"default": ("http://u:pa,ss@10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80:u:p,w")}


def test_a_comma_separated_proxies_string_is_refused_without_showing_a_password():
    with pytest.raises(SettingError, match=r"PROXY_SHARD_PROXIES\['default'\] entry 1: .*never on commas") as info:
        parse(PROXY_SHARD_PROXIES="http://u:Pa55,wOrdZ@10.0.0.1:80,http://v:OtherQ,PwY@10.0.0.2:80")
    assert not any(part in str(info.value) for part in ("Pa55", "wOrdZ", "OtherQ", "PwY"))


def test_a_bad_proxies_entry_stops_at_start_naming_setting_pool_and_entry():
    with pytest.raises(SettingError, match=r"PROXY_SHARD_PROXIES\['dc'\] entry 2: .*needs both") as info:
        parse(PROXY_SHARD_PROXIES={"dc": ["10.0.0.1:80", "10.0.0.2:80:Secret-User"]})
    assert "Secret-User" not in str(info.value)


def test_redis_params_are_never_echoed_in_errors():
    with pytest.raises(SettingError, match="PROXY_SHARD_REDIS_PARAMS") as info:
        parse(PROXY_SHARD_REDIS_PARAMS='{"password": "Top-Secret"')
    assert "Top-Secret" not in str(info.value)


# --- the per-request lease margin (issue 8, item 14; the reference states it: test_settings_table.py) ---

def test_a_request_lease_outlives_its_download_timeout_by_the_margin(redis_server, real_redis):
    import asyncio

    from scrapy import Request, Spider
    from scrapy.utils.misc import build_from_crawler
    from scrapy.utils.test import get_crawler

    from scrapy_proxy_shard.crawl.runtime import LEASE_MARGIN
    from scrapy_proxy_shard.engine.store import PoolStore
    from scrapy_proxy_shard.middlewares import ProxyShardMiddleware

    PoolStore(real_redis, namespace="margin").add_proxies("default", ["10.8.0.1:3128"])
    crawler = get_crawler(Spider, {"PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_NAMESPACE": "margin",
                                   "PROXY_SHARD_LEASE_TTL": 4, "DOWNLOAD_TIMEOUT": 2})
    crawler.spider = Spider("margin")
    mw = build_from_crawler(ProxyShardMiddleware, crawler)

    async def lease_with(timeout: float) -> float:
        request = Request("http://shop.example/", meta={"download_timeout": timeout})
        await mw.process_request(request)
        # the held record in the site's hash: "token|host|issued_ms|expires_ms|session"
        site = next(real_redis.scan_iter("{margin:default}:site:*"))
        [record] = [v for f, v in real_redis.hgetall(site).items() if "/" in f]
        issued, expires = (int(x) for x in record.split("|")[2:4])
        pttl = (expires - issued) / 1000
        await mw.runtime.finish(request, "ok")
        return pttl

    async def scenario():
        await mw.runtime.spider_opened(crawler.spider)
        try:
            return await lease_with(100), await lease_with(1)
        finally:
            await mw.runtime.spider_closed(crawler.spider)

    long_download, short_download = asyncio.run(scenario())
    assert 100 + LEASE_MARGIN - 1 < long_download <= 100 + LEASE_MARGIN  # the download's time, plus the margin
    assert 3 < short_download <= 4  # PROXY_SHARD_LEASE_TTL when it is the longer


# --- one parse, one table (issue 9) ---------------------------------------------------------------

def test_field_defaults_are_the_parsed_table():
    """Building ShardSettings directly gives what parsing no settings gives (mode: 'auto' resolved)."""
    from dataclasses import replace

    from scrapy_proxy_shard.engine.bans import BanOptions

    direct = ShardSettings(host_id="h")
    assert direct == replace(ShardSettings.from_settings({}), host_id="h")
    assert direct.mode == "embedded" and direct.requested_mode == "auto"
    assert direct.bans == BanOptions()  # the engine's own defaults agree with the table


def test_one_parse_per_crawler_is_shared_by_middlewares_runtime_and_policy():
    from scrapy import Spider
    from scrapy.utils.misc import build_from_crawler
    from scrapy.utils.test import get_crawler

    from scrapy_proxy_shard.middlewares import BanDetectionMiddleware, ProxyShardMiddleware
    from scrapy_proxy_shard.policy import BanPolicy

    crawler = get_crawler(Spider, {"PROXY_SHARD_BAN_CODES": [403, 451], "PROXY_SHARD_REDIS_EVICTION": "warn"})
    leases = build_from_crawler(ProxyShardMiddleware, crawler)
    bans = build_from_crawler(BanDetectionMiddleware, crawler)
    parsed = ShardSettings.for_crawler(crawler)
    assert leases.runtime.settings is parsed and bans.runtime.settings is parsed
    assert parsed.redis_eviction == "warn"
    assert isinstance(bans.policy, BanPolicy) and bans.policy.ban_codes == parsed.policy.ban_codes == {403, 451}


def test_a_bad_value_stops_every_component_with_the_same_setting_error():
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(settings_dict={"PROXY_SHARD_REDIS_EVICTION": "ignore"})
    for _ in range(2):
        with pytest.raises(SettingError, match=r"PROXY_SHARD_REDIS_EVICTION \('ignore'\) must be one of"):
            ShardSettings.for_crawler(crawler)


def test_plain_mappings_use_scrapy_getters_too():
    s = ShardSettings.from_settings({"PROXY_SHARD_ENABLED": "False", "PROXY_SHARD_SITE_POOLS": '{"a.example": "dc"}',
                                     "PROXY_SHARD_BAN_CODES": "403,520"})
    assert s.enabled is False and s.site_pools == {"a.example": "dc"} and s.policy.ban_codes == {403, 520}
    with pytest.raises(SettingError, match="must be a Scrapy Settings object or a mapping"):
        ShardSettings.from_settings(["PROXY_SHARD_ENABLED"])


def test_per_site_options_are_one_list_for_pacing_and_content_rules():
    s = parse(PROXY_SHARD_MIN_INTERVAL=1.0,
              PROXY_SHARD_SITES={"shop.example": {"concurrency": 2, "challenge_patterns": ["/wall"],
                                                  "min_body_size": 10}})
    assert s.site_options("shop.example") == SiteOptions(2, 1.0)
    rules = s.policy.site_rules["shop.example"]
    assert [p.pattern for p in rules.challenge_patterns] == ["/wall"] and rules.min_body_size == 10


def test_the_old_captcha_patterns_name_still_works_with_a_deprecation_warning():
    from scrapy.exceptions import ScrapyDeprecationWarning

    with pytest.warns(ScrapyDeprecationWarning, match=r"PROXY_SHARD_SITES\['a.example'\].captcha_patterns .*"
                                                      r"'challenge_patterns'"):
        s = parse(PROXY_SHARD_SITES={"a.example": {"captcha_patterns": ["/wall"]}})
    assert [p.pattern for p in s.policy.site_rules["a.example"].challenge_patterns] == ["/wall"]
    with pytest.raises(SettingError, match=r"set 'challenge_patterns' only"):
        parse(PROXY_SHARD_SITES={"a.example": {"captcha_patterns": ["/a"], "challenge_patterns": ["/b"]}})
