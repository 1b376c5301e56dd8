"""What actually reaches the site, whatever download handler downloads a request (issue 19, items 1-2).

Each test runs real ``scrapy runspider`` processes (embedded engine, no Redis) against the local
anti-bot site and real local forward proxies, and judges from the *site's* log: every proxy egresses
from its own 127.0.0.x (x >= 11), and a request that escapes the proxies reaches the site from
127.0.0.1 (Scrapy through ``DemoSiteResolver``, Chromium through ``--host-resolver-rules``), so
a direct send shows up in the log instead of dying in DNS.

The scrapy-playwright test needs scrapy-playwright and Debian's chromium: skipped locally when one
is missing, a failure under ``CI=true`` (.ci/run installs both).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scrapy_proxy_shard.demo.run import _spawn, _stop, _wait_file
from scrapy_proxy_shard.demo.sitelog import read_log, summarize

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SITE = "shop-a.test"
CHROMIUM = "/usr/bin/chromium"
PROXIES = 4


class Stack:
    """The anti-bot site and a fleet of forward proxies (2 of them with Basic auth), in ``workdir``."""

    def __init__(self, workdir: Path, site_args: tuple[str, ...] = (), proxies: int = PROXIES) -> None:
        self.workdir = workdir
        self.log = workdir / "site.log"
        self.children: list[subprocess.Popen] = []
        ready = workdir / "site.ready"
        self.children.append(_spawn(
            [sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--port", "0", "--log", str(self.log),
             "--ready-file", str(ready), "--sites", SITE, "--pages-per-site", "20", *site_args], workdir / "site.out"))
        self.port = int(_wait_file(ready, self.children[-1]).strip())
        ready = workdir / "proxies.ready"
        self.children.append(_spawn(
            [sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count", str(proxies),
             "--site-port", str(self.port), "--proxy-file", str(workdir / "proxies.txt"), "--ready-file",
             str(ready), "--auth", "2", "--dead", "0", "--slow", "0"], workdir / "proxies.out"))
        self.manifest = json.loads(_wait_file(ready, self.children[-1]))["proxies"]

    @property
    def proxy_urls(self) -> list[str]:
        return [m["url"] for m in self.manifest]

    @property
    def egress(self) -> set[str]:
        return {m["source_ip"] for m in self.manifest}

    def url(self, n: int) -> str:
        return f"http://{SITE}:{self.port}/catalog/{n}"

    def entries(self) -> list[dict]:
        return read_log(self.log) if self.log.exists() else []

    def direct(self) -> list[dict]:
        """Requests the site got from an address no proxy egresses from: sent from the host itself."""
        return [e for e in self.entries() if e["ip"] not in self.egress]

    def stop(self) -> None:
        for child in reversed(self.children):
            _stop(child)


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.stop()


SPIDER = '''
import scrapy

SETTINGS = {settings}


class Probe(scrapy.Spider):
    name = "probe"
    custom_settings = SETTINGS

    async def start(self):
        for n, url in enumerate({urls}, 1):
            yield scrapy.Request(url, meta={meta}, callback=self.parse, errback=self.failed)

    def parse(self, response):
        yield {{"url": response.url, "status": response.status,
                "proxy_id": response.meta.get("proxy_shard_proxy_id")}}

    def failed(self, failure):
        self.logger.error("FAILED %s: %s", failure.request.url, failure.value)
'''

BASE_SETTINGS = {
    "ADDONS": {"scrapy_proxy_shard.addon.ProxyShardAddon": 0},
    "PROXY_SHARD_MODE": "embedded",
    "PROXY_SHARD_MIN_INTERVAL": 0.4,  # the site allows one request per IP at a time, 0.2 s apart
    "PROXY_SHARD_MAX_WAIT": 30,
    "CONCURRENT_REQUESTS": 4,
    "DOWNLOAD_TIMEOUT": 15,
    "RETRY_ENABLED": False,
    "ROBOTSTXT_OBEY": False,
    "TELNETCONSOLE_ENABLED": False,
    "LOG_LEVEL": "INFO",
}


def crawl(stack: Stack, settings: dict, urls: list[str], meta: dict | None = None,
          extra_files: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run the probe spider in ``stack.workdir`` (its own modules importable), items to items.jl."""
    for name, text in (extra_files or {}).items():
        (stack.workdir / name).write_text(textwrap.dedent(text))
    spider = stack.workdir / "probe_spider.py"
    merged = {**BASE_SETTINGS, "PROXY_SHARD_PROXIES": stack.proxy_urls, **settings}
    spider.write_text(SPIDER.format(settings=repr(merged), urls=repr(urls), meta=repr(meta or {})))
    items = stack.workdir / "items.jl"
    items.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(stack.workdir)])}
    # Read from the process settings only (the reactor is set up before the spider's own settings).
    process = ["-s", "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver",
               "-s", "TWISTED_REACTOR=twisted.internet.asyncioreactor.AsyncioSelectorReactor"]
    return subprocess.run([sys.executable, "-m", "scrapy", "runspider", str(spider), "-o", f"{items}:jsonl",
                           *process], cwd=stack.workdir, env=env, capture_output=True, text=True, timeout=timeout)


