"""Issue 21: ``PROXY_SHARD_PROXIES_PATH``, a proxy list file read at start (like scrapy-rotating-proxies'
``ROTATING_PROXY_LIST_PATH``), with the parser of ``scrapy-proxy-shard load``."""

from __future__ import annotations

import asyncio
import os

import pytest

from scrapy_proxy_shard.engine.proxies import Proxy
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.modes.pools import initial_proxies
from scrapy_proxy_shard.settings import ShardSettings

SECRET = "FileS3cret-9"
GOOD = f"""# datacenter proxies
http://u:{SECRET}@10.0.0.1:3128   # EU, bought 2026-11

  10.0.0.2:3128
# 10.0.0.99:3128 (off for now)
10.0.0.3:3128:u:{SECRET}
"""


def _parse(**settings) -> ShardSettings:
    return ShardSettings.from_settings(settings)


def _write(tmp_path, text: str | bytes, name: str = "proxies.txt") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_one_proxy_per_line_comments_and_blank_lines_skipped(tmp_path):
    s = _parse(PROXY_SHARD_PROXIES_PATH=_write(tmp_path, GOOD))
    assert list(s.proxies) == ["default"]
    assert [p.exit for p in s.proxies["default"]] == ["10.0.0.1:3128", "10.0.0.2:3128", "10.0.0.3:3128"]
    assert SECRET not in repr(s.proxies)  # a Proxy shows itself masked
    loaded = initial_proxies(s)["default"]
    assert loaded[0].url == f"http://u:{SECRET}@10.0.0.1:3128"


def test_the_same_entries_as_the_list_setting(tmp_path):
    entries = [f"http://u:{SECRET}@10.0.0.1:3128", "10.0.0.2:3128", f"10.0.0.3:3128:u:{SECRET}"]
    from_file = initial_proxies(_parse(PROXY_SHARD_PROXIES_PATH=_write(tmp_path, "\n".join(entries))))
    from_list = initial_proxies(_parse(PROXY_SHARD_PROXIES=entries))
    assert from_file == from_list


def test_csv_tags_are_kept_and_the_pool_follows_the_settings(tmp_path):
    path = _write(tmp_path, "url,type,country\n10.0.0.1:3128,datacenter,de\n")
    s = _parse(PROXY_SHARD_PROXIES_PATH=path, PROXY_SHARD_POOL="dc")
    (proxy,) = initial_proxies(s)["dc"]
    assert isinstance(proxy, Proxy) and proxy.tags == {"type": "datacenter", "country": "DE"}


def test_one_file_per_pool_and_the_list_for_another(tmp_path):
    s = _parse(PROXY_SHARD_PROXIES_PATH={"dc": _write(tmp_path, "10.0.0.1:3128\n", "dc.txt"),
                                         "resi": _write(tmp_path, "10.0.0.2:3128\n", "resi.txt")},
               PROXY_SHARD_PROXIES={"default": ["10.0.0.3:3128"]})
    assert {pool: [p.exit if isinstance(p, Proxy) else p for p in e] for pool, e in s.proxies.items()} == {
        "default": ["10.0.0.3:3128"], "dc": ["10.0.0.1:3128"], "resi": ["10.0.0.2:3128"]}
    as_json = _parse(PROXY_SHARD_PROXIES_PATH=f'{{"dc": "{_write(tmp_path, "10.0.0.1:3128", "j.txt")}"}}')
    assert list(as_json.proxies) == ["dc"]  # -s PROXY_SHARD_PROXIES_PATH='{"dc": "..."}'


def test_relative_and_home_paths(tmp_path, monkeypatch):
    _write(tmp_path, "10.0.0.1:3128\n")
    monkeypatch.chdir(tmp_path)
    assert len(_parse(PROXY_SHARD_PROXIES_PATH="proxies.txt").proxies["default"]) == 1
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(_parse(PROXY_SHARD_PROXIES_PATH="~/proxies.txt").proxies["default"]) == 1


def test_both_settings_for_one_pool_is_one_clear_error(tmp_path):
    with pytest.raises(SettingError) as info:
        _parse(PROXY_SHARD_PROXIES_PATH=_write(tmp_path, GOOD), PROXY_SHARD_PROXIES=[f"http://u:{SECRET}@h:1"])
    assert str(info.value).startswith("PROXY_SHARD_PROXIES and PROXY_SHARD_PROXIES_PATH both give the proxies "
                                      "of pool 'default': set one of them")
    assert SECRET not in str(info.value)
    # an empty list is not a second source
    assert len(_parse(PROXY_SHARD_PROXIES_PATH=_write(tmp_path, GOOD), PROXY_SHARD_PROXIES=[]).proxies["default"]) == 3


