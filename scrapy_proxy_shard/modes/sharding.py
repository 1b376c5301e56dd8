"""Static, shared-nothing splits of a proxy pool: which host (or platform) may use which proxy.

Used when there is no shared Redis (static mode) and when Redis is unreachable (fallback): each host
computes the same assignment from the same inputs, so hosts never overlap without talking.

- ``modulo``: proxy i goes to host ``i % n`` (by the proxy's position in the sorted id list, over the
  sorted host list, so the order the hosts are listed in does not matter).
  Simple, but changing the number of hosts moves almost every proxy.
- ``consistent``: rendezvous (highest-random-weight) hashing: each proxy goes to the host with the
  highest ``hash(host, proxy)``. A joining host takes about 1/(n+1) of the proxies, all from the
  others; a leaving host's proxies are spread over the rest and no other proxy moves.
- ``partition_by_platform``: the same rendezvous rule with platforms instead of hosts, so a proxy
  serves exactly one platform and one IP is never seen on several platforms that share blacklists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from scrapy_proxy_shard.exceptions import SettingError

STRATEGIES = ("consistent", "modulo")


def _weight(owner: str, item: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{owner}\x00{item}".encode(), digest_size=8).digest(), "big")


def rendezvous_owner(item: str, owners: Sequence[str]) -> str:
    """The owner with the highest hash weight for ``item`` (ties broken by owner name)."""
    if not owners:
        raise ValueError("no owners to assign to")
    return max(owners, key=lambda owner: (_weight(owner, item), owner))


def assign(items: Iterable[str], hosts: Sequence[str], strategy: str = "consistent") -> dict[str, str]:
    """Map every item (proxy id) to exactly one host."""
    hosts = _unique_hosts(hosts)
    ordered = sorted(set(items))
    if strategy == "consistent":
        return {item: rendezvous_owner(item, hosts) for item in ordered}
    if strategy == "modulo":  # over the sorted host list: the same hosts in another order, the same split
        hosts = sorted(hosts)
        return {item: hosts[i % len(hosts)] for i, item in enumerate(ordered)}
    raise SettingError(f"PROXY_SHARD_SHARDING ({strategy!r}) must be one of {', '.join(STRATEGIES)}")


def slice_for(items: Iterable[str], hosts: Sequence[str], me: str, strategy: str = "consistent") -> list[str]:
    """The items host ``me`` may use. ``me`` must be one of ``hosts``."""
    if me not in hosts:
        raise SettingError(f"PROXY_SHARD_HOST_ID ({me!r}) is not in the host list {list(hosts)!r}")
    return sorted(item for item, owner in assign(items, hosts, strategy).items() if owner == me)


def moved_fraction(items: Iterable[str], before: Sequence[str], after: Sequence[str],
                   strategy: str = "consistent") -> float:
    """Share of items whose host changes when the host list goes from ``before`` to ``after``."""
    items = list(items)
    if not items:
        return 0.0
    a, b = assign(items, before, strategy), assign(items, after, strategy)
    return sum(a[i] != b[i] for i in items) / len(items)


def partition_by_platform(items: Iterable[str], platforms: Sequence[str]) -> dict[str, list[str]]:
    """Split proxies between platforms so each proxy serves exactly one of them."""
    owners = assign(items, platforms, "consistent")
    out: dict[str, list[str]] = {p: [] for p in _unique_hosts(platforms)}
    for item, platform in owners.items():
        out[platform].append(item)
    return out


def _unique_hosts(hosts: Sequence[str]) -> list[str]:
    seen = list(dict.fromkeys(str(h) for h in hosts))
    if not seen:
        raise SettingError("the host list is empty: set PROXY_SHARD_HOSTS (or let hosts register in Redis)")
    return seen
