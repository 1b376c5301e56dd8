"""Which hosts a host slices over when Redis goes away, and whether it may take a slice at all.

The fallback splits a pool by rendezvous hashing: host X takes proxy p iff X scores highest for p
among the hosts of X's list. If X's list holds Y and Y's list holds X, X and Y cannot both take p
(X beats Y and Y beats X cannot both hold), whatever else either list holds. So slices never
overlap as long as every host that takes a slice has, in its list, every other host that takes one.
Extra hosts (dead ones, hosts that will wait) only leave their share idle during the outage.

The lists come from Redis (``host_list.lua``, read every ``PROXY_SHARD_SNAPSHOT_INTERVAL``): the
live hosts of the pool, each with its registration time (``since``) and the time of its own last
read (``read``), all on Redis's clock. A host Y takes a slice at the outage only if:

1. it has read the list since it registered, and found itself in it (a host that joins during the
   outage, or that had no heartbeat yet at its last read, has no list: it waits);
2. its registration was still live when Redis went away, as far as it can tell (its alive-until of
   that read, against the read's Redis time plus the local time since): a host whose heartbeats
   lapsed may be missing from the others' lists, so it waits;
3. every other host live at that read that has read a list at all read it *after* Y registered:
   its list (that read's or a later one) then holds Y, since Y stayed registered (2). A host that
   has never read takes no slice unless its first read comes later, and that read holds Y.

A host whose heartbeat Redis answered TAKEN (another process took its host id over after its own
heartbeats lapsed) takes no slice at all: the other process computes the same slice for that id.

Two hosts X and Y that both pass: say X registered first. Y's last read came after Y registered,
while X was live (X's rule 2), so Y's list holds X; and X's last read seen by Y came after Y
registered (Y's rule 3), so X's list holds Y. Every list is also kept a *superset*: the hosts seen
live in the last ``window`` seconds, plus this host.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostEntry:
    """One live host as a ``host_list`` read saw it (Redis clock, s; 0 when unknown)."""

    host: str
    alive_until: float
    since: float
    read: float


@dataclass
class HostView:
    """What this host last read of one pool's hosts, and every host it saw live lately."""

    read_at: float = 0.0  # Redis clock of the last read
    read_mono: float = 0.0  # this host's clock at that read
    entries: dict[str, HostEntry] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)  # host -> this host's clock when last seen live

    def update(self, now: float, rows: Iterable[tuple[str, float, float, float]], mono: float,
               window: float) -> None:
        """Take a new read (``now``: its Redis time, ``rows``: host_list's) made at local time ``mono``."""
        self.read_at, self.read_mono = now, mono
        self.entries = {row[0]: HostEntry(*row) for row in rows}
        for host in self.entries:
            self.seen[host] = mono
        self.seen = {h: t for h, t in self.seen.items() if mono - t <= window}


@dataclass(frozen=True)
class SliceDecision:
    """The hosts to slice over, or None and why this host takes no slice (it waits for Redis)."""

    hosts: tuple[str, ...] | None
    reason: str = ""


#: The reason of a host whose id another process took over (its heartbeat was answered TAKEN).
HOST_ID_TAKEN = "host id taken"


def decide(view: HostView | None, me: str, now_mono: float, *, taken: bool = False) -> SliceDecision:
    """Apply the rule of the module docstring at the outage (``now_mono``: this host's clock).
    ``taken``: another process holds this host id now; it would compute this very slice, so none."""
    if taken:
        return SliceDecision(None, HOST_ID_TAKEN)
    if view is None or not view.read_at:
        return SliceDecision(None, "no host list was read from Redis before it went away")
    mine = view.entries.get(me)
    if mine is None or not mine.since or mine.since > view.read_at:
        return SliceDecision(None, "this host was not registered in the host list it read last")
    if view.read_at + (now_mono - view.read_mono) >= mine.alive_until:
        return SliceDecision(None, "this host's heartbeat in Redis had lapsed")
    behind = sorted(e.host for e in view.entries.values() if e.host != me and e.read and e.read <= mine.since)
    if behind:
        return SliceDecision(None, f"{len(behind)} other host(s) had not read the host list since this host "
                                   "registered (a host that joined lately)")
    return SliceDecision(tuple(sorted({*view.entries, *view.seen, me})))
