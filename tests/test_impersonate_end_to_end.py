"""scrapy-impersonate (curl_cffi) through the shared pool, judged by the site's own log (issue 22, item 2).

Real software only: a Scrapy project run with ``scrapy crawl`` by 2 processes ("hosts") sharing one
real redis-server, scrapy-impersonate's download handler downloading every page with
``meta['impersonate']``, the local anti-bot site and real local forward proxies (2 of 4 with Basic
auth). Every proxy egresses from its own 127.0.0.x (x >= 11); a request that escapes the proxies
reaches the site from 127.0.0.1: the spider gives curl a ``RESOLVE`` entry for the site (as the
browser tests give Chromium ``--host-resolver-rules``), so a direct send shows up in the log instead
of dying in DNS.

Needs scrapy-impersonate (a test extra): skipped locally when it is missing, a failure under CI=true.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_browser_end_to_end import _stack_on_redis, report
from test_handlers_end_to_end import BASE_SETTINGS, ROOT, SITE, Stack, _on_ci

from scrapy_proxy_shard.demo.sitelog import summarize

pytestmark = pytest.mark.slow

HANDLER = "scrapy_impersonate.ImpersonateDownloadHandler"
BURNT = "127.0.0.11"  # the site answers this proxy's every page with a 403
HOSTS = 2
PAGES = 12


@pytest.fixture(scope="session")
def impersonate_installed() -> None:
    if importlib.util.find_spec("scrapy_impersonate") is None:
        message = "the scrapy-impersonate test needs scrapy-impersonate (pip install -e '.[test]')"
        if _on_ci():
            pytest.fail(f"CI=true requires it: {message}", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def stack(tmp_path, impersonate_installed):
    with _stack_on_redis(tmp_path, ("--burnt", f"{SITE}={BURNT}", "--ban-styles", "403"), proxies=4) as s:
        yield s


SCRAPY_CFG = """
[settings]
default = impproject.settings
"""

PROJECT_SETTINGS = """
BOT_NAME = "impproject"
SPIDER_MODULES = ["impproject.spiders"]
TWISTED_REACTOR = "twisted.internet.asyncioreactor.AsyncioSelectorReactor"
DOWNLOAD_HANDLERS = {{"http": {handler!r}, "https": {handler!r}}}
ADDONS = {{"scrapy_proxy_shard.addon.ProxyShardAddon": 0}}
PROXY_SHARD_MODE = "redis"
PROXY_SHARD_REDIS_URL = {redis_url!r}
PROXY_SHARD_NAMESPACE = "impersonate-e2e"
PROXY_SHARD_PROXIES = {proxies!r}
{extra}
"""

SPIDER = """
import scrapy

PAGES = {pages!r}
BASE = {base!r}
META = {meta!r}


class Probe(scrapy.Spider):
    name = "probe"

    async def start(self):
        for n in PAGES:
            meta = {{"impersonate": "chrome", **META,
                     # A send that escapes the proxy reaches the site from 127.0.0.1 (curl resolves the
                     # site's name itself; through a proxy the proxy resolves it and this is unused).
                     "impersonate_curl_options": {{**META.get("impersonate_curl_options", {{}}),
                                                  "RESOLVE": [{resolve!r}]}}}}
            yield scrapy.Request(f"{{BASE}}/catalog/{{n}}", meta=meta, callback=self.parse, errback=self.failed)

    def parse(self, response):
        yield {{"url": response.url, "status": response.status, "flags": response.flags,
                "proxy_id": response.meta.get("proxy_shard_proxy_id"),
                "product": bool(response.css("div.product"))}}

    def failed(self, failure):
        self.logger.error("FAILED %s: %s", failure.request.url, failure.value)
