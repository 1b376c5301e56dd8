"""Crawl benchmark: middleware overhead against a fast site, and pool efficiency against a strict one.

    python benchmarks/bench_crawl.py [--quick] [--at-commit REV] [--repeat N] [--repeat-b N] [--keep]

Everything runs on this machine and talks only to 127.0.0.x: one run starts throwaway
redis-servers (``RedisServer``), the local anti-bot site and the local forward proxies
(``python -m scrapy_proxy_shard.demo.site`` / ``.forward_proxy``) as subprocesses, runs every crawl
as a fresh ``python benchmarks/bench_crawl.py --crawl CONFIG`` subprocess (a fresh reactor each
time; the spider, the baseline middleware and the timing extension are defined in this file), and
stops every process it started before it exits, on error too.

(a) Overhead. One Scrapy process fetches ``--pages-a`` catalog pages spread over 3 sites of a
    permissive site (latency 0, max concurrency 1000, no min interval, compressed bodies as the
    site does by default) through 8 healthy local forward proxies, CONCURRENT_REQUESTS 32, with:
    ``direct`` (no proxy, for context), ``baseline`` (a tiny downloader middleware of this file
    assigning proxies round-robin) and ``ours`` (ProxyShardMiddleware + BanDetectionMiddleware via
    the add-on, a real redis-server, PROXY_SHARD_MIN_INTERVAL 0, PROXY_SHARD_SITE_CONCURRENCY 16).
    pages/s = items / seconds from the first scheduled request to the last scraped item, measured
    inside the crawl. Variants alternate within each round (order rotated per round); medians.
    Target: ours >= 0.85 x baseline.

(b) Efficiency. The strict anti-bot site (its defaults: latency 0.05 s, 1 request at a time and
    0.2 s between request starts per IP and site, 5 s bans extended by every violation), 3 sites,
    ``--healthy`` proxies of which ``--burnt`` per site are already blacklisted by that site, one
    dead proxy, and ``--hosts`` Scrapy processes (CONCURRENT_REQUESTS 16) crawling disjoint shards
    of ``--pages-b`` pages per site (sites interleaved in start order; the hosts start crawling
    together once all have started up). Variants:
      ours        the rule known: both middlewares, real Redis, PROXY_SHARD_MIN_INTERVAL ``--interval``
                  (start-to-start; default the site's own rule, 0.2 s, which the site enforces with zero
                  tolerance: the arrival guard, on by default, keeps path jitter from breaking it)
      baseline    each process picks a random proxy per request, no coordination, Scrapy's default retry
      ours-hz100  diagnostic: ours with redis-server ``--hz 100`` (a setting)
      ours-br     context: ours with Scrapy's own Accept-Encoding, so the site compresses with brotli
                  (quality 11, ~2.5 ms CPU per page, on the same 2 CPUs as the crawlers)
      adaptive    the rule unknown: ours with PROXY_SHARD_AUTOTHROTTLE_ENABLED and no interval (the learned
                  interval starts at the default 1 s), the demo's ban disguises named as rate-type, and
                  ``--pages-adaptive`` pages per site so the crawl runs past 60 s. It prints the learned
                  interval of each site every 5 s (the trace, from the crawls' release signals). Targets:
                  efficiency >= 0.65, blocked answers <= 2% of requests, the learned interval in force
                  after 60 s within 25% of the site's rule (the largest value seen after 60 s is judged).
    The crawlers send ``Accept-Encoding: gzip, deflate`` (``--accept-encoding``) so that the local
    site's own CPU stays out of the crawlers' cycle as far as possible; ours-br shows what it costs.
    Efficiency = distinct status-200 catalog pages per second (from the site's own log, over the span
    from first request start to last request end) / the ceiling:
    min(site bound = live non-burnt proxies summed over sites / max(min_interval, latency),
        Scrapy bound = hosts x CONCURRENT_REQUESTS / latency). Target: ours >= 0.78. The ours
    variants also trace every lease and release (through the public ``lease_acquired`` /
    ``lease_released`` signals of ``scrapy_proxy_shard.signals``) and join them with the site's log
    to split each cycle of a (proxy, site) slot into parts.

Each missed target prints ``MISS`` and makes the run exit with status 1 (0 when every target is met).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import scrapy
from scrapy import signals

REPO = Path(__file__).resolve().parents[1]
SITES = ("shop-a.test", "shop-b.test", "market.test")
OVERHEAD_TARGET = 0.85  # ours pages/s / baseline pages/s
EFFICIENCY_TARGET = 0.78  # ours OK pages/s / ceiling (issue 11: the rule known)
FIRST_IP = "127.0.0.11"
CATALOG_CSS = ["div.product", "span.price"]


# =================================================================================================
# Crawl side: runs inside the `--crawl CONFIG` subprocess
# =================================================================================================

class ProxyListMiddleware:
    """Baseline: set ``meta['proxy']`` from a fixed list, round-robin or at random; no coordination."""

    def __init__(self, proxies: list[str], choice: str, seed: int) -> None:
        if not proxies:
            raise ValueError("BENCH_PROXIES is empty")
        self.proxies = proxies
        self.choice = choice
        self._cycle = itertools.cycle(proxies)
        self._rng = random.Random(seed)

    @classmethod
    def from_crawler(cls, crawler: Any) -> ProxyListMiddleware:
        s = crawler.settings
        return cls(list(s.getlist("BENCH_PROXIES")), s.get("BENCH_PROXY_CHOICE", "roundrobin"),
                   s.getint("BENCH_SEED", 0))

    def process_request(self, request: scrapy.Request, spider: Any = None) -> None:
        if self.choice == "random":
            request.meta["proxy"] = self._rng.choice(self.proxies)
        else:
            request.meta["proxy"] = next(self._cycle)
        return None


class BenchRecorder:
    """Times the crawl from inside: first scheduled request -> last scraped item, wall and CPU."""

    def __init__(self, crawler: Any, path: str) -> None:
        self.crawler = crawler
        self.path = path
        self.items = 0
        self.trace: list[list[Any]] = []
        self.t0 = self.t1 = self.cpu0 = self.cpu1 = None

    @classmethod
    def from_crawler(cls, crawler: Any) -> BenchRecorder:
        ext = cls(crawler, crawler.settings.get("BENCH_RESULT_FILE"))
        crawler.signals.connect(ext.request_scheduled, signal=signals.request_scheduled)
        crawler.signals.connect(ext.item_scraped, signal=signals.item_scraped)
        crawler.signals.connect(ext.spider_closed, signal=signals.spider_closed)
        if crawler.settings.get("BENCH_TRACE_FILE"):
            from scrapy_proxy_shard import signals as shard_signals

            crawler.signals.connect(ext.response_downloaded, signal=signals.response_downloaded)
            crawler.signals.connect(ext.lease_acquired, signal=shard_signals.lease_acquired)
            crawler.signals.connect(ext.lease_released, signal=shard_signals.lease_released)
            crawler.signals.connect(ext.request_reached_downloader, signal=signals.request_reached_downloader)
        return ext

    def request_reached_downloader(self, request: Any, spider: Any = None) -> None:
        """Diagnostics for (b): when the leased request entered Scrapy's downloader (local clock)."""
        self.trace.append(["reach", request.url, time.time()])

    def response_downloaded(self, response: Any, request: Any, spider: Any = None) -> None:
        self.trace.append(["resp", request.url, time.time()])

    def lease_acquired(self, request: Any, lease: Any, waited: float) -> None:
        """Diagnostics for (b): when each request got its proxy, on the Redis clock."""
        self.trace.append(["lease", request.url, lease.proxy_id, lease.issued_at])

    def lease_released(self, request: Any, lease: Any, outcome: str, reason: Any, result: Any) -> None:
        """Diagnostics for (b): when each lease went back, on the Redis clock."""
        self.trace.append(["release", request.url, outcome, result.now, getattr(result, "interval", None)])

    def request_scheduled(self, request: Any, spider: Any = None) -> None:
        if self.t0 is None:
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def item_scraped(self, item: Any, response: Any = None, spider: Any = None) -> None:
        self.items += 1
        self.t1, self.cpu1 = time.perf_counter(), time.process_time()

    def spider_closed(self, spider: Any, reason: str) -> None:
        raw = self.crawler.stats.get_stats()
        stats = {k: v for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        elapsed = (self.t1 - self.t0) if self.items and self.t0 is not None else 0.0
        cpu = (self.cpu1 - self.cpu0) if self.items and self.cpu0 is not None else 0.0
        result = {"items": self.items, "elapsed": elapsed, "cpu": cpu, "reason": reason, "stats": stats}
        Path(self.path).write_text(json.dumps(result, indent=1, sort_keys=True), encoding="utf-8")
        trace = self.crawler.settings.get("BENCH_TRACE_FILE")
        if trace:
            Path(trace).write_text("".join(json.dumps(e) + "\n" for e in self.trace), encoding="utf-8")


class BenchSpider(scrapy.Spider):
    """Catalog pages of several sites, sites interleaved (A1 B1 C1 A2 ...) so every site stays busy."""

    name = "bench"

    def __init__(self, sites: str = ",".join(SITES), pages: int = 30, shard: int = 0, shards: int = 1,
                 direct_base: str = "", required_css: str = "", ready_file: str = "", go_file: str = "",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ready_file, self.go_file = ready_file, go_file
        self.sites = [s for s in str(sites).split(",") if s]
        self.pages, self.shard, self.shards = int(pages), int(shard), int(shards)
        self.direct_base = direct_base
        if required_css:
            self.proxy_shard_required_css = [c for c in required_css.split("|") if c]

    async def start(self):
        if self.go_file:  # several hosts: start crawling together, once every one has started up
            import asyncio

            Path(self.ready_file).write_text("ready\n", encoding="utf-8")
            deadline = time.monotonic() + 60
            while not Path(self.go_file).exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        for n in range(1, self.pages + 1):
            if n % self.shards != self.shard:
                continue
            for site in self.sites:
                if self.direct_base:  # no proxy: the site picks the virtual host from the Host header
                    yield scrapy.Request(f"{self.direct_base}/catalog/{n}", headers={"Host": site},
                                         callback=self.parse, errback=self.failed, dont_filter=True)
                else:
                    yield scrapy.Request(f"http://{site}/catalog/{n}", callback=self.parse, errback=self.failed,
                                         dont_filter=True)

    def parse(self, response: Any):
        yield {"url": response.url, "status": response.status, "size": len(response.body)}

    def failed(self, failure: Any) -> None:
        self.crawler.stats.inc_value(f"bench/failed/{type(failure.value).__name__}")


COMMON_SETTINGS: dict[str, Any] = {
    "ROBOTSTXT_OBEY": False,
    "COOKIES_ENABLED": False,
    "TELNETCONSOLE_ENABLED": False,
    "REMOTE_CONTROL_ENABLED": False,  # Scrapy 2.19's per-crawl HTTP control server: not needed here
    "DOWNLOAD_DELAY": 0,
    "DOWNLOAD_TIMEOUT": 10,
    "LOG_LEVEL": "INFO",
    "LOGSTATS_INTERVAL": 0,
}


def crawl_child(config_path: str) -> int:
    """Run one crawl as described by a JSON config (the orchestrator writes it)."""
    from scrapy.crawler import CrawlerProcess

    cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
    settings = {**COMMON_SETTINGS, **cfg["settings"], "EXTENSIONS": {BenchRecorder: 0}}
    if cfg["mode"] in ("roundrobin", "random"):
        settings["DOWNLOADER_MIDDLEWARES"] = {ProxyListMiddleware: 610}
        settings["BENCH_PROXY_CHOICE"] = cfg["mode"]
    elif cfg["mode"] == "ours":
        settings["ADDONS"] = {"scrapy_proxy_shard.addon.ProxyShardAddon": 0}
    process = CrawlerProcess(settings)
    process.crawl(BenchSpider, **cfg["spider"])
    if cfg.get("profile"):
        import cProfile

        cProfile.runctx("process.start()", globals(), {"process": process}, cfg["profile"])
    else:
        process.start()
    return 0


# =================================================================================================
# Orchestrator side
# =================================================================================================

class Kids:
    """Every subprocess this run started; stop_all() ends them by PID (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.servers: list[Any] = []

    def spawn(self, cmd: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(out, "wb") as handle:
            proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def redis(self, hz: int | None = None) -> Any:
        from scrapy_proxy_shard.demo.redis_server import RedisServer

        server = RedisServer(extra_args=("--hz", str(hz)) if hz else ())
        self.servers.append(server)
        return server.start()

    @staticmethod
    def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10)

    def stop_server(self, server: Any) -> None:
        server.stop()
        if server in self.servers:
            self.servers.remove(server)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()


def wait_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args} not ready within {timeout}s")


def start_site(kids: Kids, workdir: Path, *, pages: int, latency: float, max_concurrency: int,
               min_interval: float, ban_seconds: float = 5.0, burnt: dict[str, list[str]] | None = None,
               log: Path | None = None) -> tuple[subprocess.Popen, int]:
    ready = workdir / "site.ready"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--host", "127.0.0.1", "--port", "0",
           "--ready-file", str(ready), "--sites", ",".join(SITES), "--pages-per-site", str(pages),
           "--latency", str(latency), "--max-concurrency", str(max_concurrency),
           "--min-interval", str(min_interval), "--ban-seconds", str(ban_seconds)]
    if burnt:
        cmd += ["--burnt", ";".join(f"{site}={'+'.join(ips)}" for site, ips in burnt.items() if ips)]
    if log is not None:
        cmd += ["--log", str(log)]
    proc = kids.spawn(cmd, workdir / "site.out")
    return proc, int(wait_file(ready, proc).strip())


def start_fleet(kids: Kids, workdir: Path, site_port: int, *, count: int, auth: int = 0,
                dead: int = 0) -> tuple[subprocess.Popen, list[dict]]:
    ready = workdir / "proxies.ready"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count", str(count),
           "--site-port", str(site_port), "--site-host", "127.0.0.1", "--first-ip", FIRST_IP,
           "--proxy-file", str(workdir / "proxies.txt"), "--ready-file", str(ready),
           "--auth", str(auth), "--dead", str(dead), "--slow", "0"]
    proc = kids.spawn(cmd, workdir / "proxies.out")
    return proc, json.loads(wait_file(ready, proc))["proxies"]


def load_pool(redis_url: str, namespace: str, urls: list[str]) -> None:
    import redis

    from scrapy_proxy_shard.engine.store import PoolStore

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        PoolStore(client, namespace=namespace, host_id="bench-loader").add_proxies("default", urls)
    finally:
        client.close()


def launch_crawl(kids: Kids, workdir: Path, name: str, mode: str, settings: dict, spider: dict, *,
                 trace: bool = False, profile: bool = False) -> dict:
    result = workdir / f"{name}.result.json"
    config = workdir / f"{name}.config.json"
    settings = {**settings, "BENCH_RESULT_FILE": str(result), "LOG_FILE": str(workdir / f"{name}.log")}
    if trace:
        settings["BENCH_TRACE_FILE"] = str(workdir / f"{name}.trace.jsonl")
    config.write_text(json.dumps({"mode": mode, "settings": settings, "spider": spider,
                                  "profile": str(workdir / f"{name}.prof") if profile else None}, indent=1))
    proc = kids.spawn([sys.executable, str(Path(__file__).resolve()), "--crawl", str(config)],
                      workdir / f"{name}.out")
    return {"name": name, "proc": proc, "result": result, "started": time.monotonic(),
            "trace": settings.get("BENCH_TRACE_FILE")}


def finish_crawl(kids: Kids, run: dict, timeout: float) -> dict:
    proc = run["proc"]
    try:
        proc.wait(timeout=max(0.1, run["started"] + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        kids.stop(proc)
    with contextlib.suppress(ValueError):
        kids.procs.remove(proc)
    wall = time.monotonic() - run["started"]
    out = {"exit": proc.returncode, "wall": wall, "items": 0, "elapsed": 0.0, "cpu": 0.0, "stats": {}, "trace": []}
    if run["result"].exists():
        out.update(json.loads(run["result"].read_text()))
    if run["trace"] and Path(run["trace"]).exists():
        out["trace"] = [json.loads(line) for line in Path(run["trace"]).read_text().splitlines() if line]
    return out


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) a live process has used so far, from /proc (0 if unknown)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# --- (a) overhead -----------------------------------------------------------------------------------

def bench_overhead(args: argparse.Namespace, kids: Kids, workdir: Path) -> dict:
    wd = workdir / "overhead"
    wd.mkdir()
    per_site = max(1, args.pages_a // len(SITES))
    total = per_site * len(SITES)
    server = kids.redis()
    site, port = start_site(kids, wd, pages=per_site, latency=0.0, max_concurrency=1000, min_interval=0.0)
    fleet, manifest = start_fleet(kids, wd, port, count=args.proxies_a)
    urls = [m["url"] for m in manifest]
    base_settings = {"CONCURRENT_REQUESTS": args.concurrency_a, "CONCURRENT_REQUESTS_PER_DOMAIN": args.concurrency_a}
    variants = ["direct", "baseline", "ours"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    rounds = args.repeat + (1 if args.warmup else 0)
    print(f"(a) overhead: {total} pages over {len(SITES)} sites per crawl, {len(urls)} proxies, "
          f"CONCURRENT_REQUESTS {args.concurrency_a}, {args.repeat} rounds"
          + (" after 1 warm-up round" if args.warmup else ""), flush=True)
    try:
        for r in range(rounds):
            warm = args.warmup and r == 0
            order = variants[r % 3:] + variants[:r % 3]
            for variant in order:
                name = f"a{r}-{variant}"
                spider = {"sites": ",".join(SITES), "pages": per_site}
                settings = dict(base_settings)
                mode = {"direct": "direct", "baseline": "roundrobin", "ours": "ours"}[variant]
                if variant == "direct":
                    spider["direct_base"] = f"http://127.0.0.1:{port}"
                elif variant == "baseline":
                    settings["BENCH_PROXIES"] = urls
                else:
                    ns = f"bencha{r}"
                    load_pool(server.url, ns, urls)
                    settings.update({
                        "PROXY_SHARD_REDIS_URL": server.url, "PROXY_SHARD_NAMESPACE": ns,
                        "PROXY_SHARD_MIN_INTERVAL": 0, "PROXY_SHARD_SITE_CONCURRENCY": args.site_concurrency_a,
                        "PROXY_SHARD_HOST_ID": f"bench-a{r}",
                    })
                cpu_before = {k: proc_cpu(p) for k, p in
                              (("site", site.pid), ("proxies", fleet.pid), ("redis", server.pid))}
                run = launch_crawl(kids, wd, name, mode, settings, spider, profile=args.profile_a)
                res = finish_crawl(kids, run, args.timeout_a)
                for k, p in (("site", site.pid), ("proxies", fleet.pid), ("redis", server.pid)):
                    res[f"cpu_{k}"] = proc_cpu(p) - cpu_before[k]
                res["rate"] = res["items"] / res["elapsed"] if res["elapsed"] > 0 else 0.0
                res["complete"] = res["items"] == total and res["exit"] == 0
                res["round"] = r
                tag = "warm-up" if warm else f"round {r + 1 - (1 if args.warmup else 0)}"
                print(f"  {tag:8s} {variant:8s} {res['items']:5d}/{total} items in {res['elapsed']:6.2f}s = "
                      f"{res['rate']:7.1f} pages/s  (scrapy CPU {1000 * res['cpu'] / max(1, res['items']):.2f} "
                      f"ms/page, exit {res['exit']})", flush=True)
                if not warm:
                    runs[variant].append(res)
    finally:  # (anything left running is also stopped by Kids.stop_all at exit)
        kids.stop(fleet)
        kids.stop(site)
        kids.stop_server(server)
    return {"total": total, "runs": runs, "proxies": len(urls)}


def report_overhead(a: dict) -> list[str]:
    runs = a["runs"]
    lines = ["", "(a) Middleware overhead: one Scrapy process, fast site (latency 0, no limits), "
             f"{a['total']} pages / crawl, {a['proxies']} local proxies",
             f"  {'variant':10s} {'pages/s per run':30s} {'median':>8s} {'vs base':>8s} "
             f"{'scrapy':>8s} {'site':>7s} {'proxies':>8s} {'redis':>7s}  (CPU ms/page, medians)"]
    base = median([r["rate"] for r in runs["baseline"]])
    for variant in ("direct", "baseline", "ours"):
        rs = runs[variant]
        rates = [r["rate"] for r in rs]
        med = median(rates)

        def cpu(key: str, rs: list[dict] = rs) -> float:
            return median([1000 * r[key] / max(1, r["items"]) for r in rs])

        lines.append(f"  {variant:10s} {' '.join(f'{x:7.1f}' for x in rates):30s} {med:8.1f} "
                     f"{(med / base if base else 0):8.3f} {cpu('cpu'):8.2f} {cpu('cpu_site'):7.2f} "
                     f"{cpu('cpu_proxies'):8.2f} {cpu('cpu_redis'):7.2f}")
    ours = median([r["rate"] for r in runs["ours"]])
    ratio = ours / base if base else 0.0
    paired = [o["rate"] / b["rate"] for o, b in zip(runs["ours"], runs["baseline"], strict=False) if b["rate"]]
    incomplete = [f"{v} round {r['round']}" for v in runs for r in runs[v] if not r["complete"]]
    lines.append(f"  ours / baseline = {ratio:.3f} (median of per-round ratios {median(paired):.3f}; "
                 f"target >= {OVERHEAD_TARGET}) {verdict(ratio >= OVERHEAD_TARGET)}")

    def cpu_per_page(variant: str) -> float:
        return median([r["cpu"] / max(1, r["items"]) for r in runs[variant]])

    base_cpu, ours_cpu = cpu_per_page("baseline"), cpu_per_page("ours")
    redis_cpu = median([r["cpu_redis"] / max(1, r["items"]) for r in runs["ours"]])
    lines.append(f"  Scrapy CPU per page: ours / baseline = {ours_cpu / base_cpu if base_cpu else 0:.3f} "
                 f"(+{1000 * (ours_cpu - base_cpu):.2f} ms/page in the crawl process, +{1000 * redis_cpu:.2f} ms/page "
                 "in redis-server); the 2 CPUs are shared by crawl, site and proxies, so pages/s moves less")
    if incomplete:
        lines.append(f"  WARNING: incomplete crawls: {', '.join(incomplete)}")
    a["ratio"] = ratio
    return lines


# --- (b) efficiency -----------------------------------------------------------------------------------

def burnt_plan(healthy_ips: list[str], per_site: int) -> dict[str, list[str]]:
    """Per site, ``per_site`` consecutive healthy IPs (a different window per site) already blacklisted."""
    plan = {}
    for i, site in enumerate(SITES):
        plan[site] = [healthy_ips[(i * per_site + k) % len(healthy_ips)] for k in range(per_site)]
    return plan


VARIANTS_B = {
    # name: (crawl mode, redis-server hz, Scrapy's own Accept-Encoding)
    "ours": ("ours", None, False),
    "baseline": ("random", None, False),
    "ours-hz100": ("ours", 100, False),  # diagnostic: a setting (redis.conf hz 100)
    "ours-br": ("ours", None, True),  # context: brotli bodies, the site's CPU competes with the crawl
    "adaptive": ("ours", None, False),  # rule unknown: adaptive pacing on, no interval given
}
#: Targets of the adaptive variant (issue 11): efficiency, blocked answers / requests, and the learned
#: interval within 25% of the site's rule once 60 s have passed.
ADAPTIVE_EFFICIENCY_TARGET = 0.65
ADAPTIVE_BLOCKED_TARGET = 0.02
ADAPTIVE_INTERVAL_TOLERANCE = 0.25
ADAPTIVE_AFTER = 60.0
#: What the adaptive variant is told about the demo site: its ban disguises (the crawl's
#: proxy_shard/bans/reason/* stats show them) are rate bans, except on its burnt IPs; never its rule.
ADAPTIVE_BAN_REASONS = ["http_429", "http_503", "http_403", "challenge_redirect", "challenge_page", "missing_css"]


def run_scenario(args: argparse.Namespace, kids: Kids, workdir: Path, variant: str, r: int) -> dict:
    from scrapy_proxy_shard.demo.sitelog import read_log, summarize

    mode, hz, scrapy_encoding = VARIANTS_B[variant]
    pages = args.pages_adaptive if variant == "adaptive" else args.pages_b
    wd = workdir / f"b{r}-{variant}"
    wd.mkdir()
    site_log = wd / "site.log"
    site = fleet = server = None
    held = 0
    try:
        site, port = start_site(kids, wd, pages=pages, latency=args.latency, max_concurrency=1,
                                min_interval=args.site_interval, ban_seconds=5.0, log=site_log,
                                burnt=args.burnt_map)
        fleet, manifest = start_fleet(kids, wd, port, count=args.healthy + 1, auth=2, dead=1)
        urls = [m["url"] for m in manifest]
        settings: dict[str, Any] = {"CONCURRENT_REQUESTS": args.concurrency_b}
        if args.accept_encoding and not scrapy_encoding:
            settings["DEFAULT_REQUEST_HEADERS"] = {"Accept": "text/html,application/xhtml+xml;q=0.9,*/*;q=0.8",
                                                   "Accept-Language": "en", "Accept-Encoding": args.accept_encoding}
        if mode == "random":
            settings["BENCH_PROXIES"] = urls
        else:
            server = kids.redis(hz=hz)
            load_pool(server.url, "benchb", urls)
            settings.update({
                "PROXY_SHARD_REDIS_URL": server.url, "PROXY_SHARD_NAMESPACE": "benchb",
                "PROXY_SHARD_MIN_INTERVAL": args.interval, "PROXY_SHARD_SITE_CONCURRENCY": 1,
                "PROXY_SHARD_BAN_TTL": 120, "PROXY_SHARD_DEAD_TTL": 120, "PROXY_SHARD_BAN_RETRIES": 6,
                "PROXY_SHARD_MAX_WAIT": 60,
            })
            if variant == "adaptive":  # no interval given: learned from the default start (1 s)
                del settings["PROXY_SHARD_MIN_INTERVAL"]
                settings.update({"PROXY_SHARD_AUTOTHROTTLE_ENABLED": True,
                                 "PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS": ADAPTIVE_BAN_REASONS})
        crawls = []
        for h in range(args.hosts):
            s = {**settings, "BENCH_SEED": 1000 * r + h, "PROXY_SHARD_HOST_ID": f"host-{h}"}
            spider = {"sites": ",".join(SITES), "pages": pages, "shard": h, "shards": args.hosts,
                      "required_css": "|".join(CATALOG_CSS), "ready_file": str(wd / f"host-{h}.ready"),
                      "go_file": str(wd / "go")}
            crawls.append(launch_crawl(kids, wd, f"host-{h}", mode, s, spider, trace=mode == "ours" and args.trace))
        deadline = time.monotonic() + 60
        while (not all((wd / f"host-{h}.ready").exists() for h in range(args.hosts))
               and all(c["proc"].poll() is None for c in crawls) and time.monotonic() < deadline):
            time.sleep(0.01)
        others = {"site": site.pid, "proxies": fleet.pid, "redis": server.pid if server else None}
        cpu0 = {k: proc_cpu(pid) for k, pid in others.items()}
        t0 = time.monotonic()
        (wd / "go").write_text("go\n")
        timeout = args.timeout_b * max(1.0, pages / args.pages_b) if variant == "adaptive" else args.timeout_b
        hosts = [finish_crawl(kids, c, timeout) for c in crawls]
        crawl_wall = time.monotonic() - t0
        cpu = {k: proc_cpu(pid) - cpu0[k] for k, pid in others.items()}
        cpu["scrapy"] = sum(h["cpu"] for h in hosts)
        if server is not None:
            held = leases_held(server.url)
    finally:
        for proc in (fleet, site):
            if proc is not None:
                kids.stop(proc)
        if server is not None:
            kids.stop_server(server)
    entries = read_log(site_log)
    expected = {(s, f"/catalog/{n}") for s in SITES for n in range(1, pages + 1)}
    summary = summarize(entries, expected_pages=expected)
    eff = summary.throughput / args.ceiling
    res = {
        "variant": variant, "round": r, "summary": summary, "efficiency": eff,
        "steady": steady_rate(entries) / args.ceiling, "crawl_wall": crawl_wall, "hosts": hosts, "held": held,
        "gaps": slot_gaps(entries, args.burnt_map), "cpu": cpu,
        "busy": sum(cpu.values()) / (crawl_wall * (os.cpu_count() or 1)),
        "breakdown": breakdown(entries, hosts, manifest, args) if mode == "ours" and args.trace else {},
        "pacing": pacing_trace(hosts) if variant == "adaptive" else {},
    }
    print(f"  round {r + 1} {variant:10s} efficiency {eff:.3f} (steady {res['steady']:.3f}): "
          f"{summary.ok_pages}/{len(expected)} pages OK in {summary.span_seconds:.1f}s = "
          f"{summary.throughput:.1f}/s; bans {summary.bans_served}, violations {summary.violations}, "
          f"overlaps {summary.overlaps}; crawl wall {crawl_wall:.1f}s; CPU busy {100 * res['busy']:.0f}% ("
          + ", ".join(f"{k} {v:.1f}s" for k, v in cpu.items()) + f"); exits {[h['exit'] for h in hosts]}", flush=True)
    if variant == "adaptive":
        res["blocked"] = summary.bans_served / max(1, summary.requests)
        res["learned_after"] = learned_after(res["pacing"], ADAPTIVE_AFTER)
    return res


def pacing_trace(hosts: list[dict]) -> dict:
    """The learned interval over time, per site, from every host's releases (Redis clock): {site: [(t, s)]}
    with t counted from the first release of the crawl."""
    events = sorted((ev[3], ev[1], ev[4]) for h in hosts for ev in h["trace"]
                    if ev[0] == "release" and len(ev) > 4 and ev[4] is not None)
    if not events:
        return {}
    t0 = events[0][0]
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, url, interval in events:
        site = url.split("/")[2]
        out[site].append((t - t0, interval))
    return dict(out)


def learned_after(trace: dict, after: float) -> dict[str, float | None]:
    """Per site, the largest learned interval in force at or after ``after`` seconds (None: the crawl ended
    sooner): the figure the 25% target is judged on (its smallest is printed beside it)."""
    return {site: max((iv for t, iv in points if t >= after), default=None) for site, points in trace.items()}


def leases_held(redis_url: str) -> int:
    import redis

    from scrapy_proxy_shard.engine.store import PoolStore

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store = PoolStore(client, namespace="benchb", host_id="bench-loader")
        return sum(state.held for state in (store.pool_status("default", s) for s in SITES) if state)
    finally:
        client.close()


def steady_rate(entries: list[dict]) -> float:
    """Distinct OK pages per second between the 10th and the 90th percentile page (no ramp-up, no tail)."""
    firsts: dict[tuple[str, str], float] = {}
    for e in entries:
        if e.get("kind") == "page" and e.get("status") == 200 and e.get("end"):
            key = (e["site"], e["path"])
            firsts[key] = min(firsts.get(key, e["end"]), e["end"])
    ends = sorted(firsts.values())
    if len(ends) < 20:
        return 0.0
    lo, hi = ends[len(ends) // 10], ends[(9 * len(ends)) // 10]
    return ((9 * len(ends)) // 10 - len(ends) // 10) / (hi - lo) if hi > lo else 0.0


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def _live_slots(entries: list[dict], burnt: dict[str, list[str]]) -> dict[tuple[str, str], list[dict]]:
    """Site log entries per live (IP, site) pair, in start order (captcha pages are exempt from the rules)."""
    per: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for e in entries:
        if e.get("end") is None or e["path"].startswith("/captcha") or e["ip"] in burnt.get(e["site"], ()):
            continue
        per[(e["ip"], e["site"])].append(e)
    for group in per.values():
        group.sort(key=lambda e: e["start"])
    return per


def slot_gaps(entries: list[dict], burnt: dict[str, list[str]]) -> dict:
    """Per (IP, site) as the site saw it: start-to-start cycle, service time, idle time after a response."""
    cycles, idles, services = [], [], []
    for group in _live_slots(entries, burnt).values():
        services += [e["end"] - e["start"] for e in group]
        for a, b in itertools.pairwise(group):
            cycles.append(b["start"] - a["start"])
            idles.append(b["start"] - a["end"])
    if not cycles:
        return {}
    return {"cycle_p50": _q(cycles, 0.5), "cycle_p90": _q(cycles, 0.9), "cycle_mean": statistics.fmean(cycles),
            "idle_p50": _q(idles, 0.5), "idle_p90": _q(idles, 0.9), "service_p50": _q(services, 0.5)}


def breakdown(entries: list[dict], hosts: list[dict], manifest: list[dict], args: argparse.Namespace) -> dict:
    """Split each cycle of a live (IP, site) slot into its parts, joining the site's log with the crawl traces.

    For consecutive requests k, k+1 on one slot (all clocks are this machine's wall clock; Redis TIME too):
    service = site end - site start of k; back = Scrapy has the response - site end (site -> proxy ->
    Scrapy); judge+release = Redis release time - response (ban detection, the release round trip);
    late = lease of k+1 - (lease of k + PROXY_SHARD_MIN_INTERVAL) (Redis times: start-to-start pacing,
    so the arrival guard's shift plus how long the free slot waited for a taker); out = site start of
    k+1 - its lease (Scrapy downloader -> proxy -> new upstream connection -> site), of which to-dl is
    the part before Scrapy's downloader has it (``request_reached_downloader``: this host's event loop).
    """
    from scrapy_proxy_shard.engine.proxies import make_proxy

    ip_of = {make_proxy(m["url"]).id: m["source_ip"] for m in manifest}
    leases: dict[tuple[str, str], list[float]] = defaultdict(list)  # (url, ip) -> Redis lease times
    releases_by_url: dict[str, list[float]] = defaultdict(list)  # url -> Redis release times
    responded: dict[str, list[float]] = defaultdict(list)
    reached: dict[str, list[float]] = defaultdict(list)  # url -> when Scrapy's downloader had it
    for host in hosts:
        for ev in host["trace"]:
            if ev[0] == "lease":
                leases[(ev[1], ip_of.get(ev[2], "?"))].append(ev[3])
            elif ev[0] == "release":
                releases_by_url[ev[1]].append(ev[3])
            elif ev[0] == "resp":
                responded[ev[1]].append(ev[2])
            elif ev[0] == "reach":
                reached[ev[1]].append(ev[2])
    parts: dict[str, list[float]] = defaultdict(list)
    for (ip, site), group in _live_slots(entries, args.burnt_map).items():
        for a, b in itertools.pairwise(group):
            url_a, url_b = f"http://{site}{a['path']}", f"http://{site}{b['path']}"
            lease_a = _nearest_before(leases.get((url_a, ip), []), a["start"])
            lease_b = _nearest_before(leases.get((url_b, ip), []), b["start"])
            resp_a = _nearest_after(responded.get(url_a, []), a["end"])
            rel_a = _nearest_after(releases_by_url.get(url_a, []), resp_a) if resp_a is not None else None
            if lease_a is None or lease_b is None or resp_a is None or rel_a is None:
                continue
            parts["service"].append(a["end"] - a["start"])
            parts["back"].append(resp_a - a["end"])
            parts["judge+release"].append(rel_a - resp_a)
            parts["late"].append(lease_b - (lease_a + args.interval))
            parts["out"].append(b["start"] - lease_b)
            reach_b = _nearest_before(reached.get(url_b, []), b["start"])
            if reach_b is not None and reach_b >= lease_b:
                parts["to-dl"].append(reach_b - lease_b)
            parts["cycle"].append(b["start"] - a["start"])
    return {
        "cycles": len(parts["cycle"]),
        "medians": {k: statistics.median(v) for k, v in parts.items()},
        "means": {k: statistics.fmean(v) for k, v in parts.items()},
        "leases": sum(len(v) for v in leases.values()),
    }


def _nearest_before(times: list[float], t: float) -> float | None:
    before = [x for x in times if x <= t]
    return max(before) if before else None


def _nearest_after(times: list[float], t: float) -> float | None:
    after = [x for x in times if x >= t - 0.002]  # Redis TIME and time.time() are one clock, read apart
    return min(after) if after else None


def bench_efficiency(args: argparse.Namespace, kids: Kids, workdir: Path) -> dict:
    healthy_ips = [f"127.0.0.{11 + i}" for i in range(args.healthy)]
    args.burnt_map = burnt_plan(healthy_ips, args.burnt)
    live = {site: args.healthy - len(set(ips)) for site, ips in args.burnt_map.items()}
    site_bound = sum(live.values()) / max(args.site_interval, args.latency)
    scrapy_bound = args.hosts * args.concurrency_b / args.latency if args.latency else float("inf")
    args.ceiling = min(site_bound, scrapy_bound)
    bound = "site (live proxies / min_interval)" if site_bound <= scrapy_bound else "Scrapy concurrency"
    variants = args.variants_b or (["ours", "baseline", "adaptive"] + (["ours-hz100", "ours-br"]
                                                          if args.diagnose else []))
    print(f"\n(b) efficiency: {args.hosts} hosts x CONCURRENT_REQUESTS {args.concurrency_b}, {len(SITES)} sites x "
          f"{args.pages_b} pages, {args.healthy} healthy proxies ({args.burnt} burnt per site) + 1 dead, "
          f"PROXY_SHARD_MIN_INTERVAL {args.interval}, Accept-Encoding {args.accept_encoding or 'Scrapy default'!r}; "
          f"ceiling {args.ceiling:.1f} pages/s ({bound}); "
          f"{args.repeat_b} rounds of {', '.join(variants)}", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeat_b):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            runs[variant].append(run_scenario(args, kids, workdir, variant, r))
    return {"runs": runs, "live": live, "site_bound": site_bound, "scrapy_bound": scrapy_bound, "bound": bound}


def report_adaptive(args: argparse.Namespace, b: dict) -> list[str]:
    """The adaptive variant: its targets, and the trace of each site's learned interval."""
    rs = b["runs"]["adaptive"]
    pick = sorted(rs, key=lambda r: r["efficiency"])[len(rs) // 2]
    eff = median([r["efficiency"] for r in rs])
    blocked = median([r["blocked"] for r in rs])
    rule = args.site_interval
    worst = [iv for r in rs for iv in r["learned_after"].values()]
    within = bool(worst) and all(iv is not None and abs(iv - rule) <= ADAPTIVE_INTERVAL_TOLERANCE * rule
                                 for iv in worst)
    b["adaptive"] = {"efficiency": eff, "blocked": blocked, "within": within}
    lines = [f"  adaptive (rule unknown, PROXY_SHARD_AUTOTHROTTLE_ENABLED, start 1 s, {args.pages_adaptive} pages per "
             f"site): efficiency {eff:.3f} (target >= {ADAPTIVE_EFFICIENCY_TARGET}) "
             f"{verdict(eff >= ADAPTIVE_EFFICIENCY_TARGET)}; blocked {100 * blocked:.2f}% of requests (target <= "
             f"{100 * ADAPTIVE_BLOCKED_TARGET:.0f}%) {verdict(blocked <= ADAPTIVE_BLOCKED_TARGET)}",
             f"    learned interval after {ADAPTIVE_AFTER:.0f}s, largest per site and run (rule {rule}s, target within "
             f"{100 * ADAPTIVE_INTERVAL_TOLERANCE:.0f}%): "
             + "; ".join(", ".join(f"{site} {'-' if iv is None else f'{iv:.3f}s'}"
                                   for site, iv in sorted(r["learned_after"].items())) for r in rs)
             + f" {verdict(within)}",
             "    trace of the median run: learned interval in force (s) per site, at the end of each 5 s of the crawl"]
    trace = pick["pacing"]
    end = max((t for points in trace.values() for t, _ in points), default=0.0)
    marks = [5.0 * k for k in range(1, int(end // 5) + 2)]
    lines.append("    " + f"{'site':14s}" + "".join(f"{int(m):>7d}" for m in marks))
    for site, points in sorted(trace.items()):
        row = []
        for m in marks:
            before = [iv for t, iv in points if t <= m]
            row.append(f"{before[-1]:7.3f}" if before else f"{'-':>7s}")
        lines.append(f"    {site:14s}" + "".join(row))
    return lines


def report_efficiency(args: argparse.Namespace, b: dict) -> list[str]:
    lines = ["", f"(b) Efficiency: strict site (latency {args.latency}s, 1 at a time, {args.site_interval}s between "
             f"starts per IP+site, 5s bans), {args.hosts} Scrapy processes x CONCURRENT_REQUESTS "
             f"{args.concurrency_b}, {len(SITES)} x {args.pages_b} pages, {args.healthy} healthy proxies "
             f"({args.burnt} burnt per site) + 1 dead, PROXY_SHARD_MIN_INTERVAL {args.interval}, "
             f"Accept-Encoding {args.accept_encoding or 'Scrapy default'!r} (ours-br: Scrapy default)",
             f"  ceiling: site bound {sum(b['live'].values())} live proxy-site pairs "
             f"({', '.join(f'{s} {n}' for s, n in b['live'].items())}) / {max(args.site_interval, args.latency)}s = "
             f"{b['site_bound']:.1f} pages/s; Scrapy bound {args.hosts} x {args.concurrency_b} / {args.latency}s = "
             f"{b['scrapy_bound']:.0f} pages/s -> the {b['bound']} bound applies",
             f"  {'variant':10s} {'efficiency per run':22s} {'median':>6s} {'steady':>6s} {'OK/s':>6s} "
             f"{'pages OK':>9s} {'bans':>5s} {'viol.':>5s} {'overl.':>6s} {'wall s':>6s} {'held':>4s} {'CPU':>4s}"]
    for variant, rs in b["runs"].items():
        expected = len(SITES) * (args.pages_adaptive if variant == "adaptive" else args.pages_b)
        effs = [r["efficiency"] for r in rs]
        pick = sorted(rs, key=lambda r: r["efficiency"])[len(rs) // 2]  # the median run's other figures
        s = pick["summary"]
        lines.append(f"  {variant:10s} {' '.join(f'{x:.3f}' for x in effs):22s} {median(effs):6.3f} "
                     f"{median([r['steady'] for r in rs]):6.3f} {s.throughput:6.1f} "
                     f"{s.ok_pages:4d}/{expected:<4d} {s.bans_served:5d} {s.violations:5d} {s.overlaps:6d} "
                     f"{pick['crawl_wall']:6.1f} {pick['held']:4d} {100 * pick['busy']:3.0f}%")
    lines.append("  (OK/s .. CPU: the median run; wall: from the common start signal to the last host's exit; "
                 "held: leases left in Redis; CPU: all CPUs' busy share over the crawl, scrapy + site + proxies + "
                 "redis)")
    if "ours" in b["runs"]:
        ours = b["ours"] = median([r["efficiency"] for r in b["runs"]["ours"]])
        lines.append(f"  ours efficiency = {ours:.3f} (target >= {EFFICIENCY_TARGET}) "
                     f"{verdict(ours >= EFFICIENCY_TARGET)}")
    if "adaptive" in b["runs"]:
        lines += report_adaptive(args, b)
    lines.append("  Where the time goes: parts of one cycle of a live (IP, site) slot, medians in ms over every cycle "
                 "of the median run (site log joined with the crawls' traces; ideal cycle = the interval, "
                 f"{1000 * args.interval:.0f} ms; the site allows {1000 * args.site_interval:.0f})")
    names = ("service", "back", "judge+release", "late", "out", "to-dl", "cycle")
    lines.append(f"    {'variant':10s} " + " ".join(f"{n:>13s}" for n in names) + "   leases")
    for variant, rs in b["runs"].items():
        pick = sorted(rs, key=lambda r: r["efficiency"])[len(rs) // 2]
        d = pick["breakdown"]
        if not d or not d["cycles"]:
            continue
        med = d["medians"]
        lines.append(f"    {variant:10s} " + " ".join(f"{1000 * med.get(n, math.nan):13.1f}" for n in names)
                     + f"   {d['leases']:6d}")
    lines.append("    (service: the site's own time; back: site -> proxy -> Scrapy; judge+release: ban detection + "
                 "release round trip; late: lease gap - interval, the arrival guard's shift + the free slot waiting "
                 "for a taker; out: lease -> Scrapy downloader -> proxy -> site; to-dl: the part of out before "
                 "Scrapy's downloader has the request)")
    return lines


# --- main ---------------------------------------------------------------------------------------------

def code_line() -> str:
    """Which scrapy_proxy_shard the crawls import, and its git state."""
    import scrapy_proxy_shard

    where = Path(scrapy_proxy_shard.__file__).resolve().parent
    rev = os.environ.get("BENCH_CRAWL_REV")
    if rev:
        return f"code: scrapy_proxy_shard exported from commit {rev} (--at-commit) into {where}"
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"code: scrapy_proxy_shard from {where} (not a git checkout)"
    state = f"{len(dirty.splitlines())} uncommitted change(s) in the package" if dirty else "clean"
    return f"code: scrapy_proxy_shard from {where}, commit {sha} ({state})"


def reexec_at_commit(rev: str, argv: list[str]) -> None:
    """Run this benchmark against the package as committed at ``rev`` (others may be editing the tree):
    export it with ``git archive`` into a temporary directory, put that first on PYTHONPATH and re-exec."""
    import io
    import tarfile

    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", sha, "scrapy_proxy_shard"], capture_output=True,
                             check=True).stdout
    code = tempfile.mkdtemp(prefix="bench-crawl-code-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(code, filter="data")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")])),
           "BENCH_CRAWL_CODE": code, "BENCH_CRAWL_REV": sha}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def redis_version() -> str:
    import redis

    return redis.__version__


def machine_lines() -> list[str]:
    import scrapy as scrapy_mod

    from scrapy_proxy_shard.demo.redis_server import find_redis_server

    try:
        binary = find_redis_server()
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # reported, not fatal
        version = f"unknown ({exc})"
    return [f"machine: {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {platform.platform()}",
            f"Python {platform.python_version()}, Scrapy {scrapy_mod.__version__}, redis-py {redis_version()}, "
            f"{version}",
            code_line(), f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run, about a minute")
    p.add_argument("--repeat", type=int, help="rounds of (a) (default 5; quick 1)")
    p.add_argument("--repeat-b", type=int, help="rounds of (b) (default 3; quick 1)")
    p.add_argument("--pages-a", type=int, help="pages per crawl in (a) (default 1500; quick 600)")
    p.add_argument("--pages-b", type=int, help="pages per site in (b) (default 400; quick 100)")
    p.add_argument("--pages-adaptive", type=int,
                   help="pages per site for the adaptive variant of (b): it must crawl past 60 s (default 3000)")
    p.add_argument("--proxies-a", type=int, default=8)
    p.add_argument("--concurrency-a", type=int, default=32)
    p.add_argument("--site-concurrency-a", type=int, default=16)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--concurrency-b", type=int, default=16)
    p.add_argument("--healthy", type=int, default=10, help="healthy proxies in (b) (plus 1 dead)")
    p.add_argument("--burnt", type=int, default=2, help="healthy proxies each site has blacklisted already")
    p.add_argument("--interval", type=float, default=None,
                   help="PROXY_SHARD_MIN_INTERVAL in (b) (start-to-start; default: --site-interval, the rule known)")
    p.add_argument("--latency", type=float, default=0.05, help="the strict site's latency in (b)")
    p.add_argument("--site-interval", type=float, default=0.2, help="the strict site's min interval in (b)")
    p.add_argument("--no-diagnose", dest="diagnose", action="store_false",
                   help="skip the diagnostic variants of (b): ours-hz100 and ours-br")
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="do not trace leases/releases in the ours variants of (b) (no time breakdown)")
    p.add_argument("--only", choices=("a", "b"), help="run one part only")
    p.add_argument("--variants-b", type=lambda text: [v for v in text.split(",") if v],
                   help=f"comma-separated variants of (b), from {', '.join(VARIANTS_B)} (default: all)")
    p.add_argument("--accept-encoding", default="gzip, deflate",
                   help="Accept-Encoding the crawlers of (b) send (default 'gzip, deflate'; '' = Scrapy's, with br: "
                   "the site then spends ~2.5 ms CPU per page on brotli, on the crawlers' CPUs; see ours-br)")
    p.add_argument("--profile-a", action="store_true",
                   help="run the crawls of (a) under cProfile (their figures are then not comparable; use with "
                   "--keep: <workdir>/overhead/*.prof)")
    p.add_argument("--at-commit", metavar="REV",
                   help="benchmark the package as committed at REV (git archive; the work tree is not used)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, site logs, stats)")
    p.add_argument("--timeout-a", type=float, default=120.0)
    p.add_argument("--timeout-b", type=float, default=180.0)
    args = p.parse_args(argv)
    quick = args.quick
    args.repeat = args.repeat or (1 if quick else 5)
    args.repeat_b = args.repeat_b or (1 if quick else 3)
    args.pages_a = args.pages_a or (600 if quick else 1500)
    args.pages_b = args.pages_b or (100 if quick else 400)
    args.pages_adaptive = args.pages_adaptive or 3000
    args.warmup = not quick
    unknown = set(args.variants_b or ()) - set(VARIANTS_B)
    if unknown:
        p.error(f"--variants-b: unknown {sorted(unknown)}; known: {', '.join(VARIANTS_B)}")
    if args.interval is None:
        args.interval = args.site_interval  # rule known: the interval set to the site's rule
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--crawl"]:
        return crawl_child(argv[1])
    args = parse_args(argv)
    if args.at_commit:
        i = argv.index("--at-commit") if "--at-commit" in argv else -1
        rest = argv[:i] + argv[i + 2:] if i >= 0 else [a for a in argv if not a.startswith("--at-commit=")]
        reexec_at_commit(args.at_commit, rest)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="bench-crawl-"))
    kids = Kids()
    started = time.monotonic()
    head = machine_lines()
    print("\n".join(head), flush=True)
    lines: list[str] = []
    misses: list[str] = []
    try:
        if args.only in (None, "a"):
            a = bench_overhead(args, kids, workdir)
            lines += report_overhead(a)
            if a["ratio"] < OVERHEAD_TARGET:
                misses.append(f"(a) ours / baseline {a['ratio']:.3f} < {OVERHEAD_TARGET}")
        if args.only in (None, "b"):
            b = bench_efficiency(args, kids, workdir)
            lines += report_efficiency(args, b)
            if "ours" in b and b["ours"] < EFFICIENCY_TARGET:
                misses.append(f"(b) ours efficiency {b['ours']:.3f} < {EFFICIENCY_TARGET}")
            ad = b.get("adaptive")
            if ad and ad["efficiency"] < ADAPTIVE_EFFICIENCY_TARGET:
                misses.append(f"(b) adaptive efficiency {ad['efficiency']:.3f} < {ADAPTIVE_EFFICIENCY_TARGET}")
            if ad and ad["blocked"] > ADAPTIVE_BLOCKED_TARGET:
                misses.append(f"(b) adaptive blocked {100 * ad['blocked']:.2f}% > {100 * ADAPTIVE_BLOCKED_TARGET:.0f}%")
            if ad and not ad["within"]:
                misses.append(f"(b) adaptive learned interval not within {100 * ADAPTIVE_INTERVAL_TOLERANCE:.0f}% "
                              f"of the rule after {ADAPTIVE_AFTER:.0f}s")
    finally:
        kids.stop_all()
        import shutil

        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if os.environ.get("BENCH_CRAWL_CODE"):
            shutil.rmtree(os.environ["BENCH_CRAWL_CODE"], ignore_errors=True)
    lines.append(f"\ntotal {time.monotonic() - started:.0f}s; load average at end: "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
                 + (f"; work directory kept: {workdir}" if args.keep else ""))
    lines.append("MISSED: " + "; ".join(misses) if misses else "all targets met")
    print("\n" + "=" * 100 + "\n" + "\n".join(head + lines), flush=True)
    return 1 if misses else 0  # a missed target fails the run (CI and scripts see it)


if __name__ == "__main__":
    sys.exit(main())
