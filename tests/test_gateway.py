"""Gateway entries (engine/gateway.py): parsing, slots, rotation on the store (every backend of the
contract suite: fakeredis, each redis-server line, a cluster), the rotation budget, one request at a
time per slot, shared exit IPs, and the crawl-side decisions (crawl/gateways.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import fakeredis
import pytest
from click.testing import CliRunner
from scrapy.settings import Settings

from scrapy_proxy_shard.crawl.gateways import GatewayRuntime
from scrapy_proxy_shard.demo.gateway_proxy import GatewayProxy
from scrapy_proxy_shard.engine.gateway import (
    GatewayOptions,
    expand_entry,
    mask_entry,
    parse_gateway,
    slot_of,
)
from scrapy_proxy_shard.engine.proxies import make_proxy, parse_proxy
from scrapy_proxy_shard.engine.proxyfile import parse_proxy_list
from scrapy_proxy_shard.engine.store import AsyncPoolStore, PoolStore
from scrapy_proxy_shard.exceptions import ProxyURLError, SettingError
from scrapy_proxy_shard.modes.pools import initial_proxies
from scrapy_proxy_shard.ops.cli import cli
from scrapy_proxy_shard.settings import ShardSettings

ENTRY = "http://user-session-{session}:S3cretPw@gw.example:7777#sessions=5"
SECRET = "S3cretPw"


# --- parsing ------------------------------------------------------------------------------------------

def test_a_gateway_entry_expands_to_n_slots_with_distinct_tokens_and_ids():
    slots = expand_entry(ENTRY)
    assert len(slots) == 5 and len({p.id for p in slots}) == 5
    tokens = [slot_of(p.url).token for p in slots]
    assert len(set(tokens)) == 5 and all((t.isalnum() and t.islower()) or t.isdigit() for t in tokens)
    for p, token in zip(slots, tokens, strict=True):
        assert f"user-session-{token}:{SECRET}@gw.example:7777" in p.url
        assert SECRET not in repr(p) and SECRET not in p.masked
        assert p.exit.startswith("gw.example:7777#gw.")


def test_a_slot_keeps_its_id_when_its_token_changes():
    spec = parse_gateway(ENTRY)
    first, again = spec.slot(3, "aaaaaaaaaaaa"), spec.slot(3, "bbbbbbbbbbbb")
    assert first.url != again.url and first.id == again.id
    assert spec.slot(2, "aaaaaaaaaaaa").id != first.id
    # a new password keeps the gateway (and its slots); another user name is another gateway
    assert parse_gateway(ENTRY.replace(SECRET, "Other")).slot(3).id == first.id
    assert parse_gateway(ENTRY.replace("user-", "user-country-de-")).slot(3).id != first.id


def test_a_placeholder_in_the_host_or_password_works_too():
    in_host = parse_gateway("http://u:pw@{session}.gw.example:7777#sessions=2")
    slot = in_host.slot(1, "abcdefabcdef")
    assert "@abcdefabcdef.gw.example:7777" in slot.url
    assert slot.exit == "{session}.gw.example:7777#gw." + in_host.gid + ".1"
    in_password = parse_gateway("http://cust:pw-{session}@gw.example:7777#sessions=2").slot(1, "abcdefabcdef")
    assert ":pw-abcdefabcdef@" in in_password.url


def test_the_mapping_form_of_the_settings_is_the_same_gateway():
    spec = parse_gateway({"url": ENTRY.partition("#")[0], "sessions": 5})
    assert spec.gid == parse_gateway(ENTRY).gid and spec.sessions == 5


def test_a_gateway_without_placeholder_is_n_slots_of_one_url():
    slots = expand_entry("http://user:pw@rotating.example:8000#sessions=3")
    assert len({p.id for p in slots}) == 3 and len({p.url.partition("#")[0] for p in slots}) == 1
    assert all(slot_of(p.url).token is None for p in slots)


@pytest.mark.parametrize(("entry", "problem"), [
    ("http://u-{session}:{session}@gw:1#sessions=2", "{session} appears 2 times: write it once"),
    ("http://u-{session}:Sekr1t@gw:1#sessions=0", "must be a whole number from 1 to 10000"),
    ("http://u-{session}:Sekr1t@gw:1#sessions=-4", "must be a whole number from 1 to 10000"),
    ("http://u-{session}:Sekr1t@gw:1#sessions=fifty", "must be a whole number from 1 to 10000"),
    ("http://u-{session}:Sekr1t@gw:1#sessions=", "must be a whole number from 1 to 10000"),
    ("http://u-{session}:Sekr1t@gw:1", "needs its number of sessions: write #sessions=N"),
    ("http://u-{sess}:Sekr1t@gw:1#sessions=2", "unknown placeholder '{sess}'"),
    ("http://u-{session}:Sekr1t@gw#sessions=2", "missing port"),
    ("http://u-{session}:Sekr1t@gw:1#session=abc#sessions=2", "not both"),
    ({"url": "http://u-{session}:Sekr1t@gw:1", "sessions": "many"}, "must be a whole number"),
    ({"url": "http://u-{session}:Sekr1t@gw:1", "sessions": 0}, "must be a whole number"),
    ({"url": "http://u-{session}:Sekr1t@gw:1"}, "exactly the keys url and sessions"),
])
def test_bad_gateway_entries_give_one_line_naming_the_problem_and_the_fix(entry, problem):
    with pytest.raises(ProxyURLError) as info:
        parse_gateway(entry)
    text = str(info.value)
    assert problem in text and "\n" not in text
    assert "Sekr1t" not in text


def test_mask_entry_hides_credentials_and_keeps_the_shape():
    assert mask_entry(ENTRY) == "http://***:***@gw.example:7777#sessions=5"
    assert SECRET not in mask_entry({"url": ENTRY, "sessions": 3})


def test_a_list_file_line_gives_the_gateway_slots_and_csv_tags_apply():
    parsed = parse_proxy_list(f"# gateway\n{ENTRY}\nhttp://10.0.0.1:8080\n")
    assert not parsed.errors and len(parsed.proxies) == 6
    csv = parse_proxy_list(f"url,type\n{ENTRY},residential\n")
    assert len(csv.proxies) == 5 and {p.tags["type"] for p in csv.proxies} == {"residential"}
    bad = parse_proxy_list("http://u-{session}:pw@gw:1#sessions=0\n")
    assert bad.errors[0].line == 1 and "sessions" in bad.errors[0].message and "pw" not in bad.errors[0].message


def test_settings_take_gateway_entries_as_strings_or_mappings():
    settings = ShardSettings.from_settings(Settings({
        "PROXY_SHARD_PROXIES": [ENTRY, {"url": "http://u:pw@{session}.gw2.example:1", "sessions": 2},
                                "http://10.0.0.1:8080"],
    }))
    loaded = initial_proxies(settings)[settings.pool]
    assert len(loaded) == 5 + 2 + 1
    assert settings.gateway == GatewayOptions()


def test_a_bad_gateway_in_settings_stops_at_start_naming_entry_and_fix():
    with pytest.raises(SettingError) as info:
        ShardSettings.from_settings(Settings({"PROXY_SHARD_PROXIES": ["http://u-{session}:pw@gw:1#sessions=0"]}))
    assert "PROXY_SHARD_PROXIES['default'] entry 1" in str(info.value) and "#sessions=50" in str(info.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"PROXY_SHARD_GATEWAY_ROTATIONS": 0}, "PROXY_SHARD_GATEWAY_ROTATIONS (0) must be >= 1"),
    ({"PROXY_SHARD_GATEWAY_ROTATION_WINDOW": "soon"}, "PROXY_SHARD_GATEWAY_ROTATION_WINDOW ('soon') must be a number"),
    ({"PROXY_SHARD_GATEWAY_EXIT_HEADER": "X Exit"}, "PROXY_SHARD_GATEWAY_EXIT_HEADER ('X Exit') must be"),
])
def test_gateway_settings_are_checked(values, message):
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ShardSettings.from_settings(Settings(values))


def test_gateway_settings_are_read():
    s = ShardSettings.from_settings(Settings({"PROXY_SHARD_GATEWAY_ROTATIONS": 7,
                                              "PROXY_SHARD_GATEWAY_ROTATION_WINDOW": 60,
                                              "PROXY_SHARD_GATEWAY_EXIT_HEADER": "X-Exit-IP"}))
    assert s.gateway == GatewayOptions(rotations=7, window=60.0, exit_header="X-Exit-IP")
    assert s.gateway.budget(50) == 7 and GatewayOptions().budget(50) == 5 and GatewayOptions().budget(2) == 2


def test_static_entries_are_unchanged():
    assert expand_entry("http://u:p@10.0.0.1:80") == [make_proxy("http://u:p@10.0.0.1:80")]
    assert parse_proxy("http://u:p@h.example:1#session=abc").endswith("#session=abc")


# --- the store: every backend --------------------------------------------------------------------------

def _stored(store, pool, pid):
    return store.client.hget(f"{{t:{pool}}}:proxies", pid)


def test_adding_a_gateway_again_keeps_every_slot_token(make_store):
    store = make_store()
    first = store.add_proxies("gw", expand_entry(ENTRY))
    assert first.added == 5
    before = {p: _stored(store, "gw", p) for p in (x.id for x in expand_entry(ENTRY))}
    again = make_store("host-b").add_proxies("gw", expand_entry(ENTRY.replace(SECRET, "NewPw")))  # new tokens
    assert again.added == 0 and again.updated == 5
    for pid, url in before.items():
        now = _stored(store, "gw", pid)
        assert slot_of(now).token == slot_of(url).token and "NewPw" in now


def test_a_rotation_is_one_atomic_compare_and_set_seen_by_every_host(make_store):
    a, b = make_store("host-a"), make_store("host-b")
    a.add_proxies("gw", expand_entry(ENTRY))
    lease = a.lease("gw", "shop.example", ttl=30)
    old = slot_of(lease.proxy_url + "#session=" + lease.exit_session).token
    result = a.gateway_rotate("gw", lease.proxy_id, "shop.example", lease.proxy_url, rotations=5, window=60)
    assert result.status == "rotated" and result.count == 1
    new = slot_of(_stored(b, "gw", lease.proxy_id)).token
    assert new != old and new in _stored(b, "gw", lease.proxy_id).partition("#")[0]
    # the other host reports the same ban (the old token): nothing rotates twice
    assert b.gateway_rotate("gw", lease.proxy_id, "shop.example", lease.proxy_url, rotations=5,
                            window=60).status == "stale"
    # the lease issued with the old token is released later: the new token stays, the slot is free again
    assert a.release(lease, outcome="unknown").status == "ok"
    assert slot_of(_stored(a, "gw", lease.proxy_id)).token == new
    # every host's next lease of the slot goes out with the new token
    leases = [b.lease("gw", "other.example", ttl=30) for _ in range(5)]
    rotated = next(x for x in leases if x.proxy_id == lease.proxy_id)
    assert f"user-session-{new}:" in rotated.proxy_url and rotated.exit_session.endswith(new)


def test_the_rotation_budget_per_site_then_quarantine(make_store):
    store = make_store()
    store.add_proxies("gw", expand_entry(ENTRY))
    statuses = []
    for _ in range(4):
        lease = store.lease("gw", "strict.example", ttl=30)
        statuses.append(store.gateway_rotate("gw", lease.proxy_id, "strict.example", lease.proxy_url,
                                             rotations=3, window=60))
        store.release(lease, outcome="unknown")
    assert [r.status for r in statuses] == ["rotated", "rotated", "rotated", "cooldown"]
    assert statuses[-1].count == 3 and 0 < statuses[-1].left <= 60
    # another site has a budget of its own
    lease = store.lease("gw", "relaxed.example", ttl=30)
    assert store.gateway_rotate("gw", lease.proxy_id, "relaxed.example", lease.proxy_url, rotations=3,
                                window=60).status == "rotated"
    counters = store.client.hgetall("{t:gw}:counters")
    assert counters["gw_rot"] == "4" and counters["gw_cool"] == "1"


def test_a_clean_answer_through_the_gateway_on_the_site_starts_the_count_again(make_store):
    store = make_store()
    store.add_proxies("gw", expand_entry(ENTRY))
    statuses = []
    for n in range(4):
        lease = store.lease("gw", "fickle.example", ttl=30)
        statuses.append(store.gateway_rotate("gw", lease.proxy_id, "fickle.example", lease.proxy_url,
                                             rotations=2, window=60).status)
        store.release(lease, outcome="unknown")
        if n == 1:  # a fresh IP worked there
            ok = store.lease("gw", "fickle.example", ttl=30)
            store.release(ok, outcome="ok")
    assert statuses == ["rotated", "rotated", "rotated", "rotated"]
    # a clean answer on another site does not count for this one
    lease = store.lease("gw", "fickle.example", ttl=30)
    other = store.lease("gw", "calm.example", ttl=30)
    store.release(other, outcome="ok")
    assert store.gateway_rotate("gw", lease.proxy_id, "fickle.example", lease.proxy_url, rotations=2,
                                window=60).status == "cooldown"


def test_the_budget_comes_back_after_the_window(make_store):
    store = make_store()
    store.add_proxies("gw", expand_entry(ENTRY))
    lease = store.lease("gw", "s.example", ttl=30)
    assert store.gateway_rotate("gw", lease.proxy_id, "s.example", lease.proxy_url, rotations=1,
                                window=0.2).status == "rotated"
    sent = _stored(store, "gw", lease.proxy_id).partition("#")[0]
    assert store.gateway_rotate("gw", lease.proxy_id, "s.example", sent, rotations=1,
                                window=0.2).status == "cooldown"
    time.sleep(0.25)
    assert store.gateway_rotate("gw", lease.proxy_id, "s.example", sent, rotations=1,
                                window=0.2).status == "rotated"


def test_a_gateway_without_placeholder_counts_but_changes_nothing_and_statics_are_left_alone(make_store):
    store = make_store()
    store.add_proxies("gw", [*expand_entry("http://u:pw@rot.example:8000#sessions=2"), make_proxy("10.0.0.9:80")])
    seen = {}
    for _ in range(3):
        lease = store.lease("gw", "a.example", ttl=30)
        seen[lease.proxy_id] = store.gateway_rotate("gw", lease.proxy_id, "a.example", lease.proxy_url,
                                                    rotations=9, window=60).status
    assert sorted(seen.values()) == ["noop", "noop", "static"]


def test_a_gateway_slot_serves_one_request_at_a_time_across_sites(make_store):
    """The plan's concurrency limit: N sessions, N requests in flight at most, whatever the sites."""
    a, b = make_store("host-a"), make_store("host-b")
    a.add_proxies("gw", expand_entry("http://u-{session}:pw@gw.example:1#sessions=2"))
    held = [a.lease("gw", "one.example", ttl=30), b.lease("gw", "two.example", ttl=30)]
    assert len({h.proxy_id for h in held}) == 2
    wait = b.lease("gw", "three.example", ttl=30)
    assert not hasattr(wait, "proxy_id") and wait.firm is False and wait.wait <= 0.05
    a.release(held[0], outcome="ok")
    deadline = time.monotonic() + 2
    got = b.lease("gw", "three.example", ttl=30)
    while not hasattr(got, "proxy_id") and time.monotonic() < deadline:
        time.sleep(got.wait)
        got = b.lease("gw", "three.example", ttl=30)
    assert got.proxy_id == held[0].proxy_id


