"""Loads the Lua operation scripts: each ``lua/<op>.lua`` is prefixed with ``lua/_lib.lua``, and that
with the roles of its KEYS (``keyset.ROLES``; nil for a script whose KEYS depend on data), which
``_lib.lua`` binds to ``K_<ROLE>`` locals: a script names no key itself.

redis-py's ``register_script`` runs a script by EVALSHA and reloads it by itself after a NOSCRIPT
reply (a Redis restart or SCRIPT FLUSH), so callers never handle script caching.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from scrapy_proxy_shard.engine.keyset import ROLES, VARIABLE

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
    "pool_status",
    "hold",
    "abandon",
    "sites",
    "sessions",
    "migrate",
)


@cache
def script_source(name: str) -> str:
    """Full source of one operation: the shared helpers followed by the operation itself."""
    if name not in OPERATIONS:
        raise KeyError(f"no Lua script named {name!r}")
    folder = Path(__file__).with_name("lua")
    lib = (folder / "_lib.lua").read_text(encoding="utf-8")
    body = (folder / f"{name}.lua").read_text(encoding="utf-8")
    roles = "nil" if name in VARIABLE else "{" + ", ".join(f"'{role}'" for role in ROLES[name]) + "}"
    return f"local KEY_ROLES = {roles}\n{lib}\n-- ==== {name}.lua ====\n{body}"


def register_all(client) -> dict:
    """Register every operation on a redis-py client (sync, asyncio or cluster)."""
    return {name: client.register_script(script_source(name)) for name in OPERATIONS}
