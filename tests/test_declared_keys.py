"""Every key a script touches is one its caller declared in KEYS (Redis's documented rule; Dragonfly and
some managed Redis services refuse the others).

A real redis-server is watched with MONITOR while the store runs every script (lease, release with each
outcome, sticky sessions and their rebinding, the circuit breaker, hold, abandon, bans, admin, heartbeats,
status, sites, the migration of an old pool): each command a script runs is shown after its EVALSHA,
and ``COMMAND GETKEYS`` (the server's own key specs) says which of its arguments are keys; each must be
one of the EVALSHA's declared keys. ``tests/test_schema.py`` checks the same statically on ``lua/``.
Dragonfly itself (which enforces the rule) is not installable here.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time

import pytest
import redis

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.breaker import BreakerOptions
from scrapy_proxy_shard.engine.gateway import expand_entry
from scrapy_proxy_shard.engine.scripts import OPERATIONS, function_library, script_source
from scrapy_proxy_shard.engine.store import Lease, LeaseWait, PoolStore

POOL = "main"
URLS = [f"http://10.2.0.{i}:8000" for i in range(1, 5)]
DONE = "declared-keys-monitor-done"
_ARG = re.compile(r'"((?:\\.|[^"\\])*)"')
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", '"': '"', "\\": "\\"}


def _unquote(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "x":
                out.append(chr(int(text[i + 2:i + 4], 16)))
                i += 4
                continue
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _parse(line: str) -> tuple[str, list[str]]:
    """A MONITOR line: (source, arguments); source "lua" for a command a script ran."""
    head, _, rest = line.partition("] ")
    source = head.rpartition(" ")[2]
    return source, [_unquote(a) for a in _ARG.findall(rest)]


class Monitor:
    """MONITOR on its own connection, read by a thread until the DONE marker comes by."""

    def __init__(self, url: str) -> None:
        self.conn = redis.Redis.from_url(url).connection_pool.get_connection()
        self.conn.send_command("MONITOR")
        assert self.conn.read_response() in (b"OK", "OK")
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            line = self.conn.read_response()
            line = line.decode("utf-8", "replace") if isinstance(line, bytes) else str(line)
            if DONE in line:
                return
            self.lines.append(line)

    def stop(self, client: redis.Redis) -> list[str]:
        client.echo(DONE)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "MONITOR never saw the end marker"
        self.conn.disconnect()
        return self.lines


def _calls(lines: list[str]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(script name, declared keys, commands the script ran) per EVALSHA/EVAL/FCALL, in order."""
    by_sha = {hashlib.sha1(script_source(name).encode()).hexdigest(): name for name in OPERATIONS}
    by_sha.update({function: op for op, function in function_library().functions.items()})
    calls: list[tuple[str, list[str], list[list[str]]]] = []
    for line in lines:
        source, args = _parse(line)
        if source == "lua":
            assert calls, f"a script command before any script call: {args}"
            calls[-1][2].append(args)
        elif args and args[0].upper() in ("EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO"):
            name = by_sha.get(args[1].lower(), "?") if args[0].upper().startswith(("EVALSHA", "FCALL")) else "eval"
            calls.append((name, args[3:3 + int(args[2])], []))
    return calls


def _keys_of(client: redis.Redis, command: list[str], cache: dict) -> list[str]:
    """The keys among a command's arguments, by the server's own key specs (COMMAND GETKEYS)."""
    try:
        return [k.decode() if isinstance(k, bytes) else k for k in client.command_getkeys(*command)]
    except redis.ResponseError as exc:  # TIME and other commands without key arguments
        if command[0].upper() not in cache.setdefault("keyless", set()):
            cache["keyless"].add(command[0].upper())
        assert "key" in str(exc).lower() or "invalid" in str(exc).lower(), exc
        return []


def _old_layout(client: redis.Redis, prefix: str, site: str) -> None:
    """What the version before lazy sites wrote: P:sites, no P:order, no P:site hash, no layout."""
    client.hset(f"{prefix}:{schema.LEGACY_SITES}", site, 1)
    client.delete(f"{prefix}:{schema.SITE}:{site}", f"{prefix}:{schema.ORDER}", f"{prefix}:{schema.SITEIDX}")
    client.hdel(f"{prefix}:{schema.META}", schema.META_LAYOUT, "seq")


