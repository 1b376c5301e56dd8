"""The multi-host recipe (docs/recipes/scrapy-redis.md): scrapy-redis as the shared scheduler and
dupefilter, this plugin as the shared proxy pool, both on one Redis named once by ``REDIS_URL``.

The end-to-end test builds its project from the recipe's own code blocks (so the page cannot drift
from what is tested), runs three ``scrapy crawl`` processes pulling one queue through one pool,
and judges the crawl from the demo site's log: what an anti-bot system saw.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.run import DemoConfig, _start_proxies, _start_site, _stop
from scrapy_proxy_shard.demo.sitelog import read_log, summarize
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.modes.connection import redis_url_of
from scrapy_proxy_shard.settings import ShardSettings

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "docs" / "recipes" / "scrapy-redis.md"
SPIDER = "catalog"  # as in the recipe's spider
NAMESPACE = "shop"  # as in the recipe's settings
USES_REDIS_URL = "proxy_shard: PROXY_SHARD_REDIS_URL is not set: the pool uses REDIS_URL (scrapy-redis' setting)"


def recipe_block(first_line: str) -> str:
    """The recipe's ```python block that starts with ``first_line`` (a comment naming the file)."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(encoding="utf-8"), re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"{RECIPE} has {len(found)} python blocks starting with {first_line!r}"
    return found[0]


def recipe_settings() -> dict:
    namespace: dict = {}
    exec(recipe_block("# settings.py"), namespace)
    return {k: v for k, v in namespace.items() if k.isupper()}


# --- which Redis the plugin uses ----------------------------------------------------------------

def test_the_recipe_settings_put_the_pool_in_the_redis_of_redis_url():
    settings = recipe_settings()
    assert "PROXY_SHARD_REDIS_URL" not in settings
    parsed = ShardSettings.from_settings(settings)
    assert (parsed.redis_url, parsed.redis_url_setting, parsed.mode) == (settings["REDIS_URL"], "REDIS_URL", "redis")
    assert parsed.namespace == NAMESPACE
    assert settings["SCHEDULER_PERSIST"] is True  # several hosts: the first to finish must not flush the queue


def test_proxy_shard_redis_url_wins_and_neither_means_the_embedded_engine():
    both = ShardSettings.from_settings({"REDIS_URL": "redis://q:6379/0", "PROXY_SHARD_REDIS_URL": "redis://p:6379/1"})
    assert (both.redis_url, both.redis_url_setting, both.mode) == ("redis://p:6379/1", "PROXY_SHARD_REDIS_URL", "redis")
    neither = ShardSettings.from_settings({})
    assert (neither.redis_url, neither.redis_url_setting, neither.mode) == (None, None, "embedded")
    # An empty PROXY_SHARD_REDIS_URL counts as unset (as `-s PROXY_SHARD_REDIS_URL=` gives it).
    empty = ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "", "REDIS_URL": "redis://q:6379/0"})
    assert (empty.redis_url, empty.redis_url_setting) == ("redis://q:6379/0", "REDIS_URL")


def test_a_bad_redis_url_is_named_as_the_setting_it_came_from():
    with pytest.raises(SettingError, match=r"^REDIS_URL \('<int>'\) must be a redis:// URL string"):
        ShardSettings.from_settings({"REDIS_URL": 6379})
    with pytest.raises(SettingError, match=r"^REDIS_URL \('http://\*\*\*:\*\*\*@q:6379/0'\) must start with redis://"):
        redis_url_of(ShardSettings.from_settings({"REDIS_URL": "http://u:Pw0rd@q:6379/0"}))
    with pytest.raises(SettingError, match=r"^PROXY_SHARD_REDIS_URL \('http://q:1'\) must start with"):
        redis_url_of(ShardSettings.from_settings({"PROXY_SHARD_REDIS_URL": "http://q:1", "REDIS_URL": "redis://q:1"}))


