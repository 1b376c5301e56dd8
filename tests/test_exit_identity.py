"""One exit IP is one pool member, whatever its entries' credentials or scheme (issue 19, item 3).

Engine contract part: runs against fakeredis, each redis-server line and the cluster (``backend``).
"""

from __future__ import annotations

import hashlib
import logging

import pytest
from engine_clock import Clock, make_clock

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.proxies import make_proxy
from scrapy_proxy_shard.engine.store import Lease, LeaseWait
from scrapy_proxy_shard.modes.pools import initial_proxies
from scrapy_proxy_shard.ops.proxyfile import parse_proxy_list
from scrapy_proxy_shard.settings import ShardSettings

POOL = "exits"


def test_two_entries_for_one_exit_make_one_slot(store):
    """A password rotation and the https spelling of one host:port are one slot on a site."""
    result = store.add_proxies(POOL, ["http://u:old@10.9.0.1:3128", "https://u:new@10.9.0.1:3128"])
    assert (result.added, len(store.list_proxies(POOL))) == (1, 1)
    first = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(first, Lease)
    assert first.proxy_url == "https://u:new@10.9.0.1:3128"  # the later entry won
    second = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(second, LeaseWait) and second.reason == "held"


def test_adding_a_new_credential_replaces_in_place_and_keeps_the_slot_state(store):
    store.add_proxies(POOL, ["http://u:old@10.9.0.2:3128"])
    held = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(held, Lease)
    store.ban(POOL, held.proxy_id, site="b.example", ttl=60)
    result = store.add_proxies(POOL, ["http://u:new@10.9.0.2:3128"])
    assert (result.added, result.updated, result.replaced) == (0, 1, (held.proxy_id,))
    assert [r.proxy.url for r in store.list_proxies(POOL)] == ["http://u:new@10.9.0.2:3128"]
    # the same exit: still held on a.example by the running lease, still quarantined on b.example
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert isinstance(store.lease(POOL, "b.example", ttl=5), LeaseWait)
    assert store.release(held).status == "ok"
    again = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(again, Lease) and again.proxy_url == "http://u:new@10.9.0.2:3128"
    same = store.add_proxies(POOL, ["http://u:new@10.9.0.2:3128"])
    assert (same.added, same.updated, same.replaced) == (0, 1, ())


def test_declared_gateway_sessions_are_distinct_exits_and_leave_without_the_mark(store):
    store.add_proxies(POOL, ["http://user-session-abc:pw@gw.example:7777#session=abc",
                             "http://user-session-def:pw@gw.example:7777#session=def"])
    leases = [store.lease(POOL, "a.example", ttl=5) for _ in range(2)]
    assert all(isinstance(lease, Lease) for lease in leases)
    assert {lease.proxy_url for lease in leases} == {"http://user-session-abc:pw@gw.example:7777",
                                                     "http://user-session-def:pw@gw.example:7777"}
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)
    assert {r.proxy.masked for r in store.list_proxies(POOL)} == {"http://***:***@gw.example:7777#session=abc",
                                                                 "http://***:***@gw.example:7777#session=def"}


def test_removing_by_any_spelling_of_the_exit_drains_it(store):
    store.add_proxies(POOL, ["http://u:pw@10.9.0.3:3128"])
    assert store.remove_proxies(POOL, ["https://10.9.0.3:3128"]) == 1


