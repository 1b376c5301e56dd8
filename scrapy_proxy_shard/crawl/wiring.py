"""Where the three downloader middlewares must sit, and the start-up check that they do.

A plugin that is not wired sends every request from the host's own IP and still finishes "ok", so
the crawl refuses to start unless, in the crawler's real merged ``DOWNLOADER_MIDDLEWARES`` (+ ``_BASE``):

- ``ProxyShardMiddleware`` (lease) runs before ``HttpProxyMiddleware`` (750), which turns the leased
  URL's credentials into ``Proxy-Authorization``;
- ``BanDetectionMiddleware`` has a higher number than the lease middleware and than ``RedirectMiddleware``
  (600), ``HttpCompressionMiddleware`` (590) and ``RetryMiddleware`` (550): ``process_response`` runs in
  decreasing order, so it judges the raw response (and releases the lease with its verdict) first;
- ``ProxyShardGuardMiddleware`` runs after every built-in middleware, so it sees the request as it
  goes to the download handler and drops it unless it carries the proxy leased for it.
"""

from __future__ import annotations

import logging
from typing import Any

from scrapy.utils.misc import load_object

from scrapy_proxy_shard.exceptions import SettingError

logger = logging.getLogger(__name__)

LEASE_MIDDLEWARE = "scrapy_proxy_shard.middlewares.ProxyShardMiddleware"
BAN_MIDDLEWARE = "scrapy_proxy_shard.middlewares.BanDetectionMiddleware"
GUARD_MIDDLEWARE = "scrapy_proxy_shard.middlewares.ProxyShardGuardMiddleware"
#: Default orders: the add-on inserts these; explicit DOWNLOADER_MIDDLEWARES entries win.
PRIORITIES = {LEASE_MIDDLEWARE: 610, BAN_MIDDLEWARE: 620, GUARD_MIDDLEWARE: 950}
ADDON = "scrapy_proxy_shard.addon.ProxyShardAddon"

HTTP_PROXY = "scrapy.downloadermiddlewares.httpproxy.HttpProxyMiddleware"
#: Built-ins whose process_response must see the response only after the ban detector did.
AFTER_BAN_DETECTION = (
    "scrapy.downloadermiddlewares.redirect.RedirectMiddleware",
    "scrapy.downloadermiddlewares.httpcompression.HttpCompressionMiddleware",
    "scrapy.downloadermiddlewares.retry.RetryMiddleware",
)


class WiringError(SettingError):
    """DOWNLOADER_MIDDLEWARES misses one of the plugin's middlewares or has them in a wrong order."""


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def enabled_middlewares(settings: Any) -> dict[type, float]:
    """Class → order of every enabled downloader middleware, as Scrapy will build them."""
    merged = settings.getwithbase("DOWNLOADER_MIDDLEWARES")
    out: dict[type, float] = {}
    for key, order in merged.items():
        if order is None:
            continue
        out[load_object(key) if isinstance(key, str) else key] = order
    return out


def _orders_of(enabled: dict[type, float], path: str) -> list[tuple[str, float]]:
    """(path, order) of the enabled middlewares that are ``path``'s class or a subclass of it."""
    base = load_object(path)
    return [(_path(cls), order) for cls, order in enabled.items() if isinstance(cls, type) and issubclass(cls, base)]


def _fix(path: str) -> str:
    return f"{path!r}: {PRIORITIES[path]} in DOWNLOADER_MIDDLEWARES (or ADDONS = {{{ADDON!r}: 0}})"


def check_wiring(settings: Any) -> list[str]:
    """Raise WiringError (one line naming the fix) when the wiring is unsafe; return warnings."""
    enabled = enabled_middlewares(settings)
    ours = {}
    for path in PRIORITIES:
        found = _orders_of(enabled, path)
        if not found:
            raise WiringError(f"DOWNLOADER_MIDDLEWARES does not enable {_short(path)}: add {_fix(path)}")
        ours[path] = found[0][1]
    lease, ban, guard = ours[LEASE_MIDDLEWARE], ours[BAN_MIDDLEWARE], ours[GUARD_MIDDLEWARE]
    # Each constraint names the most binding conflict, so that the number it suggests fixes them all.
    for other, order in sorted(_orders_of(enabled, HTTP_PROXY), key=lambda o: o[1]):
        if not lease < order:
            raise WiringError(_order_problem(LEASE_MIDDLEWARE, lease, "before", other, order))
    before_ban = [(LEASE_MIDDLEWARE, lease)] + [o for p in AFTER_BAN_DETECTION for o in _orders_of(enabled, p)]
    for other, order in sorted(before_ban, key=lambda o: -o[1]):
        if not ban > order:
            raise WiringError(_order_problem(BAN_MIDDLEWARE, ban, "after", other, order))
    base = {load_object(k) if isinstance(k, str) else k for k in settings.getdict("DOWNLOADER_MIDDLEWARES_BASE")}
    before_guard = [(_path(cls), order) for cls, order in enabled.items()
                    if cls in base or _path(cls) in (LEASE_MIDDLEWARE, BAN_MIDDLEWARE)]
    for other, order in sorted(before_guard, key=lambda o: -o[1]):
        if not guard > order:
            raise WiringError(_order_problem(GUARD_MIDDLEWARE, guard, "after", other, order))
    return [
        f"{_path(cls)} ({order:g}) runs after {_short(GUARD_MIDDLEWARE)} ({guard:g}): a proxy it changes "
        f"is not checked; give it a number below {guard:g}"
        for cls, order in enabled.items() if order > guard and _path(cls) not in PRIORITIES
    ]


def _order_problem(path: str, order: float, when: str, other: str, other_order: float) -> str:
    """One line: what is wrong and which number fixes it."""
    relation = "below" if when == "before" else "above"
    return (
        f"DOWNLOADER_MIDDLEWARES: {_short(path)} ({order:g}) must run {when} {_short(other)} ({other_order:g}): "
        f"give it a number {relation} {other_order:g}, e.g. {path!r}: {PRIORITIES[path]}"
    )
