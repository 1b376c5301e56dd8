"""Pacing sleeps a release can cut short.

A request told to wait for a pacing slot (the engine's WAIT with the earliest slot's time) sleeps
exactly that long, locally (crawl/runtime.py ``_wait``): every ms late is throughput lost at the
site's limit, and a Redis blocking call would wake up to 100 ms late. That sleep assumed no slot given
back meanwhile can be free sooner, true while every slot of a site is paced by one interval. It is
not under adaptive pacing: the probe's proxy is paced by a lower interval than the others
(docs/pacing.md), and a lowered interval paces each slot from its next release on. So each release
that gives a slot back tells this host when it frees (``ReleaseResult.free_at``), and the request of
this host sleeping longest past that for the same site is woken to ask again: one request per
release, only when it gains, and never a busy loop (it asks once and sleeps again as told).

Requests of other hosts are not woken (each host wakes its own; a site's hosts all have waiting
requests when pacing limits the crawl, so the host that gave the slot back takes it).
"""

from __future__ import annotations

import asyncio

#: A wake-up is worth it when it moves a request's next ask at least this much sooner (seconds).
GAIN = 0.005


class PacingSleepers:
    """This host's requests sleeping for a pacing slot, per (pool, site)."""

    def __init__(self) -> None:
        self._sleeping: dict[tuple[str, str], list[tuple[float, asyncio.Future]]] = {}

    async def sleep(self, pool: str, site: str, seconds: float) -> None:
        """Sleep ``seconds``, or less when ``release_freed`` wakes this request."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future = loop.create_future()
        entry = (loop.time() + seconds, woken)
        key = (pool, site)
        self._sleeping.setdefault(key, []).append(entry)
        timer = loop.call_later(seconds, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()
            sleepers = self._sleeping.get(key)
            if sleepers is not None:
                sleepers.remove(entry)
                if not sleepers:
                    del self._sleeping[key]

    def release_freed(self, pool: str, site: str, free_in: float) -> bool:
        """A slot of ``site`` is free again in ``free_in`` seconds: wake the request sleeping longest past
        that (by more than GAIN), if any. Returns whether one was woken."""
        sleepers = self._sleeping.get((pool, site))
        if not sleepers:
            return False
        at = asyncio.get_running_loop().time() + max(0.0, free_in)
        latest = None
        for entry in sleepers:
            if not entry[1].done() and (latest is None or entry[0] > latest[0]):
                latest = entry
        if latest is None or latest[0] <= at + GAIN:
            return False
        _wake(latest[1])
        return True

    def __len__(self) -> int:
        return sum(len(v) for v in self._sleeping.values())


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
