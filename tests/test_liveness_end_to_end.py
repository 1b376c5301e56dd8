"""Liveness in a real crawl: `scrapy crawl shop` against the demo site through local forward proxies and
a real redis-server, with every proxy of the pool quarantined on the crawled site for ten minutes,
far past PROXY_SHARD_PAUSE_HORIZON (3 s). Before, each of the 300 requests waited out its 3 s (16 at a
time: ~57 s) and then failed, lost. Now the crawl ends in seconds with reason proxy_pool_exhausted
and one ERROR line, no request reaches the site (from the proxies or from the host's own address),
and with JOBDIR the next run, once the quarantines are lifted, sends every page. What reached the site
comes from the site's own log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.run import (
    NAMESPACE,
    RESIDENTIAL,
    DemoConfig,
    _load_pools,
    _start_proxies,
    _start_site,
    _stop,
)
from scrapy_proxy_shard.demo.sitelog import read_log
from scrapy_proxy_shard.engine.proxies import proxy_id
from scrapy_proxy_shard.engine.store import PoolStore

SITE, OTHER = "shop-a.test", "shop-b.test"
PAGES = 300
LINE = "closing the spider (proxy_pool_exhausted)"


class Stack:
    """redis-server, the demo site and its forward proxies (the demo harness's own pieces)."""

    def __init__(self, workdir: Path, sites: tuple[str, ...]) -> None:
        self.workdir = workdir
        self.config = DemoConfig(sites=sites, pages=PAGES, flows=0, burnt={}, workdir=workdir, progress=False)
        self.children: list[subprocess.Popen] = []
        self.server = RedisServer().start()
        self.site_log = workdir / "site.log"
        site_port = _start_site(self.config, workdir, self.site_log, self.children)
        self.manifest = _start_proxies(self.config, workdir, site_port, self.children)
        self.store = PoolStore(redis.Redis.from_url(self.server.url, decode_responses=True), namespace=NAMESPACE,
                               host_id="test-loader")
        _load_pools(self.store, self.manifest)
        self.datacenter = [proxy_id(m["url"]) for m in self.manifest[RESIDENTIAL:]]
        self.egress = {m["source_ip"] for m in self.manifest}

    def quarantine(self, site: str, ttl: float) -> None:
        for pid in self.datacenter:
            self.store.ban("datacenter", pid, site=site, ttl=ttl)

    def unban(self, site: str) -> None:
        for pid in self.datacenter:
            self.store.unban("datacenter", pid, site=site)

    def crawl(self, name: str, sites: str, *settings: str, pages: int = PAGES,
              spider_args: tuple[str, ...] = ()) -> tuple[int, dict, str, float]:
        """One `scrapy crawl shop` host: its exit code, stats, log text and duration (s)."""
        stats_file = self.workdir / f"{name}.stats.json"
        env = {**os.environ, "PROXY_SHARD_REDIS_URL": self.server.url, "STATS_DUMP_FILE": str(stats_file)}
        extra = [a for s in ("PROXY_SHARD_PAUSE_HORIZON=3", "CONCURRENT_REQUESTS=16", "LOG_LEVEL=INFO", *settings)
                 for a in ("-s", s)]
        cmd = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"sites={sites}", "-a", f"pages={pages}",
               "-a", "flows=0", *(a for arg in spider_args for a in ("-a", arg)),
               *extra, "--logfile", str(self.workdir / f"{name}.log")]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.config.project, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=150)
        took = time.monotonic() - started
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
        return proc.returncode, stats, (self.workdir / f"{name}.log").read_text(), took

    def entries(self) -> list[dict]:
        return read_log(self.site_log) if self.site_log.exists() else []

    def stop(self) -> None:
        for child in reversed(self.children):
            _stop(child)
        self.store.client.close()
        self.server.stop()


