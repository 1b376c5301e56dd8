"""Local forward HTTP proxies, each egressing from its own loopback address.

A real proxy pool gives every proxy its own public IP; here each proxy binds its
upstream connections to its own 127.0.0.x source address (the whole 127/8 is on the
loopback interface on Linux, no setup needed), so the demo site sees a distinct
client IP per proxy.  Some proxies require Basic auth, one can be "dead" (accepts
the TCP connection and hangs up) and one "slow", so a crawler meets the same failure
modes as with a commercial pool.

Only absolute-form ``http://`` requests are proxied -- that is what Scrapy sends to
an http proxy for http URLs.  CONNECT is refused with 501: the demo site speaks
plain HTTP only, so a tunnel would have nothing to carry.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hmac
import ipaddress
import json
import logging
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from scrapy_proxy_shard.demo.httpkit import (
    HOP_BY_HOP,
    HttpError,
    HttpHead,
    close_server,
    parse_request_line,
    read_body,
    read_head,
    render_response,
    run_until_signalled,
    wants_keep_alive,
    write_file_atomically,
)

__all__ = [
    "ForwardProxy",
    "HostMap",
    "ProxyFleet",
    "ProxySpec",
    "default_fleet_specs",
    "main",
    "resolve_host",
    "site_hosts",
]

logger = logging.getLogger(__name__)

#: Hostname (exact, or ``*.suffix`` wildcard) -> (address, port) of the real server.
HostMap = Mapping[str, tuple[str, int]]


def site_hosts(site_port: int, pattern: str = "*.test", address: str = "127.0.0.1") -> dict[str, tuple[str, int]]:
    """The host map that sends every demo-site hostname to the local site."""
    return {pattern: (address, site_port)}


def resolve_host(hosts: HostMap, hostname: str) -> tuple[str, int] | None:
    """Exact names win; otherwise the longest matching ``*.suffix`` pattern."""
    name = hostname.lower().rstrip(".")
    for pattern, addr in hosts.items():
        if pattern.lower() == name:
            return addr
    best: tuple[int, tuple[str, int]] | None = None
    for pattern, addr in hosts.items():
        if pattern.startswith("*."):
            suffix = pattern[1:].lower()  # ".test"
            matches = name.endswith(suffix) and len(name) > len(suffix)
            if matches and (best is None or len(suffix) > best[0]):
                best = (len(suffix), addr)
    return None if best is None else best[1]


@dataclass(frozen=True)
class ProxySpec:
    """How one demo proxy behaves; ``source_ip`` is the client IP the site will see."""

    source_ip: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    dead: bool = False
    slow: float = 0.0
    #: Seconds the first request of each new client connection is held before it goes upstream: what
    #: a real proxy's connection set-up costs (TCP, CONNECT, TLS) and a reused connection does not.
    setup: float = 0.0

    def __post_init__(self) -> None:
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password go together")
        if self.slow < 0 or self.setup < 0:
            raise ValueError("slow and setup must be >= 0")
        ipaddress.ip_address(self.source_ip)

    @property
    def auth(self) -> bool:
        return self.username is not None


def default_fleet_specs(
    count: int = 12,
    *,
    first_ip: str = "127.0.0.11",
    auth: int = 3,
    dead: int = 1,
    slow: int = 1,
    slow_seconds: float = 0.5,
    setup_seconds: float = 0.0,
) -> list[ProxySpec]:
    """The demo pool: consecutive source IPs, the last ``slow`` proxies slow, the
    ``dead`` ones before them dead, and ``auth`` of the healthy ones (every other one,
    from the second) behind Basic auth with user ``user<n>`` / password ``s3cret-<n>``
    where ``n`` is the 1-based position in the fleet.

    With the defaults: 127.0.0.11-.22, auth on .12/.14/.16, .21 dead, .22 slow (0.5 s).
    ``setup_seconds``: every proxy holds the first request of each new connection that long.
    """
    if count < 1 or min(auth, dead, slow) < 0 or auth + dead + slow > count:
        raise ValueError("need count >= auth + dead + slow, all non-negative")
    first = ipaddress.IPv4Address(first_ip)
    ips = [first + i for i in range(count)]
    if not all(ip.is_loopback for ip in ips):
        raise ValueError(f"{count} source IPs from {first_ip} do not all fit in 127.0.0.0/8")
    slow_idx = set(range(count - slow, count))
    dead_idx = set(range(count - slow - dead, count - slow))
    healthy = [i for i in range(count) if i not in slow_idx and i not in dead_idx]
    preferred = healthy[1::2] + healthy[0::2]
    auth_idx = set(preferred[:auth])
    specs = []
    for i, ip in enumerate(ips):
        n = i + 1
        creds = (f"user{n}", f"s3cret-{n}") if i in auth_idx else (None, None)
        specs.append(
            ProxySpec(
                str(ip),
                username=creds[0],
                password=creds[1],
                dead=i in dead_idx,
                slow=slow_seconds if i in slow_idx else 0.0,
                setup=setup_seconds,
            )
        )
    return specs


class ForwardProxy:
    """One forward HTTP proxy listening on ``listen_host``:ephemeral port.

    Each proxied request gets a fresh upstream connection bound to ``source_ip`` and
    sent with ``Connection: close``; the response is re-framed with Content-Length
    towards the client, so client-side keep-alive works whatever the upstream did.
    """

    def __init__(
        self,
        source_ip: str,
        hosts: HostMap,
        *,
        username: str | None = None,
        password: str | None = None,
        dead: bool = False,
        slow: float = 0.0,
        setup: float = 0.0,
        jitter: float = 0.0,
        listen_host: str = "127.0.0.1",
        port: int = 0,
        upstream_timeout: float = 30.0,
        idle_timeout: float = 30.0,
    ) -> None:
        self.spec = ProxySpec(source_ip, username, password, dead, slow, setup)
        if jitter < 0:
            raise ValueError("jitter must be >= 0")
        #: Path jitter: each proxied request is held a delay drawn uniformly from [0, jitter] seconds
        #: before it goes upstream (what the network between a real proxy and a site adds).
        self.jitter = jitter
        self.hosts = dict(hosts)
        self.listen_host = listen_host
        self.upstream_timeout = upstream_timeout
        self.idle_timeout = idle_timeout
        #: Requests answered (any status, including 407/502); dead proxies count none.
        self.requests = 0
        #: TCP connections accepted.
        self.connections = 0
        self._requested_port = port
        self._port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._expected_credentials: tuple[bytes, ...] = ()
        if username is not None and password is not None:
            plain = f"{username}:{password}"
            # Scrapy encodes credentials as latin-1 by default; accept UTF-8 too.
            self._expected_credentials = tuple({plain.encode("utf-8"), plain.encode("latin-1", "replace")})

    @classmethod
    def from_spec(cls, spec: ProxySpec, hosts: HostMap, **kwargs: Any) -> ForwardProxy:
        return cls(
            spec.source_ip,
            hosts,
            username=spec.username,
            password=spec.password,
            dead=spec.dead,
            slow=spec.slow,
            setup=spec.setup,
            **kwargs,
        )

    @property
    def source_ip(self) -> str:
        return self.spec.source_ip

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("ForwardProxy is not started")
        return self._port

    @property
    def url(self) -> str:
        """Proxy URL as a crawler wants it, credentials included when auth is required."""
        return self._url(redact=False)

    @property
    def redacted_url(self) -> str:
        """Like :attr:`url` with the password replaced by ``***``: safe to log."""
        return self._url(redact=True)

    def _url(self, *, redact: bool) -> str:
        userinfo = ""
        if self.spec.username is not None and self.spec.password is not None:
            password = "***" if redact else quote(self.spec.password, safe="")
            userinfo = f"{quote(self.spec.username, safe='')}:{password}@"
        return f"http://{userinfo}{self.listen_host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("ForwardProxy already started")
        self._server = await asyncio.start_server(self._handle_connection, self.listen_host, self._requested_port)
        self._port = self._server.sockets[0].getsockname()[1]
        logger.debug("proxy %s listening, egress %s", self.redacted_url, self.source_ip)

    async def stop(self) -> None:
        server, self._server = self._server, None
        await close_server(server, self._tasks)

    async def __aenter__(self) -> ForwardProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- serving ---------------------------------------------------------------------

    async def _handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            if not self.spec.dead:
                await self._serve_connection(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while True:
            try:
                head = await asyncio.wait_for(read_head(reader), self.idle_timeout)
                if head is None:
                    return
                method, target, version = parse_request_line(head.start_line)
                keep_alive = wants_keep_alive(version, head)
                if method == "CONNECT":
                    raise HttpError(501, "CONNECT is not supported by the demo proxy")
                body = await read_body(reader, head)
            except HttpError as exc:
                self.requests += 1
                writer.write(self._error(exc.status, exc.message, keep_alive=False))
                await writer.drain()
                return
            self.requests += 1
            if not self._authorized(head):
                response = render_response(
                    407,
                    [
                        ("Proxy-Authenticate", 'Basic realm="scrapy-proxy-shard demo"'),
                        ("Content-Type", "text/plain"),
                    ],
                    b"proxy authentication required",
                    keep_alive=keep_alive,
                )
                status = 407
            else:
                delay = self.spec.slow + (self.spec.setup if first else 0.0)
                if self.jitter > 0:
                    delay += random.uniform(0.0, self.jitter)
                if delay > 0:
                    await asyncio.sleep(delay)
                status, response = await self._proxied(method, target, head, body, keep_alive)
            first = False
            logger.debug("proxy %s: %s %s -> %d", self.source_ip, method, target, status)
            writer.write(response)
            await writer.drain()
            if not keep_alive:
                return

    def _authorized(self, head: HttpHead) -> bool:
        if not self._expected_credentials:
            return True
        scheme, _, token = (head.get("proxy-authorization") or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            supplied = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        return any(hmac.compare_digest(supplied, exp) for exp in self._expected_credentials)

    @staticmethod
    def _error(status: int, message: str, *, keep_alive: bool) -> bytes:
        return render_response(status, [("Content-Type", "text/plain")], message.encode(), keep_alive=keep_alive)

    async def _proxied(
        self, method: str, target: str, head: HttpHead, body: bytes, keep_alive: bool
    ) -> tuple[int, bytes]:
        """An authorized request's answer (a subclass picks the egress per request: gateway_proxy.py)."""
        return await self._forward(method, target, head, body, keep_alive)

    async def _forward(
        self, method: str, target: str, head: HttpHead, body: bytes, keep_alive: bool,
        *, source_ip: str | None = None, extra_headers: Sequence[tuple[str, str]] = (),
    ) -> tuple[int, bytes]:
        """Send the request upstream from ``source_ip`` (default: this proxy's); (status, serialised
        response), with ``extra_headers`` added to the response."""
        parts = urlsplit(target)
        if parts.scheme.lower() != "http" or not parts.hostname:
            msg = "the demo proxy expects absolute-form http:// request targets"
            return 400, self._error(400, msg, keep_alive=keep_alive)
        addr = resolve_host(self.hosts, parts.hostname)
        if addr is None:
            return 502, self._error(502, f"unknown host {parts.hostname}", keep_alive=keep_alive)

        dropped = HOP_BY_HOP | head.tokens("connection") | {"host", "content-length"}
        lines = [
            f"{method} {(parts.path or '/') + (f'?{parts.query}' if parts.query else '')} HTTP/1.1",
            f"Host: {parts.netloc.rpartition('@')[2]}",
            *(f"{k}: {v}" for k, v in head.headers if k.lower() not in dropped),
            "Connection: close",
        ]
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(addr[0], addr[1], local_addr=(source_ip or self.source_ip, 0)),
                self.upstream_timeout,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            msg = f"upstream connect failed: {type(exc).__name__}"
            return 502, self._error(502, msg, keep_alive=keep_alive)
        try:
            up_writer.write(request)
            await up_writer.drain()
            status, reason, resp_head, resp_body = await asyncio.wait_for(
                self._read_response(up_reader, method), self.upstream_timeout
            )
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, HttpError) as exc:
            msg = f"bad upstream response: {type(exc).__name__}"
            return 502, self._error(502, msg, keep_alive=keep_alive)
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError):
                await up_writer.wait_closed()

        relay = HOP_BY_HOP | resp_head.tokens("connection") | {"content-length"}
        headers = [(k, v) for k, v in resp_head.headers if k.lower() not in relay] + list(extra_headers)
        response = render_response(
            status,
            headers,
            resp_body,
            keep_alive=keep_alive,
            include_body=method != "HEAD",
            reason=reason,
        )
        return status, response

    @staticmethod
    async def _read_response(reader: asyncio.StreamReader, method: str) -> tuple[int, str, HttpHead, bytes]:
        head = await read_head(reader)
        if head is None:
            raise HttpError(502, "upstream closed without a response")
        version, _, rest = head.start_line.partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise HttpError(502, "malformed upstream status line")
        status = int(code)
        body = await read_body(reader, head, response_to=method, status=status)
        return status, reason, head, body