def test_a_sticky_session_on_a_slot_busy_elsewhere_waits_and_stays(make_store):
    store = make_store()
    store.add_proxies("gw", expand_entry("http://u-{session}:pw@gw.example:1#sessions=1"))
    first = store.lease("gw", "cart.example", ttl=30, session_id="cart-1")
    store.release(first, outcome="ok")
    other = store.lease("gw", "news.example", ttl=30)
    wait = store.lease("gw", "cart.example", ttl=30, session_id="cart-1")
    assert wait.reason == "session"
    store.release(other, outcome="ok")
    again = store.lease("gw", "cart.example", ttl=30, session_id="cart-1")
    assert again.proxy_id == first.proxy_id and not again.rebound


def test_two_slots_on_one_exit_ip_are_counted_and_one_rotates(make_store):
    store = make_store()
    store.add_proxies("gw", expand_entry(ENTRY))
    one = store.lease("gw", "a.example", ttl=30)
    two = store.lease("gw", "b.example", ttl=30)
    assert store.gateway_exit("gw", one.proxy_id, one.proxy_url, "203.0.113.7", ttl=60).status == "ok"
    assert store.gateway_exit("gw", one.proxy_id, one.proxy_url, "203.0.113.7", ttl=60).status == "ok"  # itself
    shared = store.gateway_exit("gw", two.proxy_id, two.proxy_url, "203.0.113.7", ttl=60)
    assert shared.status == "shared" and shared.other == one.proxy_id
    assert _stored(store, "gw", two.proxy_id).partition("#")[0] != two.proxy_url  # rotated
    assert store.gateway_exit("gw", two.proxy_id, two.proxy_url, "203.0.113.8", ttl=60).status == "stale"
    # once slot one has rotated away, its old record no longer counts
    store.gateway_rotate("gw", one.proxy_id, "a.example", one.proxy_url, rotations=9, window=60)
    three = store.lease("gw", "c.example", ttl=30)
    assert store.gateway_exit("gw", three.proxy_id, three.proxy_url, "203.0.113.7", ttl=60).status == "ok"
    assert store.client.hget("{t:gw}:counters", "gw_shared") == "1"


