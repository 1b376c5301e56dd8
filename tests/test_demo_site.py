"""Tests for the local anti-bot demo site and the analysis of its request log."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from demo_http import RELAXED, Response, parse_response, run, send_raw

from scrapy_proxy_shard.demo.site import AntiBotSite, ServerThread, SiteRules
from scrapy_proxy_shard.demo.sitelog import find_overlaps, read_log, summarize


async def fetch(
    port: int,
    target: str,
    *,
    host: str | None = "shop-a.test",
    source_ip: str | None = None,
    method: str = "GET",
    extra: Sequence[str] = (),
) -> Response:
    """One request on a fresh connection (optionally from a chosen 127.0.0.x address)."""
    lines = [f"{method} {target} HTTP/1.1", *([f"Host: {host}"] if host else []), *extra]
    raw = await send_raw(port, ("\r\n".join([*lines, "Connection: close"]) + "\r\n\r\n").encode(),
                         source_ip=source_ip)
    response = parse_response(raw)
    assert int(response.headers["content-length"]) == len(response.body) or method == "HEAD"
    return response


# -- pages ---------------------------------------------------------------------------


def test_catalog_page_index_and_not_found() -> None:
    async def scenario() -> None:
        async with AntiBotSite(rules=RELAXED) as site:
            page = await fetch(site.port, "/catalog/7", host="market.test:8080")
            assert page.status == 200
            assert page.headers["content-type"].startswith("text/html")
            assert len(page.body) >= 2048
            text = page.body.decode()
            assert '<div class="product" data-id="market-0007">' in text
            assert re.search(r'<h1 class="title">[^<]+ 7</h1>', text)
            assert re.search(r'<span class="price">\d+\.\d\d</span>', text)

            index = await fetch(site.port, "/", host="shop-b.test")
            assert index.status == 200
            links = re.findall(r'href="(/catalog/\d+)"', index.body.decode())
            assert links == [f"/catalog/{n}" for n in range(1, 31)]

            assert (await fetch(site.port, "/catalog/31")).status == 404
            assert (await fetch(site.port, "/catalog/1", host="elsewhere.test")).status == 404
            head = await fetch(site.port, "/catalog/2", method="HEAD")
            assert head.status == 200 and head.body == b""
            assert int(head.headers["content-length"]) >= 2048

            kinds = [(e["site"], e["kind"], e["status"]) for e in site.entries]
            assert kinds == [
                ("market.test", "page", 200),
                ("shop-b.test", "index", 200),
                ("shop-a.test", "notfound", 404),
                ("elsewhere.test", "notfound", 404),
                ("shop-a.test", "page", 200),
            ]

    run(scenario())


def test_page_content_is_deterministic_per_site() -> None:
    async def scenario() -> tuple[bytes, bytes, bytes]:
        async with AntiBotSite(rules=RELAXED) as site:
            a = await fetch(site.port, "/catalog/3", host="shop-a.test")
            b = await fetch(site.port, "/catalog/3", host="shop-b.test")
            a2 = await fetch(site.port, "/catalog/3", host="shop-a.test")
        return a.body, b.body, a2.body

    a, b, a2 = run(scenario())
    assert a == a2
    assert a != b


def test_keep_alive_and_absolute_form_from_a_thread() -> None:
    with ServerThread(AntiBotSite(rules=RELAXED)) as site:
        conn = http.client.HTTPConnection("127.0.0.1", site.port, timeout=5)
        try:
            for n in (1, 2):
                conn.request("GET", f"/catalog/{n}", headers={"Host": "shop-a.test"})
                response = conn.getresponse()
                assert response.status == 200
                assert b'class="product"' in response.read()
            conn.request("GET", "http://shop-b.test/catalog/3")  # absolute-form wins over Host
            response = conn.getresponse()
            assert response.status == 200
            response.read()
        finally:
            conn.close()
    assert [e["site"] for e in site.entries] == ["shop-a.test", "shop-a.test", "shop-b.test"]
    assert len({e["ip"] for e in site.entries}) == 1


def test_malformed_request_gets_400() -> None:
    async def scenario() -> bytes:
        async with AntiBotSite(rules=RELAXED) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(b"NONSENSE\r\n\r\n")
            raw = await reader.read()
            writer.close()
            await writer.wait_closed()
            assert site.entries == []
            return raw

    assert run(scenario()).startswith(b"HTTP/1.1 400 ")


# -- rules and bans ------------------------------------------------------------------


def test_concurrency_violation_bans_with_rotating_styles() -> None:
    rules = SiteRules(latency=0.12, min_interval=0.0, ban_seconds=30)

    async def scenario() -> None:
        async with AntiBotSite(rules=rules) as site:
            first_task = asyncio.create_task(fetch(site.port, "/catalog/1"))
            await asyncio.sleep(0.04)  # well inside the first request's 0.12 s latency
            second = await fetch(site.port, "/catalog/2")
            first = await first_task
            assert (first.status, second.status) == (200, 429)
            assert second.headers["retry-after"] == "30"

            rotation = [await fetch(site.port, f"/catalog/{n}") for n in range(3, 8)]
            assert [r.status for r in rotation] == [403, 503, 302, 200, 429]
            assert rotation[2].headers["location"] == "/captcha?return=%2Fcatalog%2F5"
            stub = rotation[3].body
            assert len(stub) < 200 and b'class="product"' not in stub

            # The ban is per (IP, site): another IP, or the same IP elsewhere, is fine.
            assert (await fetch(site.port, "/catalog/1", source_ip="127.0.0.2")).status == 200
            assert (await fetch(site.port, "/catalog/1", host="shop-b.test")).status == 200

            by_ip_site = [e for e in site.entries if e["ip"] == "127.0.0.1" and e["site"] == "shop-a.test"]
            assert [e["violation"] for e in by_ip_site] == [None, "concurrency", *[None] * 5]
            assert [e["banned"] for e in by_ip_site] == [False, *[True] * 6]
            assert [e["ban_style"] for e in by_ip_site] == [None, "429", "403", "503", "captcha", "stub", "429"]
            assert [e["kind"] for e in by_ip_site] == ["page", "ban", "ban", "ban", "captcha", "stub", "ban"]

            summary = summarize(site.entries)
            assert summary.overlaps == 1
            assert summary.violations_by_kind == {"concurrency": 1}
            assert summary.bans_by_style == {"403": 1, "429": 2, "503": 1, "captcha": 1, "stub": 1}
            assert summary.ok_pages == 2  # /catalog/1 on shop-a (two IPs) and on shop-b

    run(scenario())


def test_rate_violation() -> None:
    rules = SiteRules(latency=0.01, min_interval=0.5, ban_seconds=5, ban_styles=("503",))

    async def scenario() -> None:
        async with AntiBotSite(rules=rules) as site:
            assert (await fetch(site.port, "/catalog/1")).status == 200
            second = await fetch(site.port, "/catalog/2")
            assert second.status == 503
            assert second.headers["retry-after"] == "5"
            assert [e["violation"] for e in site.entries] == [None, "rate"]
            assert summarize(site.entries).overlaps == 0

    run(scenario())


def test_a_burnt_ip_is_told_no_time_to_come_back() -> None:
    """A blacklisted IP is blocked for good: its 429/503 carry no Retry-After (the site used to say
    "1", which a crawler honouring Retry-After would take at its word). A rate ban says how long, and
    the log keeps what the client was told."""
    rules = SiteRules(latency=0.01, min_interval=5, ban_seconds=5, ban_styles=("429",),
                      burnt_ips=frozenset({"127.0.0.3"}))

    async def scenario() -> None:
        async with AntiBotSite(rules=rules) as site:
            burnt = await fetch(site.port, "/catalog/1", source_ip="127.0.0.3")
            assert burnt.status == 429 and "retry-after" not in burnt.headers
            assert (await fetch(site.port, "/catalog/1")).status == 200
            told = await fetch(site.port, "/catalog/2")
            assert told.status == 429 and told.headers["retry-after"] == "5"
            assert [e.get("retry_after") for e in site.entries] == [None, None, 5]

    run(scenario())


def test_ban_expires_and_violations_extend_it() -> None:
    rules = SiteRules(latency=0.01, min_interval=0.1, ban_seconds=0.3, ban_styles=("429",))

    async def scenario() -> None:
        async with AntiBotSite(rules=rules) as site:
            assert (await fetch(site.port, "/catalog/1")).status == 200
            assert (await fetch(site.port, "/catalog/2")).status == 429  # rate violation
            await asyncio.sleep(0.15)
            # Not a violation (interval respected) but still banned.
            assert (await fetch(site.port, "/catalog/3")).status == 429
            await asyncio.sleep(0.3)
            assert (await fetch(site.port, "/catalog/4")).status == 200
            assert [e["violation"] for e in site.entries] == [None, "rate", None, None]
            assert [e["banned"] for e in site.entries] == [False, True, True, False]

    run(scenario())


def test_captcha_redirect_and_captcha_page() -> None:
    rules = SiteRules(latency=0.01, min_interval=0.5, ban_styles=("captcha",))

    async def scenario() -> None:
        async with AntiBotSite(rules=rules) as site:
            await fetch(site.port, "/catalog/1")
            redirect = await fetch(site.port, "/catalog/2?ref=x")
            assert redirect.status == 302
            location = redirect.headers["location"]
            assert location == "/captcha?return=%2Fcatalog%2F2%3Fref%3Dx"
            # Following it at once must not count as another violation.
            captcha = await fetch(site.port, location)
            assert captcha.status == 200
            assert b"verify you are human" in captcha.body.lower()
            assert b'value="/catalog/2?ref=x"' in captcha.body
            assert b'class="product"' not in captcha.body
            last = site.entries[-1]
            assert last["kind"] == "captcha" and last["violation"] is None and last["banned"] is True
            assert last["ban_style"] is None
            assert summarize(site.entries).bans_by_style == {"captcha": 1}

    run(scenario())


def test_per_site_rule_overrides() -> None:
    strict = SiteRules(latency=0.01, min_interval=10.0, ban_styles=("403",))

    async def scenario() -> None:
        async with AntiBotSite(rules=RELAXED, site_rules={"market.test": strict}) as site:
            for _ in range(2):
                assert (await fetch(site.port, "/", host="shop-a.test")).status == 200
            assert (await fetch(site.port, "/", host="market.test")).status == 200
            assert (await fetch(site.port, "/", host="market.test")).status == 403

    run(scenario())


def test_rules_validation() -> None:
    with pytest.raises(ValueError):
        SiteRules(ban_styles=("418",))
    with pytest.raises(ValueError):
        SiteRules(max_concurrency=0)
    assert SiteRules(ban_styles=["stub"]).ban_styles == ("stub",)  # type: ignore[arg-type]


# -- sticky flows ----------------------------------------------------------------------


def test_flow_steps_and_session_ip_change() -> None:
    async def scenario() -> None:
        async with AntiBotSite(rules=RELAXED) as site:
            step1 = await fetch(site.port, "/flow/f1/step/1", source_ip="127.0.0.2")
            assert step1.status == 200
            assert b'href="/flow/f1/step/2"' in step1.body

            moved = await fetch(site.port, "/flow/f1/step/2", source_ip="127.0.0.3")
            assert (moved.status, moved.body) == (403, b"session ip changed")

            for k in (2, 3):
                step = await fetch(site.port, f"/flow/f1/step/{k}", source_ip="127.0.0.2")
                assert step.status == 200
                assert f'href="/flow/f1/step/{k + 1}"'.encode() in step.body
            last = await fetch(site.port, "/flow/f1/step/4", source_ip="127.0.0.2")
            assert last.status == 200 and b'<div class="flow-done">' in last.body

            orphan = await fetch(site.port, "/flow/f2/step/3", source_ip="127.0.0.2")
            assert (orphan.status, orphan.body) == (403, b"flow not started")
            assert (await fetch(site.port, "/flow/f1/step/5", source_ip="127.0.0.2")).status == 404

            flow_entries = [(e["ip"], e["step"], e["ip_changed"], e["flow_done"]) for e in site.entries]
            assert flow_entries[:5] == [
                ("127.0.0.2", 1, False, False),
                ("127.0.0.3", 2, True, False),
                ("127.0.0.2", 2, False, False),
                ("127.0.0.2", 3, False, False),
                ("127.0.0.2", 4, False, True),
            ]

            summary = summarize(site.entries)
            assert summary.flows_started == 1
            assert summary.flows_completed == 1
            assert summary.session_ip_changes == 1
            assert summary.session_ip_change_examples == [("shop-a.test", "f1", ["127.0.0.2", "127.0.0.3"])]
            assert summary.ip_changed_responses == 1
            assert summary.ips_by_site == {"shop-a.test": ["127.0.0.2", "127.0.0.3"]}

    run(scenario())


# -- the log ---------------------------------------------------------------------------

LOG_FIELDS = {
    "start",
    "end",
    "ip",
    "site",
    "method",
    "path",
    "status",
    "kind",
    "bytes",
    "violation",
    "banned",
    "ban_style",
    "blackout",
    "flow_id",
    "step",
    "ip_changed",
    "flow_done",
}


def test_log_file_has_one_json_object_per_request(tmp_path: Path) -> None:
    log = tmp_path / "site.jsonl"

    async def scenario() -> None:
        async with AntiBotSite(rules=RELAXED, log_path=log) as site:
            await fetch(site.port, "/catalog/1", source_ip="127.0.0.5")
            # Flushed per line: readable while the site is still running.
            assert len(read_log(log)) == 1
            await fetch(site.port, "/flow/abc/step/1", host="shop-b.test")

    before = time.time()
    run(scenario())
    raw = log.read_text()
    assert raw.endswith("\n") and raw.count("\n") == 2
    first, second = (json.loads(line) for line in raw.splitlines())
    assert set(first) == LOG_FIELDS == set(second)
    assert before <= first["start"] < first["end"] <= second["start"] < second["end"] <= time.time()
    assert first["end"] - first["start"] >= 0.01  # the configured latency
    assert {k: first[k] for k in ("ip", "site", "path", "status", "kind", "violation", "banned")} == {
        "ip": "127.0.0.5",
        "site": "shop-a.test",
        "path": "/catalog/1",
        "status": 200,
        "kind": "page",
        "violation": None,
        "banned": False,
    }
    assert first["flow_id"] is None and first["bytes"] >= 2048
    assert (second["kind"], second["flow_id"], second["step"]) == ("flow", "abc", 1)
    assert read_log(log) == [first, second]


def test_read_log_skips_an_unfinished_last_line(tmp_path: Path) -> None:
    log = tmp_path / "site.jsonl"
    entry = {"start": 1.0, "end": 2.0, "ip": "127.0.0.11", "site": "a.test", "path": "/"}
    log.write_text(json.dumps(entry) + "\n\n" + '{"start": 3.0, "end"')
    assert read_log(log) == [entry]
    log.write_text(json.dumps(entry))  # complete object, newline not yet written
    assert read_log(log) == [entry]


def test_site_cli_runs_until_sigterm(tmp_path: Path) -> None:
    log, ready = tmp_path / "site.jsonl", tmp_path / "ready"
    cmd = [sys.executable, "-m", "scrapy_proxy_shard.demo.site", "--port", "0"]
    cmd += ["--log", str(log), "--ready-file", str(ready), "--sites", "solo.test"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "site did not become ready"
            time.sleep(0.02)
        port = int(ready.read_text())
        response = run(fetch(port, "/catalog/4", host="solo.test"))
        assert response.status == 200
        assert (run(fetch(port, "/catalog/4"))).status == 404  # shop-a.test not served
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.splitlines()[0] == str(port)
    assert [e["site"] for e in read_log(log)] == ["solo.test", "shop-a.test"]


# -- summary and overlap analysis ------------------------------------------------------


def entry(
    start: float,
    end: float | None,
    *,
    ip: str = "127.0.0.11",
    site: str = "shop-a.test",
    path: str = "/catalog/1",
    status: int = 200,
    kind: str = "page",
    **extra: object,
) -> dict[str, object]:
    base: dict[str, object] = {
        "start": start,
        "end": end,
        "ip": ip,
        "site": site,
        "path": path,
        "status": status,
        "kind": kind,
        "violation": None,
        "banned": False,
        "ban_style": None,
        "flow_id": None,
        "step": None,
        "ip_changed": None,
        "flow_done": None,
    }
    base.update(extra)
    return base


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([(0, 1), (1, 2)], 0),  # one ends exactly when the next starts
        ([(0, 1), (2, 3)], 0),
        ([(0, 2), (1, 3)], 1),
        ([(1, 3), (0, 2)], 1),  # order in the log does not matter
        ([(0, 10), (1, 2), (3, 4)], 2),  # a long request overlaps two that do not overlap
        ([(0, 1), (0, 1), (0, 1)], 3),  # identical intervals: every pair
        ([(0, 1), (0.5, 0.5)], 0),  # an empty interval overlaps nothing
        ([(0, 1), (0.5, None)], 0),  # unfinished entries are ignored
        ([(0, 2), (2, 4), (1.999, 2.001)], 2),
    ],
)
def test_overlap_counting_edge_cases(intervals: list[tuple[float, float | None]], expected: int) -> None:
    entries = [entry(s, e, path=f"/catalog/{i}") for i, (s, e) in enumerate(intervals)]
    count, examples = find_overlaps(entries)
    assert count == expected
    assert len(examples) == expected


def test_overlaps_need_same_ip_and_same_site() -> None:
    entries = [
        entry(0, 2),
        entry(1, 3, ip="127.0.0.12"),
        entry(1, 3, site="shop-b.test"),
        entry(1.5, 2.5, path="/catalog/9"),
    ]
    count, examples = find_overlaps(entries)
    assert count == 1
    (ex,) = examples
    assert (ex.ip, ex.site, ex.first_path, ex.second_path) == ("127.0.0.11", "shop-a.test", "/catalog/1", "/catalog/9")
    assert (ex.first_start, ex.first_end, ex.second_start, ex.second_end) == (0, 2, 1.5, 2.5)
    assert "overlapped by 500 ms" in str(ex)


def test_overlap_count_matches_brute_force() -> None:
    rng = random.Random(1234)
    entries = []
    for _ in range(400):
        start = rng.uniform(0, 50)
        end = start + rng.choice([0.0, rng.uniform(0, 1.5)])
        if rng.random() < 0.1:
            start, end = round(start), round(start) + 1  # exact touching boundaries
        entries.append(entry(start, end, ip=rng.choice(["a", "b", "c"]), site=rng.choice(["x", "y"])))
    brute = sum(
        1
        for i, a in enumerate(entries)
        for b in entries[i + 1 :]
        if a["ip"] == b["ip"] and a["site"] == b["site"] and max(a["start"], b["start"]) < min(a["end"], b["end"])  # type: ignore[operator]
    )
    count, examples = find_overlaps(entries, max_examples=3)
    assert count == brute > 0
    assert len(examples) == 3


def test_summary_counts_from_hand_made_entries() -> None:
    entries = [
        entry(0.0, 0.5, path="/catalog/1"),
        entry(0.6, 1.0, path="/catalog/1"),  # same page again: one distinct page
        entry(1.0, 1.5, path="/catalog/2", ip="127.0.0.2"),
        entry(
            1.1,
            1.2,
            path="/catalog/3",
            ip="127.0.0.2",
            status=429,
            kind="ban",
            ban_style="429",
            banned=True,
            violation="concurrency",
        ),
        entry(2.0, 2.1, path="/catalog/3", ip="127.0.0.2", status=200, kind="stub", ban_style="stub", banned=True),
        entry(2.0, 2.5, path="/catalog/1", site="shop-b.test", ip="127.0.0.3"),
        entry(3.0, 3.5, path="/flow/z/step/1", kind="flow", flow_id="z", step=1, ip_changed=False, flow_done=False),
        entry(3.6, 4.0, path="/flow/z/step/2", kind="flow", flow_id="z", step=2, ip_changed=False, flow_done=True),
        entry(4.0, 5.0, path="/", kind="index", ip="127.0.0.3", violation="rate", status=302, ban_style="captcha"),
    ]
    expected = {("shop-a.test", "/catalog/1"), ("shop-a.test", "/catalog/2"), ("shop-a.test", "/catalog/3")}
    s = summarize(entries, expected_pages=expected)
    assert s.requests == 9
    assert s.span_seconds == 5.0
    assert s.ok_pages == 3 and s.ok_page_responses == 4
    assert s.ok_pages_by_site == {"shop-a.test": 2, "shop-b.test": 1}
    assert s.expected_pages == 3
    assert s.missing_pages == [("shop-a.test", "/catalog/3")]
    assert s.throughput == pytest.approx(3 / 5.0)
    assert s.status_counts == {200: 7, 302: 1, 429: 1}
    assert s.kind_counts == {"ban": 1, "flow": 2, "index": 1, "page": 4, "stub": 1}
    assert (s.bans_served, s.bans_by_style) == (3, {"429": 1, "captcha": 1, "stub": 1})
    assert (s.violations, s.violations_by_kind) == (2, {"concurrency": 1, "rate": 1})
    assert s.overlaps == 1
    assert (s.flows_started, s.flows_completed, s.session_ip_changes) == (1, 1, 0)
    assert s.ips_per_site == {"shop-a.test": 3, "shop-b.test": 1}
    assert list(s.requests_per_ip.items()) == [("127.0.0.2", 3), ("127.0.0.3", 2), ("127.0.0.11", 4)]
    table = s.format()
    assert "pages scraped OK" in table and "3 / 3" in table
    assert "same-IP overlaps" in table and "missing pages" in table

    assert summarize(entries, expected_pages=90).expected_pages == 90
    empty = summarize([], expected_pages=10)
    assert (empty.requests, empty.ok_pages, empty.expected_pages, empty.throughput) == (0, 0, 10, 0.0)
    assert "requests" in empty.format()


def test_server_thread_reports_start_failure() -> None:
    with ServerThread(AntiBotSite(rules=RELAXED)) as running:
        clash = ServerThread(AntiBotSite(port=running.port))
        with pytest.raises(RuntimeError, match="failed to start") as info:
            clash.start()
        assert isinstance(info.value.__cause__, OSError)
        clash.stop()  # no-op once the thread has ended


def test_demo_refuses_in_one_line_without_example_project(tmp_path):
    """No Scrapy project where the demo looks (a broken install): it says so before it spawns anything.
    (A wheel ships one: tests/test_wheel.py runs the demo from an installed wheel.)"""
    from scrapy_proxy_shard.demo.run import DemoConfig, DemoSetupError, require_project, run_demo

    with pytest.raises(DemoSetupError, match="project is missing") as info:
        run_demo(DemoConfig(project=tmp_path / "example_project", progress=False))
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)
    require_project(DemoConfig().project)  # a source checkout passes


def test_quarantine_reuse_follows_the_engines_escalation_with_its_jitter() -> None:
    """The demo's check of quarantines against the site's log: a second rate ban in a row of an IP that
    never answered clean rests 4 x the first (each step up to BAN_JITTER shorter, compounding)."""
    from scrapy_proxy_shard.demo.run import BAN_JITTER, BRIEF_REST, _quarantine_reuse

    brief = BRIEF_REST * (1 - BAN_JITTER)

    def entries(third_after: float) -> list[dict]:
        row = [(0.0, "503"), (1.0, "429"), (1.0 + third_after, "captcha")]
        return [{"ip": "10.0.0.1", "site": "a.test", "start": t, "end": t + 0.05, "status": 429,
                 "ban_style": style} for t, style in row]

    # escalated: 4 x 0.9 x 0.9 = 3.24 s at least, measured from the ban's end
    assert _quarantine_reuse(entries(3.4), 100.0, brief=brief) == []
    assert len(_quarantine_reuse(entries(2.0), 100.0, brief=brief)) == 1
    # a block (403) on first contact keeps the long quarantine
    block = [{"ip": "10.0.0.2", "site": "a.test", "start": 0.0, "end": 0.1, "status": 403, "ban_style": "403"},
             {"ip": "10.0.0.2", "site": "a.test", "start": 50.0, "end": 50.1, "status": 200, "ban_style": None}]
    assert len(_quarantine_reuse(block, 100.0, brief=brief)) == 1
