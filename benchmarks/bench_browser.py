"""Browser benchmark: rendered pages/s through the shared pool vs scrapy-playwright with one fixed proxy.

    python benchmarks/bench_browser.py [--pages 40] [--interval 1.5] [--margin 0.3] [--proxies 6] [--rounds 1]
                                       [--variants pool,fixed,rr] [--keep]

Same machine, same run, same site: the demo's anti-bot site (1 request at a time and ``--interval``
seconds between request starts per IP, 5 s bans: the kind of per-IP rule that makes a site worth a
proxy pool), local forward proxies, scrapy-playwright 0.0.48 with Debian's chromium
(``/usr/bin/chromium``). Each variant crawls ``--pages`` catalog pages in one ``scrapy runspider``
process on a fresh site and fleet, pacing at the site's interval + ``--margin`` (0.3 s: with 0.05 s
the browser's own jitter between a lease and its request reaching the site, up to ~0.2 s on 2 loaded
CPUs, broke the rule 1-5 times in 40 pages in every variant; the pool now paces a page's slot from
its last answer, not its lease, and needs no margin for it: tests/test_browser_pacing.py, 0 gaps
under the interval; the margin is kept so the variants stay comparable):

  pool   the plugin (redis mode, a throwaway redis-server, ``--proxies`` proxies,
         PROXY_SHARD_MIN_INTERVAL), CONCURRENT_REQUESTS = the proxies: every browser request in the
         context of its leased proxy (crawl/contexts.py)
  fixed  what a scrapy-playwright user does without a pool: one proxy set on the default context
         (``PLAYWRIGHT_CONTEXTS = {'default': {'proxy': ...}}``), paced politely for the same rule
         (CONCURRENT_REQUESTS 1, DOWNLOAD_DELAY, no randomization)
  rr     (diagnostic) one host without the pool: a context per proxy, requests round-robin over
         them, a download slot per context with DOWNLOAD_DELAY: what the browser itself renders on
         this machine at that concurrency (the ceiling the pool can reach here)

Rendered pages/s = distinct status-200 product pages in the *site's* log / the span from the first
request's start to the last one's end. Bans and rule violations are read from the same log. The
variants alternate within each round (order reversed per round); the ratio is of the medians. With
a lax site (``--interval 0.2``) the browser's own CPU (about 0.3 s per page on 2 shared CPUs) is the
bound and the three variants render at about the same rate. Everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scrapy_proxy_shard.demo.redis_server import RedisServer  # noqa: E402
from scrapy_proxy_shard.demo.run import _spawn, _stop, _wait_file  # noqa: E402
from scrapy_proxy_shard.demo.sitelog import read_log, summarize  # noqa: E402

SITE = "shop-a.test"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HANDLER = "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler"

SPIDER = '''
import scrapy

SETTINGS = {settings}
URLS = {urls}


class Render(scrapy.Spider):
    name = "render"
    custom_settings = SETTINGS

    async def start(self):
        contexts = sorted(SETTINGS.get("PLAYWRIGHT_CONTEXTS") or {{}})
        for n, url in enumerate(URLS):
            meta = {{"playwright": True}}
            if len(contexts) > 1:  # rr: round-robin over one context per proxy, one download slot each
                meta.update(playwright_context=contexts[n % len(contexts)], download_slot=contexts[n % len(contexts)])
            yield scrapy.Request(url, meta=meta, callback=self.parse)

    def parse(self, response):
        yield {{"url": response.url, "product": bool(response.css("div.product"))}}
'''


def browser_settings() -> dict:
    return {
        "DOWNLOAD_HANDLERS": {"http": HANDLER, "https": HANDLER},
        "PLAYWRIGHT_BROWSER_TYPE": "chromium",
        "PLAYWRIGHT_LAUNCH_OPTIONS": {
            "executable_path": CHROMIUM,
            "args": ["--no-sandbox", "--host-resolver-rules=MAP *.test 127.0.0.1",
                     "--disable-background-networking", "--disable-component-update", "--no-first-run"],
        },
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "RETRY_ENABLED": False,
        "DOWNLOAD_TIMEOUT": 30,
        "LOG_LEVEL": "INFO",
    }


def variant_settings(name: str, proxies: list[str], redis_url: str, interval: float) -> dict:
    base = browser_settings()
    if name == "pool":
        return {**base, "ADDONS": {"scrapy_proxy_shard.addon.ProxyShardAddon": 0},
                "PROXY_SHARD_MODE": "redis", "PROXY_SHARD_REDIS_URL": redis_url,
                "PROXY_SHARD_NAMESPACE": f"bench-browser-{time.time_ns()}", "PROXY_SHARD_PROXIES": proxies,
                "PROXY_SHARD_MIN_INTERVAL": interval, "PROXY_SHARD_MAX_WAIT": 120,
                "CONCURRENT_REQUESTS": len(proxies)}
    if name == "rr":
        return {**base, "PLAYWRIGHT_CONTEXTS": {f"p{i}": {"proxy": {"server": url}} for i, url in enumerate(proxies)},
                "CONCURRENT_REQUESTS": len(proxies), "DOWNLOAD_DELAY": interval, "RANDOMIZE_DOWNLOAD_DELAY": False}
    return {**base, "PLAYWRIGHT_CONTEXTS": {"default": {"proxy": {"server": proxies[0]}}},
            "CONCURRENT_REQUESTS": 1, "DOWNLOAD_DELAY": interval, "RANDOMIZE_DOWNLOAD_DELAY": False}


def run_variant(name: str, args: argparse.Namespace, workdir: Path, redis_url: str) -> dict:
    work = workdir / f"{name}-{time.time_ns()}"
    work.mkdir()
    kids = []
    try:
        ready = work / "site.ready"
        kids.append(_spawn([sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--port", "0", "--log",
                            str(work / "site.log"), "--ready-file", str(ready), "--sites", SITE,
                            "--pages-per-site", str(args.pages), "--min-interval", str(args.interval)],
                           work / "site.out"))
        port = int(_wait_file(ready, kids[-1]).strip())
        ready = work / "proxies.ready"
        kids.append(_spawn([sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count",
                            str(args.proxies), "--site-port", str(port), "--proxy-file", str(work / "proxies.txt"),
                            "--ready-file", str(ready), "--auth", "0", "--dead", "0", "--slow", "0"],
                           work / "proxies.out"))
        proxies = [m["url"] for m in json.loads(_wait_file(ready, kids[-1]))["proxies"]]
        urls = [f"http://{SITE}:{port}/catalog/{n}" for n in range(1, args.pages + 1)]
        spider = work / "render_spider.py"
        settings = variant_settings(name, proxies, redis_url, args.interval + args.margin)
        spider.write_text(SPIDER.format(settings=repr(settings), urls=repr(urls)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(work)])}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "scrapy", "runspider", str(spider), "-o",
                               f"{work}/items.jl:jsonl", "-s",
                               "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver",
                               "-s", "TWISTED_REACTOR=twisted.internet.asyncioreactor.AsyncioSelectorReactor"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - started
        (work / "crawl.log").write_text(proc.stderr)
    finally:
        for kid in reversed(kids):
            _stop(kid)
    entries = read_log(work / "site.log")
    summary = summarize(entries)
    good = {e["path"] for e in entries if e.get("status") == 200 and e.get("kind") == "page"}
    span = max(e["end"] for e in entries) - min(e["start"] for e in entries) if entries else float("nan")
    return {"variant": name, "exit": proc.returncode, "pages": len(good), "span": span,
            "rate": len(good) / span if span else 0.0, "wall": wall, "bans": summary.bans_served,
            "violations": summary.violations, "overlaps": summary.overlaps, "workdir": str(work)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=40, help="catalog pages per crawl (default 40)")
    p.add_argument("--interval", type=float, default=1.5,
                   help="the site's minimum interval between request starts per IP, seconds (default 1.5; "
                        "the crawlers pace at it + --margin)")
    p.add_argument("--margin", type=float, default=0.3,
                   help="pacing margin over the site's interval, seconds (default 0.3: a browser's time from "
                        "the lease to its request reaching the site varies by up to ~0.2 s on a loaded machine)")
    p.add_argument("--proxies", type=int, default=6, help="proxies in the pool (default 6)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both variants (default 1)")
    p.add_argument("--variants", default="pool,fixed",
                   help="pool, fixed, and rr (diagnostic: one context per proxy round-robin, no pool)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print(f"chromium not found at {CHROMIUM} (apt-get install chromium)")
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="bench-browser-"))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        with RedisServer() as redis_server:
            for r in range(args.rounds):
                for name in (variants if r % 2 == 0 else variants[::-1]):
                    result = run_variant(name, args, workdir, redis_server.url)
                    results[name].append(result)
                    print(f"round {r + 1} {name:5s}: {result['pages']}/{args.pages} pages in {result['span']:.1f} s "
                          f"= {result['rate']:.2f} rendered pages/s (exit {result['exit']}, bans {result['bans']}, "
                          f"violations {result['violations']}, overlaps {result['overlaps']}, "
                          f"wall {result['wall']:.1f} s)", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    rate = {v: statistics.median(r["rate"] for r in rs) for v, rs in results.items()}
    load = os.getloadavg()
    if "pool" in rate and "fixed" in rate:
        print(f"rendered pages/s: pool ({args.proxies} proxies) {rate['pool']:.2f}, one fixed proxy "
              f"{rate['fixed']:.2f}, ratio {rate['pool'] / rate['fixed']:.2f}x  [{args.pages} pages, chromium, "
              f"load {load[0]:.1f}, {os.cpu_count()} CPUs]")
    if "rr" in rate:
        print(f"rendered pages/s: round-robin contexts, no pool ({args.proxies} proxies, one host) {rate['rr']:.2f}")
    failed = [r for rs in results.values() for r in rs if r["exit"] != 0 or r["pages"] != args.pages]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
