"""Raw HTTP helpers shared by the demo site and demo proxy tests (a real socket, no client library)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from scrapy_proxy_shard.demo.site import SiteRules

# No rate rule, short latency: tests that are not about the rules must not trip them.
RELAXED = SiteRules(latency=0.01, min_interval=0.0)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_response(raw: bytes) -> Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return Response(int(status_line.split(" ")[1]), headers, body)


async def send_raw(port: int, raw: bytes, *, source_ip: str | None = None) -> bytes:
    """Send bytes on a fresh connection (optionally from a chosen 127.0.0.x address) and read until
    the server closes it."""
    local_addr = (source_ip, 0) if source_ip else None
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=local_addr)
    try:
        writer.write(raw)
        await writer.drain()
        try:
            return await reader.read()
        except ConnectionResetError:
            return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)
