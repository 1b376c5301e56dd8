"""One slot per exit: a list that names one exit twice keeps its later entry, and says so.

An exit is what a site sees one IP behind (``proxies.exit_key``: ``host:port``, plus a declared
gateway session), so two entries of one exit (a rotated password, the ``http``/``https`` spelling)
are one pool member, never two slots that would send two requests from one IP to one site at once.
Every path that takes a list of entries (``PROXY_SHARD_PROXIES``, proxy files, ``add``, the store's
own add and restore) merges it here: the later entry's URL wins, tags are merged (the later's
winning), and each replaced entry gives one line naming both entries, masked, and the exit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable
from typing import Any

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine import schema as keys
from scrapy_proxy_shard.engine.proxies import Proxy, parse_proxy, proxy_id
from scrapy_proxy_shard.exceptions import ProxyURLError

logger = logging.getLogger("scrapy_proxy_shard")
#: Notes already logged by this process: a list merged again (a restore, each spider open) says it once.
_SAID: set[str] = set()
_SAID_MAX = 1024


def merge_exits(entries: Iterable[tuple[str, Proxy]]) -> tuple[dict[str, Proxy], list[str]]:
    """``(label, proxy)`` pairs in list order -> (proxies by id, one message per replaced entry).

    ``label`` says where an entry was (``line 4``, ``entry 2``); an entry repeated with the same URL
    is merged without a message (nothing was replaced)."""
    by_id: dict[str, Proxy] = {}
    labels: dict[str, str] = {}
    notes: list[str] = []
    for label, proxy in entries:
        pid = proxy.id
        old = by_id.get(pid)
        if old is not None:
            if old.url != proxy.url:
                notes.append(f"{label} ({proxy.masked}) replaces {labels[pid]} ({old.masked}): both are exit "
                             f"{proxy.exit}, listed twice (one IP is one slot; keep one entry per exit)")
            proxy = Proxy(proxy.url, {**old.tags, **proxy.tags})
        by_id[pid] = proxy
        labels[pid] = label
    return by_id, notes


def unique_exits(proxies: Iterable[Proxy], where: str, *, label: str = "entry") -> dict[str, Proxy]:
    """``merge_exits`` of a list numbered from 1, each replaced entry logged as one WARNING line (once
    per process: the same list merged again says nothing new)."""
    by_id, notes = merge_exits((f"{label} {n}", p) for n, p in enumerate(proxies, start=1))
    for note in notes:
        line = f"proxy_shard: {where}: {note}"
        if line in _SAID:
            continue
        if len(_SAID) >= _SAID_MAX:
            _SAID.clear()
        _SAID.add(line)
        logger.warning("%(line)s", {"line": line})
    return by_id


#: Entries per page of the re-keying (proxies scanned per HSCAN, quads per script call).
REKEY_PAGE = 500


def rekey_to_exits(prefix: str, warm_ms: int, command: Callable[[tuple], Any],
                   script: Callable[[str, list, tuple], Any]) -> Generator[Any, Any, int]:
    """A store plan (``PoolStore._migrate``'s last step before "done"): move every proxy whose id was
    hashed from its URL (layout 2 and before) under its exit id, with its tags and bans; returns how many.

    Two entries of one exit become one proxy (the first URL met stays; a later ``add`` replaces it in
    place). Each re-keyed proxy rests ``warm_ms`` proxy-wide: a request sent through its old id may
    still be running, and the new id's slots do not know it. ``command`` and ``script`` build what the
    plan yields (the store's ``_Command`` and ``_Script``: this module does not import the store)."""

    quads: list[tuple[str, str, str, str]] = []
    cursor = "0"
    while True:
        cursor, page = yield command(("HSCAN", keys.sub_key(prefix, keys.PROXIES), cursor, "COUNT", REKEY_PAGE))
        for old, stored in _pairs(page):
            try:
                url = parse_proxy(stored)
            except ProxyURLError:  # not a URL this version accepts: leave it (it cannot be leased twice anyway)
                continue
            new = proxy_id(url)
            if new != old or url != stored:
                quads.append((old, new, stored, url))
        if str(cursor) == "0":
            break
    if not quads:
        return 0
    exit_of = {old: new for old, new, _, _ in quads}
    bans: dict[str, list[tuple[str, str]]] = {}
    while True:
        cursor, page = yield command(("HSCAN", keys.sub_key(prefix, keys.BANS), cursor, "COUNT", REKEY_PAGE))
        for name, _ in _pairs(page):
            scope, _, old = name.rpartition("|")
            if old in exit_of and exit_of[old] != old:
                bans.setdefault(old, []).append((name, f"{scope}|{exit_of[old]}"))
        if str(cursor) == "0":
            break
    moved = 0
    for start in range(0, len(quads), REKEY_PAGE):
        page_quads = quads[start:start + REKEY_PAGE]
        pairs = [x for q in page_quads for pair in bans.get(q[0], ()) for x in pair]
        reply = yield script("migrate", keyset.migrate_rekey_keys(prefix),
                              ("rekey", warm_ms, len(page_quads), *(x for q in page_quads for x in q), *pairs))
        moved += int(reply[1])
    return moved


def _pairs(page: Any) -> list[tuple[str, str]]:
    """An HSCAN page (a flat list, or a dict once decoded by the client) as (field, value) pairs."""
    if isinstance(page, dict):
        return list(page.items())
    page = list(page or ())
    return list(zip(page[::2], page[1::2], strict=True))