# --- the crawl side ---------------------------------------------------------------------------------------

class _Stats:
    def __init__(self):
        self.values = {}

    def inc_value(self, key, count=1):
        self.values[key] = self.values.get(key, 0) + count


def _runtime(options: GatewayOptions | None = None):
    options = options or GatewayOptions()
    client = fakeredis.FakeAsyncRedis(decode_responses=True)
    store = AsyncPoolStore(client, namespace="t", host_id="h")
    stats = _Stats()
    return GatewayRuntime(options, stats, lambda: store), store, stats


def test_a_ban_on_a_slot_rotates_until_the_budget_then_quarantines_and_says_so_once(caplog):
    async def run():
        gw, store, stats = _runtime(GatewayOptions(rotations=2, window=60))
        proxies = [*expand_entry(ENTRY), make_proxy("10.0.0.1:80")]
        gw.learn("gw", proxies)
        await store.add_proxies("gw", proxies)
        outcomes = []
        for _ in range(4):
            lease = await store.lease("gw", "strict.example", ttl=30)
            while not lease.exit_session:  # the static proxy: not a gateway slot
                assert await gw.on_ban(lease, "http_403") == "ban"
                await store.release(lease, outcome="unknown")
                lease = await store.lease("gw", "strict.example", ttl=30)
            outcomes.append(await gw.on_ban(lease, "http_403"))
            await store.release(lease, outcome="unknown")
        return outcomes, stats

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        outcomes, stats = asyncio.run(run())
    assert outcomes == ["unknown", "unknown", "ban", "ban"]
    assert stats.values["proxy_shard/gateway/rotations"] == 2
    assert stats.values["proxy_shard/gateway/cooldown_bans"] == 2
    text = caplog.text
    assert text.count("banned 2 fresh gateway IPs") == 1
    assert "gateway https://" not in text and SECRET not in text and "5 sessions" in text


