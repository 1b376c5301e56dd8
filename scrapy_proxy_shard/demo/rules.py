"""The demo site's anti-bot decisions: when a client IP is banned on a site, and how.

The whole point of scrapy-proxy-shard is that no two requests use the same proxy IP
on the same site at the same time, across many crawler processes.  These rules are
what a real site would punish, made deterministic so tests can assert on them.  They
hold no I/O: :class:`scrapy_proxy_shard.demo.site.AntiBotSite` asks :class:`AntiBot`
for a verdict per request and renders it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BAN_STYLES", "EXEMPT_PATHS", "AntiBot", "ClientState", "SiteRules", "Verdict"]

#: Every disguise a ban can take; each one needs a different detector in the crawler.
BAN_STYLES: tuple[str, ...] = ("429", "403", "503", "captcha", "stub")

#: Paths a banned client may still fetch and that do not count toward the rules:
#: a crawler that follows the captcha redirect must not be punished for doing so.
EXEMPT_PATHS = frozenset({"/captcha", "/robots.txt", "/favicon.ico"})


@dataclass(frozen=True)
class SiteRules:
    """What one client IP may do on one site before it is banned there.

    The defaults are strict on purpose: one request at a time per IP and site, and a
    minimum gap between request starts, which is exactly the contract the proxy
    leases are meant to enforce across crawler processes.
    """

    #: Seconds every response on a known site is held back, so concurrent use shows.
    latency: float = 0.05
    #: A request arriving while this many from the same IP are in flight is a violation.
    max_concurrency: int = 1
    #: A request starting sooner than this after the previous start is a violation.
    min_interval: float = 0.2
    #: How long a violation bans the (IP, site); another violation extends it.
    ban_seconds: float = 5.0
    #: Disguises used, in rotation, for responses served while banned.
    ban_styles: tuple[str, ...] = BAN_STYLES
    #: Client IPs this site has blacklisted already (a "burnt" proxy): always served a ban.
    burnt_ips: frozenset[str] = frozenset()
    #: Seconds, from the site's first request, during which it rejects every client (its rules
    #: changed, the crawler's headers are flagged): every request is served a ban, whatever its IP.
    blackout: float = 0.0

    def __post_init__(self) -> None:
        styles = tuple(self.ban_styles)
        object.__setattr__(self, "ban_styles", styles)
        object.__setattr__(self, "burnt_ips", frozenset(self.burnt_ips))
        if not styles or any(s not in BAN_STYLES for s in styles):
            raise ValueError(f"ban_styles must be a non-empty subset of {BAN_STYLES}")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if min(self.latency, self.min_interval, self.ban_seconds, self.blackout) < 0:
            raise ValueError("latency, min_interval, ban_seconds and blackout must be >= 0")


@dataclass
class ClientState:
    """Per (client IP, site) bookkeeping; times are time.monotonic()."""

    in_flight: int = 0
    last_start: float | None = None
    banned_until: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """The site's decision on one request, taken when the request starts."""

    #: "concurrency" or "rate" when this request broke a rule, else None.
    violation: str | None
    #: Whether the client is banned (or burnt) on the site at this moment.
    banned: bool
    #: The disguise to serve, set only when the ban applies (banned and not exempt).
    ban_style: str | None
    #: Seconds until the ban (or the site's blackout) lifts, rounded up (at least 1), for Retry-After;
    #: None for a burnt IP, which the site blocks for good.
    retry_after: int | None
    #: The slot the request holds while in flight; None for exempt paths.
    client: ClientState | None
    #: Whether the site rejected everyone at that moment (its blackout), not this client.
    blackout: bool = False


class AntiBot:
    """Tracks every (client IP, site) and judges each request against its SiteRules."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str], ClientState] = {}
        self._ban_counter = 0
        self._first_request: dict[str, float] = {}  # site -> time of its first counted request

    def admit(self, ip: str, site: str, rules: SiteRules, route: str, now: float) -> Verdict:
        """Judge a request starting at ``now`` and count it in flight (call :meth:`release`)."""
        exempt = route in EXEMPT_PATHS
        client = self._clients.setdefault((ip, site), ClientState())
        violation = None
        if not exempt:
            violation = check_rules(client, rules, now)
            client.in_flight += 1
        first = self._first_request.setdefault(site, now) if not exempt else self._first_request.get(site, now)
        blackout = now < first + rules.blackout
        banned = client.banned_until > now or ip in rules.burnt_ips or blackout
        style = None
        if banned and not exempt:
            # One site-wide counter: deterministic for a given request order, and it spreads
            # the disguises over different clients so every detector gets exercised.
            style = rules.ban_styles[self._ban_counter % len(rules.ban_styles)]
            self._ban_counter += 1
        if ip in rules.burnt_ips:
            retry_after = None  # blacklisted for good: the site gives no time to come back
        else:
            until = max(client.banned_until, first + rules.blackout if blackout else 0.0)
            retry_after = max(1, math.ceil(until - now))
        return Verdict(violation, banned, style, retry_after, None if exempt else client, blackout)

    @staticmethod
    def release(verdict: Verdict) -> None:
        """The request is over (answered or cancelled): free its in-flight slot."""
        if verdict.client is not None:
            verdict.client.in_flight -= 1


def check_rules(client: ClientState, rules: SiteRules, now: float) -> str | None:
    """Record a request start; return the rule it breaks, extending the ban if any."""
    violation = None
    if client.in_flight >= rules.max_concurrency:
        violation = "concurrency"
    elif client.last_start is not None and now - client.last_start < rules.min_interval:
        violation = "rate"
    client.last_start = now
    if violation is not None:
        client.banned_until = max(client.banned_until, now + rules.ban_seconds)
    return violation
