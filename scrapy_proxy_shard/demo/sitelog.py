"""Read the demo site's JSON-lines request log and summarise it.

The site's log is the ground truth for the demo and the end-to-end tests: a crawler
can believe it never used one IP twice at once, but only the site sees when requests
from the same IP on the same site actually overlapped in time.  ``summarize`` turns
the log into those verdicts (overlaps, bans, violations, session IP changes) plus
the throughput and coverage numbers used to compare crawler set-ups.
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import json
import os
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Overlap", "Summary", "find_overlaps", "read_log", "summarize", "summarize_log"]

Entry = Mapping[str, Any]


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All entries of a site log, in file order.

    A final line without its newline is skipped: it is a write the site had not
    finished when the log was read (the site may still be running).
    """
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]
    entries = [json.loads(line) for line in complete if line.strip()]
    if tail.strip():
        with contextlib.suppress(json.JSONDecodeError):
            entries.append(json.loads(tail))
    return entries


@dataclass(frozen=True)
class Overlap:
    """Two requests from one IP on one site whose [start, end) intervals intersect."""

    ip: str
    site: str
    first_path: str
    first_start: float
    first_end: float
    second_path: str
    second_start: float
    second_end: float

    def __str__(self) -> str:
        shared = min(self.first_end, self.second_end) - self.second_start
        return (
            f"{self.ip} on {self.site}: {self.first_path} and {self.second_path} overlapped by {shared * 1000:.0f} ms"
        )


def find_overlaps(entries: Iterable[Entry], max_examples: int = 10) -> tuple[int, list[Overlap]]:
    """Count overlapping same-(ip, site) request pairs; return (count, some examples).

    Per (ip, site), requests are swept in start order with a min-heap of end times of
    those still open: an open request overlaps the new one iff its end is after the
    new start (an interval ending exactly when the next starts does not overlap).
    O(n log n) for the count, however many pairs there are.
    """
    groups: dict[tuple[str, str], list[Entry]] = defaultdict(list)
    for e in entries:
        if e.get("end") is not None and e["end"] > e["start"]:
            groups[(e["ip"], e["site"])].append(e)
    count = 0
    examples: list[Overlap] = []
    for (ip, site), group in sorted(groups.items()):
        group.sort(key=lambda e: (e["start"], e["end"]))
        open_ends: list[tuple[float, int]] = []
        for idx, e in enumerate(group):
            while open_ends and open_ends[0][0] <= e["start"]:
                heapq.heappop(open_ends)
            count += len(open_ends)
            for _, other_idx in sorted(open_ends)[: max(0, max_examples - len(examples))]:
                other = group[other_idx]
                examples.append(
                    Overlap(
                        ip,
                        site,
                        other["path"],
                        other["start"],
                        other["end"],
                        e["path"],
                        e["start"],
                        e["end"],
                    )
                )
            heapq.heappush(open_ends, (e["end"], idx))
    return count, examples


@dataclass
class Summary:
    """What happened on the demo site, as seen by the site."""

    #: Log entries (every request, whatever its outcome).
    requests: int = 0
    #: Seconds from the first request start to the last request end.
    span_seconds: float = 0.0
    #: Distinct (site, path) answered with a normal 200 catalog page.
    ok_pages: int = 0
    #: 200 catalog-page responses including repeats of the same page.
    ok_page_responses: int = 0
    ok_pages_by_site: dict[str, int] = field(default_factory=dict)
    #: As passed to summarize(): a page count, or None.
    expected_pages: int | None = None
    #: Expected (site, path) pairs never served OK (only when a collection was given).
    missing_pages: list[tuple[str, str]] = field(default_factory=list)
    #: Distinct OK pages per second over ``span_seconds``.
    throughput: float = 0.0
    status_counts: dict[int, int] = field(default_factory=dict)
    kind_counts: dict[str, int] = field(default_factory=dict)
    #: Responses served in a ban disguise, and how many of each style.
    bans_served: int = 0
    bans_by_style: dict[str, int] = field(default_factory=dict)
    #: Requests that broke a rule (each one started or extended a ban).
    violations: int = 0
    violations_by_kind: dict[str, int] = field(default_factory=dict)
    #: Pairs of same-(ip, site) requests in flight at the same time.
    overlaps: int = 0
    overlap_examples: list[Overlap] = field(default_factory=list)
    #: Distinct (site, flow_id) whose step 1 was served OK / whose last step was.
    flows_started: int = 0
    flows_completed: int = 0
    #: (site, flow_id) whose requests came from more than one IP, with examples.
    session_ip_changes: int = 0
    session_ip_change_examples: list[tuple[str, str, list[str]]] = field(default_factory=list)
    #: Flow steps the site rejected with "session ip changed".
    ip_changed_responses: int = 0
    #: Distinct client IPs per site (count, and the sorted IPs themselves).
    ips_per_site: dict[str, int] = field(default_factory=dict)
    ips_by_site: dict[str, list[str]] = field(default_factory=dict)
    requests_per_ip: dict[str, int] = field(default_factory=dict)

    def format(self) -> str:
        """A human-readable table for the demo's output."""

        def counts(mapping: Mapping[Any, int]) -> str:
            return ", ".join(f"{k}: {v}" for k, v in mapping.items()) or "-"

        pages = f"{self.ok_pages}" + (f" / {self.expected_pages}" if self.expected_pages is not None else "")
        rows = [
            ("requests", f"{self.requests}"),
            ("span", f"{self.span_seconds:.2f} s"),
            ("pages scraped OK", pages),
            ("  per site", counts(self.ok_pages_by_site)),
            ("throughput", f"{self.throughput:.2f} OK pages/s"),
            ("status codes", counts(self.status_counts)),
            ("bans served", f"{self.bans_served} ({counts(self.bans_by_style)})"),
            ("rule violations", f"{self.violations} ({counts(self.violations_by_kind)})"),
            ("same-IP overlaps", f"{self.overlaps}"),
            ("flows completed", f"{self.flows_completed} of {self.flows_started} started"),
            (
                "session IP changes",
                f"{self.session_ip_changes} (rejected steps: {self.ip_changed_responses})",
            ),
            ("distinct IPs per site", counts(self.ips_per_site)),
            ("requests per IP", counts(self.requests_per_ip)),
        ]
        width = max(len(label) for label, _ in rows) + 2
        lines = [f"{label:<{width}}{value}" for label, value in rows]
        if self.missing_pages:
            shown = ", ".join(f"{s}{p}" for s, p in self.missing_pages[:5])
            more = len(self.missing_pages) - 5
            lines.append(f"{'missing pages':<{width}}{shown}" + (f" (+{more})" if more > 0 else ""))
        lines.extend(f"  overlap: {example}" for example in self.overlap_examples[:5])
        lines.extend(
            f"  ip change: {site} flow {flow_id} via {', '.join(ips)}"
            for site, flow_id, ips in self.session_ip_change_examples[:5]
        )
        return "\n".join(lines)


