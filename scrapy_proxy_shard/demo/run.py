"""The demo: several Scrapy hosts sharing one proxy pool against the local anti-bot site.

``python -m scrapy_proxy_shard.demo`` starts a throwaway redis-server, the anti-bot site and a
fleet of local forward proxies (each sending from its own 127.0.0.x address; some with Basic auth,
one dead, one slow, some already blacklisted by a site), loads the proxies into two pools
(datacenter and residential), runs N ``scrapy crawl shop`` processes of ``example_project/`` at
once, shows progress, stops everything it started, and prints a summary computed from the *site's*
log: what the anti-bot system saw, not what the crawlers believe.

The end-to-end test runs ``run_demo`` with the same code and asserts on its ``DemoResult``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer, terminate
from scrapy_proxy_shard.demo.sitelog import Summary, read_log, summarize
from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.proxies import mask
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.settings import DEFAULTS

DEFAULT_SITES = ("shop-a.test", "shop-b.test", "market.test")
#: (site, source IP) pairs the site has blacklisted before the crawl starts: the crawl must find
#: them, quarantine them for every host, and never use them there again.
DEFAULT_BURNT = {
    "market.test": ("127.0.0.16", "127.0.0.19"),
    "shop-a.test": ("127.0.0.18", "127.0.0.20"),
    "shop-b.test": ("127.0.0.13",),
}
RESIDENTIAL = 4  # the first proxies of the fleet form the residential pool (sticky sessions)
NAMESPACE = "shardshop"


@dataclass
class DemoConfig:
    hosts: int = 3
    pages: int = 30
    flows: int = 2
    flow_steps: int = 4
    sites: tuple[str, ...] = DEFAULT_SITES
    proxies: int = 12
    burnt: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_BURNT))
    project: Path = field(default_factory=lambda: default_project())
    workdir: Path | None = None
    timeout: float = 300.0
    progress: bool = True
    ban_ttl: float = 120.0
    #: Extra Scrapy settings for every host (``-s NAME=VALUE``).
    settings: dict[str, str] = field(default_factory=dict)
    #: Kill the redis-server once the site has served ``outage[0]`` pages, and start it again
    #: (empty, as after a restart without persistence) ``outage[1]`` seconds later.
    outage: tuple[int, float] | None = None
    #: SIGKILL host number ``crash[0]`` once the site has served ``crash[1]`` pages.
    crash: tuple[int, int] | None = None
    #: Let a request that escapes the proxies reach the site (the site's port in the URLs, ``*.test``
    #: resolved to 127.0.0.1 by :class:`~.resolver.DemoSiteResolver`), so the site logs it as a
    #: request from the host's own address and the "no direct request" check can fail.
    direct_reachable: bool = False
    #: Fault-injection hook, called while the hosts run (see :class:`Injector`).
    injector: Injector | None = None
    #: Extra redis-server arguments (e.g. ``--enable-debug-command local`` for a stall test).
    redis_args: tuple[str, ...] = ()
    #: Sites that reject every client for this many seconds after their first request (the site
    #: circuit breaker's case).
    blackout: dict[str, float] = field(default_factory=dict)
    #: Seconds every proxy holds the first request of each new client connection (a connection's
    #: set-up: the arrival guard's case).
    proxy_setup: float = 0.0
    #: Give every host ``PROXY_SHARD_HOSTS`` (all the host ids); False: the hosts learn each other
    #: from the heartbeats in Redis (the fallback's host list then comes from there).
    host_list: bool = True
    #: Host number -> seconds after the others that it starts (a host joining the crawl).
    start_after: dict[int, float] = field(default_factory=dict)

    def shard_pages(self, host: int) -> set[tuple[str, str]]:
        return {(site, path) for site, path in self.expected_pages
                if int(path.rsplit("/", 1)[1]) % self.hosts == host}

    @property
    def expected_pages(self) -> set[tuple[str, str]]:
        return {(site, f"/catalog/{n}") for site in self.sites for n in range(1, self.pages + 1)}

    @property
    def expected_flows(self) -> int:
        return self.hosts * len(self.sites) * self.flows


class Injector(Protocol):
    """What a fault-injection test plugs into the run: ``tick`` every poll (0.25 s) while the hosts
    run, with the seconds since they started and the pages the site has served; ``finish`` once they
    have all exited, while the redis-server is still up."""

    def tick(self, server: RedisServer, elapsed: float, served: int) -> None: ...

    def finish(self, server: RedisServer) -> None: ...


@dataclass
class HostRun:
    name: str
    exit_code: int | None
    stats: dict
    items: list[dict]
    log_path: Path


@dataclass
class Events:
    """What the runner did to the cluster and what it measured meanwhile."""

    outage_at: float | None = None
    restarted_at: float | None = None
    #: The outage in the site log's clock (time.time()): from the kill to the restart.
    outage_wall: tuple[float, float] | None = None
    crashed_at: float | None = None
    #: Seconds from the SIGKILL until Redis held no lease of the killed host any more.
    crash_leases_gone_after: float | None = None
    crash_leases_at_kill: int = 0


@dataclass
class DemoResult:
    config: DemoConfig
    summary: Summary
    hosts: list[HostRun]
    leases_left: int
    quarantine_reuse: list[str]
    duration: float
    workdir: Path
    events: Events = field(default_factory=Events)
    #: Requests the site got from an address no proxy egresses from: sent from the host itself.
    direct_requests: list[dict] = field(default_factory=list)

    @property
    def survivors(self) -> list[HostRun]:
        crashed = f"host-{self.config.crash[0]}" if self.config.crash else None
        return [h for h in self.hosts if h.name != crashed]

    @property
    def missing_survivor_pages(self) -> set[tuple[str, str]]:
        wanted = set().union(*(self.config.shard_pages(int(h.name.split("-")[1])) for h in self.survivors))
        return wanted & set(self.summary.missing_pages)

    @property
    def flows_done(self) -> int:
        return sum(1 for h in self.hosts for item in h.items if item.get("kind") == "flow")

    @property
    def failed_items(self) -> int:
        return sum(1 for h in self.hosts for item in h.items if item.get("kind") == "failed")

    def checks(self) -> list[tuple[str, bool, str]]:
        s = self.summary
        flows_expected = self.config.flows * len(self.config.sites) * len(self.survivors)
        checks = [
            ("every host finished", all(h.exit_code == 0 for h in self.survivors),
             ", ".join(f"{h.name}: exit {h.exit_code}" for h in self.hosts)),
            ("every expected page scraped", not self.missing_survivor_pages,
             f"{s.ok_pages}/{len(self.config.expected_pages)} pages, {len(self.missing_survivor_pages)} missing"
             + (" (the killed host's own shard is not expected)" if self.config.crash else "")),
            ("every flow completed", self.flows_done >= flows_expected,
             f"{self.flows_done}/{flows_expected} flows"),
            ("zero overlaps (same IP, same site, same time)", s.overlaps == 0, f"{s.overlaps} overlaps"),
            ("zero rate/concurrency violations", s.violations == 0, f"{s.violations} violations"),
            ("no session changed IP mid-flow", s.ip_changed_responses == 0,
             f"{s.ip_changed_responses} 'session ip changed' responses"),
            ("quarantined proxies not reused on their site", not self.quarantine_reuse,
             f"{len(self.quarantine_reuse)} reuses"),
            ("every lease released", self.leases_left == 0, f"{self.leases_left} slots still held"),
        ]
        if self.config.direct_reachable:
            checks.append(("zero requests from the host's own address", not self.direct_requests,
                           f"{len(self.direct_requests)} direct requests"
                           + "".join(f"; {e['ip']} {e['site']}{e['path']}" for e in self.direct_requests[:3])))
        if self.config.crash:
            gone = self.events.crash_leases_gone_after
            ttl = float(self.config.settings.get("PROXY_SHARD_LEASE_TTL", 60))
            checks.append(("the killed host's leases expired within the lease TTL",
                           gone is not None and gone <= ttl + 1.0,
                           f"{self.events.crash_leases_at_kill} leases held at the kill, gone after "
                           f"{'never' if gone is None else f'{gone:.1f}s'} (TTL {ttl:g}s)"))
        return checks

    @property
    def ok(self) -> bool:
        return all(passed for _, passed, _ in self.checks())

    def format(self) -> str:
        s = self.summary
        lines = ["", "=" * 72, "What the anti-bot site saw (from its own log)", "=" * 72, s.format(), ""]
        lines.append("What the hosts did (Scrapy stats proxy_shard/*)")
        keys = sorted({k for h in self.hosts for k in h.stats if k.startswith("proxy_shard/")})
        width = max([len(k) for k in keys] + [10])
        lines.append("  " + "stat".ljust(width) + "".join(f"{h.name:>10}" for h in self.hosts))
        for key in keys:
            lines.append("  " + key.ljust(width) + "".join(f"{_fmt(h.stats.get(key, 0)):>10}" for h in self.hosts))
        items = ["  items: " + ", ".join(
            f"{h.name} {Counter(i.get('kind') for i in h.items).get('page', 0)} pages"
            f" + {Counter(i.get('kind') for i in h.items).get('flow', 0)} flows" for h in self.hosts)]
        lines += items
        share = Counter(i.get("proxy_id") for h in self.hosts for i in h.items if i.get("kind") == "page")
        lines.append(f"  pages per proxy (load spread): {sorted(share.values(), reverse=True)}")
        lines += ["", "Checks"]
        for name, passed, detail in self.checks():
            lines.append(f"  [{'PASS' if passed else 'FAIL'}] {name}: {detail}")
        lines.append(f"\n{len(self.hosts)} hosts, {self.duration:.1f}s wall time; logs and outputs in {self.workdir}")
        return "\n".join(lines)


def _fmt(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


class DemoSetupError(RuntimeError):
    """The demo cannot start here (said in one line, before anything is spawned)."""


def default_project() -> Path:
    """The demo's Scrapy project: the copy an installed wheel ships (``demo/example_project/``, put there
    by setup.py), else a checkout's ``example_project/`` (an editable install, or the source tree)."""
    here = Path(__file__).resolve().parent
    shipped, checkout = here / "example_project", here.parents[1] / "example_project"
    return shipped if (shipped / "scrapy.cfg").is_file() else checkout


