"""A local anti-bot web site that punishes a client IP for concurrent or too-fast use.

The whole point of scrapy-proxy-shard is that no two requests use the same proxy IP
on the same site at the same time, across many crawler processes.  A real site only
tells you that you got this wrong by banning you, in one of several disguises; this
site does the same, deterministically, and logs every request with its timing so
the demo and the end-to-end tests can prove (from the site's point of view, not the
crawler's) that the rules were respected.

Client identity is the peer IP of the TCP connection.  The local forward proxies in
:mod:`scrapy_proxy_shard.demo.forward_proxy` each connect from their own loopback
address (127.0.0.x), so the site sees one IP per proxy, like a real target would.

The rules themselves (when an IP is banned, in which disguise) live in
:mod:`scrapy_proxy_shard.demo.rules`; the HTTP plumbing and server running shared
with the forward proxy in :mod:`scrapy_proxy_shard.demo.httpkit`.  This module turns
verdicts into pages and logs every request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import html
import json
import os
import re
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import parse_qs, quote, urlsplit

from scrapy_proxy_shard.demo.httpkit import (
    COMPRESSORS,
    HttpError,
    HttpHead,
    ServerThread,
    close_server,
    parse_request_line,
    pick_encoding,
    read_body,
    read_head,
    render_response,
    run_until_signalled,
    wants_keep_alive,
    write_file_atomically,
)
from scrapy_proxy_shard.demo.rules import BAN_STYLES, AntiBot, SiteRules, Verdict

# HttpError, HttpHead, ServerThread, SiteRules and BAN_STYLES are re-exported: tests and
# callers that drive the site import them from here.
__all__ = [
    "BAN_STYLES",
    "DEFAULT_SITES",
    "AntiBotSite",
    "HttpError",
    "HttpHead",
    "ServerThread",
    "SiteRules",
    "main",
]

DEFAULT_SITES: tuple[str, ...] = ("shop-a.test", "shop-b.test", "market.test")

_CATALOG_RE = re.compile(r"/catalog/(\d{1,6})")
_FLOW_RE = re.compile(r"/flow/([A-Za-z0-9_.~-]{1,64})/step/(\d{1,4})")

# --------------------------------------------------------------------------------------
# The anti-bot site
# --------------------------------------------------------------------------------------


@dataclass
class _Reply:
    status: int
    body: bytes
    kind: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "text/html; charset=utf-8"


_ADJECTIVES = ("Sturdy", "Compact", "Deluxe", "Classic", "Portable", "Silent", "Bright", "Rugged")
_NOUNS = ("Kettle", "Lamp", "Backpack", "Headphones", "Blender", "Drill", "Umbrella", "Notebook")
_FILLER = (
    "Built for daily use and tested in our own workshop, this item ships in recyclable "
    "packaging and comes with a two-year warranty. Customers praise its finish, its "
    "balance and the fact that spare parts remain available for many years. "
)
_STUB_BODY = b"<html><head><title>Loading</title></head><body><p>Please wait&hellip;</p></body></html>"


def _html_page(title: str, body: str) -> bytes:
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title></head>\n<body>\n{body}\n</body></html>\n"
    ).encode()


class AntiBotSite:
    """Virtual-hosted HTTP/1.1 test site with per-(client IP, site) anti-bot rules.

    Use ``async with AntiBotSite(...) as site:`` in async code, ``ServerThread(site)``
    from synchronous code, or the module CLI.  Every request is appended to
    ``entries`` and, if ``log_path`` is set, to a JSON-lines file flushed per line.
    """

    def __init__(
        self,
        *,
        sites: Sequence[str] = DEFAULT_SITES,
        rules: SiteRules | None = None,
        site_rules: Mapping[str, SiteRules] | None = None,
        pages_per_site: int = 30,
        flow_steps: int = 4,
        log_path: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout: float = 30.0,
        keep_entries: bool = True,
        compress: bool = True,
    ) -> None:
        if not sites:
            raise ValueError("at least one site is required")
        if pages_per_site < 1 or flow_steps < 1:
            raise ValueError("pages_per_site and flow_steps must be >= 1")
        self.sites: tuple[str, ...] = tuple(s.lower() for s in sites)
        self.rules = rules or SiteRules()
        self.site_rules = {k.lower(): v for k, v in (site_rules or {}).items()}
        self.pages_per_site = pages_per_site
        self.flow_steps = flow_steps
        self.log_path = log_path
        self.host = host
        self.idle_timeout = idle_timeout
        self.keep_entries = keep_entries
        #: Compress bodies (br or gzip) when the client accepts it, as real sites do: ban detection
        #: must see through it (it runs before Scrapy's HttpCompressionMiddleware).
        self.compress = compress
        self.entries: list[dict[str, Any]] = []
        self._requested_port = port
        self._port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._log: IO[str] | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._antibot = AntiBot()
        self._flows: dict[tuple[str, str], str] = {}  # (site, flow_id) -> owning IP

    # -- lifecycle -------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("AntiBotSite is not started")
        return self._port

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` -- send a Host header to pick the virtual site."""
        return f"http://{self.host}:{self.port}"

    def rules_for(self, site: str) -> SiteRules:
        return self.site_rules.get(site, self.rules)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("AntiBotSite already started")
        if self.log_path is not None:
            self._log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115
        try:
            self._server = await asyncio.start_server(self._handle_connection, self.host, self._requested_port)
        except BaseException:
            self._close_log()
            raise
        self._port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening, drop open connections (cancelling in-flight requests), close log."""
        server, self._server = self._server, None
        await close_server(server, self._connections)
        self._close_log()

    async def __aenter__(self) -> AntiBotSite:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            log.close()

    # -- connection handling ---------------------------------------------------------

    async def _handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        peer = writer.get_extra_info("peername")
        ip = peer[0] if peer else "unknown"
        try:
            while True:
                try:
                    head = await asyncio.wait_for(read_head(reader), self.idle_timeout)
                    if head is None:
                        break
                    method, target, version = parse_request_line(head.start_line)
                    await read_body(reader, head)  # requests bodies are accepted and ignored
                except HttpError as exc:
                    writer.write(
                        render_response(
                            exc.status,
                            [("Content-Type", "text/plain")],
                            exc.message.encode(),
                            keep_alive=False,
                        )
                    )
                    await writer.drain()
                    break
                if not await self._serve(ip, method, target, version, head, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @staticmethod
    def _locate(target: str, head: HttpHead) -> tuple[str, str]:
        """(site, origin-form path) from an origin-form or absolute-form target."""
        if target.startswith(("http://", "https://")):
            parts = urlsplit(target)
            authority = parts.netloc.rpartition("@")[2]
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        else:
            authority = head.get("host") or ""
            path = target
        try:
            site = urlsplit(f"//{authority}").hostname or ""
        except ValueError:
            site = authority.partition(":")[0].lower()
        return site.rstrip("."), path

    async def _serve(
        self,
        ip: str,
        method: str,
        target: str,
        version: str,
        head: HttpHead,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request; returns whether the connection should stay open."""
        site, path = self._locate(target, head)
        route = urlsplit(path).path
        keep_alive = wants_keep_alive(version, head)
        start, now = time.time(), time.monotonic()
        entry: dict[str, Any] = {
            "start": start,
            "end": None,
            "ip": ip,
            "site": site,
            "method": method,
            "path": path,
            "status": None,
            "kind": None,
            "bytes": None,
            "violation": None,
            "banned": False,
            "ban_style": None,
            "blackout": False,
            "flow_id": None,
            "step": None,
            "ip_changed": None,
            "flow_done": None,
        }
        verdict: Verdict | None = None
        latency = 0.0
        if site not in self.sites:
            reply = _Reply(404, f"unknown site {site!r}".encode(), "notfound", content_type="text/plain")
        else:
            rules = self.rules_for(site)
            latency = rules.latency
            verdict = self._antibot.admit(ip, site, rules, route, now)
            entry.update(violation=verdict.violation, banned=verdict.banned, ban_style=verdict.ban_style,
                         blackout=verdict.blackout)
            if verdict.ban_style is not None:
                reply = self._ban_reply(verdict.ban_style, verdict.retry_after, path)
                told = dict(reply.headers).get("Retry-After")
                if told is not None:  # what the crawler was told: a quarantine that long is enough
                    entry["retry_after"] = int(told)
            else:
                reply = self._route(ip, site, route, path, entry)

        cancelled = False
        try:
            if latency > 0:
                await asyncio.sleep(latency)
            headers = [("Content-Type", reply.content_type), *reply.headers]
            body = reply.body
            encoding = pick_encoding(head.get("accept-encoding") or "") if self.compress and body else None
            if encoding is not None:
                body = COMPRESSORS[encoding](body)
                headers.append(("Content-Encoding", encoding))
            writer.write(
                render_response(
                    reply.status,
                    headers,
                    body,
                    keep_alive=keep_alive,
                    include_body=method != "HEAD",
                )
            )
            await writer.drain()
        except asyncio.CancelledError:
            cancelled = True  # server shutting down: the request never completed
            raise
        finally:
            # Taking `end` and releasing the in-flight slot in one synchronous step keeps
            # the log's [start, end) intervals consistent with the concurrency verdicts.
            end = time.time()
            if verdict is not None:
                self._antibot.release(verdict)
            if not cancelled:
                entry.update(end=end, status=reply.status, kind=reply.kind, bytes=len(reply.body))
                self._record(entry)
        return keep_alive

    @staticmethod
    def _ban_reply(style: str, retry_seconds: int | None, path: str) -> _Reply:
        retry_after = [("Retry-After", str(retry_seconds))] if retry_seconds is not None else []
        if style == "429":
            return _Reply(429, b"Too Many Requests", "ban", retry_after, "text/plain")
        if style == "403":
            body = _html_page("Access denied", "<h1>Access denied</h1><p>Request blocked.</p>")
            return _Reply(403, body, "ban")
        if style == "503":
            return _Reply(503, b"Service temporarily unavailable", "ban", retry_after, "text/plain")
        if style == "captcha":
            location = "/captcha?return=" + quote(path, safe="")
            return _Reply(302, b"", "captcha", [("Location", location)], "text/plain")
        return _Reply(200, _STUB_BODY, "stub")

    def _route(self, ip: str, site: str, route: str, path: str, entry: dict[str, Any]) -> _Reply:
        if route == "/":
            return self._index(site)
        match = _CATALOG_RE.fullmatch(route)
        if match and 1 <= int(match.group(1)) <= self.pages_per_site:
            return self._catalog_page(site, int(match.group(1)))
        match = _FLOW_RE.fullmatch(route)
        if match:
            return self._flow_step(ip, site, match.group(1), int(match.group(2)), entry)
        if route == "/captcha":
            return self._captcha_page(path)
        return _Reply(404, _html_page("Not found", "<h1>Not found</h1>"), "notfound")

    def _index(self, site: str) -> _Reply:
        links = "\n".join(
            f'<li><a class="product-link" href="/catalog/{n}">Product {n}</a></li>'
            for n in range(1, self.pages_per_site + 1)
        )
        body = f'<h1 class="site">{html.escape(site)}</h1>\n<ul class="catalog">\n{links}\n</ul>'
        return _Reply(200, _html_page(f"{site} catalog", body), "index")

    def _catalog_page(self, site: str, n: int) -> _Reply:
        seed = zlib.crc32(f"{site}/{n}".encode())
        title = f"{_ADJECTIVES[seed % 8]} {_NOUNS[(seed >> 3) % 8]} {n}"
        price = f"{1 + (seed >> 6) % 20000 / 100:.2f}"
        product_id = f"{site.split('.')[0]}-{n:04d}"
        specs = "\n".join(f"<tr><th>Property {i}</th><td>{(seed >> i) % 97} units</td></tr>" for i in range(1, 13))
        nav = "".join(
            f'<a class="nav" href="/catalog/{m}">Product {m}</a> '
            for m in (n - 1, n + 1)
            if 1 <= m <= self.pages_per_site
        )
        body = (
            f'<div class="product" data-id="{product_id}">\n'
            f'<h1 class="title">{html.escape(title)}</h1>\n'
            f'<span class="price">{price}</span>\n'
            f'<div class="description"><p>{_FILLER * 4}</p><p>{_FILLER * 3}</p></div>\n'
            f'<table class="specs">\n{specs}\n</table>\n'
            f'<nav>{nav}<a href="/">Back to catalog</a></nav>\n'
            "</div>"
        )
        return _Reply(200, _html_page(f"{title} | {site}", body), "page")

    def _flow_step(self, ip: str, site: str, flow_id: str, step: int, entry: dict[str, Any]) -> _Reply:
        entry.update(flow_id=flow_id, step=step, ip_changed=False, flow_done=False)
        if not 1 <= step <= self.flow_steps:
            return _Reply(404, _html_page("Not found", "<h1>No such step</h1>"), "notfound")
        key = (site, flow_id)
        if step == 1:
            self._flows[key] = ip  # (re)starting a flow binds it to the caller's IP
        else:
            owner = self._flows.get(key)
            if owner is None:
                return _Reply(403, b"flow not started", "flow", content_type="text/plain")
            if owner != ip:
                entry["ip_changed"] = True
                return _Reply(403, b"session ip changed", "flow", content_type="text/plain")
        if step == self.flow_steps:
            entry["flow_done"] = True
            tail = f'<div class="flow-done">Flow {html.escape(flow_id)} complete.</div>'
        else:
            nxt = f"/flow/{quote(flow_id)}/step/{step + 1}"
            tail = f'<a class="next-step" href="{nxt}">Continue to step {step + 1}</a>'
        body = (
            f'<div class="flow-step" data-flow="{html.escape(flow_id)}" data-step="{step}">\n'
            f"<h1>Checkout step {step} of {self.flow_steps}</h1>\n"
            f"<p>{_FILLER * 4}</p>\n{tail}\n</div>"
        )
        return _Reply(200, _html_page(f"Step {step}", body), "flow")

    @staticmethod
    def _captcha_page(path: str) -> _Reply:
        back = parse_qs(urlsplit(path).query).get("return", ["/"])[0]
        body = (
            '<div class="captcha"><h1>Please verify you are human</h1>'
            f'<form method="post" action="/captcha"><input type="hidden" name="return" '
            f'value="{html.escape(back)}"><button>I am not a robot</button></form></div>'
        )
        return _Reply(200, _html_page("Verify you are human", body), "captcha")

    def _record(self, entry: dict[str, Any]) -> None:
        if self.keep_entries:
            self.entries.append(entry)
        if self._log is not None:
            self._log.write(json.dumps(entry) + "\n")
            self._log.flush()


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    defaults = SiteRules()
    p = argparse.ArgumentParser(
        prog="python -m scrapy_proxy_shard.demo.site",
        description="Local anti-bot test site (prints the bound port on stdout when ready).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = ephemeral")
    p.add_argument("--log", help="JSON-lines request log (appended)")
    p.add_argument("--ready-file", help="written atomically with the bound port when ready")
    p.add_argument("--sites", default=",".join(DEFAULT_SITES), help="comma-separated hosts")
    p.add_argument("--pages-per-site", type=int, default=30)
    p.add_argument("--flow-steps", type=int, default=4)
    p.add_argument("--latency", type=float, default=defaults.latency)
    p.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency)
    p.add_argument("--min-interval", type=float, default=defaults.min_interval)
    p.add_argument("--ban-seconds", type=float, default=defaults.ban_seconds)
    p.add_argument("--ban-styles", default=",".join(BAN_STYLES), help="comma-separated")
    p.add_argument(
        "--burnt",
        default="",
        help="IPs a site has blacklisted already: 'site=ip+ip;site=ip' (always served a ban there)",
    )
    p.add_argument(
        "--blackout",
        default="",
        help="sites that reject every client for a while after their first request: 'site=seconds;site=seconds'",
    )
    return p


