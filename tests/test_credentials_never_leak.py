"""Credentials never leak: proxies with distinctive passwords (and a Redis with one) go through a real
crawl, every CLI command and the exporter; then everything they wrote is searched for the passwords:
stdout, stderr, the crawl log (DEBUG), stats, items, /metrics, and every Redis key name and value
except the one hash whose job is to hold the proxy URLs.

The run happens once per module (``leak_run``); each surface is then its own named test, so a
failure says where the password showed up."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from scrapy_proxy_shard.demo.redis_server import RedisServer, free_port
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.ops.cli import cli as cli_group
from scrapy_proxy_shard.ops.exporter import serve

pytestmark = pytest.mark.slow
PROJECT = Path(__file__).resolve().parents[1] / "example_project"
NS = "shardshop"  # the example project's namespace
REDIS_PASSWORD = "RedisCanary-5hQ"
PASSWORDS = {"canary-a": "ProxyCanary-A1", "canary-b": "ProxyCanary-B2", "canary-c": "ProxyCanary-C3",
             "canary-d": "ProxyCanary-D4", "canary-x": "ProxyCanary-X9"}
CANARIES = [REDIS_PASSWORD, *PASSWORDS.values(),
            *(base64.b64encode(f"{u}:{p}".encode()).decode() for u, p in PASSWORDS.items())]

FLEET = """
import asyncio, json, sys
from scrapy_proxy_shard.demo.forward_proxy import ProxyFleet, ProxySpec, site_hosts
from scrapy_proxy_shard.demo.httpkit import run_until_signalled, write_file_atomically
site_port, out = int(sys.argv[1]), sys.argv[2]
specs = [ProxySpec("127.0.0.41", "canary-a", "ProxyCanary-A1"), ProxySpec("127.0.0.42", "canary-b", "ProxyCanary-B2"),
         ProxySpec("127.0.0.43"), ProxySpec("127.0.0.44", "canary-c", "ProxyCanary-C3")]
fleet = ProxyFleet(specs, site_hosts(site_port))
asyncio.run(run_until_signalled(fleet, lambda: write_file_atomically(out, json.dumps(fleet.proxy_urls()))))
"""


class Outputs:
    """Everything a person or a log could see, collected for the final search, by surface."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.surfaces: dict[str, str] = {}  # text name -> surface ("crawl", "cli", "metrics", "redis")

    def add(self, name: str, text: str, surface: str) -> str:
        key = f"{name}#{len(self.texts)}"
        self.texts[key] = text
        self.surfaces[key] = surface
        return text

    def leaks(self, surface: str | None = None) -> list[str]:
        return [f"{canary} in {name}" for name, text in self.texts.items() for canary in CANARIES
                if canary in text and surface in (None, self.surfaces[name])]


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_with_password():
    server = RedisServer().start()
    redis.Redis(port=server.port).config_set("requirepass", REDIS_PASSWORD)
    yield server, f"redis://:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"
    server.stop()