def _cycle(url: str) -> None:
    """Every script, with the branches that touch the most keys."""
    client = redis.Redis.from_url(url, decode_responses=True)
    tokens = iter(f"tok{i}" for i in range(10_000))
    store = PoolStore(client, namespace="dk", host_id="h1", site_idle_ttl=60,
                      token_factory=lambda: next(tokens),
                      breakers=BreakerOptions(threshold=2, min_proxies=1, window=60, cooloff=0.05,
                                              max_cooloff=1, probes=1))
    store.add_proxies(POOL, URLS)
    # plain leases and every outcome
    for outcome in ("ok", "error", "unknown", "dead"):
        lease = store.lease(POOL, "a.example", ttl=5)
        assert isinstance(lease, Lease)
        store.release(lease, outcome=outcome, min_interval=0)
    # bans on one site open its breaker; its probe closes it
    for _ in range(2):
        store.release(store.lease(POOL, "b.example", ttl=5), outcome="ban", reason="http_403", ban_ttl=1)
    assert isinstance(store.lease(POOL, "b.example", ttl=5), LeaseWait)
    # a content check: suspect failures open a site's breaker (cause content); a pass, then trusted
    ids = [store.lease(POOL, "g.example", ttl=5).proxy_id for _ in range(2)]
    for pid in ids:
        store.content_check(POOL, "g.example", "fail", proxy_id=pid, check="'div.x'", suspects=2)
    store.content_check(POOL, "h.example", "pass")
    store.content_check(POOL, "h.example", "fail", proxy_id=ids[0], check="'div.x'")
    # learned site groups: three proxies rate-banned after a clean answer on one site while quarantined
    # on the other link the two (and the link restarts the group's adaptive pace)
    for pid in [p.id for p in store.list_proxies(POOL)][:3]:
        for site in ("k.example", "l.example"):
            client.hset(schema.pace_key(store.prefix(POOL), site), f"p:{pid}", "c")
            store.site_link(POOL, site, pid, quarantine=30, start=3.0, span=0)
    assert store.site_link(POOL, "-", "", quarantine=0).groups == {"l.example": "k.example"}
    # a proxy's requests in flight on other sites, whatever host leased them (overlap evidence)
    flying = store.lease(POOL, "m.example", ttl=5)
    assert store.in_flight(POOL, flying.proxy_id, ["m.example", "h.example"], flying.issued_at) == ["m.example"]
    store.release(flying)
    # sticky sessions: a use, its release, a rebind after a ban, the end
    sticky = store.lease(POOL, "c.example", ttl=5, session_id="s 1", session_ttl=60)
    store.release(sticky, min_interval=0, session_ttl=60)
    store.ban(POOL, sticky.proxy_id, site="c.example", ttl=30)
    again = store.lease(POOL, "c.example", ttl=5, session_id="s 1", session_ttl=60)
    assert isinstance(again, Lease) and again.rebound
    status = store.pool_status(POOL, "c.example", detail=True)
    assert status is not None and status.session == 1
    assert store.end_session(POOL, "c.example", "s 1", min_interval=1)
    store.unban(POOL, sticky.proxy_id, site="c.example")
    # a stale and an expired release, a WAIT with waiters announced
    first = store.lease(POOL, "d.example", ttl=0.001, concurrency=1)
    client.execute_command("PING")
    store.release(first)
    held = []
    while isinstance(got := store.lease(POOL, "e.example", ttl=30), Lease):
        held.append(got)
    assert got.reason == "held" and len(held) == len(URLS) - 1  # one proxy is quarantined proxy-wide
    for lease in held:
        store.release(lease, min_interval=0)
    # hold (adopting a local lease), abandon (a lease whose reply was lost), proxy-wide bans
    got = store.hold(POOL, "f.example", held[0].member, ttl=5)
    assert isinstance(got, Lease)
    assert isinstance(store.hold(POOL, "f.example", got.member, ttl=5, in_flight=True, token="ov"), LeaseWait)
    store.release(got)
    store.lift(POOL, "f.example", got.member, "ov")  # the overlapping local lease ended
    lost = store.lease(POOL, "f.example", ttl=5)
    store._in_doubt[lost.token] = (store.prefix(POOL), "f.example", "")
    lost_session = store.lease(POOL, "f.example", ttl=5, session_id="s2", session_ttl=60)
    store._in_doubt[lost_session.token] = (store.prefix(POOL), "f.example", "s2")
    store._in_doubt["never-ran"] = (store.prefix(POOL), "f.example", "")
    assert store.ping() and not store._in_doubt
    store.ban(POOL, URLS[0], reason="dead")
    store.unban(POOL, URLS[0])
    # admin and health
    store.remove_proxies(POOL, URLS[-1:])
    store.restore_pool(POOL, URLS[-1:])
    store.add_proxies(POOL, URLS[-1:])
    assert store.heartbeat(POOL, ttl=0.001) is not None
    other = PoolStore(client, namespace="dk", host_id="h2")
    time.sleep(0.01)  # h1's 1 ms heartbeat TTL has passed on the Redis clock (a PING alone can take less)
    assert other.heartbeat(POOL, ttl=30, info={"spider": "x"}).sites  # forgets h1 (dead) on the way
    assert [h.host for h in other.hosts(POOL)] == ["h2"]
    assert [row[0] for row in other.host_list(POOL)[1]] == ["h2"]  # the fallback's read, stamped
    assert "a.example" in other.sites(POOL)
    assert other.leave(POOL)
    # a site's tier on a tier list: an escalation, a probe claimed and answered
    tiers = (POOL, "dear")
    store.tier_step(tiers, "a.example", counts=[8, 0, 8, 0, 0, 0])
    store.tier_step(tiers, "a.example", probe_answer="ok", probe_tier=0, claim=True)
    # gateway slots (engine/gateway.py): one request at a time across sites, a rotation, its budget, a
    # clean answer that forgets it, a sticky use, exit IPs (one shared)
    slots = expand_entry("http://u-{session}:pw@gw.example:7777#sessions=2")
    store.add_proxies("gw", slots)
    store.add_proxies("gw", expand_entry("http://u-{session}:pw@gw.example:7777#sessions=2"))  # tokens kept
    one, two = store.lease("gw", "a.example", ttl=5), store.lease("gw", "b.example", ttl=5)
    assert isinstance(store.lease("gw", "c.example", ttl=5), LeaseWait)  # both slots busy elsewhere
    assert store.gateway_exit("gw", one.proxy_id, one.proxy_url, "192.0.2.1", ttl=60).status == "ok"
    assert store.gateway_exit("gw", two.proxy_id, two.proxy_url, "192.0.2.1", ttl=60).status == "shared"
    assert store.gateway_rotate("gw", one.proxy_id, "a.example", one.proxy_url, rotations=1,
                                window=60).status == "rotated"
    store.release(one, outcome="unknown")
    store.release(two, outcome="ok")
    again = store.lease("gw", "a.example", ttl=5, session_id="g1", session_ttl=60)
    assert store.gateway_rotate("gw", again.proxy_id, "a.example", again.proxy_url, rotations=1,
                                window=60).status == "cooldown"
    store.release(again, outcome="ok", session_ttl=60)
    # a pool of the previous layout is migrated by the first lease
    _old_layout(client, store.prefix(POOL), "a.example")
    assert isinstance(store.lease(POOL, "a.example", ttl=5), Lease)
    client.close()