def test_a_gateway_without_placeholder_is_announced_plainly(caplog):
    gw, _, _ = _runtime()
    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        gw.learn("gw", expand_entry("http://u:Pw9@rot.example:8000#sessions=4"))
    assert "NO per-IP guarantee" in caplog.text and "4 concurrent slots" in caplog.text and "Pw9" not in caplog.text


def test_an_exit_ip_header_is_reported_once_per_slot_and_token():
    async def run():
        gw, store, stats = _runtime(GatewayOptions(exit_header="X-Exit"))
        await store.add_proxies("gw", expand_entry(ENTRY))
        one = await store.lease("gw", "a.example", ttl=30)
        two = await store.lease("gw", "b.example", ttl=30)
        await gw.saw_response(one, {"X-Exit": b"198.51.100.1"})
        await gw.saw_response(one, {"X-Exit": b"198.51.100.1"})  # known: no second report
        await gw.saw_response(two, {"X-Exit": b"198.51.100.1"})
        await gw.saw_response(two, {})
        return stats.values

    values = asyncio.run(run())
    assert values["proxy_shard/gateway/exit_reports"] == 2
    assert values["proxy_shard/gateway/shared_exit"] == 1


# --- the demo gateway -----------------------------------------------------------------------------------

def test_the_demo_gateway_maps_tokens_to_addresses_and_shares_only_when_out_of_addresses():
    gw = GatewayProxy(["127.0.0.41", "127.0.0.42"], {})
    assert gw.exit_for("a") == "127.0.0.41" and gw.exit_for("a") == "127.0.0.41"
    assert gw.exit_for("b") == "127.0.0.42" and gw.shared == 0
    assert gw.exit_for("c") in ("127.0.0.41", "127.0.0.42") and gw.shared == 1
    assert gw.exit_for(None) != gw.exit_for(None)  # no session: a new address per request
    told = GatewayProxy(["127.0.0.41", "127.0.0.42", "127.0.0.43"], {}, collide=1)
    assert told.exit_for("a") == told.exit_for("b") == "127.0.0.41" and told.shared == 1
    assert told.exit_for("c") == "127.0.0.42"


