"""Tiered pools with real software (issue 23 item 4, the tier half): three ``scrapy crawl`` processes share
one redis-server; two local forward-proxy fleets egress from their own loopback addresses (tier 1 "dc":
127.0.0.51-53, tier 2 "resi": 127.0.0.61-62); the local anti-bot site has blacklisted every tier-1
address on ``blocks.test`` only. Verdicts come from the site's own log: the cluster moved that site up
to tier 2 once, for every host; the two other sites never saw a tier-2 address; every page of every
site was served; no request reached the site from anywhere but a proxy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scrapy_proxy_shard.demo.forward_proxy import ProxyFleet, ProxySpec
from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.site import AntiBotSite, ServerThread, SiteRules
from scrapy_proxy_shard.demo.sitelog import read_log

pytestmark = [pytest.mark.slow, pytest.mark.newest_redis_line]
DC_IPS = ("127.0.0.51", "127.0.0.52", "127.0.0.53")
RESI_IPS = ("127.0.0.61", "127.0.0.62")
BLOCKS, OPEN = "blocks.test", ("open-a.test", "open-b.test")
SITES = (BLOCKS, *OPEN)
PAGES = 12
HOSTS = 3

SPIDER_PY = '''
import scrapy


class TieredSpider(scrapy.Spider):
    name = "tiered"

    def __init__(self, sites, pages, shard, shards, **kwargs):
        super().__init__(**kwargs)
        self.sites, self.pages = sites.split(","), int(pages)
        self.shard, self.shards = int(shard), int(shards)

    async def start(self):
        for n in range(1, self.pages + 1):
            if n % self.shards != self.shard:
                continue
            for site in self.sites:
                yield scrapy.Request(f"http://{site}/catalog/{n}", callback=self.parse)

    def parse(self, response):
        yield {"url": response.url, "status": response.status}
'''


def _project(tmp_path: Path, redis_url: str, dc: list[str], resi: list[str]) -> Path:
    project = tmp_path / "tiers_root"
    (project / "tiersproj" / "spiders").mkdir(parents=True)
    (project / "scrapy.cfg").write_text("[settings]\ndefault = tiersproj.settings\n")
    (project / "tiersproj" / "__init__.py").write_text("")
    (project / "tiersproj" / "spiders" / "__init__.py").write_text("")
    (project / "tiersproj" / "spiders" / "tiered.py").write_text(SPIDER_PY)
    (project / "tiersproj" / "settings.py").write_text(textwrap.dedent(f'''
        BOT_NAME = "tiersproj"
        SPIDER_MODULES = ["tiersproj.spiders"]
        ROBOTSTXT_OBEY = False
        TELNETCONSOLE_ENABLED = False
        LOG_LEVEL = "INFO"
        ADDONS = {{"scrapy_proxy_shard.addon.ProxyShardAddon": 0}}
        PROXY_SHARD_REDIS_URL = {redis_url!r}
        PROXY_SHARD_NAMESPACE = "tiers-e2e"
        PROXY_SHARD_PROXIES = {{"dc": {dc!r}, "resi": {resi!r}}}
        PROXY_SHARD_TIERS = ["dc", "resi"]
        PROXY_SHARD_TIER_MIN_ANSWERS = 4
        PROXY_SHARD_TIER_PROBE_INTERVAL = 600
        PROXY_SHARD_MIN_INTERVAL = 0
        PROXY_SHARD_BAN_RETRIES = 10
        PROXY_SHARD_MAX_WAIT = 30
        CONCURRENT_REQUESTS = 8
    '''))
    return project


def _crawl(tmp_path: Path, *, pages: int = PAGES, probe: float = 600, block_latency: float = 0.05,
           extra: tuple[str, ...] = ()):
    """The stack, three hosts crawling ``pages`` pages of each site; returns (exit codes, host logs, site log)."""
    open_rules = SiteRules(latency=0.05, min_interval=0.0)
    blocked = SiteRules(latency=block_latency, min_interval=0.0, burnt_ips=frozenset(DC_IPS),
                        ban_styles=("403", "429", "503", "captcha"))  # not "stub": a 200 no policy can tell
    site = AntiBotSite(sites=SITES, rules=open_rules, site_rules={BLOCKS: blocked}, pages_per_site=pages,
                       log_path=tmp_path / "site.log")
    site_thread = ServerThread(site)
    site_thread.start()
    hosts = {name: ("127.0.0.1", site.port) for name in SITES}
    dc = ProxyFleet([ProxySpec(ip) for ip in DC_IPS], hosts)
    resi = ProxyFleet([ProxySpec(ip) for ip in RESI_IPS], hosts)
    threads = [ServerThread(dc), ServerThread(resi)]
    for thread in threads:
        thread.start()
    server = RedisServer().start()
    logs = [tmp_path / f"host-{i}.log" for i in range(HOSTS)]
    try:
        project = _project(tmp_path, server.url, dc.proxy_urls(), resi.proxy_urls())
        procs = [subprocess.Popen(
            [sys.executable, "-m", "scrapy", "crawl", "tiered", "-a", f"sites={','.join(SITES)}",
             "-a", f"pages={pages}", "-a", f"shard={i}", "-a", f"shards={HOSTS}",
             "-s", f"PROXY_SHARD_HOST_ID=host-{i}", "-s", f"PROXY_SHARD_TIER_PROBE_INTERVAL={probe}",
             *(arg for setting in extra for arg in ("-s", setting)), "--logfile", str(logs[i])],
            cwd=project, env={**os.environ, "PYTHONPATH": str(project)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(HOSTS)]
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        server.stop()
        for thread in threads:
            thread.stop()
        site_thread.stop()
    return codes, [log.read_text() for log in logs], read_log(tmp_path / "site.log")


def test_a_site_that_blocks_tier_one_moves_up_for_every_host_and_the_others_stay(tmp_path, redis_server_env):
    codes, texts, entries = _crawl(tmp_path)
    assert codes == [0] * HOSTS, [text[-2000:] for text in texts]
    # never from this machine's own address: every request came through a proxy of one tier or the other
    assert {e["ip"] for e in entries} <= set(DC_IPS) | set(RESI_IPS), {e["ip"] for e in entries}
    served = {(e["site"], e["path"]) for e in entries if e["kind"] == "page" and e["status"] == 200}
    assert served == {(s, f"/catalog/{n}") for s in SITES for n in range(1, PAGES + 1)}  # the crawl completed
    for name in OPEN:  # the other sites stay on tier 1
        ips = {e["ip"] for e in entries if e["site"] == name}
        assert ips <= set(DC_IPS) and ips, (name, ips)
        assert not [e for e in entries if e["site"] == name and e["ban_style"]]
    blocked = [e for e in entries if e["site"] == BLOCKS]
    on_dc = [e for e in blocked if e["ip"] in DC_IPS]
    assert all(e["ban_style"] for e in on_dc)  # the site serves the tier-1 addresses nothing but bans
    assert {e["ip"] for e in blocked if e["status"] == 200 and e["kind"] == "page"} <= set(RESI_IPS)
    # the cluster learnt it once: a few tier-1 bans (the evidence, and requests already in flight on other
    # hosts), then tier 2 for everyone; far fewer than the 12 pages x (1 + ban retries) without tiers
    assert 4 <= len(on_dc) <= 4 + 2 * HOSTS, len(on_dc)
    last_dc = max(e["start"] for e in on_dc)
    assert sum(e["start"] > last_dc for e in blocked) >= PAGES - len(on_dc), "tier 2 served the rest"
    moved = [line for text in texts for line in text.splitlines() if "tiers: blocks.test blocks pool 'dc'" in line]
    assert len(moved) == 1, moved  # one escalation, decided once for every host
    for text in texts:
        assert "'proxy_shard/tiers/dc/requests'" in text
    assert sum("'proxy_shard/tiers/resi/requests'" in text for text in texts) >= 2  # others used tier 2 too


def test_probes_of_the_blocked_tier_back_off(tmp_path, redis_server_env):
    """Probes of tier 1 every second at first: the site keeps banning tier 1, so each waits twice as long
    as the last (1 s, 2 s, 4 s, ...), cluster-wide, and the crawl still completes on tier 2."""
    # Quarantines short enough, and no circuit breaker, so that a tier-1 proxy is free for the site at each
    # probe: by default the first probes are skipped while the bans that moved the site up run (and while
    # tier 1's breaker for the site is open, whose own half-open probes then decide).
    codes, texts, entries = _crawl(tmp_path, pages=36, probe=1.0, block_latency=0.8,
                                   extra=("PROXY_SHARD_BAN_TTL=0.2", "PROXY_SHARD_BAN_MAX_TTL=0.5",
                                          "PROXY_SHARD_BREAKER_ENABLED=False"))
    assert codes == [0] * HOSTS, [text[-2000:] for text in texts]
    served = {(e["site"], e["path"]) for e in entries if e["kind"] == "page" and e["status"] == 200}
    assert served == {(s, f"/catalog/{n}") for s in SITES for n in range(1, 37)}
    waits = sorted(float(w) for text in texts
                   for w in re.findall(r"probe of blocks\.test through the cheaper tier was banned; next probe in "
                                       r"([\d.]+)s", text))
    assert len(waits) >= 2 and waits == [2.0 * 2 ** i for i in range(len(waits))], waits  # one doubling each
    sent = sum(int(n) for text in texts for n in re.findall(r"'proxy_shard/tiers/probes': (\d+)", text))
    assert sent == len(waits)  # every probe was banned (the site blocks tier 1 for good)
    # the site's log: after the escalation had reached every host, tier 1 met only the probes there
    blocked = sorted((e for e in entries if e["site"] == BLOCKS), key=lambda e: e["start"])
    settled = next(e["start"] for e in blocked if e["ip"] in RESI_IPS) + 2.0
    late_dc = [e for e in blocked if e["ip"] in DC_IPS and e["start"] > settled]
    assert len(late_dc) <= sent and all(e["ban_style"] for e in late_dc), late_dc
    assert [e for e in blocked if e["ip"] in RESI_IPS and e["start"] > settled]  # tier 2 served meanwhile