def test_a_list_naming_one_exit_twice_keeps_the_later_and_warns_once_masked(caplog):
    text = "http://u:OldSecret@10.9.1.1:3128\n10.9.1.2:3128\nhttps://u:NewSecret@10.9.1.1:3128\n"
    parsed = parse_proxy_list(text)
    assert [p.url for p in parsed.proxies] == ["https://u:NewSecret@10.9.1.1:3128", "http://10.9.1.2:3128"]
    assert parsed.duplicates == 1 and len(parsed.replaced) == 1
    note = parsed.replaced[0]
    assert "line 3" in note and "line 1" in note and "10.9.1.1:3128" in note
    assert "Secret" not in note and "u:" not in note

    settings = ShardSettings.from_settings({"PROXY_SHARD_PROXIES": {"p1": ["http://u:OldSecret@10.9.2.1:3128",
                                                                       "https://u:NewSecret@10.9.2.1:3128"]}})
    with caplog.at_level(logging.WARNING, logger="scrapy_proxy_shard"):
        loaded = initial_proxies(settings)
        initial_proxies(settings)  # the same list again (a restore, the next spider) says nothing new
    assert [p.url for p in loaded["p1"]] == ["https://u:NewSecret@10.9.2.1:3128"]
    lines = [r.getMessage() for r in caplog.records if "10.9.2.1:3128" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "PROXY_SHARD_PROXIES['p1']" in lines[0] and "entry 2" in lines[0] and "entry 1" in lines[0]
    assert "Secret" not in caplog.text


@pytest.mark.parametrize("spelling", ["https://10.9.3.1:3128", "10.9.3.1:3128:alice:pw"])
def test_static_slices_count_one_exit_once(spelling):
    settings = ShardSettings.from_settings({"PROXY_SHARD_MODE": "static", "PROXY_SHARD_HOSTS": ["h1", "h2"],
                                        "PROXY_SHARD_HOST_ID": "h1",
                                        "PROXY_SHARD_PROXIES": ["http://10.9.3.1:3128", spelling]})
    other = ShardSettings.from_settings({"PROXY_SHARD_MODE": "static", "PROXY_SHARD_HOSTS": ["h1", "h2"],
                                     "PROXY_SHARD_HOST_ID": "h2",
                                     "PROXY_SHARD_PROXIES": ["http://10.9.3.1:3128", spelling]})
    slices = [initial_proxies(s).get("default", []) for s in (settings, other)]
    assert sorted(len(s) for s in slices) == [0, 1]  # the exit is on one host, once


@pytest.fixture
def clock(request, monkeypatch) -> Clock:
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    return make_clock(params.get("backend") == "fakeredis", monkeypatch)


def _url_id(url: str) -> str:
    """The id layout 2 gave a proxy: a hash of its whole URL, credentials included."""
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()


def test_a_pool_keyed_by_url_is_rekeyed_to_its_exits_keeping_bans(store, backend, clock):
    """A pool written before exits were the identity (layout 2) holds one exit twice: the first lease
    migrates it to one id per exit, carries a site quarantine over, and rests re-keyed proxies a lease TTL."""
    a, b, c = "http://u:old@10.9.4.1:3128", "http://u:new@10.9.4.1:3128", "http://10.9.4.2:3128"
    store.add_proxies(POOL, [c])
    prefix = store.prefix(POOL)
    proxies, order, meta = (schema.sub_key(prefix, name) for name in (schema.PROXIES, schema.ORDER, schema.META))
    backend.hdel(proxies, make_proxy(c).id)
    backend.zrem(order, make_proxy(c).id)
    for n, url in enumerate((a, b, c), start=10):
        backend.hset(proxies, _url_id(url), url)
        backend.zadd(order, {_url_id(url): n})
    backend.hset(meta, schema.META_LAYOUT, "2")
    store.ban(POOL, _url_id(c), site="a.example", ttl=60)

    rest = store.lease(POOL, "a.example", ttl=0.5)  # migrates first; every re-keyed proxy rests 0.5 s
    assert isinstance(rest, LeaseWait), rest
    assert backend.hget(meta, schema.META_LAYOUT) == schema.LAYOUT
    assert {r.id for r in store.list_proxies(POOL)} == {make_proxy(a).id, make_proxy(c).id}
    clock.sleep(0.6)
    lease = store.lease(POOL, "a.example", ttl=5)
    assert isinstance(lease, Lease) and lease.proxy_id == make_proxy(a).id and lease.proxy_url in (a, b)
    assert isinstance(store.lease(POOL, "a.example", ttl=5), LeaseWait)  # one slot for a/b; c quarantined here
    others = [store.lease(POOL, "b.example", ttl=5) for _ in range(3)]
    assert isinstance(others[2], LeaseWait)  # two exits, two slots on a site c is not quarantined on
    assert {x.proxy_id for x in others[:2]} == {make_proxy(a).id, make_proxy(c).id}
    assert not store.migrate(POOL)  # nothing left to do


def test_cli_add_and_load_say_replaced_for_a_new_credential_of_an_exit(redis_server, real_redis, tmp_path):
    from click.testing import CliRunner

    from scrapy_proxy_shard.ops.cli import cli

    env = {"PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_NAMESPACE": "exitcli"}

    def invoke(*args):
        result = CliRunner().invoke(cli, ["--pool", POOL, *args], env=env, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "OldPw" not in result.output + result.stderr and "NewPw" not in result.output + result.stderr
        return result

    first = invoke("add", "http://u:OldPw@10.9.5.1:3128", "10.9.5.2:3128")
    assert "2 added, 0 already there" in first.stdout
    again = invoke("add", "https://u:NewPw@10.9.5.1:3128", "http://u:NewPw2@10.9.5.2:3128", "10.9.5.2:3128")
    assert "0 added, 1 replaced, 1 already there" in again.stdout  # argument 3 replaced argument 2
    assert "replaced: same exit, new URL" in again.stdout
    assert "argument 3 (http://10.9.5.2:3128) replaces argument 2 (http://***:***@10.9.5.2:3128)" in again.stderr
    path = tmp_path / "proxies.txt"
    path.write_text("10.9.5.1:3128:u:OldPw\nhttp://10.9.5.3:3128\n")
    loaded = invoke("load", str(path))
    assert "2 proxies loaded (1 new, 1 replaced, 0 already there)" in loaded.stdout
    listed = invoke("list")
    assert listed.stdout.count("10.9.5.1:3128") == 1
