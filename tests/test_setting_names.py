"""Issue 21: an unknown ``PROXY_SHARD_*`` name is named with the closest setting, at start.

An ERROR (the crawl does not start) when that setting decides what the hosts share
(``COORDINATION_SETTINGS``: a misspelt Redis URL silently runs a private pool per host), a WARNING
(once per crawler) otherwise.
"""

from __future__ import annotations

import logging

import pytest
from scrapy import Spider
from scrapy.exceptions import CloseSpider
from scrapy.settings import Settings
from scrapy.utils.misc import build_from_crawler
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.crawl.startup import StartupGate
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.settings import COORDINATION_SETTINGS, DEFAULTS, ShardSettings, check_setting_names


@pytest.mark.parametrize(("typo", "meant"), [
    ("PROXY_SHARD_REDIS_ULR", "PROXY_SHARD_REDIS_URL"),
    ("PROXY_SHARD_REDIS", "PROXY_SHARD_REDIS_URL"),
    ("PROXY_SHARD_REDIS_PARAM", "PROXY_SHARD_REDIS_PARAMS"),
    ("PROXY_SHARD_REDIS_SENTINEL", "PROXY_SHARD_REDIS_SENTINELS"),
    ("PROXY_SHARD_MODES", "PROXY_SHARD_MODE"),
    ("PROXY_SHARD_NAMESPCE", "PROXY_SHARD_NAMESPACE"),
    ("PROXY_SHARD_POOLS", "PROXY_SHARD_POOL"),
    ("PROXY_SHARD_SITE_POOL", "PROXY_SHARD_SITE_POOLS"),
    ("PROXY_SHARD_PROXY", "PROXY_SHARD_PROXIES"),
    ("PROXY_SHARD_PROXY_LIST_PATH", "PROXY_SHARD_PROXIES_PATH"),  # scrapy-rotating-proxies' habit
    ("PROXY_SHARD_HOST", "PROXY_SHARD_HOSTS"),
    ("PROXY_SHARD_HOSTID", "PROXY_SHARD_HOST_ID"),
    ("proxy_shard_pool", "PROXY_SHARD_POOL"),  # -s in lower case: never read
])
def test_a_misspelt_coordination_setting_is_an_error(typo, meant):
    assert meant in COORDINATION_SETTINGS
    with pytest.raises(SettingError) as info:
        check_setting_names({typo: "x", meant.replace("PROXY_SHARD_", "UNRELATED_"): 1})
    message = str(info.value)
    assert message.startswith(f"{typo} is not a setting of scrapy-proxy-shard; did you mean {meant}? ")
    assert "\n" not in message and "the crawl does not start" in message


@pytest.mark.parametrize(("typo", "meant"), [
    ("PROXY_SHARD_MIN_INTERVALL", "PROXY_SHARD_MIN_INTERVAL"),
    ("PROXY_SHARD_ENABLE", "PROXY_SHARD_ENABLED"),
    ("PROXY_SHARD_BAN_TTLS", "PROXY_SHARD_BAN_TTL"),
    ("PROXY_SHARD_SITE_CONCURENCY", "PROXY_SHARD_SITE_CONCURRENCY"),
    ("PROXY_SHARD_ALLOW_DIRECTS", "PROXY_SHARD_ALLOW_DIRECT"),
])
def test_another_misspelt_setting_is_a_warning(typo, meant):
    assert meant not in COORDINATION_SETTINGS
    assert check_setting_names({typo: 1}) == [
        f"{typo} is not a setting of scrapy-proxy-shard; did you mean {meant}? (ignored: {meant} keeps its value)"]


def test_a_name_close_to_no_setting_is_a_warning_without_a_guess():
    assert check_setting_names({"PROXY_SHARD_XYZZY": 1}) == ["PROXY_SHARD_XYZZY is not a setting of "
                                                             "scrapy-proxy-shard (ignored)"]