def require_project(project: Path) -> None:
    """Refuse early when the demo's Scrapy project is absent (a broken install, a wrong ``project``)."""
    if not (project / "scrapy.cfg").is_file():
        raise DemoSetupError(
            f"the demo's Scrapy project is missing (no scrapy.cfg in {project}): reinstall scrapy-proxy-shard "
            "from its wheel or sdist, or run `python -m scrapy_proxy_shard.demo` from a clone of the repository"
        )


def run_demo(config: DemoConfig) -> DemoResult:
    """Run the whole demo; everything started here is stopped before returning."""
    require_project(config.project)
    workdir = Path(config.workdir or tempfile.mkdtemp(prefix="proxy-shard-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    site_log = workdir / "site.log"
    started = time.monotonic()
    children: list[subprocess.Popen] = []
    server = RedisServer(extra_args=config.redis_args).start()
    try:
        site_port = _start_site(config, workdir, site_log, children)
        manifest = _start_proxies(config, workdir, site_port, children)
        store = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), namespace=NAMESPACE,
                          host_id="demo-loader")
        _load_pools(store, manifest)
        _say(config, f"redis-server {server.url}, site on 127.0.0.1:{site_port}, {len(manifest)} proxies "
                     f"({RESIDENTIAL} residential), {config.hosts} hosts starting")
        events = Events()
        hosts = _run_hosts(config, workdir, server, site_log, events, site_port)
        if config.injector is not None:
            config.injector.finish(server)
        leases_left = _leases_of(server, None)
        store.client.close()
    finally:
        for child in reversed(children):
            _stop(child)
        server.stop()
    entries = read_log(site_log)
    summary = summarize(entries, expected_pages=config.expected_pages)
    egress = {m["source_ip"] for m in manifest}
    return DemoResult(config, summary, hosts, leases_left,
                      _quarantine_reuse(entries, config.ban_ttl * (1 - BAN_JITTER), _blind_window(config, events),
                                        brief=BRIEF_REST * (1 - BAN_JITTER)),
                      time.monotonic() - started, workdir, events,
                      direct_requests=[e for e in entries if e["ip"] not in egress])


