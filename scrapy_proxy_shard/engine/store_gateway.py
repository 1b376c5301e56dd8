"""The store's gateway operations: rotating a gateway slot's session token after a ban, and recording
the exit IP a slot's token turned out to have (``engine/gateway.py`` says what a slot is). ``_Gateway``
is a mixin of ``store._StoreBase``: plans run by its ``_drive``, one script call each."""

from __future__ import annotations

from dataclasses import dataclass

from scrapy_proxy_shard.engine import keyset
from scrapy_proxy_shard.engine.gateway import new_token
from scrapy_proxy_shard.engine.store_calls import Plan, _ms, _Script


@dataclass(frozen=True)
class RotateResult:
    """``status``: ``rotated`` (a new token: a new exit IP), ``cooldown`` (the site's rotation budget is
    spent: quarantine the slot instead), ``stale`` (another host rotated it already), ``noop`` (a
    gateway without placeholder), ``static`` (not a gateway slot) or ``unknown`` (no such proxy)."""

    status: str
    count: int = 0
    left: float = 0.0  # cooldown: seconds until the window ends


@dataclass(frozen=True)
class ExitResult:
    """``status``: ``ok``, ``shared`` (slot ``other`` holds the IP: this slot was rotated), ``stale``,
    ``static`` or ``unknown``."""

    status: str
    other: str = ""


class _Gateway:
    """Gateway slot plans (mixed into ``store._StoreBase``)."""

    def gateway_rotate(self, pool: str, proxy_id: str, site: str, sent_url: str, *, rotations: int,
                       window: float):
        """Give slot ``proxy_id`` a new token after a ban on ``site`` through ``sent_url`` (compare-and-set:
        a ban reported with an older token rotates nothing), unless the gateway made ``rotations``
        rotations for ``site`` within ``window`` seconds already."""
        return self._drive(self._gateway_rotate(pool, proxy_id, site, sent_url, rotations, window))

    def _gateway_rotate(self, pool, proxy_id, site, sent_url, rotations, window) -> Plan:
        reply = yield _Script("gateway_rotate", keyset.script_keys("gateway_rotate", self.prefix(pool)), (
            proxy_id, site, sent_url, new_token(), max(1, int(rotations)), max(1, _ms(window, "window"))))
        status = reply[0].lower()
        if status == "cooldown":
            return RotateResult(status, int(reply[1]), int(reply[2]) / 1000)
        return RotateResult(status, int(reply[1]) if len(reply) > 1 else 0)

    def gateway_exit(self, pool: str, proxy_id: str, sent_url: str, ip: str, *, ttl: float):
        """Record that slot ``proxy_id`` (its token in ``sent_url``) exits from ``ip``, for ``ttl`` seconds;
        a slot found on an IP another slot holds is rotated (``ExitResult.status`` ``shared``)."""
        return self._drive(self._gateway_exit(pool, proxy_id, sent_url, ip, ttl))

    def _gateway_exit(self, pool, proxy_id, sent_url, ip, ttl) -> Plan:
        reply = yield _Script("gateway_exit", keyset.script_keys("gateway_exit", self.prefix(pool)), (
            proxy_id, sent_url, ip, max(1, _ms(ttl, "ttl")), new_token()))
        return ExitResult(reply[0].lower(), reply[1] if len(reply) > 1 else "")
