"""Redis stopped 1, 3, 8 and 20 s after three real `scrapy crawl` hosts registered, with no
PROXY_SHARD_HOSTS (each host's fallback list comes from the heartbeats in Redis), and once with a
host joining just before the outage and one leaving just before it. Verdicts from the demo site's
own log: no two requests in flight at once from one IP on one site, every page of the hosts that
stayed served, no request from the host's own address.

Before the fallback re-read its host list (issue 19, item 4), each host sliced over the list of its
first snapshot, taken at open before its own heartbeat: one host, so every host took the whole pool.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field

import pytest
import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.run import NAMESPACE, DemoConfig, run_demo

pytestmark = pytest.mark.slow

SITES = ("shop-a.test", "shop-b.test")
OUTAGE = 6.0  # seconds Redis stays down; it comes back empty (no persistence)
SETTINGS = {
    "PROXY_SHARD_MIN_INTERVAL": "1.0",  # a slow crawl: it still runs 20 s after the hosts registered
    "PROXY_SHARD_SNAPSHOT_INTERVAL": "0.5",
    "PROXY_SHARD_HEARTBEAT_INTERVAL": "1",
    "PROXY_SHARD_FALLBACK_GRACE": "1",
    "PROXY_SHARD_FALLBACK_WARMUP": "1",
    "PROXY_SHARD_LEASE_TTL": "10",
    "DOWNLOAD_TIMEOUT": "5",
    "PROXY_SHARD_REDIS_PARAMS": '{"socket_connect_timeout": 1, "socket_timeout": 2}',
}
HOSTS_KEY = f"{{{NAMESPACE}:datacenter}}:hosts"
INFO_KEY = f"{{{NAMESPACE}:datacenter}}:hostinfo"


@dataclass
class OutageAfterRegistration:
    """Stop the redis-server ``offset`` seconds after ``hosts`` hosts are live in the pool's registry,
    start it again (empty) ``OUTAGE`` seconds later; ``leaver``: SIGTERM that host (a clean close,
    which leaves the registry) one second before the outage."""

    hosts: int
    offset: float
    leaver: str | None = None
    registered_at: float | None = None
    killed_at: float | None = None
    restarted_at: float | None = None
    ended_in_outage: bool = False
    notes: list[str] = field(default_factory=list)

    def tick(self, server: RedisServer, elapsed: float, served: int) -> None:
        if self.registered_at is None:
            if self._live(server) >= self.hosts:
                self.registered_at = elapsed
        elif self.leaver and elapsed >= self.registered_at + self.offset - 1.0:
            self._stop(server, self.leaver)
            self.leaver = None
        elif self.killed_at is None and elapsed >= self.registered_at + self.offset:
            server.kill()
            self.killed_at = elapsed
        elif self.killed_at is not None and self.restarted_at is None and elapsed >= self.killed_at + OUTAGE:
            server.start()
            self.restarted_at = elapsed

    def finish(self, server: RedisServer) -> None:
        if self.killed_at is not None and self.restarted_at is None:  # the crawl ended within the outage
            server.start()
            self.ended_in_outage = True
            self.notes.append("the crawl ended before Redis came back")

    @staticmethod
    def _live(server: RedisServer) -> int:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            return client.zcount(HOSTS_KEY, f"({int(time.time() * 1000)}", "+inf")
        finally:
            client.close()

    def _stop(self, server: RedisServer, host: str) -> None:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            info = json.loads(json.loads(client.hget(INFO_KEY, host) or "{}").get("info", "{}"))
        finally:
            client.close()
        if info.get("pid"):
            os.kill(int(info["pid"]), signal.SIGTERM)  # a host this test started (its pid from its heartbeat)
            self.notes.append(f"{host} stopped (pid {info['pid']})")


def _crawl(tmp_path, fault: OutageAfterRegistration, pages: int, **overrides):
    config = DemoConfig(hosts=3, pages=pages, flows=0, proxies=12, sites=SITES, burnt={}, workdir=tmp_path,
                        progress=False, timeout=120, direct_reachable=True, injector=fault, host_list=False,
                        settings=dict(SETTINGS), **overrides)
    return run_demo(config)


def _check(result, fault: OutageAfterRegistration, stayed: list[int]) -> None:
    s = result.summary
    wanted = set().union(*(result.config.shard_pages(i) for i in stayed))
    missing = sorted(wanted & set(s.missing_pages))
    no_slice = {h.name: h.stats.get("proxy_shard/fallback/no_slice", 0) for h in result.hosts}
    fallback_leases = sum(h.stats.get("proxy_shard/fallback/leases", 0) for h in result.hosts)
    report = (f"registered at {fault.registered_at}, Redis killed at {fault.killed_at}, back at {fault.restarted_at}; "
              f"{'; '.join(fault.notes)}; overlaps {s.overlaps} {s.overlap_examples[:3]}; missing {len(missing)} "
              f"{missing[:3]}; direct {len(result.direct_requests)}; fallback leases {fallback_leases}; "
              f"hosts without a slice {no_slice}; {result.duration:.0f}s, workdir {result.workdir}")
    print("\n" + report)
    assert fault.killed_at is not None and fault.restarted_at is not None and not fault.ended_in_outage, report
    assert s.overlaps == 0, report
    assert not result.direct_requests, report
    assert not missing, report
    assert fallback_leases > 0, report  # the outage met the crawl: hosts leased from their slices


@pytest.mark.parametrize(("offset", "pages"), [(1, 60), (3, 70), (8, 100), (20, 180)])
def test_redis_stopped_after_the_hosts_registered_leaves_no_overlap_and_no_lost_page(
        tmp_path, offset, pages):
    fault = OutageAfterRegistration(hosts=3, offset=offset)
    _check(_crawl(tmp_path, fault, pages), fault, stayed=[0, 1, 2])


def test_a_host_joining_and_one_leaving_around_the_outage(tmp_path):
    """host-2 starts 5 s after the others (it registers a moment before Redis stops); host-1 closes one
    second before the outage: host-1 stays in the others' lists (its share idles), host-2 takes a
    slice only if every other host read the list after it registered, else it waits for Redis."""
    fault = OutageAfterRegistration(hosts=2, offset=8, leaver="host-1")
    _check(_crawl(tmp_path, fault, 200, start_after={2: 5.0}), fault, stayed=[0, 2])
