"""A local provider gateway: one port, the session token in the proxy user name picks the exit.

What residential plans sell, in miniature: ``user-session-<token>:<password>@127.0.0.1:<port>``. The
first request of a token binds it to one of several loopback source addresses (127.0.0.x: the site
sees a distinct client IP per session); the same token keeps its address, a new token gets the
address least recently given out among those no token holds yet (a provider's big pool); only when
every address is held, or when told to (``collide``: a provider that gave two sessions one IP), does a
new token share one (``shared`` counts that: what the plugin's exit-IP check must find). A user
name without ``-session-<token>`` gets a new address per request (a
rotating gateway). Every proxied response carries its exit address in ``X-Gateway-Exit-IP`` (as some
providers report it), and an optional limit on concurrent requests (the plan's sessions) answers
the extra ones 429 with ``X-Gateway-Refused: concurrency`` (``refused`` counts them).

The forwarding itself is ``forward_proxy.ForwardProxy``'s; only the egress choice is new here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hmac
import json
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from scrapy_proxy_shard.demo.forward_proxy import ForwardProxy, HostMap, site_hosts
from scrapy_proxy_shard.demo.httpkit import HttpHead, render_response, run_until_signalled, write_file_atomically

EXIT_HEADER = "X-Gateway-Exit-IP"
SESSION_PART = "-session-"


class GatewayProxy(ForwardProxy):
    """A gateway over ``addresses`` (loopback source addresses), Basic auth ``<user>[-session-<token>]``
    with one password; at most ``max_concurrency`` (None: no limit) requests at once."""

    def __init__(self, addresses: Sequence[str], hosts: HostMap, *, user: str = "user", password: str = "gwpass",
                 max_concurrency: int | None = None, collide: int = 0, **kwargs: Any) -> None:
        if not addresses:
            raise ValueError("a gateway needs at least one source address")
        super().__init__(addresses[0], hosts, **kwargs)
        self.addresses = list(addresses)
        self.user = user
        self.password = password
        self.max_concurrency = max_concurrency
        #: The first ``collide`` tokens after the first one get the first token's address (a provider that
        #: gave two sessions one IP: what the plugin's exit-IP check must find), whatever is free.
        self.collide = collide
        #: token -> the address it exits from (every token ever seen).
        self.sessions: dict[str, str] = {}
        #: address -> when it was last given out (the least recent goes to the next new token).
        self._given: dict[str, int] = dict.fromkeys(self.addresses, -1)
        self._turn = 0
        self.shared = 0  # new tokens given an address another token holds
        self.refused = 0  # requests answered 429 over the concurrency limit
        self.active = 0
        self.peak = 0  # most requests in flight at once

    @property
    def template(self) -> str:
        """The gateway entry's template for the plugin (add ``#sessions=N``)."""
        return (f"http://{quote(self.user, safe='')}{SESSION_PART}{{session}}:{quote(self.password, safe='')}"
                f"@{self.listen_host}:{self.port}")

    def _url(self, *, redact: bool) -> str:
        password = "***" if redact else quote(self.password, safe="")
        return f"http://{quote(self.user, safe='')}:{password}@{self.listen_host}:{self.port}"

    def _credentials(self, head: HttpHead) -> tuple[str, str] | None:
        scheme, _, token = (head.get("proxy-authorization") or "").partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, ValueError, UnicodeDecodeError):
            return None
        return (user, password) if sep else None

    def _token(self, user: str) -> str | None:
        prefix = self.user + SESSION_PART
        return user[len(prefix):] if user.startswith(prefix) and len(user) > len(prefix) else None

    def _authorized(self, head: HttpHead) -> bool:
        creds = self._credentials(head)
        if creds is None or not hmac.compare_digest(creds[1].encode(), self.password.encode()):
            return False
        return creds[0] == self.user or self._token(creds[0]) is not None

    def exit_for(self, token: str | None) -> str:
        """The address ``token`` exits from (given at its first use); None: a new one each time."""
        if token is not None and token in self.sessions:
            return self.sessions[token]
        held = set(self.sessions.values())
        free = [a for a in self.addresses if a not in held]
        address = min(free or self.addresses, key=lambda a: self._given[a])
        if token is not None and self.sessions and len(self.sessions) <= self.collide:
            address, free = next(iter(self.sessions.values())), []
        if token is not None:
            if not free:
                self.shared += 1
            self.sessions[token] = address
        self._turn += 1
        self._given[address] = self._turn
        return address

    async def _proxied(self, method: str, target: str, head: HttpHead, body: bytes,
                       keep_alive: bool) -> tuple[int, bytes]:
        if self.max_concurrency is not None and self.active >= self.max_concurrency:
            self.refused += 1
            return 429, render_response(429, [("Content-Type", "text/plain"), ("X-Gateway-Refused", "concurrency")],
                                        b"too many concurrent sessions for this plan", keep_alive=keep_alive)
        creds = self._credentials(head)
        address = self.exit_for(self._token(creds[0]) if creds else None)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await self._forward(method, target, head, body, keep_alive, source_ip=address,
                                       extra_headers=[(EXIT_HEADER, address)])
        finally:
            self.active -= 1

    def state(self) -> dict[str, Any]:
        """What the gateway saw (no password): tokens and their addresses, shared, refused, peak."""
        return {"addresses": self.addresses, "max_concurrency": self.max_concurrency, "sessions": dict(self.sessions),
                "shared": self.shared, "refused": self.refused, "peak": self.peak, "requests": self.requests}


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scrapy_proxy_shard.demo.gateway_proxy",
                                description="Start a local provider gateway in front of the demo site.")
    p.add_argument("--site-port", type=int, required=True)
    p.add_argument("--site-host", default="127.0.0.1")
    p.add_argument("--host-pattern", default="*.test")
    p.add_argument("--first-ip", default="127.0.0.41", help="first source address (127.0.0.x)")
    p.add_argument("--addresses", type=int, default=8, help="how many source addresses the gateway has")
    p.add_argument("--max-concurrency", type=int, default=0, help="requests at once (the plan's sessions); 0: no limit")
    p.add_argument("--password", default="gwpass")
    p.add_argument("--collide", type=int, default=0,
                   help="the first N new tokens after the first share its address (a provider's collision)")
    p.add_argument("--ready-file", required=True, help="written when listening: JSON with the entry template")
    p.add_argument("--state-file", help="written at exit: JSON with the sessions seen, shared, refused, peak")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    net, _, last = args.first_ip.rpartition(".")
    addresses = [f"{net}.{int(last) + i}" for i in range(args.addresses)]
    gateway = GatewayProxy(addresses, site_hosts(args.site_port, args.host_pattern, args.site_host),
                           password=args.password, max_concurrency=args.max_concurrency or None,
                           collide=args.collide)

    def ready() -> None:
        write_file_atomically(args.ready_file, json.dumps({"template": gateway.template, "addresses": addresses}))
        print(f"gateway {gateway.redacted_url} -> egress {addresses[0]}..{addresses[-1]}", flush=True)

    try:
        asyncio.run(run_until_signalled(gateway, ready))
    finally:
        if args.state_file:
            write_file_atomically(args.state_file, json.dumps(gateway.state(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