def items_of(stack: Stack) -> list[dict]:
    path = stack.workdir / "items.jl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def report(stack: Stack, proc: subprocess.CompletedProcess) -> str:
    seen = [(e["ip"], e["path"], e.get("status")) for e in stack.entries()]
    return f"exit {proc.returncode}; site saw {seen}\n--- stderr tail ---\n{proc.stderr[-4000:]}"


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="session")
def playwright_installed() -> None:
    """scrapy-playwright and Debian's chromium: a skip locally when missing, a failure under CI=true."""
    missing = []
    if importlib.util.find_spec("scrapy_playwright") is None:
        missing.append("scrapy-playwright (pip install -e '.[test]')")
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing.append(f"chromium at {CHROMIUM} (sudo apt-get install chromium)")
    if missing:
        message = f"the scrapy-playwright test needs {', '.join(missing)}"
        if _on_ci():
            pytest.fail(f"CI=true requires it: {message}", pytrace=False)
        pytest.skip(message)


def test_playwright_pages_go_out_through_their_leased_proxies(stack, playwright_installed):
    """Before: 6/6 pages reached the site from 127.0.0.1 (the browser ignored meta['proxy']), exit 0."""
    pages = [stack.url(n) for n in range(1, 7)]
    handler = "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler"
    settings = {
        "DOWNLOAD_HANDLERS": {"http": handler, "https": handler},
        "PLAYWRIGHT_BROWSER_TYPE": "chromium",
        "PLAYWRIGHT_LAUNCH_OPTIONS": {
            "executable_path": shutil.which("chromium") or CHROMIUM,
            # A request that escapes the proxy reaches the site from 127.0.0.1 instead of failing in DNS.
            "args": ["--no-sandbox", "--host-resolver-rules=MAP *.test 127.0.0.1"],
        },
        "PLAYWRIGHT_MAX_PAGES_PER_CONTEXT": 1,
    }
    proc = crawl(stack, settings, pages, meta={"playwright": True})
    why = report(stack, proc)
    assert not stack.direct(), why
    catalog = [e for e in stack.entries() if e["path"].startswith("/catalog/")]
    assert {e["path"] for e in catalog if e.get("status") == 200} == {f"/catalog/{n}" for n in range(1, 7)}, why
    assert summarize(stack.entries()).overlaps == 0, why
    items = items_of(stack)
    assert len(items) == 6 and all(i["proxy_id"] for i in items), why
    # Both proxies with Basic auth were used by the browser (credentials from the context, not a header).
    assert {e["ip"] for e in catalog} == stack.egress, why
    assert proc.returncode == 0, why
    for m in stack.manifest:
        if m["auth"]:
            secret = m["url"].split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
            assert secret not in proc.stderr + proc.stdout, "a proxy password was logged"