# --- the command line -------------------------------------------------------------------------------------

def test_the_cli_adds_loads_and_removes_a_gateway_without_showing_its_password(redis_server, real_redis, tmp_path):
    env = {"PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_NAMESPACE": "gwcli"}

    def invoke(*args):
        result = CliRunner().invoke(cli, ["--pool", "res", *args], env=env, catch_exceptions=False)
        assert SECRET not in result.stdout + result.stderr
        return result

    store = PoolStore(real_redis, namespace="gwcli")
    added = invoke("add", ENTRY)
    assert added.exit_code == 0 and "5 added" in added.stdout and ".{session}" in added.stdout
    key = "{gwcli:res}:proxies"
    tokens = {p: slot_of(real_redis.hget(key, p)).token for p in real_redis.hkeys(key)}
    listing = tmp_path / "list.txt"
    listing.write_text(f"{ENTRY}\nhttp://u-{{session}}:{SECRET}@gw.example:7777#sessions=0\n")
    bad = invoke("load", str(listing))
    assert bad.exit_code != 0 and "list.txt:2: gateway" in bad.stderr and "1 to 10000" in bad.stderr
    listing.write_text(f"{ENTRY}\n")
    again = invoke("load", str(listing))
    assert again.exit_code == 0 and "0 new, 5 already there" in again.stdout
    assert {p: slot_of(real_redis.hget(key, p)).token for p in tokens} == tokens  # kept
    removed = invoke("remove", ENTRY.replace(SECRET, "whatever"))
    assert removed.exit_code == 0 and "5 proxies drained" in removed.stdout
    assert store.pool_size("res") == 0


