"""Loads the Lua operation scripts: each ``lua/<op>.lua`` is prefixed with the ``lua/_lib.lua`` helpers it
uses and with ``local K_<ROLE> = KEYS[i]`` bindings of the roles of its KEYS (``keyset.ROLES``): a script
names no key itself.

Only what a script uses goes in front of it (a dependency scan of the names ``_lib.lua`` defines: its
``local function``s and constants, and what those use in turn), so a call does not define dozens of
helpers it never runs: defining them cost a lease or release more Redis time than several commands.
A helper used only on a rare path is defined on that path: a comment line ``--@lazy name ...`` inside
a block of the script is replaced by the definitions of those names (and of their helpers not already
defined at the top), so only a call that takes the block creates them (a release defines the ban,
breaker and adaptive pacing helpers only when it bans, has a breaker or paces adaptively). A lazy name
must be used only inside blocks that define it. ``tests/test_schema.py`` checks that every helper a
script calls is defined in its source.

redis-py's ``register_script`` runs a script by EVALSHA and reloads it by itself after a NOSCRIPT
reply (a Redis restart or SCRIPT FLUSH), so callers never handle script caching.

The hot path (``FUNCTION_OPS``: lease and release) also exists as a Redis Functions library
(``function_library``, Redis >= 7.0): the same helpers and bodies, but the helpers are defined once,
when the library loads, instead of at every call. That prelude was the largest fixed cost of a call
(on a 2-vCPU VM, about a tenth of a lease + release's Redis time). The store calls the functions by
FCALL where the server has them and falls back to EVALSHA where not (see ``engine/store_calls.py``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from scrapy_proxy_shard.engine.keyset import ROLES, VARIABLE

#: The helper files, in the order their definitions are read (a helper uses only those before it):
#: ``_lib.lua`` (keys, leases, bans, breaker) and ``_pace.lua`` (what a site teaches, adaptive pacing).
LIB_FILES = ("_lib.lua", "_pace.lua")

OPERATIONS = (
    "lease",
    "release",
    "ban",
    "unban",
    "add",
    "remove",
    "end_session",
    "host_beat",
    "host_leave",
    "hosts",
    "host_list",
    "pool_status",
    "hold",
    "lift",
    "abandon",
    "content",
    "gateway_rotate",
    "gateway_exit",
    "site_link",
    "sites",
    "sessions",
    "flying",
    "migrate",
    "tier",
)

_FOLDER = Path(__file__).with_name("lua")
_NAME = re.compile(r"[A-Za-z_]\w*")
_KEY_LOCAL = re.compile(r"\bK_[A-Z_]+\b")
_LAZY = re.compile(r"^(\s*)--@lazy ((?:\w+ ?)+)$", re.M)


_STRING = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")


def _code(text: str) -> str:
    """Lua text without its comments and string literals (names only; no string literal in the
    scripts holds "--")."""
    return _STRING.sub("''", "\n".join(line.split("--", 1)[0] for line in text.splitlines()))


def role_local(role: str) -> str:
    """The local a script reads a KEYS role from: ``K_<ROLE>``."""
    return "K_" + role.upper()


@cache
def lib_definitions() -> tuple[tuple[tuple[str, ...], str], ...]:
    """The helpers' (``LIB_FILES``) top-level definitions in order: (names defined, text with its leading
    comment).

    Every top-level statement of a helper file is a ``local`` (a function or a constant) starting at
    column 0; its body is indented and a function ends with ``end`` at column 0.
    """
    chunks: list[tuple[tuple[str, ...], str]] = []
    pending: list[str] = []  # comment lines right above the next definition
    body: list[str] | None = None  # the function being read
    lines = [line for lib in LIB_FILES for line in (_FOLDER / lib).read_text(encoding="utf-8").splitlines()]
    for line in lines:
        if body is not None:
            body.append(line)
            if line == "end":
                chunks.append(_chunk(body))
                body = None
        elif line.startswith("local function ") and not line.endswith(" end"):
            body, pending = [*pending, line], []
        elif line.startswith("local "):  # a one-line function or constant
            chunks.append(_chunk([*pending, line]))
            pending = []
        elif line.startswith("--"):
            pending.append(line)
        elif not line.strip():
            pending = []
        else:
            raise ValueError(f"{'/'.join(LIB_FILES)}: unexpected top-level line {line!r}")
    if body is not None:
        raise ValueError(f"{'/'.join(LIB_FILES)}: a function without its closing 'end' at column 0")
    return tuple(chunks)


def _chunk(lines: list[str]) -> tuple[tuple[str, ...], str]:
    head = next(line for line in lines if line.startswith("local "))
    match = re.match(r"local function (\w+)", head)
    if match:
        names: tuple[str, ...] = (match.group(1),)
    else:
        names = tuple(n.strip() for n in head[len("local "):].split("=", 1)[0].split(","))
    return names, "\n".join(lines)


def lib_used_by(body: str, skip: frozenset[int] = frozenset(), roots: tuple[str, ...] = ()) -> list[int]:
    """Indexes (in ``lib_definitions`` order) of the definitions ``body`` (or the names ``roots``) needs,
    directly or not, leaving out ``skip`` (and what only they need)."""
    chunks = lib_definitions()
    where = {name: i for i, (names, _) in enumerate(chunks) for name in names}
    needed: set[int] = set()
    todo = [_code(body), " ".join(roots)]
    while todo:
        for name in set(_NAME.findall(todo.pop())):
            i = where.get(name)
            if i is not None and i not in needed and i not in skip:
                needed.add(i)
                todo.append(_code(chunks[i][1]))
    return sorted(needed)


def _lazy_indexes(body: str) -> dict[str, list[int]]:
    """``--@lazy`` names of a script -> the definitions each stands for (itself only)."""
    chunks = lib_definitions()
    where = {name: i for i, (names, _) in enumerate(chunks) for name in names}
    out = {}
    for match in _LAZY.finditer(body):
        for name in match.group(2).split():
            if name not in where:
                raise ValueError(f"--@lazy {name}: _lib.lua defines no {name}")
            out[name] = [where[name]]
    return out


@cache
def script_source(name: str) -> str:
    """Full source of one operation: its KEYS check and bindings, the helpers it uses, the operation."""
    if name not in OPERATIONS:
        raise KeyError(f"no Lua script named {name!r}")
    body = (_FOLDER / f"{name}.lua").read_text(encoding="utf-8")
    chunks = lib_definitions()
    lazy = frozenset(i for ids in _lazy_indexes(body).values() for i in ids)
    top = lib_used_by(body, skip=lazy)
    for i in top:
        if lazy & set(lib_used_by(chunks[i][1], roots=())) - {i}:
            raise ValueError(f"{name}.lua: {chunks[i][0][0]} is defined at the top but needs a --@lazy helper")

    def expand(match: re.Match) -> str:
        wanted = lib_used_by("", skip=frozenset(top), roots=tuple(match.group(2).split()))
        return match.group(0) + "\n" + "\n".join(chunks[i][1] for i in wanted)

    body = _LAZY.sub(expand, body)
    lib = "\n".join(chunks[i][1] for i in top)
    used = sorted(set(_KEY_LOCAL.findall(_code(lib) + "\n" + _code(body))))
    if name in VARIABLE:
        if used:
            raise ValueError(f"{name}.lua takes a variable KEYS list but uses {used}")
        head = ""
    else:
        roles = ROLES[name]
        index = {role_local(role): i + 1 for i, role in enumerate(roles)}
        undeclared = [k for k in used if k not in index]
        if undeclared:
            raise ValueError(f"{name}.lua touches {undeclared} without declaring them in keyset.ROLES")
        head = (f"if #KEYS ~= {len(roles)} then\n"
                f"  return redis.error_reply('ERR scrapy-proxy-shard: this script takes {len(roles)} keys "
                f"({' '.join(roles)}), got ' .. #KEYS)\nend\n")
        head += "".join(f"local {k} = KEYS[{index[k]}]\n" for k in sorted(used, key=index.get))
    return f"-- ==== scrapy-proxy-shard: {name}.lua ====\n{head}{lib}\n-- ==== {name}.lua ====\n{body}"


def register_all(client) -> dict:
    """Register every operation on a redis-py client (sync, asyncio or cluster)."""
    return {name: client.register_script(script_source(name)) for name in OPERATIONS}


#: Operations the store calls as Redis Functions when the server has them: the hot path.
FUNCTION_OPS = ("lease", "release")


@dataclass(frozen=True)
class FunctionLibrary:
    """The ``FUNCTION_OPS`` as one Redis Functions library (``FUNCTION LOAD source``).

    Its name and its functions' names carry a hash of the source: hosts running different versions
    of the plugin on one Redis each load and call their own library (function names are global to a
    server), and a library of a given name never changes."""

    name: str
    source: str
    functions: dict[str, str]  # operation -> function name


@cache
def function_library() -> FunctionLibrary:
    """``FUNCTION_OPS`` as a Functions library: every helper they use defined once at the library's
    top (``--@lazy`` blocks need not define anything there), ``KEYS``/``ARGV`` and the ``K_<ROLE>``
    locals as library-level upvalues that each function binds from its own arguments on entry (one
    function runs at a time: Redis is single-threaded), then the operation's body unchanged."""
    bodies = {op: _LAZY.sub("", (_FOLDER / f"{op}.lua").read_text(encoding="utf-8")) for op in FUNCTION_OPS}
    chunks = lib_definitions()
    top = lib_used_by("\n".join(bodies.values()))
    lib = "\n".join(chunks[i][1] for i in top)
    roles_used: dict[str, list[str]] = {}
    for op, body in bodies.items():
        script_source(op)  # refuses an operation that touches a key it does not declare
        closure = "\n".join(chunks[i][1] for i in lib_used_by(body))
        used = set(_KEY_LOCAL.findall(_code(closure) + "\n" + _code(body)))
        roles_used[op] = [role for role in ROLES[op] if role_local(role) in used]
    all_locals = sorted({role_local(r) for roles in roles_used.values() for r in roles})
    functions_src = []
    for op, body in bodies.items():
        roles = ROLES[op]
        binds = "".join(f"  {role_local(r)} = keys[{roles.index(r) + 1}]\n" for r in roles_used[op])
        functions_src.append(
            f"-- ==== {op}.lua ====\n"
            f"local function op_{op}(keys, args)\n"
            f"  if #keys ~= {len(roles)} then\n"
            f"    return redis.error_reply('ERR scrapy-proxy-shard: this script takes {len(roles)} keys "
            f"({' '.join(roles)}), got ' .. #keys)\n  end\n"
            f"  KEYS, ARGV = keys, args\n{binds}{body}\nend\n")
    core = (f"local KEYS, ARGV\nlocal {', '.join(all_locals)}\n{lib}\n" + "\n".join(functions_src))
    digest = hashlib.sha1(core.encode()).hexdigest()[:12]
    name = f"scrapy_proxy_shard_{digest}"
    functions = {op: f"psh_{digest}_{op}" for op in FUNCTION_OPS}
    registers = "".join(f"redis.register_function('{functions[op]}', op_{op})\n" for op in FUNCTION_OPS)
    source = (f"#!lua name={name}\n-- scrapy-proxy-shard {', '.join(FUNCTION_OPS)} as Redis Functions "
              f"(built by engine/scripts.py from lua/)\n{core}\n{registers}")
    return FunctionLibrary(name, source, functions)