DIRECT_HANDLER = '''
from scrapy.core.downloader.handlers.http11 import HTTP11DownloadHandler


class DirectHandler(HTTP11DownloadHandler):
    """Downloads every request without its proxy, as many a hand-written handler does."""

    async def download_request(self, request):
        meta = {k: v for k, v in request.meta.items() if k != "proxy"}
        request = request.replace(meta=meta)
        request.headers.pop(b"Proxy-Authorization", None)
        return await super().download_request(request)


class HonestHandler(HTTP11DownloadHandler):
    """Uses meta['proxy'] (it only tags the response)."""

    async def download_request(self, request):
        response = await super().download_request(request)
        return response.replace(flags=[*response.flags, "honest"])
'''


def test_a_handler_that_ignores_meta_proxy_is_refused_at_start_and_a_declared_one_runs(stack):
    """Before: the custom handler sent 4/4 pages from 127.0.0.1, exit 0."""
    pages = [stack.url(n) for n in range(1, 5)]
    direct = "direct_handlers.DirectHandler"
    proc = crawl(stack, {"DOWNLOAD_HANDLERS": {"http": direct}}, pages,
                 extra_files={"direct_handlers.py": DIRECT_HANDLER})
    why = report(stack, proc)
    assert not stack.entries(), why  # nothing reached the site at all
    assert proc.returncode == 1, why
    lines = [line for line in proc.stderr.splitlines() if "proxy_shard: cannot start" in line]
    assert len(lines) == 1, why
    assert "DOWNLOAD_HANDLERS['http'] is 'direct_handlers.DirectHandler'" in lines[0], why
    assert "PROXY_SHARD_PROXY_AWARE_HANDLERS" in lines[0], why

    honest = "direct_handlers.HonestHandler"
    proc = crawl(stack, {"DOWNLOAD_HANDLERS": {"http": honest}, "PROXY_SHARD_PROXY_AWARE_HANDLERS": [honest]}, pages)
    why = report(stack, proc)
    assert proc.returncode == 0, why
    assert not stack.direct(), why
    assert len([e for e in stack.entries() if e.get("status") == 200]) == 4, why


SETDEFAULT_MIDDLEWARE = '''
class SetDefaultProxy:
    """A project middleware that writes meta.setdefault('proxy', None) before the plugin sees it."""

    def process_request(self, request, spider=None):
        request.meta.setdefault("proxy", None)
'''


@pytest.mark.parametrize("how", ["none", "empty", "setdefault"])
def test_a_falsy_meta_proxy_is_leased_not_sent_direct(stack, how):
    """Before: each of the 3 pages reached the site from 127.0.0.1 (counted proxy_shard/skipped), exit 0."""
    pages = [stack.url(n) for n in range(1, 4)]
    settings, meta = {}, {}
    if how == "setdefault":
        settings["DOWNLOADER_MIDDLEWARES"] = {"falsy_mw.SetDefaultProxy": 500}
    else:
        meta["proxy"] = None if how == "none" else ""
    proc = crawl(stack, settings, pages, meta=meta, extra_files={"falsy_mw.py": SETDEFAULT_MIDDLEWARE})
    why = report(stack, proc)
    assert not stack.direct(), why
    assert len([e for e in stack.entries() if e.get("status") == 200]) == 3, why
    assert all(i["proxy_id"] for i in items_of(stack)) and len(items_of(stack)) == 3, why
    assert proc.returncode == 0, why


def test_an_opt_out_without_a_proxy_is_refused_unless_direct_sends_are_allowed(stack):
    pages = [stack.url(n) for n in range(1, 3)]
    proc = crawl(stack, {}, pages, meta={"proxy_shard": False})
    why = report(stack, proc)
    assert not stack.entries(), why
    assert proc.stderr.count("PROXY_SHARD_ALLOW_DIRECT is False") >= 2, why

    proc = crawl(stack, {"PROXY_SHARD_ALLOW_DIRECT": True}, pages, meta={"proxy_shard": False})
    why = report(stack, proc)
    assert {e["ip"] for e in stack.entries()} == {"127.0.0.1"} and len(stack.entries()) == 2, why
    assert proc.stderr.count("goes out DIRECT") == 2, why
    assert "'proxy_shard/direct': 2" in proc.stderr, why
