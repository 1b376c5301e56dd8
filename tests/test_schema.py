"""The Redis schema has one list of names: ``engine/schema.py``. The Lua scripts spell the counter fields
as literals, so these tests read ``engine/lua/`` and compare, both ways: a counter field written in Lua
that schema.py does not name (a typo, or a new counter nobody reads) fails, and so does a constant that
no script uses (a reader that would read nothing).

Keys are never spelled in Lua: every key a script touches is declared in its KEYS (``engine/keyset.py``),
and the tests below read ``lua/`` to check that no script builds a key name and that each script (with
the ``_lib.lua`` helpers it calls) uses only the keys its caller declares, in the order its header states.
``tests/test_declared_keys.py`` checks the same against a real redis-server, command by command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fakeredis
import pytest

from scrapy_proxy_shard.engine import keyset, schema
from scrapy_proxy_shard.engine.scripts import LIB_FILES, OPERATIONS, lib_definitions, role_local, script_source
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.ops.snapshot import read_pool

PACKAGE = Path(schema.__file__).resolve().parent.parent
LUA = {path.name: path.read_text(encoding="utf-8") for path in sorted((PACKAGE / "engine" / "lua").glob("*.lua"))}
STAT_HASHES = {"K_PSTATS": schema.PSTATS, "K_HSTATS": schema.HSTATS, "K_SSTATS": schema.SSTATS,
               "K_SITESTATS": schema.SITESTATS, "K_COUNTERS": schema.COUNTERS}
#: The hashes whose fields are the counter names themselves (the others: "<owner>:<counter>").
PLAIN_HASHES = ("K_COUNTERS", "K_SITESTATS")
#: Python modules that read the schema: none may spell a key suffix or counter field itself. The store is
#: every engine/store*.py module (store.py composes the mixins of the others) and the records it returns.
READERS = (*(f"engine/{path.name}" for path in sorted((PACKAGE / "engine").glob("store*.py"))),
           "engine/records.py", "engine/keyset.py", "ops/snapshot.py", "ops/views.py", "ops/exporter.py",
           "crawl/health.py")


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


def _roles() -> set[str]:
    """Every KEYS role: the fixed scripts' and the two memos."""
    return {role for roles in keyset.ROLES.values() for role in roles} | {keyset.MEMO, keyset.LEASE_MEMO}


def _bound_roles() -> dict[str, str]:
    """``K_<NAME>`` local -> role, as scripts.py binds them from KEYS."""
    return {role_local(role): role for role in _roles()}


def _lib_functions() -> dict[str, str]:
    """The helper files' (_lib.lua, _pace.lua) local functions by name: their bodies (comments stripped)."""
    code = "\n".join(_code(LUA[lib]) for lib in LIB_FILES)
    return dict(re.findall(r"^local function (\w+)\((.*?)^end$", code, flags=re.M | re.S))


def _keys_used(code: str, functions: dict[str, str]) -> set[str]:
    """The K_ locals a piece of code touches, itself and through every _lib function it calls."""
    used, seen, todo = set(re.findall(r"\bK_[A-Z_]+\b", code)), set(), [code]
    while todo:
        for name in re.findall(r"\b(\w+)\(", todo.pop()):
            if name in functions and name not in seen:
                seen.add(name)
                used |= set(re.findall(r"\bK_[A-Z_]+\b", functions[name]))
                todo.append(functions[name])
    return used


def _lua_counter_fields() -> dict[str, set[str]]:
    """Counter fields each stat hash is written or read under, by hash."""
    fields: dict[str, set[str]] = {name: set() for name in STAT_HASHES.values()}
    for source in LUA.values():
        code = _code(source)
        for variable, hash_name in STAT_HASHES.items():
            for _, args in _calls_on(code, variable):
                if variable in PLAIN_HASHES:  # a site's "ban:<reason>" too
                    fields[hash_name].update(re.findall(r"^, '(\w+)(?::|')", args))
                else:  # "<owner>:<counter>", and a site's "ban:<reason>"
                    fields[hash_name].update(re.findall(r"\.\. ':(\w+)(?::|')", args))
                if "string.lower(status)" in args:
                    fields[hash_name].update(_release_statuses())
        # _lib.lua's site_stat(field) counts in the call's site counters (K_SITESTATS)
        fields[schema.SITESTATS].update(re.findall(r"\bsite_stat\('(\w+)(?::|')", code))
    return fields


