"""Scrapy's own per-slot delay and concurrency in real crawls.

``scrapy startproject`` (Scrapy >= 2.13) writes ``DOWNLOAD_DELAY = 1`` and
``CONCURRENT_REQUESTS_PER_DOMAIN = 1`` into every new project. Each leased request has its own download
slot, ``<site>|<proxy id>``; left to Scrapy, that slot held a leased request back for the delay (or
behind the proxy's other slot) and sent it long after the lease that paced it, next to a request another
host leased on time through the same IP (crawl/slots.py). Verdicts from the site's log.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

DELAY = 0.5


@pytest.mark.slow
def test_the_project_templates_delay_is_kept_per_ip_at_the_lease_for_every_host(tmp_path):
    """The zoo's ``api-overlap2`` site (0.1 s per IP, two in flight tolerated, 3 strikes ban 30 s) with
    the rule given, 3 hosts, and the template's two lines (a 0.5 s delay here, to keep it short): every
    IP's arrivals are about the delay apart as the site sees them, for all hosts together, nothing
    early, nothing banned, every page served. Before, the site saw 65 early arrivals (some 2.5 ms
    apart) and banned 21 IPs, and 709 of 1,400 pages were lost at the 140 s budget."""
    import bench_zoo
    from bench_crawl import Kids

    profile = dataclasses.replace(bench_zoo.PROFILES["api-overlap2"], dead=0)
    settings = {"DOWNLOAD_DELAY": str(DELAY), "CONCURRENT_REQUESTS_PER_DOMAIN": "1"}
    kids = Kids()
    try:
        bench_zoo.EXTRA_SETTINGS.update(settings)
        run = bench_zoo.run_zoo(kids, tmp_path, profile, "given", 0.15, aiohttp_ok=False)
    finally:
        bench_zoo.EXTRA_SETTINGS.clear()
        kids.stop_all()
    s = run.summary
    report = f"{run.figures()}"
    assert run.exits and all(code == 0 for code in run.exits), report
    assert s.lost == 0 and s.early == 0 and s.bans == 0 and s.blocked == 0, report
    from zoo_site import read_log

    last: dict[str, float] = {}
    closest = float("inf")
    for e in sorted(read_log(tmp_path / "api-overlap2-given" / "site.log"), key=lambda e: e["start"]):
        if e["ip"] in last:
            closest = min(closest, e["start"] - last[e["ip"]])
        last[e["ip"]] = e["start"]
    # (the lease keeps the delay; a send's own lateness on a loaded 2-core machine, tens of ms, is not
    # the host's slot queueing it for the delay: that made gaps of a few ms)
    assert closest >= 0.8 * DELAY, (closest, report)