def _engine_lines(settings: dict, caplog) -> list[str]:
    from scrapy import Spider
    from scrapy.utils.misc import build_from_crawler
    from scrapy.utils.test import get_crawler

    from scrapy_proxy_shard.middlewares import ProxyShardMiddleware

    crawler = get_crawler(Spider, {"PROXY_SHARD_PROXIES": ["10.0.0.1:3128"], "PROXY_SHARD_HOST_ID": "h1", **settings})
    spider = Spider.from_crawler(crawler, name="solo")
    mw = build_from_crawler(ProxyShardMiddleware, crawler)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="scrapy_proxy_shard")

    async def go():
        await mw.runtime.spider_opened(spider)
        await mw.runtime.spider_closed(spider, "finished")

    asyncio.run(go())
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("proxy_shard: ")
            and ("REDIS_URL" in r.getMessage() or "proxy_shard: engine " in r.getMessage())]


def test_the_plugin_says_once_that_it_uses_redis_url(redis_server, real_redis, caplog):
    lines = _engine_lines({"REDIS_URL": redis_server.url}, caplog)
    assert len(lines) == 2, lines
    assert lines[0] == f"{USES_REDIS_URL}, Redis at {redis_server.url}"
    assert lines[1].startswith(f"proxy_shard: engine redis at {redis_server.url}")
    # Set explicitly, or no Redis at all: no such line.
    lines = _engine_lines({"REDIS_URL": "redis://127.0.0.1:1/0", "PROXY_SHARD_REDIS_URL": redis_server.url}, caplog)
    assert len(lines) == 1 and lines[0].startswith(f"proxy_shard: engine redis at {redis_server.url}"), lines
    lines = _engine_lines({"PROXY_SHARD_MODE": "embedded"}, caplog)
    assert len(lines) == 1 and lines[0].startswith("proxy_shard: engine embedded"), lines


# --- the recipe, end to end ---------------------------------------------------------------------

#: What the test adds to the recipe's settings.py: the demo site's pacing (it allows one request at a
#: time per IP and site, 0.2 s apart; the interval here is wider so that the crawl lasts long enough for
#: every host to take part), the resolver that lets a request escaping the proxies reach the site (so the
#: site logs it from 127.0.0.1), and the test's Redis.
TEST_SETTINGS = """
# --- added by tests/test_scrapy_redis.py ---
PROXY_SHARD_MIN_INTERVAL = 1.5
PROXY_SHARD_ARRIVAL_GUARD = 0.5
PROXY_SHARD_BAN_RETRIES = 6
DOWNLOAD_TIMEOUT = 10
TWISTED_DNS_RESOLVER = "scrapy_proxy_shard.demo.resolver.DemoSiteResolver"
TELNETCONSOLE_ENABLED = False
LOG_LEVEL = "INFO"
REDIS_URL = {redis_url!r}
"""
HOSTS = 3
PAGES = 30


def make_project(where: Path, redis_url: str) -> Path:
    project = where / "project"
    (project / "shop" / "spiders").mkdir(parents=True)
    (project / "scrapy.cfg").write_text("[settings]\ndefault = shop.settings\n")
    (project / "shop" / "__init__.py").write_text("")
    (project / "shop" / "spiders" / "__init__.py").write_text("")
    (project / "shop" / "settings.py").write_text(recipe_block("# settings.py")
                                                  + TEST_SETTINGS.format(redis_url=redis_url))
    (project / "shop" / "spiders" / "catalog.py").write_text(recipe_block("# shop/spiders/catalog.py"))
    return project