def _release_statuses() -> set[str]:
    """The statuses release.lua counts under their own (lower-case) name: every one but OK."""
    code = _code(LUA["release.lua"])
    assert "if status ~= 'OK' then" in code
    return {s.lower() for s in re.findall(r"status = '([A-Z]+)'", code)} - {"ok"}


def test_every_key_role_is_a_schema_name_and_back():
    declared = {role for roles in keyset.ROLES.values() for role in roles}
    used = {k for source in LUA.values() for k in re.findall(r"\bK_[A-Z_]+\b", _code(source))}
    # every K_ local the Lua reads is a role's, and every role is read by some Lua
    assert used == set(_bound_roles()), used ^ set(_bound_roles())
    assert declared <= keyset.POOL_ROLES | keyset.SITE_ROLES | {schema.SESSION, keyset.MEMO, keyset.LEASE_MEMO}
    # every key suffix names a pool key, a site key, the session or the memo (and nothing else does)
    assert set(schema.KEY_SUFFIXES) == keyset.POOL_ROLES | keyset.SITE_ROLES | {schema.SESSION, schema.DONE}
    assert len(set(schema.KEY_SUFFIXES)) == len(schema.KEY_SUFFIXES)
    assert set(keyset.ROLES) | set(keyset.VARIABLE) == set(OPERATIONS)


def test_each_script_header_states_its_keys_in_order():
    for name, roles in keyset.ROLES.items():
        header = re.search(r"^-- KEYS: (.+)$", LUA[f"{name}.lua"], flags=re.M)
        assert header, f"{name}.lua: no '-- KEYS: role ...' line"
        assert tuple(header.group(1).split("(")[0].split()) == roles, name


def test_no_script_builds_a_key_name():
    """Every key a script passes to redis.call is a declared one: a K_ local bound from KEYS (or a
    local alias of one), or KEYS[i] itself in the scripts whose KEYS depend on data; never a string
    built from the pool prefix (the layout before this rule: ``P .. ':ready:' .. site``)."""
    bound = _bound_roles()
    key_args_all = {"DEL", "EXISTS", "MGET", "UNLINK", "TOUCH"}
    for name, source in LUA.items():
        code = _code(source)
        assert not re.search(r"\bP \.\.|KEYS\[1\] \.\.|\.\. ':(?:" + "|".join(schema.KEY_SUFFIXES) + r")\b", code), name
        if name not in LIB_FILES:
            assert "KEY_ROLES" not in code and "K[" not in code, name
        aliases = set(re.findall(r"^\s*(?:local )?(\w+) = K_[A-Z_]+$", code, flags=re.M))
        allowed = re.compile(r"K_[A-Z_]+|KEYS\[[^\]]+\]|" + "|".join(aliases or {"K_"}))
        for call in re.finditer(r"redis\.call\('(\w+)'((?:, [^,()]+(?:\([^()]*\))?)*)", code):
            command, args = call.group(1), [a.strip() for a in call.group(2).split(", ")[1:]]
            if command == "TIME":
                continue
            keys_at = args if command in key_args_all else args[:1]
            for arg in keys_at:
                if name in LIB_FILES and arg in ("memo", "key", "bans", "idx"):  # helpers: see their call sites
                    continue
                assert allowed.fullmatch(arg), f"{name}: redis.call('{command}', {arg}, ...) is not a declared key"
        for call in re.findall(r"(?<!function )\b(?:recall|remember\w*|as_table|bans_expire)\((\w+)", code):
            assert call in bound or (call == "KEYS" and name in {f"{v}.lua" for v in keyset.VARIABLE}) or (
                name in LIB_FILES and call not in ("key", "bans")), f"{name}: {call} is not a declared key"
    for name, roles in keyset.ROLES.items():  # the one binding: scripts.py's, from KEYS by position
        bindings = re.findall(r"^local (K_\w+) = KEYS\[(\d+)\]$", script_source(name), flags=re.M)
        assert bindings and all(roles[int(i) - 1] == _bound_roles()[k] for k, i in bindings), name