def _start_site(config: DemoConfig, workdir: Path, log: Path, children: list) -> int:
    ready = workdir / "site.ready"
    burnt = ";".join(f"{site}={'+'.join(ips)}" for site, ips in config.burnt.items())
    cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--port", "0", "--log", str(log),
           "--ready-file", str(ready), "--sites", ",".join(config.sites), "--pages-per-site", str(config.pages),
           "--flow-steps", str(config.flow_steps), "--burnt", burnt,
           "--blackout", ";".join(f"{site}={seconds}" for site, seconds in config.blackout.items())]
    children.append(_spawn(cmd, workdir / "site.out"))
    return int(_wait_file(ready, children[-1]).strip())


def _start_proxies(config: DemoConfig, workdir: Path, site_port: int, children: list) -> list[dict]:
    ready = workdir / "proxies.ready"
    cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count", str(config.proxies),
           "--site-port", str(site_port), "--proxy-file", str(workdir / "proxies.txt"), "--ready-file", str(ready),
           "--setup-seconds", str(config.proxy_setup)]
    children.append(_spawn(cmd, workdir / "proxies.out"))
    return json.loads(_wait_file(ready, children[-1]))["proxies"]


def _load_pools(store: PoolStore, manifest: list[dict]) -> None:
    residential = [m["url"] for m in manifest[:RESIDENTIAL]]
    datacenter = [m["url"] for m in manifest[RESIDENTIAL:]]
    from scrapy_proxy_shard.engine.proxies import make_proxy

    store.add_proxies("residential", [make_proxy(u, {"type": "residential"}) for u in residential])
    store.add_proxies("datacenter", [make_proxy(u, {"type": "datacenter"}) for u in datacenter])


