"""The Redis schema has one list of names: ``engine/schema.py``. The Lua scripts spell the same names as
literals, so these tests read ``engine/lua/`` and compare, both ways: a key suffix or counter field
written in Lua that schema.py does not name (a typo, or a new counter nobody reads) fails, and so
does a constant that no script uses (a reader that would read nothing)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fakeredis
import pytest

from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.ops.snapshot import read_pool

PACKAGE = Path(schema.__file__).resolve().parent.parent
LUA = {path.name: path.read_text(encoding="utf-8") for path in sorted((PACKAGE / "engine" / "lua").glob("*.lua"))}
STAT_HASHES = {"K_PSTATS": schema.PSTATS, "K_HSTATS": schema.HSTATS, "K_SSTATS": schema.SSTATS,
               "K_COUNTERS": schema.COUNTERS}
#: Python modules that read the schema: none may spell a key suffix or counter field itself.
READERS = ("engine/store.py", "ops/snapshot.py", "ops/views.py", "ops/exporter.py", "crawl/health.py")


def _code(source: str) -> str:
    """Lua source without comments (the layout comment in _lib.lua names every key in prose)."""
    return "\n".join(line.split("--", 1)[0] for line in source.splitlines())


def _calls_on(source: str, variable: str) -> list[tuple[str, str]]:
    """(command, the text of the remaining arguments) of every ``redis.call('H...', <variable>, ...)``,
    over several lines if need be."""
    found = []
    for match in re.finditer(r"redis\.call\('(H\w+)', " + variable + r"\b", source):
        depth, i = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        found.append((match.group(1), source[match.end():i - 1]))
    return found


def _lua_key_suffixes() -> set[str]:
    return {name for source in LUA.values() for name in re.findall(r"\bP \.\. ':([a-z_]+)", _code(source))}


def _lua_counter_fields() -> dict[str, set[str]]:
    """Counter fields each stat hash is written or read under, by hash."""
    fields: dict[str, set[str]] = {name: set() for name in STAT_HASHES.values()}
    for source in LUA.values():
        code = _code(source)
        for variable, hash_name in STAT_HASHES.items():
            for _, args in _calls_on(code, variable):
                if variable == "K_COUNTERS":
                    fields[hash_name].update(re.findall(r"^, '(\w+)'", args))
                else:  # "<owner>:<counter>", and a site's "ban:<reason>"
                    fields[hash_name].update(re.findall(r"\.\. ':(\w+)(?::|')", args))
                if "string.lower(status)" in args:
                    fields[hash_name].update(_release_statuses())
    return fields


def _release_statuses() -> set[str]:
    """The statuses release.lua counts under their own (lower-case) name: every one but OK."""
    code = _code(LUA["release.lua"])
    assert "if status ~= 'OK' then" in code
    return {s.lower() for s in re.findall(r"status = '([A-Z]+)'", code)} - {"ok"}


def test_every_key_suffix_in_lua_is_a_schema_constant_and_back():
    assert _lua_key_suffixes() == set(schema.KEY_SUFFIXES) | set(schema.LEGACY_KEY_SUFFIXES)
    assert len(set(schema.KEY_SUFFIXES)) == len(schema.KEY_SUFFIXES)


def test_every_counter_field_in_lua_is_a_schema_constant_and_back():
    fields = _lua_counter_fields()
    used = set().union(*fields.values())
    assert used <= {*schema.COUNTER_FIELDS, schema.LEGACY_HOST_BANNED}, used - set(schema.COUNTER_FIELDS)
    assert set(schema.COUNTER_FIELDS) <= used, set(schema.COUNTER_FIELDS) - used
    assert set(schema.COUNTER_HASHES) == set(STAT_HASHES.values())


def test_ban_and_banned_keep_one_meaning_on_every_scope():
    """``banned`` counts responses judged a ban (host, site); ``ban`` quarantines started (proxy, site):
    the counters written by release.lua for a ban verdict and by ban() for a quarantine never cross."""
    verdict = _code(LUA["release.lua"]).split("elseif outcome == 'ban'", 1)[1].split("elseif", 1)[0]
    assert re.findall(r"\.\. ':(\w+)'", verdict) == [schema.BANNED, schema.BANNED]
    started = _code(LUA["_lib.lua"]).split("local function ban(", 1)[1].split("\nend", 1)[0]
    assert set(re.findall(r"\.\. ':(\w+)(?::|')", started)) == {schema.QUARANTINES}
    old_name = [(command, args) for source in LUA.values() for command, args in _calls_on(_code(source), "K_HSTATS")
                if "':ban'" in args]
    # a host's old field is only read (always beside banned) or deleted with the host, never written
    assert {command for command, _ in old_name} == {"HMGET", "HDEL"}
    assert all("':banned'" in args for _, args in old_name)


def test_python_readers_spell_no_schema_name_themselves():
    """Counter fields where counters are read (``.get``, ``startswith``), key suffixes where keys are built."""
    checked = {"get": set(schema.COUNTER_FIELDS), "startswith": set(schema.COUNTER_FIELDS),
               "counters": set(schema.KEY_SUFFIXES), "sub_key": set(schema.KEY_SUFFIXES),
               "_Command": set(schema.KEY_SUFFIXES)}
    for relative in READERS:
        tree = ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in checked:
                names = checked[func]
                literals = [a.value for a in ast.walk(node) if isinstance(a, ast.Constant) and a.value in names]
                assert not literals, f"{relative}:{node.lineno} spells {literals}: use engine.schema"


@pytest.fixture
def store():
    return PoolStore(fakeredis.FakeRedis(decode_responses=True), namespace="t", host_id="h1")


def test_a_host_banned_count_written_before_the_rename_still_reads(store):
    """A pool written by an older version holds a host's banned responses as ``<host>:ban``: the
    heartbeat, the host list and the status read it as ``banned`` (no migration step)."""
    store.add_proxies("main", ["http://10.0.0.1:8080"])
    lease = store.lease("main", "a.example", ttl=5)
    store.release(lease, outcome="ban", reason="http_403")
    hstats = schema.sub_key(store.prefix("main"), schema.HSTATS)
    assert store.client.hgetall(hstats).get(schema.owned("h1", schema.BANNED)) == "1"
    store.client.hset(hstats, schema.owned("h1", schema.LEGACY_HOST_BANNED), 2)  # what an old version wrote
    assert store.heartbeat("main", ttl=30).bans == 3
    assert [h.bans for h in store.hosts("main")] == [3]
    snap = read_pool(store, "main")
    assert snap.host_outcomes("h1").banned == 3
    assert snap.site_outcomes("a.example").banned == 1
    assert snap.site_stats["a.example"][schema.QUARANTINES] == 1
    assert store.leave("main")
    assert not any(k.startswith("h1:") for k in store.client.hgetall(hstats))
