"""Site zoo: real crawls against sites with different rules, rule given exactly and rule unknown.

    python benchmarks/bench_zoo.py [--profiles a,b] [--modes given,unknown] [--scale F] [--json PATH]
                                   [--keep] [--list] [--random N [--seed S]]

Each profile is a site with its own per-IP rule (``benchmarks/zoo_site.py``, or stock nginx ``limit_req``
+ tinyproxy for the ``nginx`` profile, ``scrapy_proxy_shard/demo/nginx_stack.py``), local forward proxies
adding a path jitter of 0..J ms per request (``--jitter-ms``), a fleet with dead, slow and
authenticating proxies, and three runs on a fresh site each:

  reference  a hand-paced aiohttp client (the ceiling): one worker per (live proxy, blacklist group),
             at most ``overlap`` requests in flight, each arrival at least the interval in force after
             the previous one of its (IP, group): it sends no sooner than the previous arrival (which
             the zoo site states in ``X-Zoo-Arrival``) + the interval, nor than the previous send + the
             interval + the profile's jitter; it knows when a site tightens its rule. Dead proxies are
             left out. On nginx: each (proxy, vhost) worker spaces its starts exactly by the interval.
  given      3 Scrapy hosts x CONCURRENT_REQUESTS 16 with the plugin, sharing one redis-server, and
             what a user who read the site's rule would write: PROXY_SHARD_MIN_INTERVAL = the published
             interval, PROXY_SHARD_SITE_CONCURRENCY = the overlap tolerance, PROXY_SHARD_SITE_GROUPS =
             the domains that share a blacklist; nothing else (no margin added by the benchmark)
  unknown    the same hosts with the plugin's defaults and PROXY_SHARD_AUTOTHROTTLE_ENABLED = True set
             explicitly (adaptive pacing, measured before and after it becomes the default)

Every figure comes from the site's own log: items = distinct pages answered 200; lost = requested pages
the site never answered 200; share = items/s of the crawl (first arrival to last answer) / items/s of
the reference on the same profile; blocked = blocked answers / requests; bans = bans started;
early = arrivals sooner than the interval in force (strikes). Targets (a miss prints MISS and the
script exits 1): given: 0 lost, share >= 0.78, blocked <= 1%; unknown: 0 lost, share >= 0.65,
blocked <= 2%. Crawl sizes: about ``TARGET_SECONDS`` x ``--scale`` seconds at the reference's pace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_crawl import (  # noqa: E402
    CATALOG_CSS,
    FIRST_IP,
    Kids,
    code_line,
    finish_crawl,
    launch_crawl,
    load_pool,
    wait_file,
)
from zoo_site import ZooRules, ZooSummary, parse_service, read_log, summarize  # noqa: E402

DOMAINS = ("shop-a.test", "shop-b.test", "market.test")
HOSTS = 3
CONCURRENT_REQUESTS = 16
TARGET_SECONDS = 20.0  # each crawl's length at the reference's pace, x --scale (the whole zoo: about 24 min)
MODES = ("given", "unknown")
TARGETS = {"given": (0.78, 0.01), "unknown": (0.65, 0.02)}  # (share of the reference, blocked share)


@dataclass(frozen=True)
class Profile:
    name: str
    about: str
    rules: ZooRules | None  # None: the nginx profile
    domains: int = 3
    proxies: int = 20
    dead: int = 2
    slow: int = 1
    auth: int = 2
    jitter_ms: float = 20.0
    #: The tightening profile's rule changes this share of the expected crawl time in.
    tighten_at: float = 0.4
    #: nginx only: the rule (1 request per interval per (IP, vhost), burst 1) and the service time.
    nginx_interval: float = 0.2
    nginx_latency: float = 0.05


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("issue", "the issue's scenario: 0.5 s, 3 strikes in 60 s ban 15 s, 2 in flight ban, two of three "
            "domains share a blacklist, service 50-200 ms, jitter 0-20 ms, 20 proxies (2 dead, 1 slow, 2 auth)",
            ZooRules(interval=0.5, overlap=1, strikes=3, window=60, ban=15, service="uniform:0.05:0.2",
                     groups=(("shop-a.test", "shop-b.test"),))),
    Profile("api-overlap2", "API: 0.1 s, 2 in flight tolerated, service 50-200 ms, 3 strikes ban 30 s, one domain, "
            "8 proxies (1 dead), jitter 0-5 ms",
            ZooRules(interval=0.1, overlap=2, strikes=3, window=60, ban=30, service="uniform:0.05:0.2"),
            domains=1, proxies=8, dead=1, slow=0, auth=1, jitter_ms=5),
    Profile("one-strike", "one early arrival bans for 10 min (403, no Retry-After): 0.5 s, service fixed 50 ms, "
            "12 proxies (1 dead), jitter 0-10 ms",
            ZooRules(interval=0.5, overlap=1, strikes=1, window=60, ban=600, service="fixed:0.05", ban_style="403"),
            proxies=12, dead=1, slow=0, auth=2, jitter_ms=10),
    Profile("lognormal", "heavy-tailed service (lognormal, median 80 ms, sigma 0.8): 0.25 s, 3 strikes ban 60 s, "
            "6 proxies, jitter 0-10 ms",
            ZooRules(interval=0.25, overlap=1, strikes=3, window=60, ban=60, service="lognormal:0.08:0.8"),
            proxies=6, dead=0, slow=0, auth=1, jitter_ms=10),
    Profile("slow-2s", "a slow site: 2 s, service fixed 100 ms, 3 strikes ban 120 s, jitter 0-30 ms, 20 proxies",
            ZooRules(interval=2.0, overlap=1, strikes=3, window=60, ban=120, service="fixed:0.1"), jitter_ms=30),
    Profile("all-shared", "all three domains share one blacklist: 0.4 s, service 50-150 ms, 3 strikes ban 30 s, "
            "jitter 0-10 ms, 20 proxies",
            ZooRules(interval=0.4, overlap=1, strikes=3, window=60, ban=30, service="uniform:0.05:0.15",
                     groups=(DOMAINS,)), jitter_ms=10),
    Profile("tighten", "the rule tightens mid-crawl: 0.3 s, then 0.45 s from 40% of the crawl on, 3 strikes "
            "ban 60 s, service 50-150 ms, 8 proxies (1 dead), no jitter",
            ZooRules(interval=0.3, overlap=1, strikes=3, window=60, ban=60, service="uniform:0.05:0.15",
                     tighten_after=0.0, tighten_factor=1.5), proxies=8, dead=1, slow=0, auth=1, jitter_ms=0),
    Profile("pareto-overlap2", "Pareto service (40 ms x Pareto(1.5), cap 3 s), 2 in flight tolerated, 0.2 s, "
            "3 strikes ban 60 s, 2 domains, 8 proxies (1 dead), jitter 0-10 ms",
            ZooRules(interval=0.2, overlap=2, strikes=3, window=60, ban=60, service="pareto:0.04:1.5"),
            domains=2, proxies=8, dead=1, slow=0, auth=1, jitter_ms=10),
    Profile("nginx", "stock nginx limit_req 1 per 0.2 s per (IP, vhost) burst 1 (429) + limit_conn 1 (503), "
            "50 ms service, 3 vhosts, 5 tinyproxies", None, proxies=5, dead=0, slow=0, auth=0, jitter_ms=0),
)}


def random_profiles(count: int, seed: int) -> list[Profile]:
    """``count`` profiles drawn from the issue's ranges, none of them tuned: a site the plugin has not seen.

    interval 0.1-2 s (log-uniform), path jitter 0-30 ms, service fixed / uniform / lognormal / Pareto,
    1 or 2 in flight tolerated, 1 or 3 strikes, bans of 15 s - 10 min (429 or a silent 403), 1-3 domains
    of which some may share a blacklist, a rule that may tighten mid-crawl, 6-20 proxies.
    """
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        interval = round(math.exp(rng.uniform(math.log(0.1), math.log(2.0))), 2)
        kind = rng.choice(("fixed", "uniform", "lognormal", "pareto"))
        if kind == "fixed":
            service = f"fixed:{rng.uniform(0.02, 0.3):.3f}"
        elif kind == "uniform":
            low = rng.uniform(0.02, 0.2)
            service = f"uniform:{low:.3f}:{low + rng.uniform(0.02, 0.3):.3f}"
        elif kind == "lognormal":
            service = f"lognormal:{rng.uniform(0.03, 0.15):.3f}:{rng.uniform(0.4, 1.0):.2f}"
        else:
            service = f"pareto:{rng.uniform(0.02, 0.06):.3f}:{rng.uniform(1.3, 2.0):.2f}"
        domains = rng.choice((1, 2, 3, 3))
        groups: tuple[tuple[str, ...], ...] = ()
        if domains > 1 and rng.random() < 0.35:
            groups = (DOMAINS[:domains] if rng.random() < 0.5 else DOMAINS[:2],)
        proxies = rng.randint(6, 20)
        tighten = rng.random() < 0.15
        rules = ZooRules(interval=interval, overlap=2 if rng.random() < 0.3 else 1,
                         strikes=1 if rng.random() < 0.3 else 3, window=60,
                         ban=round(math.exp(rng.uniform(math.log(15), math.log(600)))),
                         service=service, groups=groups, ban_style=rng.choice(("429", "429", "403")),
                         tighten_after=0.0 if tighten else None,
                         tighten_factor=round(rng.uniform(1.2, 1.6), 2))
        jitter = round(rng.uniform(0, 30), 1)
        about = (f"drawn (seed {seed}): {interval} s, {rules.overlap} in flight, {rules.strikes} strike(s) ban "
                 f"{rules.ban:g} s ({rules.ban_style}), service {service}, {domains} domain(s)"
                 f"{', blacklist ' + '+'.join(groups[0]) if groups else ''}"
                 f"{f', tightens x{rules.tighten_factor}' if tighten else ''}, jitter 0-{jitter} ms, "
                 f"{proxies} proxies")
        out.append(Profile(f"rand{seed}-{i}", about, rules, domains=domains, proxies=proxies,
                           dead=rng.randint(0, 2), slow=rng.randint(0, 1), auth=rng.randint(0, 2),
                           jitter_ms=jitter))
    return out


# --- sizing ----------------------------------------------------------------------------------------------

def mean_service(spec: str, cap: float) -> float:
    kind, p = parse_service(spec)
    if kind == "fixed":
        return p[0]
    if kind == "uniform":
        return (p[0] + p[1]) / 2
    if kind == "lognormal":
        return min(cap, p[0] * math.exp(p[1] ** 2 / 2))
    return min(cap, p[0] * p[1] / (p[1] - 1)) if p[1] > 1 else cap


def expected_rate(profile: Profile) -> float:
    """Items/s a perfect client could get: per live (IP, group), min(1/interval, overlap / cycle)."""
    if profile.rules is None:
        return profile.proxies * profile.domains / profile.nginx_interval
    r = profile.rules
    groups = len({r.group_of(d) for d in DOMAINS[:profile.domains]})
    service = mean_service(r.service, r.service_cap) + 0.01 + profile.jitter_ms / 2000
    live = profile.proxies - profile.dead
    fast = live - profile.slow
    per = [min(1 / r.interval, r.overlap / service)] * fast + [min(1 / r.interval, r.overlap / (service + 0.5))] * \
        profile.slow
    return sum(per) * groups


def pages_per_domain(profile: Profile, scale: float) -> int:
    return max(20, int(scale * TARGET_SECONDS * expected_rate(profile) / profile.domains))


def crawl_budget(scale: float) -> float:
    """Seconds a run may take before its processes are stopped (its unserved pages then count as lost)."""
    return 60 + 4 * TARGET_SECONDS * scale


def runtime_rules(profile: Profile, scale: float) -> ZooRules:
    r = profile.rules
    assert r is not None
    if r.tighten_after is not None:
        r = dataclasses.replace(r, tighten_after=round(profile.tighten_at * TARGET_SECONDS * scale, 1))
    return r


# --- processes ------------------------------------------------------------------------------------------

def start_zoo_site(kids: Kids, wd: Path, rules: ZooRules, domains: list[str], pages: int, log: Path) -> int:
    ready = wd / "site.ready"
    (wd / "rules.json").write_text(rules.to_json(), encoding="utf-8")
    cmd = [sys.executable, str(HERE / "zoo_site.py"), "--rules", str(wd / "rules.json"), "--domains",
           ",".join(domains), "--pages", str(pages), "--log", str(log), "--ready-file", str(ready)]
    proc = kids.spawn(cmd, wd / "site.out")
    return int(wait_file(ready, proc).strip())


def start_fleet(kids: Kids, wd: Path, port: int, profile: Profile) -> list[dict]:
    ready = wd / "proxies.ready"
    cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count", str(profile.proxies),
           "--site-port", str(port), "--site-host", "127.0.0.1", "--first-ip", FIRST_IP,
           "--proxy-file", str(wd / "proxies.txt"), "--ready-file", str(ready), "--auth", str(profile.auth),
           "--dead", str(profile.dead), "--slow", str(profile.slow), "--slow-seconds", "0.5",
           "--jitter-ms", str(profile.jitter_ms)]
    proc = kids.spawn(cmd, wd / "proxies.out")
    return json.loads(wait_file(ready, proc))["proxies"]


# --- the hand-paced reference client ----------------------------------------------------------------------

async def reference_client(manifest: list[dict], domains: list[str], pages: int, rules: ZooRules,
                           jitter: float, deadline: float) -> None:
    import aiohttp

    groups: dict[str, list[str]] = {}
    for d in domains:
        groups.setdefault(rules.group_of(d), []).append(d)
    queues = {d: asyncio.Queue() for d in domains}
    for n in range(1, pages + 1):
        for d in domains:
            queues[d].put_nowait(f"http://{d}/catalog/{n}")
    first: list[float] = []  # the site's first arrival, from the first answer's X-Zoo-Arrival
    safety = jitter + 0.005

    def interval_at(t: float) -> float:
        if rules.tighten_after is not None and first:  # knows the schedule: switch a second early
            return rules.interval_at(t + 1.0, first[0])
        return rules.interval

    def next_url(members: list[str], turn: list[int]) -> str | None:
        for k in range(len(members)):
            q = queues[members[(turn[0] + k) % len(members)]]
            if not q.empty():
                turn[0] += k + 1
                return q.get_nowait()
        return None

    async def worker(session: aiohttp.ClientSession, proxy: dict, members: list[str]) -> None:
        url_proxy, auth = proxy["url"], None
        if "@" in url_proxy:  # plain http through a proxy: the request's own headers go to the proxy
            import base64
            from urllib.parse import unquote

            userinfo, host = url_proxy.split("//", 1)[1].split("@", 1)
            user, _, password = userinfo.partition(":")
            token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
            auth = {"Proxy-Authorization": f"Basic {token}"}
            url_proxy = f"http://{host}"
        slots = asyncio.Semaphore(rules.overlap)
        last = {"send": -math.inf, "arrival": -math.inf}
        turn = [0]
        tasks: set[asyncio.Task] = set()
        failures = [0]  # answers in a row that did not come from the site (the proxy's own 407/502, errors)

        async def fetch(url: str) -> None:
            try:
                async with session.get(url, proxy=url_proxy, headers=auth) as response:
                    await response.read()
                    arrival = float(response.headers.get("X-Zoo-Arrival", "0"))
                    failures[0] = 0 if arrival else failures[0] + 1
                    if arrival:
                        if not first:
                            first.append(arrival)
                        last["arrival"] = max(last["arrival"], arrival)
                    if response.status != 200:
                        queues[url.split("/")[2]].put_nowait(url)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                failures[0] += 1
                queues[url.split("/")[2]].put_nowait(url)
                await asyncio.sleep(0.5)
            finally:
                slots.release()

        while time.time() < deadline and failures[0] < 5:  # 5 failures in a row: the proxy is left out
            await slots.acquire()
            url = next_url(members, turn)
            if url is None:
                slots.release()
                if not tasks:
                    return
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                continue
            now = time.time()
            iv = interval_at(now)
            at = max(last["arrival"] + iv, last["send"] + iv + safety)
            if at > now:
                await asyncio.sleep(at - now)
            last["send"] = time.time()
            task = asyncio.ensure_future(fetch(url))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()

    timeout = aiohttp.ClientTimeout(total=10)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        live = [p for p in manifest if not p["dead"]]
        await asyncio.gather(*(worker(session, p, members) for p in live for members in groups.values()))


# --- one zoo run ------------------------------------------------------------------------------------------

@dataclass
class Run:
    profile: str
    mode: str  # reference | given | unknown
    summary: ZooSummary
    expected: int
    wall: float
    exits: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    diagnosis: dict = field(default_factory=dict)
    note: str = ""

    def figures(self) -> dict:
        s = self.summary
        return {"profile": self.profile, "mode": self.mode, "items": s.ok_pages, "expected": self.expected,
                "lost": s.lost, "items_per_s": round(s.rate, 3), "requests": s.requests, "blocked": s.blocked,
                "blocked_share": round(s.blocked_share, 5), "bans": s.bans, "bans_by_why": s.bans_by_why,
                "early": s.early, "span": round(s.span, 2), "wall": round(self.wall, 1), "exits": self.exits,
                "diagnosis": self.diagnosis, "note": self.note}


#: Scrapy settings every crawl of the plugin gets on top of its mode's (``--set NAME=VALUE``): e.g. the
#: ``scrapy startproject`` template's ``DOWNLOAD_DELAY=1 CONCURRENT_REQUESTS_PER_DOMAIN=1``.
EXTRA_SETTINGS: dict[str, str] = {}


def plugin_settings(profile: Profile, mode: str, redis_url: str, ns: str) -> dict[str, Any]:
    s: dict[str, Any] = {"CONCURRENT_REQUESTS": CONCURRENT_REQUESTS, "PROXY_SHARD_REDIS_URL": redis_url,
                         "PROXY_SHARD_NAMESPACE": ns}
    r = profile.rules
    if mode == "given" and r is not None:
        s["PROXY_SHARD_MIN_INTERVAL"] = r.interval
        s["PROXY_SHARD_SITE_CONCURRENCY"] = r.overlap
        if r.groups:
            s["PROXY_SHARD_SITE_GROUPS"] = {f"group{i}": list(g) for i, g in enumerate(r.groups)}
    elif mode == "unknown":
        s["PROXY_SHARD_AUTOTHROTTLE_ENABLED"] = True
    return {**s, **EXTRA_SETTINGS}


def diagnose(entries: list[dict], rules: ZooRules) -> dict:
    """Where the blocked answers came from: when the first ban came, the early arrivals' gaps, how many
    early arrivals followed the previous one of their (IP, group) within 20 ms (two slots together)."""
    if not entries:
        return {}
    t0 = min(e["start"] for e in entries)
    bans = sorted(e["start"] - t0 for e in entries if e.get("verdict") == "ban")
    last: dict[tuple[str, str], float] = {}
    gaps = []
    together = 0
    for e in sorted(entries, key=lambda e: e["start"]):
        key = (e["ip"], e.get("group", e["site"]))
        if e.get("verdict") == "banned":
            continue
        if e.get("why") == "early" and key in last:
            gap = e["start"] - last[key]
            gaps.append(gap)
            together += gap < 0.02
        last[key] = e["start"]
    gaps.sort()
    out: dict[str, Any] = {"first_ban_s": round(bans[0], 1) if bans else None,
                           "ban_times_s": [round(b, 1) for b in bans[:8]]}
    if gaps:
        out.update(early_gap_ms_p50=round(1000 * gaps[len(gaps) // 2], 1), early_gap_ms_min=round(1000 * gaps[0], 1),
                   early_within_20ms=together)
    if rules.tighten_after is not None:
        cut = t0 + rules.tighten_after
        out["early_after_tighten"] = sum(1 for e in entries if e.get("why") == "early" and e["start"] >= cut)
    end = max(e.get("end", e["start"]) for e in entries)
    # (IP, group) pairs banned at some point whose last arrival came > 10 s before the end: a quarantine
    # longer than the ban (the crawl left them out), or a pair the crawl had no more use for.
    banned_pairs = {(e["ip"], e.get("group")) for e in entries if e.get("verdict") == "ban"}
    last_seen: dict[tuple[str, Any], float] = {}
    for e in entries:
        key = (e["ip"], e.get("group"))
        last_seen[key] = max(last_seen.get(key, 0.0), e["start"])
    out["banned_pairs"] = len(banned_pairs)
    out["banned_pairs_idle_last_10s"] = sum(1 for k in banned_pairs if last_seen[k] < end - 10)
    out["pairs"] = len(last_seen)
    # pages served per 10 s of the run: a slow start, a slow tail, a collapse after bans
    buckets = [0] * (int((end - t0) // 10) + 1)
    for e in entries:
        if e.get("status") == 200 and e.get("kind") == "page":
            buckets[int((e["start"] - t0) // 10)] += 1
    out["ok_per_10s"] = buckets
    return out


def crawl_stats(hosts: list[dict]) -> dict:
    keep = ("proxy_shard/bans", "proxy_shard/ban", "proxy_shard/lease/timeout", "proxy_shard/quarantine",
            "bench/failed", "proxy_shard/release/ban", "downloader/response_status_count/4")
    out: dict[str, float] = {}
    for h in hosts:
        for k, v in h.get("stats", {}).items():
            if k.startswith(keep):
                out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def run_zoo(kids: Kids, workdir: Path, profile: Profile, mode: str, scale: float, aiohttp_ok: bool) -> Run:
    wd = workdir / f"{profile.name}-{mode}"
    wd.mkdir(parents=True)
    rules = runtime_rules(profile, scale)
    domains = list(DOMAINS[:profile.domains])
    pages = pages_per_domain(profile, scale)
    expected = {(d, f"/catalog/{n}") for d in domains for n in range(1, pages + 1)}
    log = wd / "site.log"
    procs_before = len(kids.procs)
    server = None
    exits: list = []
    stats: dict = {}
    note = ""
    started = time.monotonic()
    budget = crawl_budget(scale)
    try:
        port = start_zoo_site(kids, wd, rules, domains, pages, log)
        manifest = start_fleet(kids, wd, port, profile)
        if mode == "reference":
            if not aiohttp_ok:
                raise RuntimeError("aiohttp missing")
            asyncio.run(reference_client(manifest, domains, pages, rules, profile.jitter_ms / 1000,
                                         time.time() + budget))
        else:
            server = kids.redis()
            ns = f"zoo-{profile.name}-{mode}"
            load_pool(server.url, ns, [m["url"] for m in manifest])
            crawls = []
            for h in range(HOSTS):
                settings = {**plugin_settings(profile, mode, server.url, ns), "PROXY_SHARD_HOST_ID": f"host-{h}"}
                spider = {"sites": ",".join(domains), "pages": pages, "shard": h, "shards": HOSTS,
                          "required_css": "|".join(CATALOG_CSS), "ready_file": str(wd / f"host-{h}.ready"),
                          "go_file": str(wd / "go")}
                crawls.append(launch_crawl(kids, wd, f"host-{h}", "ours", settings, spider))
            deadline = time.monotonic() + 60
            while (not all((wd / f"host-{h}.ready").exists() for h in range(HOSTS))
                   and all(c["proc"].poll() is None for c in crawls) and time.monotonic() < deadline):
                time.sleep(0.01)
            started = time.monotonic()
            (wd / "go").write_text("go\n")
            hosts = [finish_crawl(kids, c, budget) for c in crawls]
            exits = [h["exit"] for h in hosts]
            stats = crawl_stats(hosts)
            if time.monotonic() - started >= budget:
                note = f"stopped at the {budget:.0f}s budget"
    finally:
        for proc in reversed(kids.procs[procs_before:]):
            kids.stop(proc)
        del kids.procs[procs_before:]
        if server is not None:
            kids.stop_server(server)
    wall = time.monotonic() - started
    entries = read_log(log)
    return Run(profile.name, mode, summarize(entries, expected), len(expected), wall, exits, stats,
               diagnose(entries, rules), note)


def run_nginx(workdir: Path, profile: Profile, mode: str, scale: float, aiohttp_ok: bool) -> Run:
    from scrapy_proxy_shard.demo.nginx_stack import NginxStack, run_catalog_crawl
    from scrapy_proxy_shard.demo.redis_server import RedisServer

    pages = pages_per_domain(profile, scale)
    wd = workdir / f"{profile.name}-{mode}"
    stack = NginxStack(vhosts=profile.domains, proxies=profile.proxies, pages=pages,
                       interval=profile.nginx_interval, latency=profile.nginx_latency, workdir=wd / "stack")
    started = time.monotonic()
    exits: list = []
    stats: dict = {}
    with stack:
        expected = len(stack.expected_pages)
        if mode == "reference":
            if not aiohttp_ok:
                raise RuntimeError("aiohttp missing")
            from bench_nginx import hand_paced

            asyncio.run(hand_paced(stack, profile.nginx_interval))
            s = stack.analyze()
        else:
            settings = {"CONCURRENT_REQUESTS": str(CONCURRENT_REQUESTS), "LOG_LEVEL": "INFO"}
            if mode == "unknown":  # the example project's own pacing and ban settings out: the plugin's defaults
                from scrapy_proxy_shard.settings import DEFAULTS

                settings["PROXY_SHARD_AUTOTHROTTLE_ENABLED"] = "True"
                for key in ("PROXY_SHARD_MIN_INTERVAL", "PROXY_SHARD_BAN_TTL", "PROXY_SHARD_BAN_MAX_TTL",
                            "PROXY_SHARD_DEAD_TTL", "PROXY_SHARD_BAN_RETRIES", "PROXY_SHARD_MAX_WAIT",
                            "PROXY_SHARD_SESSION_TTL"):
                    settings[key] = f"{DEFAULTS[key]:g}"
            settings.update(EXTRA_SETTINGS)
            with RedisServer() as server:
                run = run_catalog_crawl(stack, server.url, wd / "crawl", hosts=HOSTS, settings=settings,
                                        namespace=f"zoo-nginx-{mode}", timeout=crawl_budget(scale))
            s = run.summary
            exits = [h.exit_code for h in run.hosts]
            for h in run.hosts:
                for k, v in h.stats.items():
                    if k.startswith(("proxy_shard/bans", "proxy_shard/ban")) and isinstance(v, (int, float)):
                        stats[k] = stats.get(k, 0) + v
    wall = time.monotonic() - started
    z = ZooSummary(requests=s.requests, ok_pages=s.ok_pages, lost=len(s.missing_pages),
                   lost_examples=s.missing_pages[:5], blocked=s.blocked, bans=0, early=s.violations,
                   span=s.duration, first_start=s.first_start, last_end=s.last_end)
    diag = {"429": s.rate_limited, "503": s.conn_limited, "overlaps": s.overlaps,
            "min_gap_ms": None if s.min_gap is None else round(1000 * s.min_gap, 1)}
    return Run(profile.name, mode, z, expected, wall, exits, stats, diag)


# --- report -----------------------------------------------------------------------------------------------

HEAD = (f"  {'profile':16} {'mode':9} {'items':>11} {'lost':>5} {'items/s':>8} {'share':>6} {'blocked':>8} "
        f"{'bans':>5} {'early':>6} {'wall':>6}  verdict")


def judge(run: Run, ref: Run | None) -> tuple[float | None, list[str]]:
    share_target, blocked_target = TARGETS[run.mode]
    misses = []
    share = run.summary.rate / ref.summary.rate if ref and ref.summary.rate else None
    if run.summary.lost:
        misses.append(f"{run.summary.lost} items lost")
    if share is None:
        misses.append("no reference")
    elif share < share_target:
        misses.append(f"share {share:.2f} < {share_target}")
    if run.summary.blocked_share > blocked_target:
        misses.append(f"blocked {run.summary.blocked_share:.2%} > {blocked_target:.0%}")
    if any(code != 0 for code in run.exits):
        misses.append(f"exit codes {run.exits}")
    return share, misses


def row(run: Run, share: float | None, verdict: str) -> str:
    s = run.summary
    share_text = "-" if share is None else f"{share:.2f}"
    return (f"  {run.profile:16} {run.mode:9} {s.ok_pages:5d}/{run.expected:<5d} {s.lost:5d} {s.rate:8.1f} "
            f"{share_text:>6} {s.blocked_share:8.2%} {s.bans:5d} {s.early:6d} {run.wall:5.0f}s  {verdict}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default="", help=f"comma-separated subset of {','.join(PROFILES)}")
    p.add_argument("--modes", default="given,unknown", help="comma-separated subset of given,unknown")
    p.add_argument("--scale", type=float, default=1.0, help="crawl sizes (and the tightening time) x this")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="also run N profiles drawn at random from the issue's ranges (sites not seen before)")
    p.add_argument("--seed", type=int, default=None, help="the draw's seed (default: from the clock, printed)")
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (site logs, crawl logs)")
    p.add_argument("--list", action="store_true", help="list the profiles and exit")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a Scrapy setting for every crawl of the plugin (repeatable), e.g. the startproject "
                        "template's DOWNLOAD_DELAY=1")
    args = p.parse_args(argv)
    for pair in args.set:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            p.error(f"--set {pair!r}: write NAME=VALUE, e.g. --set DOWNLOAD_DELAY=1")
        EXTRA_SETTINGS[name] = value
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    drawn = {prof.name: prof for prof in random_profiles(args.random, seed)}
    PROFILES.update(drawn)
    if args.list:
        for prof in PROFILES.values():
            print(f"{prof.name:16} ~{expected_rate(prof):5.1f} items/s, {pages_per_domain(prof, args.scale)} pages x "
                  f"{prof.domains} domains: {prof.about}")
        return 0
    # --profiles picks among both; else the drawn ones alone when there are any, else the whole zoo
    names = [n for n in args.profiles.split(",") if n] or list(drawn or PROFILES)
    modes = [m for m in args.modes.split(",") if m]
    bad = (set(names) - set(PROFILES)) | {f"mode {m}" for m in set(modes) - set(MODES)}
    if bad:
        p.error(f"unknown {sorted(bad)}; profiles: {','.join(PROFILES)}; modes: {','.join(MODES)}")
    try:
        import aiohttp  # noqa: F401

        aiohttp_ok = True
    except ImportError:
        aiohttp_ok = False
    signal_exit = lambda *_: sys.exit(143)  # noqa: E731
    import signal

    signal.signal(signal.SIGTERM, signal_exit)
    workdir = Path(tempfile.mkdtemp(prefix="bench-zoo-"))
    print(f"bench_zoo: {platform.node()}, {os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          f", Python {platform.python_version()}; {code_line()}; scale {args.scale}", flush=True)
    if not aiohttp_ok:
        print("  aiohttp is not installed (pip install -e '.[bench]'): no reference client, every share is a MISS")
    kids = Kids()
    runs: list[Run] = []
    lines: list[str] = []
    misses: list[str] = []
    t_start = time.monotonic()
    try:
        for name in names:
            prof = PROFILES[name]
            if prof.rules is None:
                from scrapy_proxy_shard.demo.nginx_stack import missing_binaries

                missing = missing_binaries()
                if missing:
                    print(f"{name}: skipped, not installed: {', '.join(missing)}", flush=True)
                    lines.append(f"  {name:16} skipped: {', '.join(missing)} not installed")
                    continue
            print(f"{name}: {prof.about}", flush=True)
            ref = None
            profile_runs = []
            for mode in ("reference", *modes):
                try:
                    run = (run_nginx(workdir, prof, mode, args.scale, aiohttp_ok) if prof.rules is None
                           else run_zoo(kids, workdir, prof, mode, args.scale, aiohttp_ok))
                except Exception as exc:  # one broken run is reported, the others still run
                    print(f"  {mode}: {type(exc).__name__}: {exc}", flush=True)
                    if mode != "reference":
                        misses.append(f"{name}/{mode}: did not run ({type(exc).__name__}: {exc})")
                    continue
                if mode == "reference":
                    ref = run
                    print(row(run, 1.0, "(reference)"), flush=True)
                else:
                    share, why = judge(run, ref)
                    verdict = "PASS" if not why else "MISS " + "; ".join(why)
                    if why:
                        misses.append(f"{name}/{mode}: " + "; ".join(why))
                    run.diagnosis["share"] = None if share is None else round(share, 3)
                    print(row(run, share, verdict), flush=True)
                print(f"      bans by cause {run.summary.bans_by_why or '-'}; {run.diagnosis}"
                      + (f"; crawl stats {run.stats}" if run.stats else "") + (f"; {run.note}" if run.note else ""),
                      flush=True)
                runs.append(run)
                profile_runs.append(run)
            for run in profile_runs:
                if run.mode == "reference":
                    lines.append(row(run, 1.0, "(reference)"))
                else:
                    share, why = judge(run, ref)
                    lines.append(row(run, share, "PASS" if not why else "MISS " + "; ".join(why)))
    finally:
        kids.stop_all()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - t_start
    print("\n" + "=" * 110)
    print("Site zoo (figures from the sites' own logs; share = items/s / the hand-paced reference's items/s on the "
          "same profile;\n targets: given 0 lost, share >= 0.78, blocked <= 1%; unknown 0 lost, share >= 0.65, "
          "blocked <= 2%)")
    print(HEAD)
    print("\n".join(lines))
    print(f"\ntotal {total:.0f}s; load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + (f"; work directory kept: {workdir}" if args.keep else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([r.figures() for r in runs], indent=1) + "\n", encoding="utf-8")
    for miss in misses:
        print(f"MISS {miss}")
    if not misses:
        print("all targets met")
    return 1 if misses else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
