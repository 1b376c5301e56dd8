"""Efficiency on software nobody here wrote: Debian's nginx and tinyproxy (issue 11 item 5).

    python benchmarks/bench_nginx.py [--pages 150] [--hosts 3] [--proxies 6] [--vhosts 3]
                                     [--interval 0.2] [--latency 0.05] [--margin 0.1] [--keep]

One stack (``scrapy_proxy_shard.demo.nginx_stack``): nginx serving a static catalog on ``--vhosts``
virtual hosts over HTTP and HTTPS, ``limit_req`` one request per (client IP, vhost) per ``--interval``
(burst=1 nodelay, 429 beyond), ``limit_conn`` 1 (503), ``--latency`` of service time per item page, and
one tinyproxy per proxy bound to its own 127.0.0.x. Every figure comes from nginx's access log over the
span from the run's first request start to its last request end. Configurations, one after another on
the same stack (1.5 s apart so nginx's buckets drain):

  plugin       ``--hosts`` ``scrapy crawl catalog`` processes (CONCURRENT_REQUESTS 16 each) sharing one
               pool in a real redis-server, PROXY_SHARD_MIN_INTERVAL = the site's interval (rule known)
  hand-paced   one aiohttp client, one worker per (proxy, vhost) pulling that vhost's URLs and spacing
               its request *starts* ``(1 + --margin) x interval`` apart: the practical ceiling of a
               client that knows the rule and owns every proxy (the issue's reference: 10% margin)

Ceiling = min(proxies x vhosts / interval, hosts x CONCURRENT_REQUESTS / latency) requests/s;
efficiency = status-200 responses per second / ceiling. Target: the plugin >= 0.78 of the ceiling, 0
overlaps per (IP, vhost), 429s + 503s <= 1% of requests; a miss prints MISS and exits 1.
scrapy-rotating-proxies is not run here (it is not a dependency; see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from scrapy_proxy_shard.demo.nginx_stack import LogSummary, NginxStack, binary_versions, run_catalog_crawl
from scrapy_proxy_shard.demo.redis_server import RedisServer

CONCURRENT_REQUESTS = 16
TARGET_EFFICIENCY = 0.78
MAX_BLOCKED = 0.01


def ceiling(args: argparse.Namespace) -> float:
    site = args.proxies * args.vhosts / args.interval
    scrapy = args.hosts * CONCURRENT_REQUESTS / args.latency if args.latency else float("inf")
    return min(site, scrapy)


async def hand_paced(stack: NginxStack, spacing: float) -> None:
    """One worker per (proxy, vhost); each takes its vhost's next URL and starts it no sooner than
    ``spacing`` after its own previous start (a request waits for the previous answer: one in flight)."""
    import aiohttp

    queues: dict[str, asyncio.Queue] = {v: asyncio.Queue() for v in stack.vhost_ips}
    for url in stack.index_urls() + stack.item_urls():
        queues[url.split("//", 1)[1].split(":", 1)[0]].put_nowait(url)
    failures = []

    async def worker(session: aiohttp.ClientSession, proxy: str, vhost: str) -> None:
        queue = queues[vhost]
        next_start = 0.0
        while True:
            try:
                url = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            delay = next_start - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            next_start = time.monotonic() + spacing
            async with session.get(url, proxy=proxy) as response:
                await response.read()
                if response.status != 200:
                    queue.put_nowait(url)  # blocked: someone tries it again, paced as ever
                    failures.append(response.status)

    connector = aiohttp.TCPConnector(ssl=False, limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session, p, v) for p in stack.proxy_urls for v in stack.vhost_ips))


def row(name: str, s: LogSummary, ceil: float) -> tuple[str, float]:
    eff = s.pages_per_second / ceil if ceil else 0.0
    gap = "n/a" if s.min_gap is None else f"{s.min_gap * 1000:.0f}"
    return (f"  {name:<12} {s.pages_per_second:8.1f} {eff:6.2f} {s.requests:6d} {s.rate_limited:5d} "
            f"{s.conn_limited:5d} {s.blocked_share:7.2%} {s.overlaps:5d} {s.violations:5d}/{s.pairs:<5d} {gap:>6} "
            f"{s.ok_pages:5d}/{len(s.missing_pages) + s.ok_pages}"), eff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=150, help="item pages per vhost (default 150)")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--proxies", type=int, default=6)
    parser.add_argument("--vhosts", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.2, help="the site's rule, s (nginx: 1/N or 60/N)")
    parser.add_argument("--latency", type=float, default=0.05, help="nginx service time per item page, s")
    parser.add_argument("--margin", type=float, default=0.10, help="hand-paced spacing above the rule")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
    ceil = ceiling(args)
    print(f"bench_nginx: {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{binary_versions()}, Python {platform.python_version()}")
    print(f"stack: {args.vhosts} vhosts x {args.pages} items (+ index) over HTTP and HTTPS, {args.proxies} "
          f"tinyproxies, rule 1 request per (IP, vhost) per {args.interval}s (burst 1 nodelay) and 1 in flight, "
          f"{args.latency * 1000:.0f} ms per item; ceiling min({args.proxies}x{args.vhosts}/{args.interval}, "
          f"{args.hosts}x{CONCURRENT_REQUESTS}/{args.latency}) = {ceil:.1f} requests/s")
    results: dict[str, tuple[LogSummary, float]] = {}
    with RedisServer() as server, NginxStack(vhosts=args.vhosts, proxies=args.proxies, pages=args.pages,
                                             interval=args.interval, latency=args.latency,
                                             workdir=workdir / "stack") as stack:
        since = time.time()
        asyncio.run(hand_paced(stack, args.interval * (1 + args.margin)))
        results["hand-paced"] = (stack.analyze(since=since), 0.0)
        time.sleep(1.5)
        run = run_catalog_crawl(stack, server.url, workdir / "plugin", hosts=args.hosts, timeout=300,
                                settings={"CONCURRENT_REQUESTS": str(CONCURRENT_REQUESTS), "LOG_LEVEL": "INFO"})
        results["plugin"] = (run.summary, run.duration)
        failed_hosts = [h.name for h in run.hosts if h.exit_code != 0]
    header = (f"  {'config':<12} {'pages/s':>8} {'eff':>6} {'reqs':>6} {'429':>5} {'503':>5} {'blocked':>7} "
              f"{'ovl':>5} {'viol/gaps':>11} {'minGap':>6} {'pages':>9}")
    print("\nFrom nginx's access log (viol: two starts of one (IP, vhost) closer than the interval - 10 ms;"
          " minGap in ms)")
    print(header)
    effs = {}
    for name, (summary, _) in results.items():
        line, effs[name] = row(name, summary, ceil)
        print(line)
    plugin = results["plugin"][0]
    print(f"\n  plugin / hand-paced: {effs['plugin'] / effs['hand-paced']:.2f}" if effs["hand-paced"] else "")
    print(f"  plugin crawl wall time {results['plugin'][1]:.1f}s (includes Scrapy start-up, not in pages/s)")
    misses = []
    if failed_hosts:
        misses.append(f"hosts failed: {failed_hosts}")
    if effs["plugin"] < TARGET_EFFICIENCY:
        misses.append(f"plugin efficiency {effs['plugin']:.2f} < {TARGET_EFFICIENCY}")
    if plugin.overlaps:
        misses.append(f"plugin overlaps {plugin.overlaps} > 0")
    if plugin.blocked_share > MAX_BLOCKED:
        misses.append(f"plugin blocked {plugin.blocked_share:.2%} > {MAX_BLOCKED:.0%}")
    if plugin.missing_pages or plugin.unproxied:
        misses.append(f"plugin missed {len(plugin.missing_pages)} pages, {len(plugin.unproxied)} unproxied requests")
    for miss in misses:
        print(f"MISS {miss}")
    if not misses:
        print(f"OK   plugin >= {TARGET_EFFICIENCY} of the ceiling, 0 overlaps, blocked <= {MAX_BLOCKED:.0%}")
    if args.keep:
        print(f"logs in {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