def test_known_names_and_other_settings_are_never_reported():
    everything = {**DEFAULTS, "REDIS_URL": "redis://h:1/0", "DOWNLOAD_TIMEOUT": 10, "PROXY_SHARDX": 1,
                  "MY_PROXY_SHARD_THING": 1}
    assert check_setting_names(everything) == []
    assert check_setting_names(Settings()) == []  # Scrapy's own defaults hold no PROXY_SHARD_* name
    assert check_setting_names(Settings({"PROXY_SHARD_POOL": "a"}, priority="project")) == []


def test_several_errors_are_one_line_naming_each():
    with pytest.raises(SettingError) as info:
        check_setting_names({"PROXY_SHARD_NAMESPCE": "a", "PROXY_SHARD_POOOL": "b", "PROXY_SHARD_BAN_TTLS": 1})
    message = str(info.value)
    assert "\n" not in message and "PROXY_SHARD_NAMESPCE" in message and "PROXY_SHARD_POOOL" in message
    assert "PROXY_SHARD_BAN_TTLS" not in message  # a warning, not worth a word in the error


def test_the_values_are_never_shown():
    with pytest.raises(SettingError) as info:
        check_setting_names({"PROXY_SHARD_REDIS_ULR": "redis://:Secr3t@h:1/0"})
    assert "Secr3t" not in str(info.value)
    notes = check_setting_names({"PROXY_SHARD_BAN_TTLS": "Secr3t"})
    assert notes and "Secr3t" not in notes[0]


def test_the_crawler_check_runs_once_and_an_error_reaches_the_start_up_gate(caplog):
    from scrapy_proxy_shard.middlewares import ProxyShardMiddleware

    caplog.set_level(logging.WARNING)
    crawler = get_crawler(Spider, {"PROXY_SHARD_PROXIES": ["10.0.0.1:3128"], "PROXY_SHARD_MODE": "embedded",
                                   "PROXY_SHARD_MIN_INTERVALL": 3})
    first = ShardSettings.for_crawler(crawler)
    assert ShardSettings.for_crawler(crawler) is first and first.min_interval == 1.0
    typo = [r for r in caplog.records if "PROXY_SHARD_MIN_INTERVALL" in r.getMessage()]
    assert len(typo) == 1 and typo[0].levelno == logging.WARNING
    assert typo[0].getMessage().startswith("proxy_shard: PROXY_SHARD_MIN_INTERVALL is not a setting")

    caplog.clear()
    crawler = get_crawler(Spider, {"PROXY_SHARD_PROXIES": ["10.0.0.1:3128"], "PROXY_SHARD_REDIS_ULR": "redis://h:1"})
    for _ in range(2):  # every caller sees the same cause; it is logged once
        with pytest.raises(SettingError, match="did you mean PROXY_SHARD_REDIS_URL"):
            ShardSettings.for_crawler(crawler)
    mw = build_from_crawler(ProxyShardMiddleware, crawler)
    assert mw.runtime is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["proxy_shard: cannot start: PROXY_SHARD_REDIS_ULR is not a setting of scrapy-proxy-shard; "
                      "did you mean PROXY_SHARD_REDIS_URL? It decides which Redis the hosts share: with it "
                      "misspelt the hosts would not coordinate, so the crawl does not start (rename it)"]
    spider = Spider.from_crawler(crawler, name="typo")
    with pytest.raises(CloseSpider):  # the gate stops the crawl at open: no request is sent
        StartupGate.for_crawler(crawler)._spider_opened(spider)


def test_redis_url_precedence_is_unchanged():
    """PROXY_SHARD_REDIS_URL wins over scrapy-redis' REDIS_URL, which is used when it is not set."""
    both = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "redis://a:1/0", "REDIS_URL": "redis://b:1/0"})
    assert both.redis_url == "redis://a:1/0" and both.mode == "redis"
    only = ShardSettings.from_settings({"REDIS_URL": "redis://b:1/0"})
    assert only.redis_url == "redis://b:1/0" and only.mode == "redis"
    assert check_setting_names({"REDIS_URL": "redis://b:1/0"}) == []
