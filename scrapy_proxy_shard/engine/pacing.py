"""Adaptive pacing options the engine applies (settings.py fills them from ``PROXY_SHARD_AUTOTHROTTLE_*``).

The control law itself runs inside ``release.lua`` (``pace_release`` in ``lua/_pace.lua``), on the Redis
clock, once for all hosts; docs/pacing.md states it with its constants.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AutothrottleOptions", "PaceState"]


@dataclass(frozen=True)
class AutothrottleOptions:
    """One site's adaptive pacing (seconds): the learned start-to-start interval starts at
    ``start_interval`` and stays within [``min_interval``, ``max_interval``]; ``ban_ttl`` is the shortest
    rest of a proxy after a rate ban that followed a clean answer (the site's learned rest starts there);
    ``overlap``: a site whose answers outlast its interval may be tried with two requests in flight per
    IP (``conc_release`` in engine/lua/_pace.lua); False (the default) keeps one per IP on every site."""

    enabled: bool
    start_interval: float
    min_interval: float
    max_interval: float
    ban_ttl: float = 1.0
    overlap: bool = False


@dataclass(frozen=True)
class PaceState:
    """A site's learned pacing as Redis holds it (``PoolStore.paces``); times on the Redis clock, seconds.

    ``interval``: in force now; ``changed_at``: its last change; ``floor_of``: the lowest interval known
    to fail (None before any), lowering stops 5% above it; ``raised``, ``lowered``, ``skipped`` (rate
    bans that changed nothing), ``forgotten`` (floors lowered), ``failed`` (probes that met a rate ban),
    ``undone`` (provisional lowerings undone by a rate ban): counts; ``probe``/``probe_interval``: the
    proxy trying a lower interval now, and that interval; ``per_ip``: requests in flight per IP the site
    was found to allow (2 proved clean, 1 a second one met a ban; None before any verdict) and
    ``per_ip_probe``: the proxy trying two now (``conc_release`` in engine/lua/_pace.lua).
    """

    site: str
    interval: float
    changed_at: float
    floor_of: float | None
    clean_run: int
    raised: int
    lowered: int
    skipped: int
    forgotten: int
    failed: int
    undone: int
    probe: str | None = None
    probe_interval: float | None = None
    per_ip: int | None = None
    per_ip_probe: str | None = None
