"""The site circuit breaker's options and what a release tells about it (``PROXY_SHARD_BREAKER_*``).

When a site rejects everyone (its rules changed, the spider's headers are flagged), quarantining proxy
after proxy burns the pool for nothing: the site, not the IP, is the problem. The breaker watches the
quarantines each site starts and, once ``threshold`` of them come from at least ``min_proxies``
distinct proxies within ``window`` seconds *with no successful response on the site in between*,
stops leasing for that site on every host for ``cooloff`` seconds. Then it is half-open: one probe
lease at a time, at most ``probes`` per round. A probe answered fine closes it; a probe answered with
a ban (or ``probes`` probes without a verdict) re-opens it for twice the cool-off, up to
``max_cooloff``. While open or half-open, bans on the site quarantine nobody (no strikes).

The state machine runs inside the Lua scripts (``lua/_lib.lua``, the ``breaker_*`` helpers; state in
``P:breaker:<site>``), so the one release that crosses the threshold opens it, on whatever host.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BreakerEvent", "BreakerOptions", "BreakerState", "ContentVerdict"]


@dataclass(frozen=True)
class BreakerOptions:
    """When a site's breaker opens, and for how long (seconds)."""

    threshold: int = 5
    min_proxies: int = 3
    window: float = 60.0
    cooloff: float = 30.0
    max_cooloff: float = 600.0
    probes: int = 3

    def packed(self) -> str:
        """The one script argument release.lua reads: ``threshold,min_proxies,window_ms,cooloff_ms,
        max_cooloff_ms,probes``."""
        return ",".join(str(v) for v in (
            self.threshold, self.min_proxies, round(self.window * 1000), max(1, round(self.cooloff * 1000)),
            max(1, round(self.max_cooloff * 1000)), self.probes))


@dataclass(frozen=True)
class BreakerEvent:
    """A change of a site's breaker made by one release.

    ``kind``: ``opened`` (this release's ban crossed the threshold), ``reopened`` (a probe was
    rejected, or the probes of a round ran out without a verdict), ``closed`` (a probe was answered
    fine), ``spared`` (a ban while open or half-open: no quarantine, no strike). ``bans``,
    ``proxies``, ``reasons`` and ``window`` are the evidence (``opened`` only); ``cooloff`` is the
    length of the open period that starts now (``opened``/``reopened``).
    """

    kind: str
    bans: int = 0
    proxies: int = 0
    reasons: dict[str, int] | None = None
    window: float = 0.0
    cooloff: float = 0.0


@dataclass(frozen=True)
class BreakerState:
    """A site's breaker as stored (``PoolStore.breaker``): ``state`` ``open`` or ``half`` (half-open);
    a closed breaker has no state at all. Times on the Redis clock, seconds."""

    site: str
    state: str
    until: float  # open: when probing may start
    cooloff: float  # the current open period's length
    probes_used: int
    probes: int
    probing: bool  # half-open: a probe is in flight
    since: float  # when this episode began (the first opening)
    trips: int  # openings in this episode (1 + re-openings)
    cause: str | None = None  # "content": opened by a content check that never passed (content.lua)
    check: str | None = None  # ... that check, as logged


@dataclass(frozen=True)
class ContentVerdict:
    """What a content check's answer means on its site (``PoolStore.content_check``, content.lua).

    ``kind``: ``passed`` (recorded; ``first``: the check passed there for the first time), ``trusted``
    (the check passed there before: a failure is a ban as usual), ``suspect`` (never passed there:
    no quarantine; ``proxies`` of ``needed`` distinct proxies failed so far), ``opened`` (this failure
    opened the site's breaker with cause ``content`` for ``cooloff`` seconds) or ``open`` (never
    passed, and the breaker is open already)."""

    kind: str
    first: bool = False
    proxies: int = 0
    needed: int = 0
    cooloff: float = 0.0

    @property
    def suspect(self) -> bool:
        """The failure quarantines nobody: the check, not the proxy, may be wrong."""
        return self.kind in ("suspect", "opened", "open")