def _run_hosts(config: DemoConfig, workdir: Path, server: RedisServer, site_log: Path,
               events: Events, site_port: int) -> list[HostRun]:
    redis_url = server.url
    host_ids = ",".join(f"host-{i}" for i in range(config.hosts))
    extra = [arg for name, value in config.settings.items() for arg in ("-s", f"{name}={value}")]
    sites = ",".join(config.sites)
    if config.direct_reachable:
        sites = ",".join(f"{site}:{site_port}" for site in config.sites)
        extra += ["-s", "TWISTED_DNS_RESOLVER=scrapy_proxy_shard.demo.resolver.DemoSiteResolver"]
    procs: list = []
    later: list = []  # (seconds after the start, name, command, environment) of hosts not started yet
    for i in range(config.hosts):
        name = f"host-{i}"
        env = {**os.environ, "PROXY_SHARD_REDIS_URL": redis_url, "STATS_DUMP_FILE": str(workdir / f"{name}.stats.json")}
        cmd = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"shard={i}", "-a", f"shards={config.hosts}",
               "-a", f"sites={sites}", "-a", f"pages={config.pages}", "-a", f"flows={config.flows}",
               "-a", f"flow_steps={config.flow_steps}", "-s", f"PROXY_SHARD_HOST_ID={name}",
               "-s", f"PROXY_SHARD_BAN_TTL={config.ban_ttl}",
               *(("-s", f"PROXY_SHARD_HOSTS={host_ids}") if config.host_list else ()), *extra,
               "-O", str(workdir / f"{name}.items.jsonl"), "--logfile", str(workdir / f"{name}.log")]
        later.append((config.start_after.get(i, 0.0), name, cmd, env))

    def spawn(due: float) -> None:
        for item in [x for x in later if x[0] <= due]:
            later.remove(item)
            procs.append((item[1], subprocess.Popen(item[2], cwd=config.project, env=item[3], stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, start_new_session=True)))

    spawn(0.0)
    deadline = time.monotonic() + config.timeout
    expected = len(config.expected_pages)
    last_print = 0.0
    t0 = time.monotonic()
    while later or any(p.poll() is None for _, p in procs):
        spawn(time.monotonic() - t0)
        if time.monotonic() > deadline:
            for _, p in procs:
                _stop(p)
            break
        time.sleep(0.25)
        if config.outage or config.crash or config.injector:
            served = summarize(read_log(site_log)).ok_pages
            _disturb(config, server, procs, events, time.monotonic() - t0, served)
            if config.injector is not None:
                config.injector.tick(server, time.monotonic() - t0, served)
        if config.progress and time.monotonic() - last_print >= 1.0:
            last_print = time.monotonic()
            s = summarize(read_log(site_log), expected_pages=config.expected_pages)
            running = sum(p.poll() is None for _, p in procs)
            line = (f"  {time.monotonic() - t0:5.1f}s  pages {s.ok_pages:3d}/{expected}  flows "
                    f"{s.flows_completed:2d}/{config.expected_flows}  requests {s.requests:4d}  bans seen "
                    f"{s.bans_served:2d}  overlaps {s.overlaps}  hosts running {running}/{config.hosts}")
            print(line, flush=True)
    if config.crash and events.crashed_at is not None:  # keep watching the dead host's leases run out
        ttl = float(config.settings.get("PROXY_SHARD_LEASE_TTL", 60))
        while events.crash_leases_gone_after is None and time.monotonic() - t0 < events.crashed_at + ttl + 2:
            time.sleep(0.25)
            _disturb(config, server, procs, events, time.monotonic() - t0, 0)
    hosts = []
    for name, p in procs:
        stats_file = workdir / f"{name}.stats.json"
        items_file = workdir / f"{name}.items.jsonl"
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
        items = [json.loads(line) for line in items_file.read_text().splitlines() if line.strip()] \
            if items_file.exists() else []
        hosts.append(HostRun(name, p.returncode, stats, items, workdir / f"{name}.log"))
    return hosts


