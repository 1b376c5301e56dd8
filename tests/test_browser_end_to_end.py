"""scrapy-playwright pages through the shared pool, judged by the site's own log (issue 22).

Real software only: ``scrapy runspider`` processes with scrapy-playwright and Debian's chromium, the
local anti-bot site and real local forward proxies (the fixtures of test_handlers_end_to_end.py).
Skipped locally when scrapy-playwright or chromium is missing, a failure under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest
from test_handlers_end_to_end import (
    BASE_SETTINGS,
    CHROMIUM,
    ROOT,
    SITE,
    Stack,
    playwright_installed,  # noqa: F401 (a fixture)
)

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.sitelog import summarize

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
import asyncio

import scrapy

SETTINGS = {settings}
REQUESTS = {requests}
HOLD = {hold}


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
            if HOLD:  # the spider works with the page a while: a request of the page's own, later
                await asyncio.sleep(HOLD / 2)
                await page.evaluate("fetch('/catalog/20?xhr=1').then(r => r.status)")
                await asyncio.sleep(HOLD / 2)
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
               timeout: float = 120, wait: bool = True, hold: float = 0.0,
               ) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run the browse spider in ``stack.workdir`` (items to ``<name>.jl``); ``wait=False``: a Popen."""
    merged = {**BASE_SETTINGS, "PROXY_SHARD_PROXIES": stack.proxy_urls, **browser_settings(), **settings}
    spider = stack.workdir / f"{name}_spider.py"
    spider.write_text(SPIDER.format(settings=repr(merged), requests=repr(requests), hold=hold))
    items = stack.workdir / f"{name}.jl"
    items.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(stack.workdir)])}
    argv = [sys.executable, "-m", "scrapy", "runspider", str(spider), "-o", f"{items}:jsonl",
            "-s", "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver",
            "-s", "TWISTED_REACTOR=twisted.internet.asyncioreactor.AsyncioSelectorReactor"]
    if not wait:
        with open(stack.workdir / f"{name}.log", "w") as log:  # the child has its own copy
            return subprocess.Popen(argv, cwd=stack.workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
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
    # A 403 on an IP's first contact with the site (a hard block) quarantines its proxy for long: no
    # later page from that IP. The site serves its ban styles in turn, so the first burnt answer is such
    # a 403. (A captcha is a rate-type ban, PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS: a brief rest, as for
    # Scrapy's own downloads; a 403 right after that rest escalates it, docs/pacing.md "Quarantines fit
    # to the cause", so that IP may come back; a stub before the check ever passed on the site is
    # suspect, not a ban: crawl/content.py.)
    first_contact = [b for b in bans if b["kind"] == "ban"
                     and not [e for e in entries if e["ip"] == b["ip"] and e["start"] < b["start"]]]
    assert first_contact, why
    for ban in first_contact:
        assert not [e for e in entries if e["ip"] == ban["ip"] and e["start"] > ban["start"]], why
    assert stat(proc.stderr, "proxy_shard/bans/reason/http_403") == sum(e["kind"] == "ban" for e in bans), why
    assert stat(proc.stderr, "proxy_shard/bans/reason/challenge_page") == sum(e["kind"] == "captcha" for e in bans), why
    # A stub before the check ever passed is suspect (released, no quarantine), after that a ban.
    assert stat(proc.stderr, "proxy_shard/bans/reason/missing_css") + stat(
        proc.stderr, "proxy_shard/content/suspect") == sum(e["kind"] == "stub" for e in bans), why
    assert summarize(entries).overlaps == 0, why



@pytest.fixture
def two_proxies(tmp_path):
    s = Stack(tmp_path, proxies=2)
    try:
        yield s
    finally:
        s.stop()


def test_a_page_the_spider_holds_keeps_its_proxy_until_the_spider_closes_it(two_proxies):
    """playwright_include_page: the spider keeps each page 1.2 s and the page fetches a resource of its
    own meanwhile; the lease covers the page until it is closed, so no other page is sent through its
    proxy before (2 proxies, 4 pages, concurrency 4)."""
    stack = two_proxies
    pages = [(stack.url(n), {"playwright_include_page": True}) for n in range(1, 5)]
    proc = run_spider(stack, {}, pages, hold=1.2)
    why = report(stack, proc.stderr, proc.returncode)
    assert proc.returncode == 0, why
    entries = stack.entries()
    assert not stack.direct() and summarize(entries).overlaps == 0, why
    assert summarize(entries).violations == 0, why
    assert len([i for i in items_of(stack) if i["product"]]) == 4, why
    for ip in stack.egress:
        mine = sorted((e for e in entries if e["ip"] == ip), key=lambda e: e["start"])
        navigations = [k for k, e in enumerate(mine) if "xhr" not in e["path"]]
        # Between two pages through one proxy, the first page's own request: it was still held. And the
        # next page is paced from the held page's close (its release; the spider closes it HOLD / 2 after
        # the page's own request): it started at least the interval after the close.
        for a, b in itertools.pairwise(navigations):
            own = [e for e in mine[a + 1:b] if "xhr" in e["path"]]
            assert own, why
            assert mine[b]["start"] - own[-1]["start"] >= 1.2 / 2 + BASE_SETTINGS["PROXY_SHARD_MIN_INTERVAL"], why
    assert stat(proc.stderr, "proxy_shard/browser/pages_held") == 4, why
    assert stat(proc.stderr, "proxy_shard/browser/page_outlived_lease") == 0, why


@contextlib.contextmanager
def _stack_on_redis(tmp_path, site_args=(), *, proxies):
    """The site and ``proxies`` local proxies (``Stack``) with a redis-server of their own."""
    s = Stack(tmp_path, site_args, proxies=proxies)
    try:
        with RedisServer() as redis_server:
            s.redis_url = redis_server.url
            yield s
    finally:
        s.stop()


@pytest.fixture
def redis_stack(tmp_path):
    with _stack_on_redis(tmp_path, proxies=2) as s:
        yield s


def test_a_quarantine_set_elsewhere_closes_the_proxys_context_here(redis_stack):
    """A proxy quarantined in Redis by someone else (here the CLI's ban, as another host's release would)
    while this host holds its browser context: the context is closed at the next sweep (5 s), and the
    site sees no more page through that proxy."""
    import time

    import redis

    from scrapy_proxy_shard.engine.store import PoolStore

    stack = redis_stack
    pages = [(stack.url(n), {}) for n in range(1, 17)]
    settings = {"PROXY_SHARD_MODE": "redis", "PROXY_SHARD_REDIS_URL": stack.redis_url,
                "PROXY_SHARD_NAMESPACE": "sweep", "PROXY_SHARD_MIN_INTERVAL": 0.8, "CONCURRENT_REQUESTS": 2,
                "LOG_LEVEL": "DEBUG"}
    proc = run_spider(stack, settings, pages, wait=False)
    victim = next(m for m in stack.manifest if m["source_ip"] == "127.0.0.12")
    try:
        deadline = time.monotonic() + 60
        while not [e for e in stack.entries() if e["ip"] == victim["source_ip"]]:
            assert time.monotonic() < deadline and proc.poll() is None, report(stack, "", proc.poll())
            time.sleep(0.1)
        admin = PoolStore(redis.Redis.from_url(stack.redis_url, decode_responses=True), namespace="sweep")
        admin.ban("default", victim["url"], reason="manual", ttl=600)
        banned_at = time.time()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (stack.workdir / "browse.log").read_text()
    why = report(stack, output, code)
    assert code == 0, why
    entries = stack.entries()
    assert not stack.direct() and summarize(entries).overlaps == 0, why
    assert not [e for e in entries if e["ip"] == victim["source_ip"] and e["start"] > banned_at + 0.2], why
    assert len([i for i in items_of(stack) if i["product"]]) == 16, why
    assert stat(output, "proxy_shard/browser/retired/quarantined_elsewhere") == 1, why
    assert stat(output, "proxy_shard/browser/closed/retired") == 1, why
    assert "Browser context closed: 'proxy-shard:" in output, why


HOST_SPIDER = '''
import scrapy

SETTINGS = {settings}
BASE = {base!r}
PAGES = {pages!r}
FLOWS = {flows!r}
STEPS = {steps}


class Host(scrapy.Spider):
    name = "host"
    custom_settings = SETTINGS

    async def start(self):
        for flow in FLOWS:
            yield self.step_request(flow, 1)
        for n in PAGES:
            yield scrapy.Request(f"{{BASE}}/catalog/{{n}}", meta={{"playwright": True}}, callback=self.page,
                                 errback=self.failed)

    def step_request(self, flow, step):
        meta = {{"playwright": True, "session_id": flow, "proxy_shard_end_session": step == STEPS}}
        return scrapy.Request(f"{{BASE}}/flow/{{flow}}/step/{{step}}", meta=meta, callback=self.step,
                              cb_kwargs={{"flow": flow, "step": step}}, errback=self.failed, dont_filter=True)

    def page(self, response):
        yield {{"kind": "page", "url": response.url, "status": response.status,
                "product": bool(response.css("div.product")), "context": response.meta["playwright_context"]}}

    def step(self, response, flow, step):
        yield {{"kind": "step", "flow": flow, "step": step, "status": response.status,
                "ok": bool(response.css("div.flow-step")), "context": response.meta["playwright_context"]}}
        if step < STEPS:
            yield self.step_request(flow, step + 1)

    def failed(self, failure):
        self.logger.error("FAILED %s: %s", failure.request.url, failure.value)
'''

HOSTS = 3
BURNT = "127.0.0.11"  # the site answers this proxy's every page with a 403


@pytest.fixture
def shared_stack(tmp_path):
    with _stack_on_redis(tmp_path, ("--burnt", f"{SITE}={BURNT}", "--ban-styles", "403", "--flow-steps", "4"),
                         proxies=6) as s:
        yield s


def test_three_browser_hosts_share_one_pool_as_the_site_sees_it(shared_stack):
    """3 scrapy processes with scrapy-playwright + chromium, one redis-server, 6 proxies (one burnt):
    the site's log shows no request from a non-proxy IP, no overlap per exit IP, every session's steps
    from one IP (and in one browser context), and the burnt proxy's 403 banning it for every host."""
    stack = shared_stack
    base = f"http://{SITE}:{stack.port}"
    procs = []
    for host in range(HOSTS):
        settings = {**BASE_SETTINGS, **browser_settings(), "PROXY_SHARD_PROXIES": stack.proxy_urls,
                    "PROXY_SHARD_MODE": "redis", "PROXY_SHARD_REDIS_URL": stack.redis_url,
                    "PROXY_SHARD_HOST_ID": f"browser-{host}", "PROXY_SHARD_NAMESPACE": "browser-e2e",
                    "PLAYWRIGHT_MAX_CONTEXTS": 3, "PROXY_SHARD_MAX_WAIT": 90}
        spider = stack.workdir / f"host{host}_spider.py"
        spider.write_text(HOST_SPIDER.format(settings=repr(settings), base=base, pages=list(range(1, 13)),
                                             flows=[f"h{host}-cart{k}" for k in range(2)], steps=4))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(stack.workdir)])}
        log = open(stack.workdir / f"host{host}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "scrapy", "runspider", str(spider), "-o", f"{stack.workdir}/host{host}.jl:jsonl",
             "-s", "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver",
             "-s", "TWISTED_REACTOR=twisted.internet.asyncioreactor.AsyncioSelectorReactor"],
            cwd=stack.workdir, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=240))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = [(stack.workdir / f"host{h}.log").read_text() for h in range(HOSTS)]
    entries = stack.entries()
    why = report(stack, "\n=====\n".join(log[-2500:] for log in logs), codes)
    assert codes == [0] * HOSTS, why
    assert not stack.direct(), why
    assert summarize(entries).overlaps == 0, why
    # The burnt proxy's 403 quarantined it in Redis, for every host: the site saw it once.
    burnt = [e for e in entries if e["ip"] == BURNT]
    assert len(burnt) == 1 and burnt[0]["status"] == 403, why
    assert sum(log.count("quarantine of proxy") for log in logs) == 1, why
    # Sessions: each flow's 4 steps from one IP, in one context, done; the site saw no IP change.
    steps = [e for e in entries if e.get("flow_id")]
    assert not [e for e in steps if e.get("ip_changed")], why
    for host in range(HOSTS):
        items = [json.loads(line) for line in (stack.workdir / f"host{host}.jl").read_text().splitlines()]
        pages = [i for i in items if i["kind"] == "page"]
        assert len(pages) == 12 and all(i["product"] for i in pages), why
        for k in range(2):
            flow = f"h{host}-cart{k}"
            mine = [i for i in items if i["kind"] == "step" and i["flow"] == flow]
            assert [i["step"] for i in mine] == [1, 2, 3, 4] and all(i["ok"] for i in mine), why
            assert len({i["context"] for i in mine}) == 1, why
            assert ":s" in mine[0]["context"], why
            ips = {e["ip"] for e in steps if e["flow_id"] == flow and e["status"] == 200}
            assert len(ips) == 1, why
        # The bound held with the real browser: never more than 3 contexts at once.
        assert stat(logs[host], "playwright/context_count/max_concurrent") <= 3, why
        assert stat(logs[host], "proxy_shard/browser/retired/session_ended") == 2, why
    assert sum(stat(log, "proxy_shard/browser/closed/lru") for log in logs) >= 1, why
