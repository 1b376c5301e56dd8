"""The site zoo's web site: per-IP rules that ``SiteRules`` cannot express, and a log of every arrival.

    python benchmarks/zoo_site.py --rules RULES.json --domains a.test,b.test --pages 200 \\
        --log site.log --ready-file site.ready [--seed 1]

One asyncio HTTP/1.1 server with virtual hosts (the local forward proxies send every ``*.test`` name
here, each from its own 127.0.0.x, so the peer address is the proxy's IP). Every rule counts per
(client IP, blacklist group): a group is one domain, unless the profile makes several domains share
one blacklist (``groups``), as sites behind one anti-bot vendor do. Per (IP, group):

* an arrival sooner than the interval in force after the previous arrival is a *strike* (it is still
  answered); ``strikes`` strikes within ``window`` seconds ban the IP on the group for ``ban`` seconds;
* an arrival while ``overlap`` requests of the IP are already being served there bans it at once;
* a banned IP gets a blocked answer (``ban_style`` "429": 429 with Retry-After = the seconds left;
  "403": 403 with no hint), quickly, and its arrivals do not count as arrivals;
* the interval in force is ``interval``, times ``tighten_factor`` from ``tighten_after`` seconds after
  the site's first arrival on (a site that tightens its rule mid-crawl);
* a served page takes a service time drawn from ``service``: ``fixed:S``, ``uniform:A:B``,
  ``lognormal:MEDIAN:SIGMA`` or ``pareto:SCALE:ALPHA`` (seconds; capped at ``service_cap``).

Every answer carries ``X-Zoo-Arrival`` (the site's epoch time of the arrival) and ``X-Zoo-Interval``
(the interval in force): the benchmark's hand-paced reference client paces from them, a crawler
under test does not need them. The log is JSON lines, one per request, written when it is answered:
``start`` (arrival, epoch s), ``end``, ``ip``, ``site``, ``group``, ``path``, ``status``, ``verdict``
(``ok``, ``early``: a strike that was answered, ``ban``: the strike or overlap that started a ban,
``banned``: refused during a ban), ``why`` (``early`` / ``overlap``), ``interval`` and ``service``.
:func:`summarize` turns it into the benchmark's verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from scrapy_proxy_shard.demo.httpkit import (
    HttpError,
    close_server,
    parse_request_line,
    read_body,
    read_head,
    render_response,
    run_until_signalled,
    wants_keep_alive,
    write_file_atomically,
)

__all__ = ["Judge", "Verdict", "ZooRules", "ZooSite", "ZooSummary", "draw_service", "summarize"]

_CATALOG_RE = re.compile(r"/catalog/(\d{1,6})")
SERVICE_KINDS = ("fixed", "uniform", "lognormal", "pareto")


@dataclass(frozen=True)
class ZooRules:
    """One profile's rule, per (client IP, blacklist group)."""

    interval: float
    overlap: int = 1
    strikes: int = 3
    window: float = 60.0
    ban: float = 15.0
    service: str = "uniform:0.05:0.2"
    service_cap: float = 3.0
    #: Blacklists shared across domains: each tuple is one group; a domain in none is its own group.
    groups: tuple[tuple[str, ...], ...] = ()
    tighten_after: float | None = None
    tighten_factor: float = 1.5
    ban_style: str = "429"

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(tuple(g) for g in self.groups))
        if self.interval <= 0 or self.overlap < 1 or self.strikes < 1 or self.window <= 0 or self.ban <= 0:
            raise ValueError("interval, window and ban must be > 0; overlap and strikes >= 1")
        if self.ban_style not in ("429", "403"):
            raise ValueError("ban_style is '429' or '403'")
        if self.tighten_after is not None and (self.tighten_after < 0 or self.tighten_factor <= 0):
            raise ValueError("tighten_after must be >= 0 and tighten_factor > 0")
        parse_service(self.service)

    def group_of(self, domain: str) -> str:
        for members in self.groups:
            if domain in members:
                return "+".join(members)
        return domain

    def interval_at(self, now: float, first: float | None) -> float:
        """The interval in force at ``now`` for a site whose first arrival was at ``first``."""
        if self.tighten_after is not None and first is not None and now >= first + self.tighten_after:
            return self.interval * self.tighten_factor
        return self.interval

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ZooRules:
        return cls(**json.loads(text))


def parse_service(spec: str) -> tuple[str, tuple[float, ...]]:
    kind, *params = spec.split(":")
    want = {"fixed": 1, "uniform": 2, "lognormal": 2, "pareto": 2}
    if kind not in want or len(params) != want[kind]:
        raise ValueError(f"service {spec!r}: fixed:S, uniform:A:B, lognormal:MEDIAN:SIGMA or pareto:SCALE:ALPHA")
    values = tuple(float(p) for p in params)
    if any(v < 0 for v in values) or (kind == "uniform" and values[0] > values[1]):
        raise ValueError(f"service {spec!r}: bad parameters")
    if kind == "pareto" and values[1] <= 0:
        raise ValueError(f"service {spec!r}: alpha must be > 0")
    return kind, values