def _disturb(config: DemoConfig, server: RedisServer, procs: list, events: Events, elapsed: float,
             served: int) -> None:
    """Inject the configured Redis outage and host crash, and watch the crash's leases expire."""
    if config.outage and events.outage_at is None and served >= config.outage[0]:
        server.kill()
        events.outage_at = elapsed
        events.outage_wall = (time.time(), float("inf"))
        _say(config, f"  {elapsed:5.1f}s  redis-server killed (outage)")
    if config.outage and events.outage_at is not None and events.restarted_at is None \
            and elapsed >= events.outage_at + config.outage[1]:
        server.start()
        events.restarted_at = elapsed
        events.outage_wall = (events.outage_wall[0], time.time())
        _say(config, f"  {elapsed:5.1f}s  redis-server started again (empty)")
    if config.crash and events.crashed_at is None and served >= config.crash[1]:
        name, proc = procs[config.crash[0]]
        events.crash_leases_at_kill = _leases_of(server, name)
        os.killpg(proc.pid, signal.SIGKILL)
        events.crashed_at = elapsed
        _say(config, f"  {elapsed:5.1f}s  {name} killed with SIGKILL holding {events.crash_leases_at_kill} leases")
    if (events.crashed_at is not None and events.crash_leases_gone_after is None
            and _leases_of(server, procs[config.crash[0]][0]) == 0):
        events.crash_leases_gone_after = elapsed - events.crashed_at


def _leases_of(server: RedisServer, host: str | None) -> int:
    """Plain (non-session) leases in Redis held by ``host``: held records live in each site's hash
    (``<prefix>:site:<site>``, field member -> token|host|issued|expires|session), live until expires.

    Sticky sessions of a dead host deliberately keep their proxy until the session TTL, so that the
    session can go on from another host; they are not counted here.
    """
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        sec, usec = client.time()
        now = sec * 1000 + usec // 1000
        count = 0
        for key in client.scan_iter(f"{{{NAMESPACE}:*}}:{schema.SITE}:*", count=1000):
            for member, record in client.hgetall(key).items():
                parts = record.split("|", 4)
                if "/" not in member or len(parts) != 5 or not parts[3].isdigit():
                    continue
                if int(parts[3]) > now and (host is None or parts[1] == host) and parts[4] == "":
                    count += 1
        return count
    finally:
        client.close()


def _blind_window(config: DemoConfig, events: Events) -> tuple[float, float] | None:
    """While Redis is down, a ban reaches only the host that saw it (each host falls back to its own
    slice; the ban is replayed into Redis when it returns: docs/failure-model.md). A ban served from
    shortly before the kill (its release may not have reached Redis) until the hosts are back on Redis
    (restart + FALLBACK_GRACE + a probe interval) may therefore be unknown to the host whose slice holds
    the proxy: such a reuse is that documented limit, not a fault."""
    if events.outage_wall is None:
        return None
    grace = float(config.settings.get("PROXY_SHARD_FALLBACK_GRACE", 10))
    start, end = events.outage_wall
    return start - 1.0, end + grace + 2.0


