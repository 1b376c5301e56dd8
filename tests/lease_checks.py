"""Shared by the tests that drive many asyncio tasks through one store: hold a lease across an
event-loop turn and record it when another task holds the same slot at that moment."""

from __future__ import annotations

import asyncio
from typing import Any


async def hold_and_release(store: Any, lease: Any, held: set[str], overlaps: list) -> Any:
    """Hold ``lease`` for one event-loop turn (other tasks run meanwhile), noting in ``overlaps`` a slot
    already in ``held``, then release it; returns the release's result."""
    if lease.member in held:
        overlaps.append(lease.member)
    held.add(lease.member)
    await asyncio.sleep(0)
    held.discard(lease.member)
    return await store.release(lease)
