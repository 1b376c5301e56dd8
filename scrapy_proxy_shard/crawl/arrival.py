"""The arrival guard: pace a slot's next request from when its last one can have *reached* the site.

Start-to-start pacing counts from the lease (the Redis clock). A site counts from arrivals, and the
path from a lease to the site's door is not constant: the first request through a proxy opens the
connections (TCP, a CONNECT tunnel, TLS), a busy event loop or a queueing proxy holds one request
back and lets the next through at once. When request *a* reaches the site late and *b* on time, the
site sees them closer than the interval although the leases were not: a rate violation the crawler
never made. Measured on the project's site (3 hosts, 0.22 s interval, zero tolerance): every
violation came from an *a* held 35-125 ms before its arrival, nearly all in the first half second
(cold connections, processes warming up).

The release cannot see the arrival, but it bounds it: a request's lease-to-release time ``elapsed``
is its way out + the site's service + the way back, and the fastest of these a host has seen on the
(proxy, site) pair, its *floor*, is the way out at its quickest plus the rest at its quickest. So
``elapsed - floor`` is at least how much later than the quickest way out this request arrived. The
release paces the slot's next start that much later (the *shift*): the two arrivals are then at
least the interval apart however late *a* was, as long as *b* is no quicker than the floor. A pair
this host has timed fewer than WARM_SAMPLES times is *cold*: its connections are new, the way out
the least known, and no floor exists yet; the release itself is then the only sure bound on the
arrival, and the next start is paced from it (the shift is the whole ``elapsed``, for the first uses
of a pair by a host).

The shift also grows when the site's own answer was slow (service time is in ``elapsed`` too), which
costs throughput on a site whose answer times vary a lot; so it is capped at ``guard`` x the interval
(``PROXY_SHARD_ARRIVAL_GUARD``, 0 turns it off). The floor is the
quickest of the last WINDOW..2 x WINDOW answers, so a path that became slower for good stops costing
a shift after a while; a quicker answer lowers it at once (the safe direction).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ArrivalGuard"]

#: The floor is the quickest time of the last WINDOW to 2 x WINDOW answers (two rotating windows): a
#: path that became slower for good stops costing a shift after that many answers, and a quicker
#: answer lowers the floor at once (the safe direction).
WINDOW = 64
#: Answers of a pair it takes to be warm: before, its next start is paced from the release (the
#: first answers of a pair come while its connections and the processes on the way warm up: their
#: times are no floor yet).
WARM_SAMPLES = 2
#: Answers of a pair after which its own floor alone is the reference (before, the lower of the
#: pair's and the site's: one early answer, slow while everything warms up, is not a floor).
PAIR_SAMPLES = 8
#: Pairs remembered per host (the oldest is forgotten first: it is cold again if it comes back).
MAX_PAIRS = 65536
#: Redis times are whole milliseconds: a lease's start and its release may each read up to 1 ms
#: early, so one answer's time is up to 1 ms off either way and the floor handed to release.lua is
#: this much lower.
CLOCK_STEP = 0.002
#: The least shift of a warm pair (release.lua's 1 ms): the start itself may read 1 ms early.
MIN_SHIFT = 0.001


class _Floor:
    """The quickest lease-to-release time of the last WINDOW..2 x WINDOW answers."""

    __slots__ = ("current", "n", "previous")

    def __init__(self, sample: float) -> None:
        self.current = sample
        self.previous = sample
        self.n = 1

    @property
    def floor(self) -> float:
        return min(self.current, self.previous)

    def add(self, sample: float) -> None:
        if self.n % WINDOW == 0:
            self.previous, self.current = self.current, sample
        elif sample < self.current:
            self.current = sample
        self.n += 1


class ArrivalGuard:
    """Per host: the floors of the (site, proxy) pairs it used, on the Redis clock.

    A release sends the pair's floor (:meth:`floor`) with the guard's cap; release.lua, which knows
    the lease's start and the release's time on the Redis clock, pushes the slot's next start back by
    ``min(cap, max(MIN_SHIFT, now - start - floor))``, or by ``now - start`` (paced from the release)
    when ``floor`` is None (cold). The release's reply
    then feeds the pair's floor (:meth:`observe`). Both ends of ``elapsed`` are Redis times, so a
    stall of this host between the lease's reply and the request's departure counts too, and host
    clock skew does not.
    """

    def __init__(self, max_pairs: int = MAX_PAIRS) -> None:
        self._pairs: dict[tuple[str, str], _Floor] = {}
        self._sites: dict[str, _Floor] = {}
        self._max_pairs = max_pairs

    def floor(self, site: str, proxy_id: str) -> float | None:
        """The quickest lease-to-release time to count from (seconds), or None while the pair is cold
        (never timed by this host: release.lua then paces from the release itself)."""
        pair = self._pairs.get((site, proxy_id))
        if pair is None or pair.n < WARM_SAMPLES:
            return None
        floor = pair.floor
        if pair.n < PAIR_SAMPLES:
            site_floor = self._sites.get(site)
            if site_floor is not None and site_floor.floor < floor:
                floor = site_floor.floor
        return max(0.0, floor - CLOCK_STEP)

    def observe(self, site: str, proxy_id: str, elapsed: float) -> None:
        """A normal answer of the pair took ``elapsed`` seconds from its lease to its release (Redis
        clock). A failure or a ban may come back much quicker or slower than a page: not a sample."""
        self._note(self._pairs, (site, proxy_id), elapsed)
        self._note(self._sites, site, elapsed)

    def _note(self, floors: dict, key: Any, elapsed: float) -> None:
        floor = floors.get(key)
        if floor is not None:
            floor.add(elapsed)
            return
        if len(floors) >= self._max_pairs:
            del floors[next(iter(floors))]
        floors[key] = _Floor(elapsed)

    @staticmethod
    def shift(elapsed: float, floor: float | None, cap: float) -> float:
        """What release.lua added to the interval (the same formula, for stats and tests)."""
        if floor is None:
            return max(0.0, elapsed)
        return min(cap, max(MIN_SHIFT, elapsed - floor))

    def __len__(self) -> int:
        return len(self._pairs)