#: The shortest brief quarantine (PROXY_SHARD_AUTOTHROTTLE_BAN_TTL's default, s): a rate-type ban's.
BRIEF_REST = float(DEFAULTS["PROXY_SHARD_AUTOTHROTTLE_BAN_TTL"])
#: Ban disguises the plugin reads as rate-type (PROXY_SHARD_AUTOTHROTTLE_BAN_REASONS by default): their
#: quarantine is brief (docs/pacing.md), x 4 per repeat for an IP that never answered the site clean.
RATE_STYLES = frozenset({"429", "503", "captcha"})
#: PROXY_SHARD_BAN_JITTER's default: every quarantine is up to this share shorter than its nominal
#: length, and an escalation multiplies the length the last one actually had (so the jitter compounds).
BAN_JITTER = float(DEFAULTS["PROXY_SHARD_BAN_JITTER"])


def _quarantine_reuse(entries: list[dict], quarantine: float,
                      blind: tuple[float, float] | None = None, *, brief: float | None = None) -> list[str]:
    """Requests an IP sent to a site within the quarantine its last ban there earned: ``quarantine``
    seconds for a block (403, a stub page) or any ban when ``brief`` is None; for a rate-type disguise
    (RATE_STYLES) ``brief`` x 4 per ban in a row of an IP that never answered the site clean (else x 2),
    each step less the ban jitter: at least what the plugin rests it; or within the ban's
    ``Retry-After`` when the site gave one and it is shorter (the crawler honours it:
    PROXY_SHARD_RETRY_AFTER). Bans served inside ``blind``, a Redis outage, are left out: see
    _blind_window."""
    banned_at: dict[tuple[str, str], tuple[float, float]] = {}
    in_row: dict[tuple[str, str], int] = {}
    clean: set[tuple[str, str]] = set()
    reuse = []
    for entry in sorted(entries, key=lambda e: e["start"]):
        key = (entry["ip"], entry["site"])
        since, window = banned_at.get(key, (None, 0.0))
        if since is not None and since < entry["start"] < since + window:
            reuse.append(f"{entry['ip']} on {entry['site']} {entry['start'] - since:.1f}s after its ban")
        unseen = blind is not None and blind[0] <= entry.get("end", 0) <= blind[1]
        style = entry.get("ban_style")
        if not style:
            if entry.get("status") == 200:
                clean.add(key)
                in_row.pop(key, None)
            continue
        if not entry.get("end") or unseen:
            continue
        n = in_row[key] = in_row.get(key, 0) + 1
        if brief is not None and (style in RATE_STYLES or key in clean):
            length = brief * ((2 if key in clean else 4) * (1 - BAN_JITTER)) ** (n - 1)
        elif key in banned_at:
            continue  # a block in a row: escalated from the first, which is what it is checked against
        else:
            length = quarantine
        told = entry.get("retry_after")
        banned_at[key] = (entry["end"], min(length, told) if told else length)
    return reuse


def _spawn(cmd: list[str], out: Path) -> subprocess.Popen:
    handle = open(out, "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    proc._demo_output = handle  # type: ignore[attr-defined]
    return proc


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited with {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[2]} not ready within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    terminate(proc, timeout=10)
    handle = getattr(proc, "_demo_output", None)
    if handle is not None:
        handle.close()


def _say(config: DemoConfig, text: str) -> None:
    if config.progress:
        print(mask(text), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scrapy_proxy_shard.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3, help="Scrapy processes sharing the pool (default 3)")
    parser.add_argument("--pages", type=int, default=30, help="catalog pages per site (default 30)")
    parser.add_argument("--flows", type=int, default=2, help="sticky multi-step flows per site and host")
    parser.add_argument("--workdir", type=Path, help="where logs and outputs go (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    config = DemoConfig(hosts=args.hosts, pages=args.pages, flows=args.flows, workdir=args.workdir,
                        timeout=args.timeout)
    try:
        result = run_demo(config)
    except DemoSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.format())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