def parse_burnt(text: str) -> dict[str, frozenset[str]]:
    """'market.test=127.0.0.13+127.0.0.15;shop-a.test=127.0.0.17' -> {site: {ips}}."""
    out: dict[str, frozenset[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        site, sep, ips = part.partition("=")
        if not sep or not site.strip():
            raise ValueError(f"--burnt: expected site=ip+ip, got {part!r}")
        out[site.strip()] = frozenset(ip.strip() for ip in ips.split("+") if ip.strip())
    return out


def parse_blackout(text: str) -> dict[str, float]:
    """'market.test=6;shop-a.test=2.5' -> {site: seconds}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        site, sep, seconds = part.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not sep or not site.strip() or not value >= 0:
            raise ValueError(f"--blackout: expected site=seconds, got {part!r}")
        out[site.strip()] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    rules = SiteRules(
        latency=args.latency,
        max_concurrency=args.max_concurrency,
        min_interval=args.min_interval,
        ban_seconds=args.ban_seconds,
        ban_styles=tuple(s.strip() for s in args.ban_styles.split(",") if s.strip()),
    )
    burnt = parse_burnt(args.burnt)
    blackout = parse_blackout(args.blackout)
    site = AntiBotSite(
        sites=[s.strip() for s in args.sites.split(",") if s.strip()],
        rules=rules,
        site_rules={name: dataclasses.replace(rules, burnt_ips=burnt.get(name, frozenset()),
                                              blackout=blackout.get(name, 0.0))
                    for name in {*burnt, *blackout}},
        pages_per_site=args.pages_per_site,
        flow_steps=args.flow_steps,
        log_path=args.log,
        host=args.host,
        port=args.port,
    )

    def ready() -> None:
        print(site.port, flush=True)
        print(
            f"anti-bot site on {site.base_url} serving {', '.join(site.sites)}",
            file=sys.stderr,
            flush=True,
        )
        if args.ready_file:
            write_file_atomically(args.ready_file, f"{site.port}\n")

    asyncio.run(run_until_signalled(site, ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