def test_a_missing_file_names_the_path_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingError) as info:
        _parse(PROXY_SHARD_PROXIES_PATH="nowhere.txt")
    assert str(info.value) == (f"PROXY_SHARD_PROXIES_PATH: no file 'nowhere.txt' ({tmp_path / 'nowhere.txt'}): "
                               "give the path of a proxy list file (one proxy per line), absolute or relative "
                               "to the directory scrapy runs in")
    with pytest.raises(SettingError, match=r"PROXY_SHARD_PROXIES_PATH: .* is a directory"):
        _parse(PROXY_SHARD_PROXIES_PATH=str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_names_the_path(tmp_path):
    path = _write(tmp_path, GOOD)
    os.chmod(path, 0)
    with pytest.raises(SettingError, match=r"cannot read .*proxies.txt' \(Permission denied\): make it readable"):
        _parse(PROXY_SHARD_PROXIES_PATH=path)


def test_bad_lines_stop_the_crawl_named_by_number_never_showing_the_password(tmp_path):
    path = _write(tmp_path, f"10.0.0.1:3128\nhttp://u:{SECRET}@10.0.0.2\nu:{SECRET}\n10.0.0.3:3128:{SECRET}\n")
    with pytest.raises(SettingError) as info:
        _parse(PROXY_SHARD_PROXIES_PATH=path)
    message = str(info.value)
    assert message.startswith(f"PROXY_SHARD_PROXIES_PATH: {path}:2: ")
    assert message.endswith(f"(and 2 more bad line(s): `scrapy-proxy-shard load --dry-run {path}` lists them)")
    assert SECRET not in message and "\n" not in message


def test_a_file_that_is_not_utf8_or_holds_no_proxy(tmp_path):
    latin1 = _write(tmp_path, f"10.0.0.1:3128\nhttp://u:{SECRET}\xe9@10.0.0.2:80\n".encode("latin-1"), "l.txt")
    with pytest.raises(SettingError) as info:
        _parse(PROXY_SHARD_PROXIES_PATH=latin1)
    assert str(info.value) == (f"PROXY_SHARD_PROXIES_PATH: {latin1}:2: not UTF-8 text (byte 0xe9): save the file "
                               "as UTF-8")
    with pytest.raises(SettingError, match=r"no proxies in .*empty.txt"):
        _parse(PROXY_SHARD_PROXIES_PATH=_write(tmp_path, "# nothing yet\n\n", "empty.txt"))


@pytest.mark.parametrize("bad", [42, ["a.txt"], {"bad pool!": "a.txt"}, {"dc": 3}])
def test_a_value_of_the_wrong_kind(bad):
    with pytest.raises(SettingError, match="PROXY_SHARD_PROXIES_PATH"):
        _parse(PROXY_SHARD_PROXIES_PATH=bad)


def test_unset_or_empty_reads_nothing():
    assert _parse().proxies == {} and _parse(PROXY_SHARD_PROXIES_PATH="").proxies == {}


def test_the_cli_load_accepts_what_the_setting_accepts(tmp_path):
    """One parser: the CLI's ``load --dry-run`` and the setting agree on the same file."""
    from click.testing import CliRunner

    from scrapy_proxy_shard.ops.cli import cli

    path = _write(tmp_path, GOOD)
    result = CliRunner().invoke(cli, ["load", "--dry-run", path])
    assert result.exit_code == 0 and "3 valid proxies" in result.output
    assert len(_parse(PROXY_SHARD_PROXIES_PATH=path).proxies["default"]) == 3


def test_an_embedded_crawl_loads_the_file_at_open(tmp_path, caplog):
    import logging

    from scrapy import Spider
    from scrapy.utils.misc import build_from_crawler
    from scrapy.utils.test import get_crawler

    from scrapy_proxy_shard.middlewares import ProxyShardMiddleware

    caplog.set_level(logging.INFO, logger="scrapy_proxy_shard")
    crawler = get_crawler(Spider, {"PROXY_SHARD_PROXIES_PATH": _write(tmp_path, GOOD), "PROXY_SHARD_MODE": "embedded",
                                   "PROXY_SHARD_NAMESPACE": "proxies_path"})
    spider = Spider.from_crawler(crawler, name="from_file")
    mw = build_from_crawler(ProxyShardMiddleware, crawler)

    async def go():
        await mw.runtime.spider_opened(spider)
        await mw.runtime.spider_closed(spider, "finished")

    asyncio.run(go())
    assert "pool 'default': 3 proxies added" in caplog.text
    assert SECRET not in caplog.text