def draw_service(spec: str, rng: random.Random, cap: float = math.inf) -> float:
    """One service time in seconds."""
    kind, p = parse_service(spec)
    if kind == "fixed":
        value = p[0]
    elif kind == "uniform":
        value = rng.uniform(p[0], p[1])
    elif kind == "lognormal":
        value = p[0] * math.exp(rng.gauss(0.0, p[1]))
    else:
        value = p[0] * rng.paretovariate(p[1])
    return min(value, cap)


@dataclass
class _State:
    in_flight: int = 0
    last_arrival: float | None = None
    strikes: deque = field(default_factory=deque)
    banned_until: float = 0.0


@dataclass(frozen=True)
class Verdict:
    verdict: str  # ok | early | ban | banned
    why: str | None  # early | overlap | None
    group: str
    interval: float
    retry_after: int | None = None

    @property
    def served(self) -> bool:
        return self.verdict in ("ok", "early")


class Judge:
    """The rules without I/O: :meth:`admit` at each arrival, :meth:`release` when a served one is answered."""

    def __init__(self, rules: ZooRules) -> None:
        self.rules = rules
        self.first: float | None = None
        self._state: dict[tuple[str, str], _State] = {}

    def admit(self, ip: str, domain: str, now: float) -> Verdict:
        r = self.rules
        if self.first is None:
            self.first = now
        group = r.group_of(domain)
        interval = r.interval_at(now, self.first)
        st = self._state.setdefault((ip, group), _State())
        if st.banned_until > now:
            return Verdict("banned", None, group, interval, max(1, math.ceil(st.banned_until - now)))
        why = None
        if st.in_flight >= r.overlap:
            why = "overlap"
        elif st.last_arrival is not None and now - st.last_arrival < interval:
            why = "early"
        st.last_arrival = now
        if why is None:
            st.in_flight += 1
            return Verdict("ok", None, group, interval)
        while st.strikes and st.strikes[0] <= now - r.window:
            st.strikes.popleft()
        st.strikes.append(now)
        if why == "overlap" or len(st.strikes) >= r.strikes:
            st.banned_until = now + r.ban
            st.strikes.clear()
            return Verdict("ban", why, group, interval, max(1, math.ceil(r.ban)))
        st.in_flight += 1
        return Verdict("early", why, group, interval)

    def release(self, ip: str, verdict: Verdict) -> None:
        if verdict.served:
            self._state[(ip, verdict.group)].in_flight -= 1


def _page(domain: str, n: int) -> bytes:
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Item {n} | {domain}</title></head>\n'
        f'<body><div class="product" data-id="{domain}-{n}"><h1 class="title">Item {n}</h1>'
        f'<span class="price">{(n * 37) % 1000 / 10 + 1:.2f}</span><p>{"Sturdy and useful. " * 40}</p>'
        "</div></body></html>\n"
    ).encode()


