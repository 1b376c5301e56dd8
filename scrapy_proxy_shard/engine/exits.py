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
from collections.abc import Iterable

from scrapy_proxy_shard.engine.proxies import Proxy

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