# --- the local fallback -------------------------------------------------------------------------------------

def test_while_redis_is_away_a_ban_rotates_the_slot_in_the_local_slice(redis_server_env):
    import redis

    from scrapy_proxy_shard.demo.redis_server import RedisServer
    from scrapy_proxy_shard.engine.records import Lease
    from scrapy_proxy_shard.modes.fallback import FallbackPoolStore

    server = RedisServer().start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", expand_entry(ENTRY))

        async def scenario():
            settings = ShardSettings.from_settings({
                "PROXY_SHARD_REDIS_URL": server.url, "PROXY_SHARD_HOST_ID": "host-a", "PROXY_SHARD_HOSTS": ["host-a"],
                "PROXY_SHARD_FALLBACK_GRACE": 30, "PROXY_SHARD_FALLBACK_WARMUP": 0,
            })
            client = redis.asyncio.Redis.from_url(server.url, decode_responses=True, socket_connect_timeout=1)
            store = FallbackPoolStore(AsyncPoolStore(client, host_id="host-a", url_for_errors=server.url), settings)
            await store.release(await store.lease("default", "a.example", ttl=30))  # snapshot taken
            server.kill()
            local = await store.lease("default", "a.example", ttl=30)
            assert isinstance(local, Lease) and store.state == "fallback"
            gw, _, _ = _runtime(GatewayOptions(rotations=1))
            gw._store = lambda: store
            assert await gw.on_ban(local, "http_403") == "unknown"  # rotated in the local slice
            await store.release(local, outcome="unknown")
            seen = set()
            for _ in range(5):
                again = await store.lease("default", "b.example", ttl=30)
                seen.add((again.proxy_id, again.proxy_url))
                await store.release(again)
            rotated = {url for pid, url in seen if pid == local.proxy_id}
            assert rotated and local.proxy_url not in rotated
            await store.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()