class ZooSite:
    """The HTTP server around a :class:`Judge`."""

    def __init__(self, rules: ZooRules, domains: Sequence[str], pages: int, *, log_path: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, seed: int = 1) -> None:
        self.rules, self.domains, self.pages = rules, tuple(domains), pages
        self.judge = Judge(rules)
        self.log_path, self.host, self._requested_port = log_path, host, port
        self.rng = random.Random(seed)
        self.port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._log: IO[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        if self.log_path:
            self._log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115
        self._server = await asyncio.start_server(self._handle, self.host, self._requested_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        server, self._server = self._server, None
        await close_server(server, self._tasks)
        if self._log is not None:
            self._log.close()
            self._log = None

    async def __aenter__(self) -> ZooSite:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        ip = peer[0] if peer else "unknown"
        try:
            while True:
                try:
                    head = await asyncio.wait_for(read_head(reader), 30.0)
                    if head is None:
                        break
                    method, target, version = parse_request_line(head.start_line)
                    await read_body(reader, head)
                except HttpError as exc:
                    writer.write(render_response(exc.status, [("Content-Type", "text/plain")], exc.message.encode(),
                                                 keep_alive=False))
                    await writer.drain()
                    break
                domain = (head.get("host") or "").partition(":")[0].lower().rstrip(".")
                path = target.split("://", 1)[1].partition("/")[2] if "://" in target else target.lstrip("/")
                keep = wants_keep_alive(version, head)
                await self._serve(ip, domain, "/" + path, method, keep, writer)
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve(self, ip: str, domain: str, path: str, method: str, keep: bool,
                     writer: asyncio.StreamWriter) -> None:
        start, now = time.time(), time.monotonic()
        entry: dict[str, Any] = {"start": start, "ip": ip, "site": domain, "path": path}
        if domain not in self.domains:
            status, body, verdict, service = 404, b"unknown site", None, 0.0
        else:
            verdict = self.judge.admit(ip, domain, now)
            entry.update(group=verdict.group, verdict=verdict.verdict, why=verdict.why, interval=verdict.interval)
            service = 0.0
            if not verdict.served:
                status = int(self.rules.ban_style)
                body = b"Too Many Requests" if status == 429 else b"<html><body>Access denied</body></html>"
            else:
                m = _CATALOG_RE.fullmatch(path)
                if m and 1 <= int(m.group(1)) <= self.pages:
                    status, body = 200, _page(domain, int(m.group(1)))
                    entry["kind"] = "page"
                else:
                    status, body = 404, b"not found"
                service = draw_service(self.rules.service, self.rng, self.rules.service_cap)
        headers = [("Content-Type", "text/html; charset=utf-8" if status in (200, 403) else "text/plain"),
                   ("X-Zoo-Arrival", f"{start:.6f}")]
        if verdict is not None:
            headers.append(("X-Zoo-Interval", f"{verdict.interval:g}"))
            if status == 429 and verdict.retry_after is not None:
                headers.append(("Retry-After", str(verdict.retry_after)))
        try:
            if service > 0:
                await asyncio.sleep(service)
            writer.write(render_response(status, headers, body, keep_alive=keep, include_body=method != "HEAD"))
            await writer.drain()
        finally:
            if verdict is not None:
                self.judge.release(ip, verdict)
            entry.update(end=time.time(), status=status, service=round(service, 4))
            if self._log is not None:
                self._log.write(json.dumps(entry) + "\n")
                self._log.flush()


# --- the verdicts, from the log -----------------------------------------------------------------------------

@dataclass
class ZooSummary:
    requests: int = 0
    ok_pages: int = 0
    lost: int = 0
    lost_examples: list[tuple[str, str]] = field(default_factory=list)
    blocked: int = 0
    bans: int = 0
    bans_by_why: dict[str, int] = field(default_factory=dict)
    early: int = 0
    span: float = 0.0
    first_start: float = 0.0
    last_end: float = 0.0

    @property
    def rate(self) -> float:
        """Distinct pages served 200 per second, first arrival to last answer."""
        return self.ok_pages / self.span if self.span > 0 else 0.0

    @property
    def blocked_share(self) -> float:
        return self.blocked / self.requests if self.requests else 0.0


def read_log(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if line.strip():
                out.append(json.loads(line))
    return out


def summarize(entries: Iterable[Mapping[str, Any]], expected: Iterable[tuple[str, str]]) -> ZooSummary:
    entries = list(entries)
    s = ZooSummary(requests=len(entries))
    ok: set[tuple[str, str]] = set()
    why: dict[str, int] = {}
    for e in entries:
        if e.get("status") == 200 and e.get("kind") == "page":
            ok.add((e["site"], e["path"]))
        if e.get("verdict") in ("ban", "banned"):
            s.blocked += 1
        if e.get("verdict") == "ban":
            s.bans += 1
            why[e.get("why") or "?"] = why.get(e.get("why") or "?", 0) + 1
        if e.get("why") == "early":
            s.early += 1
    missing = sorted(set(expected) - ok)
    s.ok_pages, s.lost, s.lost_examples, s.bans_by_why = len(ok), len(missing), missing[:5], why
    if entries:
        s.first_start = min(e["start"] for e in entries)
        s.last_end = max(e.get("end", e["start"]) for e in entries)
        s.span = s.last_end - s.first_start
    return s


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The site zoo's web site (benchmarks/bench_zoo.py starts it).")
    p.add_argument("--rules", required=True, help="a JSON file of ZooRules fields")
    p.add_argument("--domains", required=True, help="comma-separated virtual hosts")
    p.add_argument("--pages", type=int, required=True, help="catalog pages per domain: /catalog/1..N")
    p.add_argument("--log", help="JSON-lines log, one line per request")
    p.add_argument("--ready-file", help="written with the bound port when ready")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rules = ZooRules.from_json(Path(args.rules).read_text(encoding="utf-8"))
    site = ZooSite(rules, [d for d in args.domains.split(",") if d], args.pages, log_path=args.log,
                   host=args.host, port=args.port, seed=args.seed)

    def ready() -> None:
        print(site.port, flush=True)
        if args.ready_file:
            write_file_atomically(args.ready_file, f"{site.port}\n")

    asyncio.run(run_until_signalled(site, ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
