"""HTTP/1.1 plumbing and server running for the demo site and the demo proxies.

Kept apart from the anti-bot rules (:mod:`scrapy_proxy_shard.demo.rules`) so that the
site module reads as "what the site decides", and so that the forward proxy reuses
the same parsing, framing and lifecycle code.  Stdlib only (brotli if installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import importlib.util
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "COMPRESSORS",
    "HOP_BY_HOP",
    "AsyncServer",
    "HttpError",
    "HttpHead",
    "ServerThread",
    "close_server",
    "parse_head",
    "parse_request_line",
    "pick_encoding",
    "read_body",
    "read_head",
    "render_response",
    "run_until_signalled",
    "wants_keep_alive",
    "write_file_atomically",
]

# --------------------------------------------------------------------------------------
# Minimal HTTP/1.1 plumbing
# --------------------------------------------------------------------------------------

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


class HttpError(Exception):
    """A message we cannot handle; ``status`` is what to answer the client with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class HttpHead:
    """The start line and header fields of one HTTP message, in wire order."""

    start_line: str
    headers: list[tuple[str, str]] = field(default_factory=list)

    def get(self, name: str, default: str | None = None) -> str | None:
        """First value of header ``name`` (case-insensitive)."""
        wanted = name.lower()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value
        return default

    def tokens(self, name: str) -> set[str]:
        """Lower-cased comma-separated tokens of every ``name`` header (e.g. Connection)."""
        wanted = name.lower()
        found: set[str] = set()
        for key, value in self.headers:
            if key.lower() == wanted:
                found.update(t.strip().lower() for t in value.split(",") if t.strip())
        return found


def parse_head(raw: bytes) -> HttpHead:
    """Parse a message head (start line + headers, CRLF-terminated) as latin-1 text."""
    lines = raw.decode("latin-1").split("\r\n")
    head = HttpHead(lines[0])
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise HttpError(400, "malformed header line")
        head.headers.append((name, value.strip()))
    return head


async def read_head(reader: asyncio.StreamReader) -> HttpHead | None:
    """Read one message head; ``None`` when the peer closed cleanly between messages."""
    while True:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial.strip():
                return None
            raise HttpError(400, "truncated message head") from exc
        except asyncio.LimitOverrunError as exc:
            raise HttpError(431, "message head too large") from exc
        # RFC 9112 2.2: ignore empty lines before the start line (stray CRLF after a body).
        raw = raw.lstrip(b"\r\n")
        if raw:
            return parse_head(raw)


def parse_request_line(line: str) -> tuple[str, str, str]:
    """Split ``METHOD target HTTP/1.x`` into its three parts."""
    parts = line.split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are supported")
    return method.upper(), target, version


def wants_keep_alive(version: str, head: HttpHead) -> bool:
    """Whether the sender of ``head`` expects the connection to stay open afterwards."""
    tokens = head.tokens("connection") | head.tokens("proxy-connection")
    if "close" in tokens:
        return False
    if version == "HTTP/1.0":
        return "keep-alive" in tokens
    return True


def _content_length(head: HttpHead) -> int | None:
    values = {v.strip() for k, v in head.headers if k.lower() == "content-length"}
    if not values:
        return None
    if len(values) != 1:
        raise HttpError(400, "conflicting Content-Length headers")
    value = values.pop()
    if not value.isdigit():
        raise HttpError(400, "invalid Content-Length")
    return int(value)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise HttpError(400, "invalid chunk size") from exc
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # skip trailer fields
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def read_body(
    reader: asyncio.StreamReader,
    head: HttpHead,
    *,
    response_to: str | None = None,
    status: int | None = None,
) -> bytes:
    """Read the body that follows ``head``.

    For a request leave ``response_to`` as ``None``; for a response pass the request
    method and the status, because HEAD answers and 1xx/204/304 carry no body and a
    response without framing runs until the connection closes.
    """
    if response_to is not None:
        assert status is not None
        if response_to == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return b""
    if "chunked" in head.tokens("transfer-encoding"):
        return await _read_chunked(reader)
    length = _content_length(head)
    if length is not None:
        return await reader.readexactly(length)
    if response_to is not None:
        return await reader.read()
    return b""


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _brotli_compress(body: bytes) -> bytes:
    import brotli

    return brotli.compress(body)


COMPRESSORS = {"br": _brotli_compress, "gzip": gzip.compress}


def pick_encoding(accept: str) -> str | None:
    """Like a real CDN: br when the client takes it (and brotli is installed), else gzip."""
    offered = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    if "br" in offered and importlib.util.find_spec("brotli") is not None:
        return "br"
    return "gzip" if "gzip" in offered else None


def render_response(
    status: int,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    *,
    keep_alive: bool,
    include_body: bool = True,
    reason: str | None = None,
) -> bytes:
    """Serialise a response framed by Content-Length (never chunked: simpler to verify).

    ``headers`` must not contain Content-Length or Connection; they are added here.
    """
    lines = [f"HTTP/1.1 {status} {reason or reason_phrase(status)}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    lines.append(f"Content-Length: {len(body)}")
    lines.append(f"Connection: {'keep-alive' if keep_alive else 'close'}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if include_body else head


# --------------------------------------------------------------------------------------
# Running servers: in-process, in a background thread, or as a CLI until a signal
# --------------------------------------------------------------------------------------


class AsyncServer(Protocol):
    """Anything with async start()/stop(): AntiBotSite, ForwardProxy, ProxyFleet."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=AsyncServer)


class ServerThread(Generic[S]):
    """Run an async server (site or proxy fleet) on its own event loop in a daemon thread.

    Synchronous callers (tests that drive Scrapy, urllib or http.client) need the
    server to keep answering while they block; a private loop in a thread does that
    without touching the caller's reactor or loop.
    """

    def __init__(self, server: S, *, start_timeout: float = 10.0) -> None:
        self.server = server
        self.start_timeout = start_timeout
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self) -> S:
        """Start the server; returns it once it is listening (ports are then known)."""
        if self._thread is not None:
            raise RuntimeError("ServerThread already started")
        self._thread = threading.Thread(target=self._run, name=f"{type(self.server).__name__}-thread", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout):
            raise RuntimeError(f"{type(self.server).__name__} did not start in time")
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"{type(self.server).__name__} failed to start") from self._error
        return self.server

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and join the thread; safe to call twice."""
        thread, loop, stop_event = self._thread, self._loop, self._stop_event
        if thread is None or not thread.is_alive():
            return
        if loop is not None and stop_event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop_event.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"{type(self.server).__name__} did not stop in time")
        if self._error is not None:
            raise RuntimeError(f"{type(self.server).__name__} failed while stopping") from self._error

    def __enter__(self) -> S:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            await self.server.start()
            self._ready.set()
            await self._stop_event.wait()
        finally:
            await self.server.stop()


async def run_until_signalled(server: AsyncServer, on_ready: Callable[[], None]) -> None:
    """Start ``server``, call ``on_ready``, serve until SIGINT/SIGTERM, then stop cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        on_ready()
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await server.stop()


def write_file_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write via rename so a process polling for the file never reads it half-written."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


async def close_server(server: asyncio.AbstractServer | None, connections: set[asyncio.Task[Any]]) -> None:
    """Stop listening, cancel every open connection's task and wait for them all.

    Shared by the site and the proxies.  Connections are cancelled before
    ``wait_closed`` because newer Pythons make ``wait_closed`` wait for open
    connections, and an idle kept-alive one would hold shutdown for its idle timeout.
    """
    if server is not None:
        server.close()
    tasks = list(connections)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if server is not None:
        await server.wait_closed()
