"""Scrapy wiring, fail-closed start and exit codes, through real `scrapy crawl` processes.

Each crawl runs in a throwaway project made in tmp_path (startproject layout, with its OWN
DOWNLOADER_MIDDLEWARES), through real local forward proxies (each sending from its own 127.0.0.x)
to the local site, with a real redis-server. Verdicts come from what the *site* saw: a request
from 127.0.0.1 is a request that left from the host's own address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio

from scrapy_proxy_shard.crawl.startup import check_eviction
from scrapy_proxy_shard.demo.forward_proxy import ProxyFleet, ProxySpec
from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.site import AntiBotSite, ServerThread, SiteRules
from scrapy_proxy_shard.exceptions import SettingError

ROOT = Path(__file__).resolve().parents[1]
PROXY_IPS = ("127.0.0.41", "127.0.0.42")
PAGES = 3
LEASE, BAN, GUARD = (f"scrapy_proxy_shard.middlewares.{name}" for name in
                     ("ProxyShardMiddleware", "BanDetectionMiddleware", "ProxyShardGuardMiddleware"))
ADDON = "ADDONS = {'scrapy_proxy_shard.addon.ProxyShardAddon': 0}"

MIDDLEWARES_PY = '''
class ProjDownloaderMiddleware:
    """What `scrapy startproject` generates: a project middleware of the user's own."""

    def process_request(self, request, spider=None):
        request.headers.setdefault("X-Project", "1")


class StripProxy:
    """A rogue middleware: drops meta['proxy'] after the lease (and after HttpProxyMiddleware)."""

    def process_request(self, request, spider=None):
        request.meta.pop("proxy", None)
'''

SPIDER_PY = '''
import scrapy


class PagesSpider(scrapy.Spider):
    name = "pages"

    def __init__(self, base, pages=3, ghost=0, **kwargs):
        super().__init__(**kwargs)
        self.base, self.pages, self.ghost = base, int(pages), int(ghost)

    async def start(self):
        for n in range(1, self.pages + 1):
            yield scrapy.Request(f"{self.base}/catalog/{n}", callback=self.parse, errback=self.failed)
        if self.ghost:
            yield scrapy.Request(f"{self.base}/catalog/{self.pages + 1}", meta={"proxy_pool": "ghost"},
                                 callback=self.parse, errback=self.failed)

    def parse(self, response):
        yield {"url": response.url, "status": response.status}

    def failed(self, failure):
        self.logger.info("errback: %s", type(failure.value).__name__)


class CustomPagesSpider(PagesSpider):
    name = "custom_pages"
    custom_settings = {"DOWNLOADER_MIDDLEWARES": {"proj.middlewares.ProjDownloaderMiddleware": 543}}