@pytest.fixture(scope="module")
def site_and_proxies(tmp_path_factory):
    """The demo anti-bot site (127.0.0.42 already blacklisted), four local proxies (three with auth) and a
    dead one: the datacenter pool gets the first three and the dead one, the residential pool the fourth
    (one IP in two pools would be two uncoordinated users of it, and the site would ban it)."""
    tmp_path = tmp_path_factory.mktemp("site")
    children = []
    try:
        ready = tmp_path / "site.ready"
        children.append(subprocess.Popen(
            [sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--port", "0", "--ready-file", str(ready),
             "--sites", "shop-a.test", "--pages-per-site", "20", "--flow-steps", "2",
             "--log", str(tmp_path / "site.log"), "--burnt", "shop-a.test=127.0.0.42"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        site_port = int(_wait_file(ready, children[-1]).split()[0])
        urls_file = tmp_path / "fleet.json"  # holds the passwords: not searched
        children.append(subprocess.Popen([sys.executable, "-c", FLEET, str(site_port), str(urls_file)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        urls = json.loads(_wait_file(urls_file, children[-1]))
        dead = f"http://canary-d:{PASSWORDS['canary-d']}@127.0.0.1:{free_port()}"  # connection refused
        yield {"datacenter": [*urls[:3], dead], "residential": urls[3:]}
    finally:
        for child in reversed(children):
            _stop(child)


class LeakRun:
    """What one run of crawl + CLI + exporter left behind, and the facts the named tests check."""

    def __init__(self) -> None:
        self.out = Outputs()
        self.facts: dict[str, object] = {}


@pytest.fixture(scope="module")
def leak_run(tmp_path_factory, redis_with_password, site_and_proxies) -> LeakRun:
    """Load, crawl, run every CLI command and scrape the exporter once, collecting every output."""
    tmp_path = tmp_path_factory.mktemp("leak")
    _server, url = redis_with_password
    run = LeakRun()
    out, facts = run.out, run.facts
    env = {**os.environ, "PROXY_SHARD_REDIS_URL": url, "PROXY_SHARD_NAMESPACE": NS}

    def cli(*args: str, stdin: str | None = None, code: int | None = 0) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "scrapy_proxy_shard", *args], env=env, input=stdin,
                              capture_output=True, text=True, timeout=60)
        out.add(f"cli {' '.join(args)} stdout", proc.stdout, "cli")
        out.add(f"cli {' '.join(args)} stderr", proc.stderr, "cli")
        if code is not None:
            assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        return proc

    def quick_cli(*args: str):
        result = CliRunner().invoke(cli_group, list(args), env={"PROXY_SHARD_REDIS_URL": url,
                                                                "PROXY_SHARD_NAMESPACE": NS})
        out.add(f"quick cli {' '.join(args)} stdout", result.stdout, "cli")
        out.add(f"quick cli {' '.join(args)} stderr", result.stderr, "cli")
        return result

    for pool, urls in site_and_proxies.items():
        assert any(p in "".join(urls) for p in PASSWORDS.values())
        cli("--pool", pool, "load", "-", stdin="\n".join(urls) + "\n")
    bad_line = f"socks5://canary-x:{PASSWORDS['canary-x']}@10.0.0.1:1080\nhttp://canary-x:{PASSWORDS['canary-x']}@h:0\n"
    facts["bad load stderr"] = cli("--pool", "datacenter", "load", "-", stdin=bad_line, code=2).stderr

    crawl = subprocess.Popen(
        [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", "sites=shop-a.test", "-a", "pages=20", "-a", "flows=1",
         "-a", "flow_steps=2", "-s", "PROXY_SHARD_HOST_ID=leak-host", "-s", "PROXY_SHARD_HEARTBEAT_INTERVAL=0.2",
         "-s", "PROXY_SHARD_LOGSTATS_INTERVAL=0.5", "-s", "LOG_LEVEL=DEBUG", "-s", "PROXY_SHARD_MAX_WAIT=20",
         "--logfile", str(tmp_path / "crawl.log"), "-O", str(tmp_path / "items.jsonl")],
        cwd=PROJECT, env={**env, "STATS_DUMP_FILE": str(tmp_path / "stats.json")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen_live = False  # the CLI (in this process: quick enough to catch the crawl) sees it live
        deadline = time.monotonic() + 60
        while crawl.poll() is None and time.monotonic() < deadline and not seen_live:
            hosts = quick_cli("hosts", "--json")
            seen_live = hosts.exit_code == 0 and any(h["host"] == "leak-host" for h in json.loads(hosts.stdout))
            time.sleep(0.05)
        for args in (["status", "--proxies"], ["sessions"], ["hosts"]):
            quick_cli(*args)
        stdout, stderr = crawl.communicate(timeout=120)
    finally:
        _stop(crawl)
    out.add("crawl stdout", stdout, "crawl")
    out.add("crawl stderr", stderr, "crawl")
    log = out.add("crawl log", (tmp_path / "crawl.log").read_text(), "crawl")
    assert crawl.returncode == 0, log[-3000:]  # the crawl ran: every later check depends on it
    facts.update(seen_live=seen_live, log=log)
    facts["stats"] = json.loads(out.add("stats", (tmp_path / "stats.json").read_text(), "stats"))
    out.add("items", (tmp_path / "items.jsonl").read_text(), "stats")
    facts["list stdout"] = cli("list").stdout

    # Every CLI view and change, naming proxies by URL (with its password) where a command takes one.
    with_password = next(u for u in site_and_proxies["datacenter"] if PASSWORDS["canary-a"] in u)
    cli("watch", "--iterations", "1", "--proxies")
    cli("--pool", "datacenter", "ban", with_password, "--site", "shop-a.test", "--reason", "leak test")
    for args in (["status"], ["status", "--json", "--proxies"], ["sessions", "--json"], ["pools"], ["list", "--json"],
                 ["--pool", "datacenter", "unban", "--all", with_password],
                 ["--pool", "datacenter", "ban", "http://canary-x:ProxyCanary-X9@10.9.9.9:1"],
                 ["--pool", "datacenter", "remove", with_password],
                 ["--pool", "datacenter", "add", "--type", "datacenter", with_password]):
        quick_cli(*args)
    down = {**env, "PROXY_SHARD_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"}
    proc = subprocess.run([sys.executable, "-m", "scrapy_proxy_shard", "status"], env=down, capture_output=True,
                          text=True, timeout=60)
    out.add("cli redis down", proc.stdout + proc.stderr, "cli")
    facts["redis down"] = proc

    # The exporter, scraped over HTTP.
    client = redis.Redis.from_url(url, decode_responses=True)
    metrics_server, thread = serve(PoolStore(client, namespace=NS), port=free_port())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_server.server_address[1]}/metrics") as response:
            facts["metrics"] = out.add("metrics", response.read().decode(), "metrics")
    finally:
        metrics_server.shutdown()
        metrics_server.server_close()
        thread.join(5)

    # Redis: key names, and every value outside the proxies hash.
    holders = []
    for key in client.scan_iter("*"):
        out.add("redis key name", key, "redis")
        kind = client.type(key)
        dump = {"string": lambda k: client.get(k), "hash": client.hgetall, "zset": lambda k: client.zrange(k, 0, -1),
                "list": lambda k: client.lrange(k, 0, -1), "set": client.smembers}[kind](key)
        if any(c in repr(dump) for c in CANARIES):
            holders.append(key)
    facts["holders"] = holders
    client.close()
    return run


def test_the_crawl_log_and_console_show_no_password(leak_run):
    log = leak_run.facts["log"]
    assert "proxy_shard: leak-host:" in log  # the periodic pool line was written
    assert not leak_run.out.leaks("crawl"), leak_run.out.leaks("crawl")


def test_stats_and_items_show_no_password(leak_run):
    stats = leak_run.facts["stats"]
    assert stats.get("proxy_shard/leases", 0) > 0 and stats.get("proxy_shard/bans", 0) > 0, stats
    assert not leak_run.out.leaks("stats"), leak_run.out.leaks("stats")


def test_cli_output_shows_no_password(leak_run):
    facts = leak_run.facts
    assert facts["seen_live"]  # the CLI watched the crawl while it ran
    assert "<stdin>:1:" in facts["bad load stderr"] and "<stdin>:2:" in facts["bad load stderr"]
    assert "http://***:***@127.0.0.1:" in facts["list stdout"]
    down = facts["redis down"]
    assert down.returncode == 1 and "redis://***:***@127.0.0.1:" in down.stderr
    assert not leak_run.out.leaks("cli"), leak_run.out.leaks("cli")


def test_exporter_metrics_show_no_password(leak_run):
    assert 'proxy_shard_proxies{pool="datacenter"}' in leak_run.facts["metrics"]
    assert not leak_run.out.leaks("metrics"), leak_run.out.leaks("metrics")


def test_redis_holds_passwords_only_in_the_proxies_hashes(leak_run):
    assert set(leak_run.facts["holders"]) == {f"{{{NS}:datacenter}}:proxies", f"{{{NS}:residential}}:proxies"}
    assert not leak_run.out.leaks("redis"), leak_run.out.leaks("redis")


def test_every_surface_was_searched(leak_run):
    """The searches above mean something only if the run produced output on every surface."""
    assert set(leak_run.out.surfaces.values()) == {"crawl", "stats", "cli", "metrics", "redis"}
    assert not leak_run.out.leaks(), leak_run.out.leaks()
    assert len(leak_run.out.texts) > 40


# --- every error path, with secret-bearing input -------------------------------------------------

SECRET = "Sweep-Secret-7Q"
SPIDER = """
import scrapy

class Sweep(scrapy.Spider):
    name = "sweep"
    start_urls = ["http://shop.invalid/"]
    custom_settings = {"DOWNLOADER_MIDDLEWARES": {"scrapy_proxy_shard.middlewares.ProxyShardMiddleware": 610,
                                                  "scrapy_proxy_shard.middlewares.BanDetectionMiddleware": 620}}

    def parse(self, response):
        pass
"""
#: Settings values that carry SECRET and are wrong in some way: each must fail with a message that
#: names the setting and never shows SECRET.
BAD_SETTINGS = [
    {"PROXY_SHARD_REDIS_URL": f"http://u:{SECRET}@h:1"},
    {"PROXY_SHARD_REDIS_URL": f"redis://h:1/0?password={SECRET}".encode()},
    {"PROXY_SHARD_REDIS_PARAMS": f'{{"password": "{SECRET}"'},
    {"PROXY_SHARD_REDIS_PARAMS": [f"password={SECRET}"]},
    {"PROXY_SHARD_REDIS_SENTINELS": [f"u:{SECRET}@h:x"], "PROXY_SHARD_REDIS_SENTINEL_MASTER": "m"},
    {"PROXY_SHARD_REDIS_SENTINELS": [f"u:{SECRET}"], "PROXY_SHARD_REDIS_SENTINEL_MASTER": "m"},
    {"PROXY_SHARD_PROXIES": f"http://u:a,{SECRET}@10.0.0.1:80,http://u:{SECRET},b@10.0.0.2:80"},
    {"PROXY_SHARD_PROXIES": [f"http://u:{SECRET}"]},
    {"PROXY_SHARD_PROXIES": [f"u:{SECRET}"]},
    {"PROXY_SHARD_PROXIES": [f"10.0.0.1:80:{SECRET}"]},
    {"PROXY_SHARD_PROXIES": [f"10.0.0.1:8O:u:{SECRET}"]},
    {"PROXY_SHARD_PROXIES": [f"socks5://u:{SECRET}@10.0.0.1:80"]},
    {"PROXY_SHARD_PROXIES": {"dc": [f"http://u:{SECRET}@010.0.0.1:80"]}},
    # gateway entries (engine/gateway.py): a password beside the placeholder, or in place of the count
    {"PROXY_SHARD_PROXIES": [f"http://u-{{session}}:{SECRET}@gw:1#sessions=0"]},
    {"PROXY_SHARD_PROXIES": [f"http://u-{{session}}:{SECRET}-{{session}}@gw:1#sessions=2"]},
    {"PROXY_SHARD_PROXIES": [f"http://u-{{session}}:pw@gw:1#sessions={SECRET}"]},
    {"PROXY_SHARD_PROXIES": [f"http://u-{{session}}:{SECRET}@gw#sessions=2"]},
    {"PROXY_SHARD_PROXIES": [{"url": f"http://u-{{session}}:{SECRET}@gw:1", "sessions": "many"}]},
    {"PROXY_SHARD_PROXIES": [{"url": f"http://u-{{session}}:{SECRET}@gw:1", "session": 2}]},
]


@pytest.mark.parametrize("bad", BAD_SETTINGS, ids=lambda b: next(iter(b)))
def test_setting_errors_never_show_the_secret(bad):
    from scrapy_proxy_shard.exceptions import SettingError
    from scrapy_proxy_shard.modes.connection import async_client
    from scrapy_proxy_shard.settings import ShardSettings

    with pytest.raises(SettingError) as info:
        async_client(ShardSettings.from_settings(bad))
    assert next(iter(bad)) in str(info.value) or "PROXY_SHARD_REDIS_URL" in str(info.value)
    assert SECRET not in str(info.value), str(info.value)


def test_cli_error_paths_never_show_the_secret(tmp_path, redis_server):
    down = f"redis://127.0.0.1:{free_port()}/0"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(f"http://u:{SECRET}\xe9@10.0.0.1:80\n".encode("latin-1"))
    bad_list = tmp_path / "bad.txt"
    bad_list.write_text("".join(f"{e}\n" for e in (f"http://u:{SECRET}", f"u:{SECRET}", f"10.0.0.1:80:{SECRET}",
                                                   f"10.0.0.1:80:u:{SECRET}:x y", f"http://u:{SECRET}@10.0.0.1:80/x")))
    busy = socket.create_server(("127.0.0.1", 0))  # metrics cannot listen there: exit 1
    runs = [
        ("--redis-url", f"{down}?password={SECRET}", "status"),
        ("--redis-url", f"redis://:{SECRET}@127.0.0.1:{free_port()}/0", "pools"),
        ("--redis-url", f"{down}?password={SECRET}", "metrics", "--port", str(busy.getsockname()[1])),
        ("--redis-url", f"http://u:{SECRET}@h:1", "status"),
        ("--redis-url", f"{redis_server.url}?password={SECRET}", "add", f"http://u:{SECRET}", f"u:{SECRET}",
         f"10.0.0.1:80:{SECRET}", f"socks5://u:{SECRET}@h:1"),
        ("--redis-url", redis_server.url, "load", str(bad_list)),
        ("--redis-url", redis_server.url, "load", str(latin1)),
        ("--redis-url", redis_server.url, "ban", f"http://u:{SECRET}@10.0.0.1:80", "--site", "*"),
        ("--redis-url", redis_server.url, "remove", f"http://u:{SECRET}@10.0.0.1:80", f"u:{SECRET}"),
        ("--redis-url", redis_server.url, "--sentinels", f"u:{SECRET}@h:x", "--sentinel-master", "m", "status"),
    ]
    with busy:
        procs = [subprocess.run([sys.executable, "-m", "scrapy_proxy_shard", *args], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "PROXY_SHARD_NAMESPACE": "sweep"}) for args in runs]
    for args, proc in zip(runs, procs, strict=True):
        shown = proc.stdout + proc.stderr
        assert proc.returncode in (1, 2), (args[-1], shown)
        assert "Traceback" not in shown and shown.strip(), (args[-1], shown)
        assert SECRET not in shown, (args[-1], shown)


@pytest.mark.parametrize("settings", [
    {"PROXY_SHARD_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0?password={SECRET}"},
    {"PROXY_SHARD_REDIS_URL": f"redis://u:{SECRET}@127.0.0.1:{free_port()}/0"},
    {"PROXY_SHARD_MODE": "embedded", "PROXY_SHARD_PROXIES": f"http://u:{SECRET},{SECRET}@10.0.0.1:80,10.0.0.2:80"},
    {"PROXY_SHARD_MODE": "embedded", "PROXY_SHARD_PROXIES": f"10.0.0.1:80:u:{SECRET} http://u:{SECRET}"},
], ids=["redis-query-password", "redis-userinfo", "proxies-comma", "proxies-no-host"])
def test_the_spider_log_never_shows_the_secret(tmp_path, settings):
    (tmp_path / "sweep.py").write_text(SPIDER)
    args = [arg for name, value in settings.items() for arg in ("-s", f"{name}={value}")]
    proc = subprocess.run([sys.executable, "-m", "scrapy", "runspider", "sweep.py", "-s", "LOG_LEVEL=DEBUG",
                           "-s", "TELNETCONSOLE_ENABLED=False", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert "proxy_shard" in log and "ERROR" in log, log[-3000:]  # the crawl did take the error path
    assert SECRET not in log, log[-3000:]


ADDON_SPIDER = """
import scrapy

class Sweep(scrapy.Spider):
    name = "sweep"
    start_urls = ["http://shop.invalid/"]
    custom_settings = {"ADDONS": {"scrapy_proxy_shard.addon.ProxyShardAddon": 0}}

    def parse(self, response):
        pass
"""


@pytest.mark.parametrize("kind", ["bad-lines", "two-urls-one-exit"])
def test_a_proxy_list_file_never_shows_the_secret(tmp_path, kind):
    """Issue 21: PROXY_SHARD_PROXIES_PATH, through a real crawl at DEBUG: bad lines (the crawl does not
    start) and a file naming one exit twice with two passwords (a WARNING names both, masked)."""
    port = free_port()  # nothing listens: every request fails at once
    text = {"bad-lines": f"10.0.0.1:80\nhttp://u:{SECRET}\nu:{SECRET}\n10.0.0.1:80:{SECRET}\n",
            "two-urls-one-exit": f"# one exit\nhttp://u:{SECRET}@127.0.0.1:{port}\nhttp://u:{SECRET}2@127.0.0.1:{port}\n"}
    (tmp_path / "proxies.txt").write_text(text[kind])
    (tmp_path / "sweep.py").write_text(ADDON_SPIDER)
    proc = subprocess.run([sys.executable, "-m", "scrapy", "runspider", "sweep.py", "-s", "LOG_LEVEL=DEBUG",
                           "-s", "TELNETCONSOLE_ENABLED=False", "-s", "PROXY_SHARD_MODE=embedded",
                           "-s", "PROXY_SHARD_PROXIES_PATH=proxies.txt", "-s", "RETRY_ENABLED=False",
                           "-s", "DOWNLOAD_TIMEOUT=5", "-s", "PROXY_SHARD_MAX_WAIT=2",
                           "-s", "PROXY_SHARD_PAUSE_HORIZON=1", "-s", "CLOSESPIDER_TIMEOUT=10"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    if kind == "bad-lines":
        assert proc.returncode != 0 and "proxy_shard: cannot start: PROXY_SHARD_PROXIES_PATH: " in log, log[-3000:]
    else:
        assert "line 3 (http://***:***@127.0.0.1" in log and "replaces line 2" in log, log[-3000:]
    assert SECRET not in log, log[-3000:]