def test_every_key_a_script_touches_is_declared(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    monitor = Monitor(redis_server.url)
    try:
        _cycle(redis_server.url)
    finally:
        lines = monitor.stop(client)
    calls = _calls(lines)
    assert {name for name, _, _ in calls} == set(OPERATIONS)  # every script ran (and is ours)
    cache: dict = {}
    undeclared = []
    touched_any = 0
    for name, declared, commands in calls:
        for command in commands:
            for key in _keys_of(client, command, cache):
                touched_any += 1
                if key not in declared:
                    undeclared.append((name, command[0], key))
    assert touched_any > 500
    assert not undeclared, undeclared[:10]
    client.close()


def test_the_check_sees_an_undeclared_key(redis_server):
    """The same check on a script that touches a key it was not given: it is reported."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    monitor = Monitor(redis_server.url)
    try:
        client.eval("redis.call('SET', KEYS[1] .. ':other', 'x') return redis.call('GET', KEYS[1])", 1, "{t}:k")
    finally:
        lines = monitor.stop(client)
    [(_, declared, commands)] = [c for c in _calls(lines) if c[0] == "eval"]
    touched = [key for command in commands for key in _keys_of(client, command, {})]
    assert declared == ["{t}:k"] and touched == ["{t}:k:other", "{t}:k"]
    client.close()


@pytest.mark.parametrize("line", ['1.5 [0 lua] "HGET" "{a:b}:x" "f\\"|\\x01"'])
def test_monitor_lines_are_parsed(line):
    assert _parse(line) == ("lua", ["HGET", "{a:b}:x", 'f"|\x01'])