def test_an_exhausted_pool_ends_the_crawl_at_once_and_jobdir_keeps_its_requests(tmp_path, redis_server_env):
    stack = Stack(tmp_path, (SITE,))
    try:
        stack.quarantine(SITE, 600)
        jobdir = f"JOBDIR={tmp_path / 'job'}"
        code, stats, log, took = stack.crawl("first", SITE, jobdir)
        report = f"exit {code}, {took:.1f}s, stats {json.dumps(stats, sort_keys=True)}"
        assert stats.get("finish_reason") == "proxy_pool_exhausted", report
        assert took < 30, report  # ~57 s (300 / 16 x 3 s) when each request waited out MAX_WAIT
        assert code == 1, report  # the crawl did not finish its work
        lines = [line for line in log.splitlines() if LINE in line]
        assert len(lines) == 1 and "ERROR" in lines[0], lines
        assert f"cannot serve site '{SITE}' before" in lines[0] and "kept in JOBDIR" in lines[0], lines
        assert "unban" in lines[0] and "PROXY_SHARD_PAUSE_HORIZON" in lines[0], lines
        assert stats.get("proxy_shard/exhausted", 0) >= 1, report
        assert stats.get("proxy_shard/exhausted/kept", 0) >= 1, report
        assert stats.get("proxy_shard/leases", 0) == 0, report
        assert stack.entries() == []  # nothing reached the site: not through a proxy, not directly

        stack.unban(SITE)
        code, stats, log, took = stack.crawl("second", SITE, jobdir, "PROXY_SHARD_PAUSE_HORIZON=30")
        report = f"exit {code}, {took:.1f}s, stats {json.dumps(stats, sort_keys=True)}"
        assert code == 0 and stats.get("finish_reason") == "finished", report
        entries = stack.entries()
        assert {e["ip"] for e in entries} <= stack.egress, "a request reached the site from a non-proxy address"
        pages = {e["path"] for e in entries if e["site"] == SITE and e.get("kind") == "page" and e["status"] == 200}
        # Every page, the kept requests included (the first run's dupe filter saw them: without the
        # keep, the resumed run would drop them as duplicates and never send them).
        assert pages == {f"/catalog/{n}" for n in range(1, PAGES + 1)}, f"{PAGES - len(pages)} pages missing; {report}"
    finally:
        stack.stop()


def test_a_pool_quarantined_for_a_while_pauses_the_crawl_and_loses_nothing(tmp_path, redis_server_env):
    """Every proxy quarantined on the site for 12 s (within the pause horizon), MAX_WAIT 1 s: before,
    every request failed after 1 s and its item was lost. Now the crawl pauses (one WARNING line per
    PAUSE_LOG_INTERVAL saying how many requests wait, until when and why), resumes (one INFO line),
    fetches every page and exits 0."""
    pages = 40
    stack = Stack(tmp_path, (SITE,))
    try:
        # (12 s: the crawl's own start may take a few of them on a loaded machine, and the pause must
        # outlast two log intervals whatever that start took)
        stack.quarantine(SITE, 12)
        code, stats, log, took = stack.crawl("paused", SITE, "PROXY_SHARD_MAX_WAIT=1", "PROXY_SHARD_PAUSE_HORIZON=60",
                                             "PROXY_SHARD_PAUSE_LOG_INTERVAL=3", "PROXY_SHARD_MIN_INTERVAL=0.2",
                                             pages=pages)
        report = f"exit {code}, {took:.1f}s, stats {json.dumps(stats, sort_keys=True)}"
        assert code == 0 and stats.get("finish_reason") == "finished", report
        assert not stats.get("proxy_shard/not_sent") and not stats.get("proxy_shard/wait/gave_up"), report
        assert stats.get("proxy_shard/pauses") == 1 and 6 < stats.get("proxy_shard/paused_seconds", 0) < 16, report
        waits = [line for line in log.splitlines() if f"for {SITE} (pool 'datacenter') wait" in line]
        assert 2 <= len(waits) <= 5 and all("WARNING" in w for w in waits), waits
        assert "quarantined (manual x" in waits[0] and "next line in 3 s" in waits[0], waits
        resumed = [line for line in log.splitlines() if f"serving {SITE} (pool 'datacenter') again after" in line]
        assert len(resumed) == 1 and "INFO" in resumed[0], resumed
        entries = stack.entries()
        got = {e["path"] for e in entries if e["site"] == SITE and e.get("kind") == "page" and e["status"] == 200}
        assert got == {f"/catalog/{n}" for n in range(1, pages + 1)}, f"{pages - len(got)} pages missing; {report}"
    finally:
        stack.stop()
