"""scrapy-playwright pages through the shared pool, judged by the site's own log (issue 22).

Real software only: ``scrapy runspider`` processes with scrapy-playwright and Debian's chromium, the
local anti-bot site and real local forward proxies (the fixtures of test_handlers_end_to_end.py).
Skipped locally when scrapy-playwright or chromium is missing, a failure under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from scrapy_proxy_shard.demo.sitelog import summarize
from tests.test_handlers_end_to_end import (
    BASE_SETTINGS,
    CHROMIUM,
    ROOT,
    SITE,
    Stack,
    playwright_installed,  # noqa: F401 (a fixture)
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("playwright_installed")]

HANDLER = "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler"


def browser_settings() -> dict:
    return {
        "DOWNLOAD_HANDLERS": {"http": HANDLER, "https": HANDLER},
        "PLAYWRIGHT_BROWSER_TYPE": "chromium",
        "PLAYWRIGHT_LAUNCH_OPTIONS": {
            "executable_path": shutil.which("chromium") or CHROMIUM,
            # A request that escapes the proxy reaches the site from 127.0.0.1 instead of failing in DNS.
            "args": ["--no-sandbox", "--host-resolver-rules=MAP *.test 127.0.0.1",
                     "--disable-background-networking", "--disable-component-update", "--no-first-run"],
        },
        "PLAYWRIGHT_MAX_PAGES_PER_CONTEXT": 1,
    }


SPIDER = '''
import scrapy

SETTINGS = {settings}
REQUESTS = {requests}


class Browse(scrapy.Spider):
    name = "browse"
    custom_settings = SETTINGS

    async def start(self):
        for url, meta in REQUESTS:
            yield scrapy.Request(url, meta=dict(meta, playwright=True), callback=self.parse,
                                 errback=self.failed, dont_filter=True)

    async def parse(self, response):
        page = response.meta.get("playwright_page")
        if page is not None:
            await page.close()
        yield {{"url": response.url, "status": response.status, "session": response.meta.get("session_id"),
                "proxy_id": response.meta.get("proxy_shard_proxy_id"),
                "product": bool(response.css("div.product")), "flags": response.flags}}

    async def failed(self, failure):
        page = failure.request.meta.get("playwright_page")
        if page is not None:
            await page.close()
        self.logger.error("FAILED %s: %s", failure.request.url, failure.value)
'''


def run_spider(stack: Stack, settings: dict, requests: list[tuple[str, dict]], *, name: str = "browse",
               timeout: float = 120, wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run the browse spider in ``stack.workdir`` (items to ``<name>.jl``); ``wait=False``: a Popen."""
    merged = {**BASE_SETTINGS, "PROXY_SHARD_PROXIES": stack.proxy_urls, **browser_settings(), **settings}
    spider = stack.workdir / f"{name}_spider.py"
    spider.write_text(SPIDER.format(settings=repr(merged), requests=repr(requests)))
    items = stack.workdir / f"{name}.jl"
    items.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(stack.workdir)])}
    argv = [sys.executable, "-m", "scrapy", "runspider", str(spider), "-o", f"{items}:jsonl",
            "-s", "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver",
            "-s", "TWISTED_REACTOR=twisted.internet.asyncioreactor.AsyncioSelectorReactor"]
    if not wait:
        log = open(stack.workdir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(argv, cwd=stack.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(argv, cwd=stack.workdir, env=env, capture_output=True, text=True, timeout=timeout)
    (stack.workdir / f"{name}.log").write_text(proc.stderr)
    return proc


def items_of(stack: Stack, name: str = "browse") -> list[dict]:
    path = stack.workdir / f"{name}.jl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stat(text: str, key: str) -> int:
    """An integer stat from a crawl's final stats dump (0 when absent)."""
    marker = f"'{key}': "
    at = text.rfind(marker)
    if at < 0:
        return 0
    digits = ""
    for ch in text[at + len(marker):]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits or 0)


def report(stack: Stack, output: str, code: int | None = None) -> str:
    seen = [(e["ip"], e["path"], e.get("status"), e.get("kind")) for e in stack.entries()]
    return f"exit {code}; site saw {seen}\n--- output tail ---\n{output[-5000:]}"


@pytest.fixture
def burnt_stack(tmp_path):
    """Proxies 1-3 (127.0.0.11-.13) burnt on the site: each is served a ban, in turn a 403, a redirect
    to the captcha page (the browser follows it itself) and a 200 stub without the product."""
    s = Stack(tmp_path, ("--burnt", f"{SITE}=127.0.0.11+127.0.0.12+127.0.0.13", "--ban-styles", "403,captcha,stub"))
    try:
        yield s
    finally:
        s.stop()


def test_bans_in_browser_pages_quarantine_their_proxy_and_retry_elsewhere(burnt_stack):
    """A 403 page, a captcha reached through a redirect the browser followed, a stub page lacking the
    required CSS: each is judged a ban; its proxy is used no more; the page is fetched through the
    healthy proxy and only real product pages reach the spider."""
    stack = burnt_stack
    pages = [(stack.url(n), {}) for n in range(1, 7)]
    settings = {"PROXY_SHARD_REQUIRED_CSS": ["div.product"], "PROXY_SHARD_BAN_RETRIES": 6}
    proc = run_spider(stack, settings, pages)
    why = report(stack, proc.stderr, proc.returncode)
    assert proc.returncode == 0, why
    assert not stack.direct(), why
    items = items_of(stack)
    assert len(items) == 6 and all(i["product"] and i["status"] == 200 for i in items), why
    assert all("/captcha" not in i["url"] for i in items), why
    entries = stack.entries()
    bans = [e for e in entries if e.get("kind") in ("ban", "stub") or (e.get("kind"), e["status"]) == ("captcha", 302)]
    assert bans and {e["ip"] for e in bans} <= {"127.0.0.11", "127.0.0.12", "127.0.0.13"}, why
    # A 403 quarantines its proxy for long: no later page from that IP. (A captcha is a rate-type ban,
    # PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS: a brief rest, as for Scrapy's own downloads; a stub before
    # the check ever passed on the site is suspect, not a ban: crawl/content.py.)
    for ban in bans:
        if ban["kind"] == "ban":
            assert not [e for e in entries if e["ip"] == ban["ip"] and e["start"] > ban["start"]], why
    assert stat(proc.stderr, "proxy_shard/bans/reason/http_403") == sum(e["kind"] == "ban" for e in bans), why
    assert stat(proc.stderr, "proxy_shard/bans/reason/challenge_page") == sum(e["kind"] == "captcha" for e in bans), why
    # A stub before the check ever passed is suspect (released, no quarantine), after that a ban.
    assert stat(proc.stderr, "proxy_shard/bans/reason/missing_css") + stat(
        proc.stderr, "proxy_shard/content/suspect") == sum(e["kind"] == "stub" for e in bans), why
    assert summarize(entries).overlaps == 0, why