"""


def write_project(stack: Stack, *, meta: dict | None = None, extra: dict | None = None) -> Path:
    """A Scrapy project (scrapy.cfg, impproject/settings.py, impproject/spiders/probe.py) in the workdir."""
    root = stack.workdir / "project"
    package = root / "impproject"
    (package / "spiders").mkdir(parents=True, exist_ok=True)
    (root / "scrapy.cfg").write_text(SCRAPY_CFG)
    (package / "__init__.py").write_text("")
    (package / "spiders" / "__init__.py").write_text("")
    settings = {**BASE_SETTINGS, "PROXY_SHARD_MAX_WAIT": 60, **(extra or {})}
    for key in ("ADDONS", "PROXY_SHARD_MODE"):
        settings.pop(key)
    lines = "\n".join(f"{k} = {v!r}" for k, v in settings.items())
    (package / "settings.py").write_text(textwrap.dedent(PROJECT_SETTINGS).format(
        handler=HANDLER, redis_url=stack.redis_url, proxies=stack.proxy_urls, extra=lines))
    (package / "spiders" / "probe.py").write_text(textwrap.dedent(SPIDER).format(
        pages=list(range(1, PAGES + 1)), base=f"http://{SITE}:{stack.port}", meta=meta or {},
        resolve=f"{SITE}:{stack.port}:127.0.0.1"))
    return root


def run_hosts(stack: Stack, root: Path, hosts: int = HOSTS, env: dict | None = None) -> tuple[list[int], list[str]]:
    """``scrapy crawl probe`` in ``hosts`` processes at once; (exit codes, logs)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(root)]), **(env or {})}
    procs = []
    for host in range(hosts):
        log = open(stack.workdir / f"host{host}.log", "w")  # noqa: SIM115 (closed below)
        argv = [sys.executable, "-m", "scrapy", "crawl", "probe", "-o", f"{stack.workdir}/host{host}.jl:jsonl",
                "-s", f"PROXY_SHARD_HOST_ID=imp-{host}",
                "-s", "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver"]
        procs.append((subprocess.Popen(argv, cwd=root, env=environ, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=180))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return codes, [(stack.workdir / f"host{h}.log").read_text() for h in range(hosts)]


def items_of(stack: Stack, host: int) -> list[dict]:
    path = stack.workdir / f"host{host}.jl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_hosts_crawl_with_scrapy_impersonate_through_the_leased_proxies_only(stack):
    """2 ``scrapy crawl`` processes, one redis-server, 4 proxies (2 with Basic auth, one burnt): every
    page downloaded by curl_cffi (the response's 'impersonate' flag), the site saw no request from a
    non-proxy IP and no overlap per exit IP, and the burnt proxy's 403 quarantined it for both hosts."""
    root = write_project(stack)
    codes, logs = run_hosts(stack, root)
    entries = stack.entries()
    why = report(stack, "\n=====\n".join(log[-3000:] for log in logs), codes)
    assert codes == [0] * HOSTS, why
    assert entries and not stack.direct(), why
    assert summarize(entries).overlaps == 0, why
    burnt = [e for e in entries if e["ip"] == BURNT]
    assert len(burnt) == 1 and burnt[0]["status"] == 403, why
    assert sum(log.count("quarantine of proxy") for log in logs) == 1, why
    for host in range(HOSTS):
        items = items_of(stack, host)
        assert len(items) == PAGES and all(i["product"] and i["status"] == 200 for i in items), why
        assert all("impersonate" in i["flags"] and i["proxy_id"] for i in items), why
    # Both proxies with Basic auth carried pages (curl got the credentials, to the proxy only).
    healthy = {m["source_ip"] for m in stack.manifest} - {BURNT}
    assert {e["ip"] for e in entries if e["status"] == 200} == healthy, why
    for m in stack.manifest:
        if m["auth"]:
            secret = m["url"].split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
            assert all(secret not in log for log in logs), "a proxy password was logged"


def test_no_proxy_in_the_environment_does_not_send_impersonate_requests_direct(stack):
    """libcurl reads ``no_proxy`` itself, and curl_cffi (trust_env, scrapy-impersonate's default) lets it
    bypass a proxy passed explicitly. Before: with NO_PROXY=* every page reached the site from
    127.0.0.1, exit 0. The plugin sets curl's NOPROXY to "" on each leased impersonate request."""
    root = write_project(stack)
    codes, logs = run_hosts(stack, root, hosts=1, env={"NO_PROXY": "*", "no_proxy": "*"})
    why = report(stack, logs[0][-4000:], codes)
    assert stack.entries() and not stack.direct(), why
    assert codes == [0], why
    assert len([i for i in items_of(stack, 0) if i["product"]]) == PAGES, why


@pytest.mark.parametrize("meta", [
    {"impersonate_args": {"proxy": None}},
    {"impersonate_args": {"proxies": {"all": ""}}},
    {"impersonate_curl_options": {"NOPROXY": "*"}},
    {"impersonate_curl_options": {"proxy": ""}},
], ids=["args-proxy-none", "args-proxies", "curl-noproxy", "curl-proxy"])
def test_a_proxy_of_the_requests_own_for_curl_is_refused(stack, meta):
    """scrapy-impersonate applies ``impersonate_args`` and ``impersonate_curl_options`` after
    ``meta['proxy']``: a proxy (or no-proxy) of the request's own there would replace the leased one.
    Before: ``{'proxy': None}`` and ``NOPROXY`` sent the pages from 127.0.0.1."""
    root = write_project(stack, meta=meta)
    codes, logs = run_hosts(stack, root, hosts=1)
    why = report(stack, logs[0][-4000:], codes)
    assert not stack.entries(), why  # nothing reached the site at all
    assert logs[0].count("proxy_shard: dropped") + logs[0].count("not sent:") >= PAGES, why
    assert codes == [1], why