@pytest.mark.slow
def test_three_hosts_pull_one_queue_through_one_pool(tmp_path, request):
    # The newest redis-server line only (asked for dynamically, so not one run per line): the crawl is
    # about the two libraries sharing one Redis, and one run keeps the test within a minute.
    binary = request.getfixturevalue("redis_binary")
    config = DemoConfig(hosts=HOSTS, pages=PAGES, flows=0, workdir=tmp_path, progress=False)
    site_log = tmp_path / "site.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PROXY_SHARD_REDIS_URL", "REDIS_URL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    children: list[subprocess.Popen] = []
    hosts: list[tuple[str, subprocess.Popen]] = []
    server = RedisServer(binary=binary.path).start()
    try:
        site_port = _start_site(config, tmp_path, site_log, children)
        manifest = _start_proxies(config, tmp_path, site_port, children)
        # The recipe's steps: load the pool with the CLI (it reads REDIS_URL too), seed, start the hosts.
        load = subprocess.run([sys.executable, "-m", "scrapy_proxy_shard", "--namespace", NAMESPACE, "--pool",
                               "datacenter", "load", str(tmp_path / "proxies.txt")],
                              env={**env, "REDIS_URL": server.url}, capture_output=True, text=True, timeout=60)
        assert load.returncode == 0, load.stdout + load.stderr
        client = redis.Redis.from_url(server.url, decode_responses=True)
        client.lpush(f"{SPIDER}:start_urls", *(json.dumps({"url": f"http://{site}:{site_port}/"})
                                                for site in config.sites))
        project = make_project(tmp_path, server.url)
        started = time.monotonic()
        for i in range(HOSTS):
            name = f"host-{i}"
            # redis_batch_size=1: each host takes one seed when it first idles (the default batch,
            # CONCURRENT_REQUESTS, would hand all three to the first host up)
            cmd = [sys.executable, "-m", "scrapy", "crawl", SPIDER, "-a", "redis_batch_size=1",
                   "-s", f"PROXY_SHARD_HOST_ID={name}", "-O", str(tmp_path / f"{name}.items.jsonl"),
                   "--logfile", str(tmp_path / f"{name}.log")]
            with open(tmp_path / f"{name}.out", "wb") as out:
                hosts.append((name, subprocess.Popen(cmd, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                     start_new_session=True)))
        deadline = started + 120
        while any(p.poll() is None for _, p in hosts) and time.monotonic() < deadline:
            time.sleep(0.25)
        took = time.monotonic() - started
        keys = set(client.keys("*"))
        fingerprints = client.scard(f"{SPIDER}:dupefilter")
        client.close()
    finally:
        for _, proc in hosts:
            _stop(proc)
        for child in reversed(children):
            _stop(child)
        server.stop()

    entries = read_log(site_log)
    expected = config.expected_pages
    s = summarize(entries, expected_pages=expected)
    items = {name: [json.loads(line) for line in (tmp_path / f"{name}.items.jsonl").read_text().splitlines()
                    if line.strip()] if (tmp_path / f"{name}.items.jsonl").exists() else [] for name, _ in hosts}
    scraped = Counter((urlsplit(i["url"]).hostname, urlsplit(i["url"]).path) for its in items.values() for i in its)
    served = Counter((e["site"], e["path"]) for e in entries if e.get("kind") == "page" and e.get("status") == 200)
    egress = {m["source_ip"] for m in manifest}
    direct = [f"{e['ip']} {e['site']}{e['path']}" for e in entries if e["ip"] not in egress]
    report = (f"{took:.1f}s; items per host {({n: len(i) for n, i in items.items()})}; "
              f"exit codes {[p.returncode for _, p in hosts]}\n{s.format()}")
    print(report)

    assert all(p.returncode == 0 for _, p in hosts), report
    # Every page once: served once by the site, scraped once across the hosts.
    assert not s.missing_pages and set(served) == expected, report
    assert [k for k, n in served.items() if n > 1] == [], report
    assert set(scraped) == expected and max(scraped.values()) == 1, report
    assert sum(len(i) for i in items.values()) == len(expected), report
    # What the site saw: never one IP twice at once on a site, never too fast, never the host's own IP.
    assert s.overlaps == 0 and s.violations == 0, report
    assert direct == [], report
    # One queue, pulled by several hosts; the dupefilter let each page through once.
    assert sum(1 for i in items.values() if i) >= 2, report
    assert fingerprints == len(expected), report
    # Each library kept to its own keys.
    theirs = {k for k in keys if k.partition(":")[0] == SPIDER
              and k.partition(":")[2] in ("start_urls", "requests", "dupefilter")}
    ours = {k for k in keys if k.startswith(f"{{{NAMESPACE}:") or k == f"{NAMESPACE}:pools"}
    assert theirs == {f"{SPIDER}:dupefilter"} and keys == theirs | ours, sorted(keys - theirs - ours)
    for name, _ in hosts:
        log = (tmp_path / f"{name}.log").read_text()
        assert log.count(USES_REDIS_URL) == 1, name