def summarize(
    entries: Iterable[Entry],
    expected_pages: int | Collection[tuple[str, str]] | None = None,
    *,
    max_examples: int = 10,
) -> Summary:
    """Summarise site log entries.

    ``expected_pages`` is either a number of pages (coverage is then reported as
    ``ok_pages / expected_pages``) or a collection of ``(site, path)`` pairs, in which
    case the pairs never served OK are listed in ``missing_pages`` too.
    """
    entries = list(entries)
    s = Summary(requests=len(entries))
    if entries:
        first_start = min(e["start"] for e in entries)
        last_end = max(e["end"] if e.get("end") is not None else e["start"] for e in entries)
        s.span_seconds = last_end - first_start

    ok: set[tuple[str, str]] = set()
    statuses: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    styles: Counter[str] = Counter()
    violations: Counter[str] = Counter()
    per_ip: Counter[str] = Counter()
    ips_by_site: dict[str, set[str]] = defaultdict(set)
    flow_ips: dict[tuple[str, str], list[str]] = {}
    flows_started: set[tuple[str, str]] = set()
    flows_done: set[tuple[str, str]] = set()

    for e in entries:
        site, ip, status, kind = e["site"], e["ip"], e.get("status"), e.get("kind")
        statuses[status] += 1
        kinds[kind] += 1
        per_ip[ip] += 1
        ips_by_site[site].add(ip)
        if kind == "page" and status == 200:
            s.ok_page_responses += 1
            ok.add((site, e["path"]))
        if e.get("ban_style"):
            styles[e["ban_style"]] += 1
        if e.get("violation"):
            violations[e["violation"]] += 1
        flow_id = e.get("flow_id")
        if flow_id is not None:
            key = (site, flow_id)
            seen = flow_ips.setdefault(key, [])
            if ip not in seen:
                seen.append(ip)
            if kind == "flow" and status == 200:
                if e.get("step") == 1:
                    flows_started.add(key)
                if e.get("flow_done"):
                    flows_done.add(key)
            if e.get("ip_changed"):
                s.ip_changed_responses += 1

    s.ok_pages = len(ok)
    s.ok_pages_by_site = dict(sorted(Counter(site for site, _ in ok).items()))
    if expected_pages is not None:
        if isinstance(expected_pages, int):
            s.expected_pages = expected_pages
        else:
            s.expected_pages = len(expected_pages)
            s.missing_pages = sorted(set(expected_pages) - ok)
    s.throughput = s.ok_pages / s.span_seconds if s.span_seconds > 0 else 0.0
    s.status_counts = dict(sorted(statuses.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
    s.kind_counts = dict(sorted(kinds.items(), key=lambda kv: str(kv[0])))
    s.bans_served = sum(styles.values())
    s.bans_by_style = dict(sorted(styles.items()))
    s.violations = sum(violations.values())
    s.violations_by_kind = dict(sorted(violations.items()))
    s.overlaps, s.overlap_examples = find_overlaps(entries, max_examples)
    s.flows_started = len(flows_started)
    s.flows_completed = len(flows_done)
    changed = sorted((k, ips) for k, ips in flow_ips.items() if len(ips) > 1)
    s.session_ip_changes = len(changed)
    s.session_ip_change_examples = [(site, fid, ips) for (site, fid), ips in changed][:max_examples]
    s.ips_by_site = {site: sorted(ips, key=_ip_key) for site, ips in sorted(ips_by_site.items())}
    s.ips_per_site = {site: len(ips) for site, ips in s.ips_by_site.items()}
    s.requests_per_ip = dict(sorted(per_ip.items(), key=lambda kv: _ip_key(kv[0])))
    return s


def _ip_key(ip: str) -> tuple[int, int, str]:
    """Sort 127.0.0.2 before 127.0.0.11; anything unparsable last."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return (1, 0, ip)
    return (0, int(addr), ip)


def summarize_log(
    path: str | os.PathLike[str],
    expected_pages: int | Collection[tuple[str, str]] | None = None,
) -> Summary:
    """``summarize(read_log(path), expected_pages)``."""
    return summarize(read_log(path), expected_pages)
