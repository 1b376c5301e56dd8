"""A real crawl whose pool lists one local forward proxy twice (a rotated password): the site's own
log must show no two requests from that proxy's IP on one site at once (issue 19, item 3).

Started here: the demo site (each response held 0.4 s, so concurrent use shows), one forward proxy
egressing from 127.0.0.11, a redis-server, and one ``scrapy crawl shop`` of ``example_project/``.
Before exits were the identity, the two entries were two slots and the site saw overlaps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.run import _spawn, _stop, _wait_file
from scrapy_proxy_shard.demo.sitelog import find_overlaps, read_log

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[1] / "example_project"
SITES = ("shop-a.test", "shop-b.test")
PAGES = 6


def test_one_proxy_listed_with_two_credentials_never_overlaps_on_a_site(tmp_path, redis_server_env):
    children: list[subprocess.Popen] = []
    server = RedisServer().start()
    try:
        children.append(_spawn([sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--port", "0",
                                "--log", str(tmp_path / "site.log"), "--ready-file", str(tmp_path / "site.ready"),
                                "--sites", ",".join(SITES), "--pages-per-site", str(PAGES), "--latency", "0.4",
                                "--min-interval", "0", "--burnt", ""], tmp_path / "site.out"))
        site_port = int(_wait_file(tmp_path / "site.ready", children[-1]).strip())
        children.append(_spawn([sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count", "1",
                                "--auth", "0", "--dead", "0", "--slow", "0", "--site-port", str(site_port),
                                "--proxy-file", str(tmp_path / "proxies.txt"),
                                "--ready-file", str(tmp_path / "proxies.ready")], tmp_path / "proxies.out"))
        _wait_file(tmp_path / "proxies.ready", children[-1])
        address = (tmp_path / "proxies.txt").read_text().split()[0].split("://", 1)[1]
        entries = f"http://crawler:OldPw1@{address} http://crawler:NewPw2@{address}"
        log = tmp_path / "crawl.log"
        proc = subprocess.run(
            [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"sites={','.join(SITES)}", "-a", f"pages={PAGES}",
             "-a", "flows=0", "-s", f"PROXY_SHARD_PROXIES={entries}", "-s", "PROXY_SHARD_MIN_INTERVAL=0",
             "-s", "PROXY_SHARD_MAX_WAIT=20",
             "-s", "PROXY_SHARD_HOST_ID=host-0", "--logfile", str(log)],
            cwd=PROJECT, env={**os.environ, "PROXY_SHARD_REDIS_URL": server.url}, timeout=90,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        for child in reversed(children):
            _stop(child)
        server.stop()
    text = log.read_text()
    site_log = read_log(tmp_path / "site.log")
    pages = {(e["site"], e["path"]) for e in site_log if e["kind"] == "page" and e["status"] == 200}
    overlaps, examples = find_overlaps(site_log)
    assert {e["ip"] for e in site_log} == {"127.0.0.11"}  # through the proxy, never from the host itself
    assert overlaps == 0, (overlaps, [str(x) for x in examples])
    assert proc.returncode == 0, text[-3000:]
    assert len(pages) == len(SITES) * PAGES, text[-3000:]
    warnings = [line for line in text.splitlines() if "listed twice" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "entry 2" in warnings[0], warnings
    assert "OldPw1" not in text and "NewPw2" not in text