class ProxyFleet:
    """Several :class:`ForwardProxy` instances started and stopped together."""

    def __init__(self, specs: Sequence[ProxySpec], hosts: HostMap, **proxy_kwargs: Any) -> None:
        self.proxies = [ForwardProxy.from_spec(spec, hosts, **proxy_kwargs) for spec in specs]

    @classmethod
    def for_site(cls, site_port: int, count: int = 12, **spec_kwargs: Any) -> ProxyFleet:
        """The default demo fleet (see :func:`default_fleet_specs`) in front of the site."""
        return cls(default_fleet_specs(count, **spec_kwargs), site_hosts(site_port))

    async def start(self) -> None:
        try:
            for proxy in self.proxies:
                await proxy.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(proxy.stop() for proxy in self.proxies))

    async def __aenter__(self) -> ProxyFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def proxy_urls(self) -> list[str]:
        """URLs for the crawler's proxy list, credentials included, in spec order."""
        return [proxy.url for proxy in self.proxies]

    def source_ips(self) -> dict[str, str]:
        """Proxy URL -> the client IP the site sees for requests through it."""
        return {proxy.url: proxy.source_ip for proxy in self.proxies}

    def specs(self) -> dict[str, ProxySpec]:
        """Proxy URL -> its spec (auth, dead, slow)."""
        return {proxy.url: proxy.spec for proxy in self.proxies}

    def manifest(self) -> list[dict[str, Any]]:
        """JSON-friendly description of every proxy (URLs include credentials)."""
        return [
            {
                "url": p.url,
                "source_ip": p.source_ip,
                "auth": p.spec.auth,
                "dead": p.spec.dead,
                "slow": p.spec.slow,
            }
            for p in self.proxies
        ]


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scrapy_proxy_shard.demo.forward_proxy",
        description="Start a fleet of local forward proxies in front of the demo site.",
    )
    p.add_argument("--count", type=int, default=12)
    p.add_argument("--site-port", type=int, required=True)
    p.add_argument("--site-host", default="127.0.0.1", help="address of the demo site")
    p.add_argument("--host-pattern", default="*.test", help="hostnames routed to the site")
    p.add_argument("--proxy-file", required=True, help="written with one proxy URL per line")
    p.add_argument("--ready-file", help="written last, with a JSON manifest of the proxies")
    p.add_argument("--first-ip", default="127.0.0.11")
    p.add_argument("--auth", type=int, default=3, help="how many proxies require Basic auth")
    p.add_argument("--dead", type=int, default=1)
    p.add_argument("--slow", type=int, default=1)
    p.add_argument("--slow-seconds", type=float, default=0.5)
    p.add_argument("--setup-seconds", type=float, default=0.0,
                   help="every proxy holds the first request of each new client connection this long")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="path jitter: every proxied request is held uniformly 0..this many ms before it goes upstream")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    specs = default_fleet_specs(
        args.count,
        first_ip=args.first_ip,
        auth=args.auth,
        dead=args.dead,
        slow=args.slow,
        slow_seconds=args.slow_seconds,
        setup_seconds=args.setup_seconds,
    )
    fleet = ProxyFleet(specs, site_hosts(args.site_port, args.host_pattern, args.site_host),
                       jitter=args.jitter_ms / 1000.0)

    def ready() -> None:
        write_file_atomically(args.proxy_file, "".join(f"{u}\n" for u in fleet.proxy_urls()))
        if args.ready_file:
            manifest = {"proxies": fleet.manifest()}
            write_file_atomically(args.ready_file, json.dumps(manifest, indent=2) + "\n")
        for proxy in fleet.proxies:  # redacted: never print a password
            flags = [f for f, on in (("auth", proxy.spec.auth), ("dead", proxy.spec.dead)) if on]
            if proxy.spec.slow:
                flags.append(f"slow={proxy.spec.slow}s")
            print(
                f"{proxy.redacted_url} -> egress {proxy.source_ip} {' '.join(flags)}".rstrip(),
                flush=True,
            )

    asyncio.run(run_until_signalled(fleet, ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