def test_each_script_defines_every_helper_it_calls_and_no_other():
    """scripts.py puts in front of each script only the _lib.lua helpers it uses: each helper called in
    the loaded source (the operation and the helpers themselves) is defined before the operation, once."""
    functions = {names[0] for names, text in lib_definitions() if text.lstrip("-\n ").startswith("local function")
                 or "\nlocal function" in text}
    assert {"ensure_site", "ban", "pace_release", "breaker_gate", "recall"} <= functions
    for name in OPERATIONS:
        source = script_source(name)
        code = _code(source)
        defined = re.findall(r"^local function (\w+)\(", code, flags=re.M)
        top = re.findall(r"^local function (\w+)\(", _code(source.split(f"-- ==== {name}.lua ====")[0]),
                         flags=re.M)
        assert len(top) == len(set(top)), name  # (a --@lazy block may define a helper again, in its scope)
        called = {f for f in re.findall(r"\b(\w+)\(", code) if f in functions}
        assert called <= set(defined), f"{name}: calls {called - set(defined)} without defining them"
        # and every helper defined is called by the operation or by another helper it includes
        for f in defined:
            elsewhere = re.sub(r"^local function " + f + r"\(.*?^end$", "", code, flags=re.M | re.S)
            assert re.search(r"\b" + f + r"\(", elsewhere), f"{name}: defines {f} but never calls it"
        assert len(defined) < len(functions), name


def test_each_script_touches_only_the_keys_it_declares():
    bound, functions = _bound_roles(), _lib_functions()
    for name, roles in keyset.ROLES.items():
        used = _keys_used(_code(LUA[f"{name}.lua"]), functions)
        undeclared = {bound[k] for k in used} - set(roles)
        assert not undeclared, f"{name}.lua touches {undeclared} without declaring them"
    for name in keyset.VARIABLE:
        assert not _keys_used(_code(LUA[f"{name}.lua"]), functions), name


def test_every_counter_field_in_lua_is_a_schema_constant_and_back():
    fields = _lua_counter_fields()
    used = set().union(*fields.values())
    assert used <= {*schema.COUNTER_FIELDS, schema.LEGACY_HOST_BANNED}, used - set(schema.COUNTER_FIELDS)
    assert set(schema.COUNTER_FIELDS) <= used, set(schema.COUNTER_FIELDS) - used
    assert {*schema.COUNTER_HASHES, schema.SITESTATS} == set(STAT_HASHES.values())


def test_ban_and_banned_keep_one_meaning_on_every_scope():
    """``banned`` counts responses judged a ban (host, site); ``ban`` quarantines started (proxy, site):
    the counters written by release.lua for a ban verdict and by ban() for a quarantine never cross."""
    verdict = _code(LUA["release.lua"]).split("elseif outcome == 'ban'", 1)[1].split("elseif", 1)[0]
    assert re.findall(r"(?:\.\. ':|K_SITESTATS, ')(\w+)'", verdict) == [schema.BANNED, schema.BANNED]
    started = _code(LUA["_lib.lua"]).split("local function ban(", 1)[1].split("\nend", 1)[0]
    assert set(re.findall(r"(?:\.\. ':|site_stat\(')(\w+)(?::|')", started)) == {schema.QUARANTINES}
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
