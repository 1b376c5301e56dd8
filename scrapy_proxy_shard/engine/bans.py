"""Quarantine lengths the engine applies (settings.py fills them from ``PROXY_SHARD_BAN_*``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BanOptions"]


@dataclass(frozen=True)
class BanOptions:
    """How long quarantines last (seconds): base TTL doubling per strike up to a cap, with jitter."""

    ttl: float = 1800.0
    max_ttl: float = 21600.0
    jitter: float = 0.1
    strike_window: float = 86400.0
    dead_ttl: float = 300.0
