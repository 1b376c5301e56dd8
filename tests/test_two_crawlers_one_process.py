"""Two crawlers in one process (``AsyncCrawlerProcess`` with two ``shop`` spiders), real local proxies,
the demo anti-bot site, and (for the Redis cases) a real redis-server. Verdicts come from the site's
own log: zero overlapping requests per (exit IP, site), zero requests from a non-proxy address,
every page served.

Issue 19 item 5: in embedded mode each crawler had its own in-memory server (190 overlapping pairs
on one IP between the two spiders); with Redis both were host ``<hostname>:<pid>`` and during an
outage took the same fallback slice in two private engines (197 overlapping pairs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.run import NAMESPACE, DemoConfig, _load_pools, _start_proxies, _start_site, _stop
from scrapy_proxy_shard.demo.sitelog import read_log, summarize
from scrapy_proxy_shard.engine.store import PoolStore

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "example_project"
RUNNER = Path(__file__).resolve().parent / "two_crawlers_run.py"
SITES = ("shop-a.test", "shop-b.test")
COMMON = {"PROXY_SHARD_MIN_INTERVAL": "0.2", "LOG_LEVEL": "INFO", "PROXY_SHARD_MAX_WAIT": "60"}


@pytest.fixture
def stack(tmp_path):
    """The demo site (nothing burnt) and 10 forward proxies: 4 residential, 6 datacenter."""
    config = DemoConfig(sites=SITES, pages=40, proxies=10, burnt={}, workdir=tmp_path)
    children: list[subprocess.Popen] = []
    site_log = tmp_path / "site.log"
    try:
        site_port = _start_site(config, tmp_path, site_log, children)
        manifest = _start_proxies(config, tmp_path, site_port, children)
        yield config, site_log, manifest
    finally:
        for child in reversed(children):
            _stop(child)


def _run(tmp_path: Path, pages: int, settings: dict[str, str], *, env: dict[str, str] | None = None,
         wait: float = 120.0, during=None) -> tuple[subprocess.Popen, dict, str]:
    out = tmp_path / "two.json"
    log = tmp_path / "two.log"
    cmd = [sys.executable, str(RUNNER), str(out), "shards=2", f"pages={pages}", "flows=0", f"sites={','.join(SITES)}"]
    for name, value in {**COMMON, **settings, "LOG_FILE": str(log)}.items():
        cmd += ["-s", f"{name}={value}"]
    err = tmp_path / "two.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=PROJECT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                                stderr=stderr)
    deadline = time.monotonic() + wait
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.25)
        if during is not None:
            during()
    if proc.poll() is None:
        _stop(proc)
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc, result, (log.read_text() if log.exists() else "") + err.read_text()


def _verdict(site_log: Path, manifest: list[dict], pages: int) -> tuple[dict, str]:
    entries = read_log(site_log)
    expected = {(site, f"/catalog/{n}") for site in SITES for n in range(1, pages + 1)}
    s = summarize(entries, expected_pages=expected)
    egress = {m["source_ip"] for m in manifest}
    direct = [e for e in entries if e["ip"] not in egress]
    found = {"requests": s.requests, "overlaps": s.overlaps, "direct": len(direct),
             "missing": len(s.missing_pages), "ok_pages": s.ok_pages}
    return found, f"{found}; examples: {[str(o) for o in s.overlap_examples[:3]]}"


def _hosts_named(log: str) -> set[str]:
    """Host ids of the engine lines ("proxy_shard: engine ..., host '<id>', pools ...")."""
    out = set()
    for line in log.splitlines():
        if "proxy_shard: engine " in line and ", host '" in line:
            out.add(line.split(", host '", 1)[1].split("'", 1)[0])
    return out


def test_two_spiders_in_one_process_share_one_embedded_engine(tmp_path, stack):
    _config, site_log, manifest = stack
    pages = 30
    proxies = " ".join(m["url"] for m in manifest[4:])  # PROXY_SHARD_POOL 'datacenter', the spider's pool
    proc, result, log = _run(tmp_path, pages, {"PROXY_SHARD_MODE": "embedded", "PROXY_SHARD_PROXIES": proxies},
                             env={"PROXY_SHARD_REDIS_URL": ""})
    found, report = _verdict(site_log, manifest, pages)
    assert proc.returncode == 0 and not result.get("failed"), log[-3000:]
    assert found["requests"] >= 2 * pages, report  # both crawlers ran
    assert found["overlaps"] == 0 and found["direct"] == 0 and found["missing"] == 0, report
    assert len(_hosts_named(log)) == 2, _hosts_named(log)  # one host id per crawler


def test_two_spiders_in_one_process_through_a_redis_outage(tmp_path, stack):
    """Redis is killed once the site has served 30 pages and started again (empty) 3 s later: both
    crawlers fall back at once, each on its own host id, on one local engine of the process."""
    _config, site_log, manifest = stack
    pages = 40
    server = RedisServer().start()
    state = {"killed": None, "restarted": False}
    try:
        store = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), namespace=NAMESPACE,
                          host_id="loader")
        _load_pools(store, manifest)
        store.client.close()

        def disturb() -> None:
            if state["killed"] is None and summarize(read_log(site_log)).ok_pages >= 30:
                server.kill()
                state["killed"] = time.monotonic()
            elif state["killed"] is not None and not state["restarted"] and time.monotonic() - state["killed"] > 3:
                server.start()
                state["restarted"] = True

        proc, result, log = _run(tmp_path, pages, {
            "PROXY_SHARD_REDIS_URL": server.url, "PROXY_SHARD_FALLBACK_GRACE": "1",
            "PROXY_SHARD_FALLBACK_WARMUP": "0.5", "PROXY_SHARD_SNAPSHOT_INTERVAL": "0.5",
            "PROXY_SHARD_REDIS_PARAMS": '{"socket_connect_timeout": 1, "socket_timeout": 2}',
        }, during=disturb)
    finally:
        server.stop()
    found, report = _verdict(site_log, manifest, pages)
    assert state["killed"] is not None, report
    assert proc.returncode == 0 and not result.get("failed"), log[-3000:]
    entered = [s.get("proxy_shard/fallback/entered", 0) for s in result["stats"]]
    assert all(entered), (entered, report)  # both crawlers used the local engine
    assert found["overlaps"] == 0 and found["direct"] == 0 and found["missing"] == 0, report
    assert len(_hosts_named(log)) == 2, _hosts_named(log)


def _shop(tmp_path: Path, name: str, redis_url: str, *settings: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", "pages=40", "-a", "flows=0",
           "-a", f"sites={','.join(SITES)}", "-s", "PROXY_SHARD_HOST_ID=worker-1",
           "-s", "PROXY_SHARD_HEARTBEAT_INTERVAL=0.5", "-s", "PROXY_SHARD_HOST_TTL=3", *settings,
           "--logfile", str(log)]
    proc = subprocess.Popen(cmd, cwd=PROJECT, env={**os.environ, "PROXY_SHARD_REDIS_URL": redis_url},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, log


def _wait_for(path: Path, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} within {timeout}s")


def test_a_live_duplicate_host_id_is_refused_and_a_crashed_ones_is_taken_over(tmp_path, stack):
    """Process A crawls as 'worker-1'; B started with the same id stops at open (one line, exit 1,
    A untouched); A is then SIGKILLed and C, started at once with the id, waits for A's heartbeat to
    expire (host TTL 3 s) and crawls."""
    _config, _site_log, manifest = stack
    server = RedisServer().start()
    a = None
    try:
        store = PoolStore(redis.Redis.from_url(server.url, decode_responses=True), namespace=NAMESPACE,
                          host_id="loader")
        _load_pools(store, manifest)
        a, a_log = _shop(tmp_path, "a", server.url, "-s", "PROXY_SHARD_MIN_INTERVAL=2")
        _wait_for(a_log, "proxy_shard: engine ")
        started = time.monotonic()
        b, b_log = _shop(tmp_path, "b", server.url)
        assert b.wait(timeout=60) == 1
        refused_after = time.monotonic() - started
        b_text = b_log.read_text()
        errors = [line for line in b_text.splitlines() if "] ERROR: " in line]
        assert len(errors) == 1, b_text[-3000:]
        assert ("cannot start: PROXY_SHARD_HOST_ID 'worker-1' is in use by another live process" in errors[0]
                and "give every process its own id" in errors[0]), errors
        assert "Traceback" not in b_text and "Spider closed (proxy_shard_error)" in b_text
        assert "worker-1" in {h.host for h in store.hosts("datacenter")} and a.poll() is None  # A still runs
        a.kill()
        a.wait(timeout=10)
        killed = time.monotonic()
        c, c_log = _shop(tmp_path, "c", server.url, "-a", "pages=6")
        assert c.wait(timeout=90) == 0, c_log.read_text()[-3000:]
        c_text = c_log.read_text()
        assert "taken over: the previous process stopped heartbeating" in c_text, c_text[-3000:]
        assert "Spider closed (finished)" in c_text
        store.client.close()
    finally:
        if a is not None and a.poll() is None:
            a.kill()
            a.wait(timeout=10)
        server.stop()
    # figures for the report
    print(f"refused after {refused_after:.1f}s; taken over, C finished {time.monotonic() - killed:.1f}s after the kill")