'''


@dataclass
class World:
    site: AntiBotSite
    fleet: ProxyFleet
    redis_url: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.site.port}"

    def ips(self) -> list[str]:
        return [e["ip"] for e in self.site.entries]


@pytest.fixture
def world(redis_server, real_redis):
    site = AntiBotSite(sites=("127.0.0.1",), rules=SiteRules(latency=0.01, min_interval=0.0), pages_per_site=10)
    site_thread = ServerThread(site)
    site_thread.start()
    specs = [ProxySpec(PROXY_IPS[0]), ProxySpec(PROXY_IPS[1], username="u", password="pw-S3cret")]
    fleet = ProxyFleet(specs, {"127.0.0.1": ("127.0.0.1", site.port)})
    fleet_thread = ServerThread(fleet)
    fleet_thread.start()
    try:
        yield World(site, fleet, redis_server.url)
    finally:
        fleet_thread.stop()
        site_thread.stop()


def make_project(tmp_path: Path, world: World, wiring: str, extra: str = "") -> Path:
    """A startproject-style project whose settings.py has its own DOWNLOADER_MIDDLEWARES."""
    project = tmp_path / "proj_root"
    (project / "proj" / "spiders").mkdir(parents=True)
    (project / "scrapy.cfg").write_text("[settings]\ndefault = proj.settings\n")
    (project / "proj" / "__init__.py").write_text("")
    (project / "proj" / "spiders" / "__init__.py").write_text("")
    (project / "proj" / "middlewares.py").write_text(MIDDLEWARES_PY)
    (project / "proj" / "spiders" / "pages.py").write_text(SPIDER_PY)
    settings = f'''
        BOT_NAME = "proj"
        SPIDER_MODULES = ["proj.spiders"]
        NEWSPIDER_MODULE = "proj.spiders"
        ROBOTSTXT_OBEY = False
        TELNETCONSOLE_ENABLED = False
        LOG_LEVEL = "INFO"
        RETRY_ENABLED = False
        PROXY_SHARD_REDIS_URL = {world.redis_url!r}
        PROXY_SHARD_NAMESPACE = "wiring"
        PROXY_SHARD_HOST_ID = "wiring-host"
        PROXY_SHARD_MIN_INTERVAL = 0
        PROXY_SHARD_MAX_WAIT = 10
        PROXY_SHARD_PROXIES = {world.fleet.proxy_urls()!r}
    '''
    text = textwrap.dedent(settings) + textwrap.dedent(wiring) + "\n" + textwrap.dedent(extra) + "\n"
    (project / "proj" / "settings.py").write_text(text)
    return project


def crawl(project: Path, world: World, spider: str = "pages", *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "scrapy", "crawl", spider, "-a", f"base={world.base}", "-a", f"pages={PAGES}", *args]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=90)


def assert_all_pages_through_proxies(proc: subprocess.CompletedProcess, world: World, exit_code: int = 0) -> None:
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    assert set(world.ips()) <= set(PROXY_IPS), f"the site saw {world.ips()} (127.0.0.1 = the host's own IP)"
    ok = [e for e in world.site.entries if e["status"] == 200]
    assert len(ok) == PAGES, proc.stderr[-3000:]
    assert "pw-S3cret" not in proc.stderr + proc.stdout


PROJECT_MIDDLEWARES = "DOWNLOADER_MIDDLEWARES = {'proj.middlewares.ProjDownloaderMiddleware': 543}\n"


def test_addon_works_with_a_project_downloader_middlewares(tmp_path, world):
    project = make_project(tmp_path, world, PROJECT_MIDDLEWARES + ADDON)
    proc = crawl(project, world, "pages", "-a", "ghost=1")
    # the ghost request was not sent: the crawl did not finish its work, exit code 1 (stat not_sent)
    assert_all_pages_through_proxies(proc, world, exit_code=1)
    assert "'proxy_shard/not_sent': 1" in proc.stderr and "finished with 1 request not sent" in proc.stderr
    # Item 10: one line says which engine runs, where (masked) and with which pools.
    engine = [line for line in proc.stderr.splitlines() if "proxy_shard: engine " in line]
    assert len(engine) == 1 and f"redis at {world.redis_url}" in engine[0] and "'default' (2 proxies)" in engine[0]
    # An unknown pool named only in meta['proxy_pool'] fails that request with one line, no traceback.
    ghost = [line for line in proc.stderr.splitlines() if "not sent: pool 'ghost'" in line]
    assert len(ghost) == 1 and "errback: RequestNotLeased" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_addon_works_with_spider_custom_settings(tmp_path, world):
    project = make_project(tmp_path, world, ADDON)
    assert_all_pages_through_proxies(crawl(project, world, "custom_pages"), world)


def test_proxies_from_a_list_file_and_a_misspelt_pacing_setting_warns(tmp_path, world):
    """Issue 21: PROXY_SHARD_PROXIES_PATH (relative to where scrapy runs: the project root) instead of
    PROXY_SHARD_PROXIES; a misspelt non-coordination setting is one WARNING, and the crawl runs."""
    project = make_project(tmp_path, world, ADDON + "\nPROXY_SHARD_PROXIES = None\n"
                           "PROXY_SHARD_PROXIES_PATH = 'proxies.txt'\nPROXY_SHARD_MIN_INTERVALL = 1")
    (project / "proxies.txt").write_text("# the fleet\n\n" + "\n".join(world.fleet.proxy_urls()) + "\n")
    proc = crawl(project, world)
    assert_all_pages_through_proxies(proc, world)
    assert "pool 'default': 2 proxies added" in proc.stderr or "'default' (2 proxies)" in proc.stderr
    typo = [line for line in proc.stderr.splitlines() if "PROXY_SHARD_MIN_INTERVALL" in line]
    assert len(typo) == 1 and "WARNING" in typo[0] and "did you mean PROXY_SHARD_MIN_INTERVAL?" in typo[0]


def test_explicit_wiring_next_to_the_project_middlewares(tmp_path, world):
    wiring = f"DOWNLOADER_MIDDLEWARES = {{'proj.middlewares.ProjDownloaderMiddleware': 543, " \
             f"{LEASE!r}: 610, {BAN!r}: 620, {GUARD!r}: 950}}"
    assert_all_pages_through_proxies(crawl(make_project(tmp_path, world, wiring), world), world)


def test_a_rogue_middleware_that_strips_the_proxy_gets_the_request_dropped(tmp_path, world):
    wiring = "DOWNLOADER_MIDDLEWARES = {'proj.middlewares.StripProxy': 800}\n" + ADDON
    proc = crawl(make_project(tmp_path, world, wiring), world)
    assert world.site.entries == [], f"the site saw {world.ips()}: a request left without its proxy"
    dropped = [line for line in proc.stderr.splitlines() if "proxy_shard: dropped " in line]
    assert len(dropped) == PAGES, proc.stderr[-3000:]
    assert f"'proxy_shard/guard/dropped': {PAGES}" in proc.stderr


def _one_clean_line(proc: subprocess.CompletedProcess, world: World, expected: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if "proxy_shard: cannot start: " in line]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]
    for noise in ("Traceback", "Task exception was never retrieved", "Unhandled error in Deferred"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert world.site.entries == []


CANNOT_START = {
    "lease after HttpProxyMiddleware": (
        f"DOWNLOADER_MIDDLEWARES = {{{LEASE!r}: 800, {BAN!r}: 620, {GUARD!r}: 950}}",
        "ProxyShardMiddleware (800) must run before HttpProxyMiddleware (750): give it a number below 750"),
    "ban detector before Retry": (
        f"DOWNLOADER_MIDDLEWARES = {{{LEASE!r}: 500, {BAN!r}: 540, {GUARD!r}: 950}}",
        "BanDetectionMiddleware (540) must run after RedirectMiddleware (600): give it a number above 600"),
    "guard missing": (
        f"DOWNLOADER_MIDDLEWARES = {{{LEASE!r}: 610, {BAN!r}: 620}}",
        "DOWNLOADER_MIDDLEWARES does not enable ProxyShardGuardMiddleware"),
    "lease disabled under the add-on": (
        f"DOWNLOADER_MIDDLEWARES = {{{LEASE!r}: None}}\n{ADDON}",
        "DOWNLOADER_MIDDLEWARES does not enable ProxyShardMiddleware"),
    "redis down": (ADDON + "\nPROXY_SHARD_REDIS_URL = 'redis://:Secr3t@127.0.0.1:1/0'",
                   "cannot reach Redis at redis://***:***@127.0.0.1:1/0"),
    "empty pool": (ADDON + "\nPROXY_SHARD_PROXIES = None\nPROXY_SHARD_POOL = 'nothing'",
                   "pool 'nothing' (namespace 'wiring', from PROXY_SHARD_POOL) holds no proxies"),
    "unknown site pool": (ADDON + "\nPROXY_SHARD_SITE_POOLS = {'127.0.0.1': 'ghost'}",
                          "pool 'ghost' (namespace 'wiring', from PROXY_SHARD_SITE_POOLS) holds no proxies"),
    "bad setting": (ADDON + "\nPROXY_SHARD_MIN_INTERVAL = 'fast'",
                    "PROXY_SHARD_MIN_INTERVAL ('fast') must be a number"),
    # Issue 21: a misspelt setting that decides what the hosts share stops the crawl; so does a
    # list file that is not there.
    "misspelt redis url": (ADDON + "\nPROXY_SHARD_REDIS_ULR = 'redis://:Secr3t@10.0.0.9:6379/0'",
                           "PROXY_SHARD_REDIS_ULR is not a setting of scrapy-proxy-shard; did you mean "
                           "PROXY_SHARD_REDIS_URL?"),
    "missing list file": (ADDON + "\nPROXY_SHARD_PROXIES = None\nPROXY_SHARD_PROXIES_PATH = 'proxies.txt'",
                          "PROXY_SHARD_PROXIES_PATH: no file 'proxies.txt' ("),
    # Issue 23: a tier list that cannot work
    "empty tiers": (ADDON + "\nPROXY_SHARD_TIERS = []", "PROXY_SHARD_TIERS is empty: name two or more pools"),
    "duplicate tier": (ADDON + "\nPROXY_SHARD_TIERS = ['default', 'default']",
                       "PROXY_SHARD_TIERS (['default', 'default']) names pool 'default' twice"),
    "unknown tier pool": (ADDON + "\nPROXY_SHARD_TIERS = ['default', 'ghost']",
                          "pool 'ghost' (namespace 'wiring', from PROXY_SHARD_TIERS) holds no proxies"),
}


@pytest.mark.parametrize("case", list(CANNOT_START))
def test_a_crawl_that_cannot_start_exits_non_zero_with_one_line(tmp_path, world, case):
    wiring, expected = CANNOT_START[case]
    proc = crawl(make_project(tmp_path, world, wiring), world)
    _one_clean_line(proc, world, expected)
    assert "Secr3t" not in proc.stderr


@pytest.mark.parametrize("case", ["redis down", "bad setting", "lease after HttpProxyMiddleware"])
def test_the_same_with_the_deferred_based_crawler_process(tmp_path, world, case):
    """Scrapy 2.19 runs `scrapy crawl` on AsyncCrawlerProcess; FORCE_CRAWLER_PROCESS picks CrawlerProcess."""
    wiring, expected = CANNOT_START[case]
    proc = crawl(make_project(tmp_path, world, wiring, "FORCE_CRAWLER_PROCESS = True\nLOG_LEVEL = 'DEBUG'"), world)
    assert "Using CrawlerProcess" in proc.stderr
    _one_clean_line(proc, world, expected)


def test_a_redis_that_may_evict_the_pool_refuses_the_crawl(tmp_path, world):
    server = RedisServer(extra_args=("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru")).start()
    try:
        project = make_project(tmp_path, world, ADDON, f"PROXY_SHARD_REDIS_URL = {server.url!r}")
        _one_clean_line(crawl(project, world), world, "maxmemory-policy 'allkeys-lru'")
    finally:
        server.stop()


# --- maxmemory-policy on a real redis-server, without a crawl -----------------------------------

def _policy(redis_server, policy: str, limit: str):
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory", limit)
    client.config_set("maxmemory-policy", policy)
    client.close()


def _check(url: str, mode: str = "refuse", **kwargs) -> None:
    async def go():
        client = redis.asyncio.Redis.from_url(url, **kwargs)
        try:
            await check_eviction(client, url, mode)
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.fixture
def restore_memory(redis_server):
    yield
    _policy(redis_server, "noeviction", "0")


def test_eviction_policy_refused_warned_or_accepted(redis_server, restore_memory, caplog):
    caplog.set_level(logging.WARNING, logger="scrapy_proxy_shard.crawl.startup")
    _policy(redis_server, "allkeys-lru", "1gb")
    with pytest.raises(SettingError, match=r"maxmemory-policy 'allkeys-lru'.*noeviction"):
        _check(redis_server.url)
    _check(redis_server.url, mode="warn")
    _policy(redis_server, "volatile-ttl", "1gb")
    _check(redis_server.url)
    assert [r.getMessage().count("may evict") for r in caplog.records] == [1, 1]
    assert "sticky sessions" in caplog.records[-1].getMessage()
    caplog.clear()
    _policy(redis_server, "allkeys-lru", "0")  # no memory limit: nothing is ever evicted
    _check(redis_server.url)
    _policy(redis_server, "noeviction", "1gb")
    _check(redis_server.url)
    assert caplog.records == []


def test_eviction_policy_that_cannot_be_read_is_a_warning(redis_server, real_redis, caplog):
    """Managed Redis often denies CONFIG: a user without it (ACL) gets a warning, not a refusal."""
    real_redis.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-config")
    try:
        caplog.set_level(logging.WARNING, logger="scrapy_proxy_shard.crawl.startup")
        _check(redis_server.url, username="limited", password="pw")
        assert len(caplog.records) == 1 and "could not read maxmemory-policy" in caplog.records[0].getMessage()
    finally:
        real_redis.execute_command("ACL", "DELUSER", "limited")


def test_auto_mode_without_redis_says_hosts_do_not_coordinate(caplog):
    """Item 10 without a crawl: the embedded engine is named, and `auto` with proxies warns."""
    from scrapy import Spider
    from scrapy.utils.misc import build_from_crawler
    from scrapy.utils.test import get_crawler

    from scrapy_proxy_shard.middlewares import ProxyShardMiddleware

    crawler = get_crawler(Spider, {"PROXY_SHARD_PROXIES": ["http://u:Pw0rd@10.0.0.1:3128", "10.0.0.2:3128"]})
    spider = Spider.from_crawler(crawler, name="solo")
    mw = build_from_crawler(ProxyShardMiddleware, crawler)
    caplog.set_level(logging.INFO, logger="scrapy_proxy_shard")

    async def go():
        await mw.runtime.spider_opened(spider)
        await mw.runtime.spider_closed(spider, "finished")

    asyncio.run(go())
    engine = [r.getMessage() for r in caplog.records if "proxy_shard: engine " in r.getMessage()]
    host = repr(mw.runtime.settings.host_id)
    assert engine == ["proxy_shard: engine embedded engine (in-process, not shared with other hosts; no Redis), "
                      "namespace 'proxy_shard', host " + host + ", pools 'default' (2 proxies)"]
    # No line names the in-process engine by its fakeredis address, as if a Redis server were used.
    assert "redis://" not in caplog.text and "Redis at" not in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "hosts do NOT coordinate" in warnings[0]
    assert "Pw0rd" not in caplog.text


def test_sigterm_is_not_held_up_by_requests_waiting_for_a_proxy(tmp_path, world):
    """Item 7 through a real crawl: two proxies, three pages, a 300 s pacing interval: the third request
    waits for a slot (MAX_WAIT 600 s). SIGTERM must stop the crawl within seconds, the waiting request
    failing (never sent, and never sent from the host's own address)."""
    import signal
    import time

    extra = "PROXY_SHARD_MIN_INTERVAL = 300\nPROXY_SHARD_MAX_WAIT = 600\n"
    project = make_project(tmp_path, world, ADDON, extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "scrapy", "crawl", "pages", "-a", f"base={world.base}", "-a", f"pages={PAGES}"]
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(world.site.entries) < len(PROXY_IPS) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(world.site.entries) == len(PROXY_IPS), "the first pages never arrived"
        time.sleep(1.0)  # the third request is waiting for a slot now
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 15, f"the crawl took {took:.1f}s to stop after SIGTERM"
    assert "'proxy_shard/wait/cancelled_at_stop': 1" in stderr, stderr[-3000:]
    assert len(world.site.entries) == len(PROXY_IPS) and set(world.ips()) <= set(PROXY_IPS)


def test_the_addon_names_a_project_middleware_that_cannot_be_loaded(caplog):
    """A typo in the project's DOWNLOADER_MIDDLEWARES: Scrapy's setdefault loads every entry and would
    fail inside the add-on with a traceback through the plugin; the add-on names the entry in one line
    and adds its middlewares by name (Scrapy refuses the entry itself when it builds the middlewares)."""
    from scrapy.settings import Settings

    from scrapy_proxy_shard.addon import PRIORITIES, ProxyShardAddon

    settings = Settings({"DOWNLOADER_MIDDLEWARES": {"nowhere.middlewares.Typo": 543, GUARD: None}})
    with caplog.at_level(logging.ERROR, logger="scrapy_proxy_shard.addon"):
        ProxyShardAddon().update_settings(settings)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'nowhere.middlewares.Typo', which cannot be loaded" in lines[0], lines
    assert "fix its path or remove it" in lines[0]
    chosen = settings.getdict("DOWNLOADER_MIDDLEWARES")
    names = {getattr(k, "__module__", "") + "." + getattr(k, "__name__", "") if not isinstance(k, str) else k: v
             for k, v in chosen.items()}
    assert names[LEASE] == PRIORITIES[LEASE] and names[BAN] == PRIORITIES[BAN]
    assert names[GUARD] is None  # the user's own entry for one of ours still wins
    assert names["nowhere.middlewares.Typo"] == 543  # never dropped: Scrapy names it again at build time
