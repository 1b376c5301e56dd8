"""Tests for the local forward proxies that give the demo one client IP per proxy."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from demo_http import RELAXED, Response, parse_response, run, send_raw

from scrapy_proxy_shard.demo.forward_proxy import (
    ForwardProxy,
    ProxyFleet,
    ProxySpec,
    default_fleet_specs,
    resolve_host,
    site_hosts,
)
from scrapy_proxy_shard.demo.site import AntiBotSite, ServerThread
from scrapy_proxy_shard.demo.sitelog import read_log


def basic(user: str, password: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def via_proxy(proxy_port: int, url: str, extra: Sequence[str] = ()) -> Response:
    request = "\r\n".join([f"GET {url} HTTP/1.1", *extra, "Connection: close"]) + "\r\n\r\n"
    return parse_response(await send_raw(proxy_port, request.encode()))


@contextlib.asynccontextmanager
async def site_and_proxies(
    *specs: ProxySpec, log_path: Path | None = None
) -> AsyncIterator[tuple[AntiBotSite, ProxyFleet]]:
    site = AntiBotSite(rules=RELAXED, log_path=log_path)
    async with site, ProxyFleet(specs, site_hosts(site.port)) as fleet:
        yield site, fleet


# -- forwarding --------------------------------------------------------------------------


def test_site_sees_each_proxys_source_ip() -> None:
    async def scenario() -> None:
        async with site_and_proxies(ProxySpec("127.0.0.11"), ProxySpec("127.0.0.12")) as (site, fleet):
            for proxy, path in zip(fleet.proxies, ("/catalog/1", "/catalog/2"), strict=True):
                response = await via_proxy(proxy.port, f"http://shop-a.test{path}", ["Host: shop-a.test"])
                assert response.status == 200
                assert b'<div class="product"' in response.body
                assert int(response.headers["content-length"]) == len(response.body)
            assert [(e["ip"], e["path"]) for e in site.entries] == [
                ("127.0.0.11", "/catalog/1"),
                ("127.0.0.12", "/catalog/2"),
            ]
            assert [p.requests for p in fleet.proxies] == [1, 1]

    run(scenario())


def test_client_keep_alive_through_the_proxy() -> None:
    async def scenario() -> None:
        async with site_and_proxies(ProxySpec("127.0.0.13")) as (site, fleet):
            reader, writer = await asyncio.open_connection("127.0.0.1", fleet.proxies[0].port)
            try:
                for n in (1, 2, 3):
                    writer.write(f"GET http://market.test/catalog/{n} HTTP/1.1\r\nHost: market.test\r\n\r\n".encode())
                    response = parse_response(await reader.readuntil(b"\r\n\r\n"))
                    assert response.status == 200
                    assert response.headers["connection"] == "keep-alive"
                    body = await reader.readexactly(int(response.headers["content-length"]))
                    assert f'data-id="market-{n:04d}"'.encode() in body
            finally:
                writer.close()
                await writer.wait_closed()
            assert fleet.proxies[0].connections == 1
            assert [e["ip"] for e in site.entries] == ["127.0.0.13"] * 3

    run(scenario())


def test_unknown_host_non_proxy_requests_and_connect() -> None:
    async def scenario() -> None:
        async with site_and_proxies(ProxySpec("127.0.0.14")) as (site, fleet):
            port = fleet.proxies[0].port
            unknown = await via_proxy(port, "http://example.com/")
            assert unknown.status == 502
            assert b"example.com" in unknown.body
            origin_form = await via_proxy(port, "/catalog/1", ["Host: shop-a.test"])
            assert origin_form.status == 400
            connect = parse_response(await send_raw(port, b"CONNECT shop-a.test:443 HTTP/1.1\r\n\r\n"))
            assert connect.status == 501
            assert site.entries == []

    run(scenario())


def test_upstream_connection_refused_is_502() -> None:
    async def scenario() -> None:
        # Grab a port that nobody listens on any more.
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead_port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with ForwardProxy("127.0.0.15", {"gone.test": ("127.0.0.1", dead_port)}) as proxy:
            response = await via_proxy(proxy.port, "http://gone.test/")
            assert response.status == 502
            assert b"upstream connect failed" in response.body

    run(scenario())


async def _echo_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers with the raw request it received, chunked, to test both directions."""
    raw = await reader.readuntil(b"\r\n\r\n")
    length = [line for line in raw.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    if length:
        raw += await reader.readexactly(int(length[0].split(b":")[1]))
    peer = writer.get_extra_info("peername")[0].encode()
    chunks = [peer + b"\n", raw[: len(raw) // 2], raw[len(raw) // 2 :]]
    writer.write(b"HTTP/1.1 201 Made Up\r\nTransfer-Encoding: chunked\r\nX-Upstream: echo\r\nConnection: close\r\n\r\n")
    for chunk in chunks:
        writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def test_request_rewriting_and_chunked_upstream() -> None:
    async def scenario() -> None:
        echo = await asyncio.start_server(_echo_upstream, "127.0.0.1", 0)
        hosts = {"echo.test": ("127.0.0.1", echo.sockets[0].getsockname()[1])}
        try:
            async with ForwardProxy("127.0.0.16", hosts, username="u", password="p") as proxy:
                request = (
                    "POST http://echo.test/form?x=1 HTTP/1.1\r\n"
                    "Host: echo.test\r\n"
                    f"{basic('u', 'p')}\r\n"
                    "Proxy-Connection: keep-alive\r\n"
                    "X-Custom: kept\r\n"
                    "Content-Length: 5\r\n"
                    "Connection: close\r\n\r\nhello"
                )
                response = parse_response(await send_raw(proxy.port, request.encode()))
        finally:
            echo.close()
            await echo.wait_closed()
        assert response.status == 201
        assert response.headers["x-upstream"] == "echo"
        assert "transfer-encoding" not in response.headers
        assert int(response.headers["content-length"]) == len(response.body)
        peer, _, forwarded = response.body.partition(b"\n")
        assert peer == b"127.0.0.16"
        lines = forwarded.split(b"\r\n")
        assert lines[0] == b"POST /form?x=1 HTTP/1.1"
        assert b"Host: echo.test" in lines
        assert b"X-Custom: kept" in lines
        assert b"Connection: close" in lines
        assert b"Content-Length: 5" in lines
        assert forwarded.endswith(b"\r\n\r\nhello")
        assert b"proxy-" not in forwarded.lower()

    run(scenario())


# -- auth, dead and slow proxies ---------------------------------------------------------


def test_basic_auth_required() -> None:
    spec = ProxySpec("127.0.0.17", username="alice", password="s3cret-17")

    async def scenario() -> None:
        async with site_and_proxies(spec) as (site, fleet):
            port, url = fleet.proxies[0].port, "http://shop-b.test/catalog/5"
            missing = await via_proxy(port, url)
            assert missing.status == 407
            assert missing.headers["proxy-authenticate"].startswith("Basic realm=")
            wrong = await via_proxy(port, url, [basic("alice", "nope")])
            assert wrong.status == 407
            garbage = await via_proxy(port, url, ["Proxy-Authorization: Basic !!!"])
            assert garbage.status == 407
            ok = await via_proxy(port, url, [basic("alice", "s3cret-17")])
            assert ok.status == 200
            assert [e["ip"] for e in site.entries] == ["127.0.0.17"]

    run(scenario())


def test_dead_proxy_closes_without_response() -> None:
    async def scenario() -> None:
        async with site_and_proxies(ProxySpec("127.0.0.18", dead=True)) as (site, fleet):
            raw = await send_raw(fleet.proxies[0].port, b"GET http://shop-a.test/ HTTP/1.1\r\n\r\n")
            assert raw == b""
            assert fleet.proxies[0].connections == 1
            assert site.entries == []

    run(scenario())


def test_slow_proxy_adds_delay() -> None:
    async def scenario() -> None:
        async with site_and_proxies(ProxySpec("127.0.0.19", slow=0.3)) as (site, fleet):
            started = time.monotonic()
            response = await via_proxy(fleet.proxies[0].port, "http://shop-a.test/catalog/1")
            assert response.status == 200
            assert time.monotonic() - started >= 0.3
            assert site.entries[0]["ip"] == "127.0.0.19"

    run(scenario())


# -- fleet ---------------------------------------------------------------------------------


def test_default_fleet_specs() -> None:
    specs = default_fleet_specs()
    assert [s.source_ip for s in specs] == [f"127.0.0.{n}" for n in range(11, 23)]
    assert [(s.source_ip, s.username, s.password) for s in specs if s.auth] == [
        ("127.0.0.12", "user2", "s3cret-2"),
        ("127.0.0.14", "user4", "s3cret-4"),
        ("127.0.0.16", "user6", "s3cret-6"),
    ]
    assert [s.source_ip for s in specs if s.dead] == ["127.0.0.21"]
    assert [(s.source_ip, s.slow) for s in specs if s.slow] == [("127.0.0.22", 0.5)]
    assert "s3cret" not in repr(specs)
    small = default_fleet_specs(3, first_ip="127.0.1.1", auth=1)
    assert [(s.source_ip, s.auth, s.dead, bool(s.slow)) for s in small] == [
        ("127.0.1.1", True, False, False),
        ("127.0.1.2", False, True, False),
        ("127.0.1.3", False, False, True),
    ]
    with pytest.raises(ValueError):
        default_fleet_specs(2)
    with pytest.raises(ValueError):
        default_fleet_specs(10, first_ip="127.255.255.250")


def test_fleet_urls_and_mappings() -> None:
    async def scenario() -> None:
        async with AntiBotSite(rules=RELAXED) as site, ProxyFleet.for_site(site.port) as fleet:
            urls = fleet.proxy_urls()
            assert len(urls) == 12 and len(set(urls)) == 12
            ports = {p.port for p in fleet.proxies}
            assert len(ports) == 12
            with_auth = [u for u in urls if "@" in u]
            assert with_auth == [p.url for p in fleet.proxies if p.spec.auth]
            assert with_auth[0] == f"http://user2:s3cret-2@127.0.0.1:{fleet.proxies[1].port}"
            assert urls[0] == f"http://127.0.0.1:{fleet.proxies[0].port}"
            assert fleet.proxies[1].redacted_url == f"http://user2:***@127.0.0.1:{fleet.proxies[1].port}"
            assert list(fleet.source_ips().values()) == [f"127.0.0.{n}" for n in range(11, 23)]
            assert fleet.specs()[urls[-1]].slow == 0.5
            manifest = fleet.manifest()
            assert manifest[9:] == [
                {"url": urls[9], "source_ip": "127.0.0.20", "auth": False, "dead": False, "slow": 0.0},
                {"url": urls[10], "source_ip": "127.0.0.21", "auth": False, "dead": True, "slow": 0.0},
                {"url": urls[11], "source_ip": "127.0.0.22", "auth": False, "dead": False, "slow": 0.5},
            ]
            # Every live proxy reaches the site with its own IP.
            live = [p for p in fleet.proxies if not p.spec.dead and not p.spec.slow]
            for n, proxy in enumerate(live, start=1):
                extra = [basic(proxy.spec.username, proxy.spec.password)] if proxy.spec.auth else []  # type: ignore[arg-type]
                response = await via_proxy(proxy.port, f"http://shop-a.test/catalog/{n}", extra)
                assert response.status == 200
            assert [e["ip"] for e in site.entries] == [p.source_ip for p in live]

    run(scenario())


def test_resolve_host() -> None:
    hosts = {"*.test": ("127.0.0.1", 1), "*.shop.test": ("127.0.0.1", 2), "exact.test": ("127.0.0.1", 3)}
    assert resolve_host(hosts, "shop-a.test") == ("127.0.0.1", 1)
    assert resolve_host(hosts, "SHOP-A.TEST.") == ("127.0.0.1", 1)
    assert resolve_host(hosts, "a.shop.test") == ("127.0.0.1", 2)
    assert resolve_host(hosts, "exact.test") == ("127.0.0.1", 3)
    assert resolve_host(hosts, "test") is None
    assert resolve_host(hosts, "example.com") is None
    assert resolve_host(hosts, "nottest") is None


def test_passwords_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    spec = ProxySpec("127.0.0.20", username="bob", password="s3cret-logged")

    async def scenario() -> None:
        async with site_and_proxies(spec) as (_, fleet):
            response = await via_proxy(fleet.proxies[0].port, "http://shop-a.test/", [basic("bob", "s3cret-logged")])
            assert response.status == 200

    with caplog.at_level(logging.DEBUG, logger="scrapy_proxy_shard.demo.forward_proxy"):
        run(scenario())
    assert caplog.records, "expected debug logging from the proxy"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "s3cret-logged" not in text
    assert base64.b64encode(b"bob:s3cret-logged").decode() not in text


def test_proxy_cli_writes_proxy_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    proxy_file, ready = tmp_path / "proxies.txt", tmp_path / "ready.json"
    with ServerThread(AntiBotSite(rules=RELAXED)) as site:
        cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.forward_proxy", "--count", "4"]
        cmd += ["--site-port", str(site.port), "--proxy-file", str(proxy_file), "--ready-file", str(ready)]
        cmd += ["--first-ip", "127.0.0.31", "--auth", "1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while not ready.exists():
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "proxies did not become ready"
                time.sleep(0.02)
            urls = proxy_file.read_text().splitlines()
            manifest = json.loads(ready.read_text())["proxies"]
            assert [m["url"] for m in manifest] == urls
            assert [m["source_ip"] for m in manifest] == ["127.0.0.31", "127.0.0.32", "127.0.0.33", "127.0.0.34"]
            assert urls[1].startswith("http://user2:s3cret-2@127.0.0.1:")
            port = int(urls[0].rsplit(":", 1)[1])
            response = run(via_proxy(port, "http://shop-b.test/catalog/9"))
            assert response.status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "s3cret" not in out + err
    assert "user2:***@" in out
    assert [e["ip"] for e in site.entries] == ["127.0.0.31"]


def test_site_log_records_proxy_ip(tmp_path: Path) -> None:
    log = tmp_path / "site.jsonl"

    async def scenario() -> None:
        async with site_and_proxies(ProxySpec("127.0.0.23"), log_path=log) as (_, fleet):
            assert (await via_proxy(fleet.proxies[0].port, "http://market.test/")).status == 200

    run(scenario())
    assert [(e["ip"], e["site"], e["kind"]) for e in read_log(log)] == [("127.0.0.23", "market.test", "index")]
