"""Every Redis key name the project uses is built here.

All keys of one pool share the hash tag ``{namespace:pool}`` so every script touches one Redis
Cluster slot; the Lua scripts derive the per-pool keys from that prefix (see ``lua/_lib.lua``).
Keys never contain proxy URLs: proxies are named by their short id.
"""

from __future__ import annotations

import re

from scrapy_proxy_shard.exceptions import InvalidSessionId, SettingError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")


def check_name(kind: str, value: object) -> str:
    """Validate a namespace or pool name: it becomes part of every key, so keep it plain.

    ``fullmatch``, not ``match`` with ``$``: ``$`` also matches before a trailing newline, which
    would let ``"pool\n"`` in as a second spelling of ``pool`` with keys of its own.
    """
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise SettingError(
            f"invalid {kind} name {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


#: Longest session id: it is part of a Redis key and of every status row that shows the session.
MAX_SESSION_ID = 200


def check_session_id(value: object) -> str | None:
    """``meta['session_id']`` as the string the engine keys the session by; None for no session.

    Only a non-empty printable string or an integer (not a bool) up to MAX_SESSION_ID characters
    names a session. Anything else (False, a dict, a 1 MB string) raises InvalidSessionId rather than
    becoming a session named ``"False"`` that unrelated requests would share.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise InvalidSessionId(f"meta['session_id'] must be a string or an integer, got {type(value).__name__}")
    if not value.strip() or not value.isprintable() or len(value) > MAX_SESSION_ID:
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise InvalidSessionId(f"meta['session_id'] ({shown!r}, {len(value)} characters) must be 1-"
                               f"{MAX_SESSION_ID} printable characters, not only spaces")
    return value


def pool_prefix(namespace: str, pool: str) -> str:
    """The hash-tagged prefix of every key of one pool: ``{namespace:pool}``."""
    return f"{{{namespace}:{pool}}}"


def pools_registry(namespace: str) -> str:
    """SET of pool names in a namespace (its own slot; written only by admin operations)."""
    return f"{namespace}:pools"


def session_key(prefix: str, site: str, session_id: str) -> str:
    return f"{prefix}:session:{site}:{session_id}"


def freed_key(prefix: str, site: str) -> str:
    return f"{prefix}:freed:{site}"


def sub_key(prefix: str, name: str) -> str:
    """A pool-level structure named in lua/_lib.lua (``proxies``, ``tags``, ``bans``, ...)."""
    return f"{prefix}:{name}"
