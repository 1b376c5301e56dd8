"""A wrong content check in a real crawl: `scrapy crawl shop` against the demo site through local
forward proxies and a real redis-server, its catalog pages checked for a selector they lack
(``-a required_css=div.nothere``). Before, every proxy answered once, was quarantined for ~28 minutes
on every host (``missing_css, strike 1``), and the crawl ended with 0 items and exit code 0. Now no
proxy is quarantined: after 3 distinct proxies failed the never-passed check the site's breaker opens
(cause content), one ERROR line names the selector and the site, and the crawl closes
``proxy_shard_content_check`` with exit code 1; a second host started then sends nothing. What
reached the site comes from the site's own log."""

from __future__ import annotations

import json

from test_liveness_end_to_end import SITE, Stack

PAGES = 60
WRONG = "required_css=div.nothere"


def test_a_wrong_check_burns_no_proxy_and_closes_the_crawl(tmp_path, redis_server_env):
    stack = Stack(tmp_path, (SITE,))
    try:
        code, stats, log, took = stack.crawl("first", SITE, "PROXY_SHARD_PAUSE_HORIZON=3600", pages=PAGES,
                                             spider_args=(WRONG,))
        report = f"exit {code}, {took:.1f}s, stats {json.dumps(stats, sort_keys=True)}"
        assert stats.get("finish_reason") == "proxy_shard_content_check", report
        assert code == 1, report
        assert took < 60, report
        wrong = [line for line in log.splitlines() if "the check may be wrong" in line]
        assert len(wrong) == 1 and "ERROR" in wrong[0], wrong
        assert f"every proxy's first answer from {SITE} lacks 'div.nothere'" in wrong[0], wrong
        closing = [line for line in log.splitlines() if "closing the spider (proxy_shard_content_check)" in line]
        assert len(closing) == 1 and "ERROR" in closing[0], closing
        assert stats.get("proxy_shard/content/breaker_opened") == 1, report
        assert not stats.get("proxy_shard/bans/reason/missing_css"), report  # no answer was taken for a ban
        quarantined = [b for b in stack.store.bans("datacenter") if b.reason == "missing_css"]
        assert quarantined == [], quarantined  # not one proxy burnt
        state = stack.store.breaker("datacenter", SITE)
        assert state is not None and state.cause == "content", state
        entries = [e for e in stack.entries() if e["site"] == SITE]
        assert {e["ip"] for e in entries} <= stack.egress
        first_run = len(entries)
        assert 3 <= first_run <= 24, first_run  # the first wave only, not the whole catalog x retries
        print(f"first run: {first_run} requests reached the site from {len({e['ip'] for e in entries})} proxies, "
              f"0 quarantined; {report}")

        # A second host started while the breaker is open: it sends nothing and closes the same way.
        code, stats, log, took = stack.crawl("second", SITE, pages=PAGES, spider_args=(WRONG,))
        report = f"exit {code}, {took:.1f}s, stats {json.dumps(stats, sort_keys=True)}"
        assert code == 1 and stats.get("finish_reason") == "proxy_shard_content_check", report
        assert len([e for e in stack.entries() if e["site"] == SITE]) == first_run
        print(f"second run: {report}")
    finally:
        stack.stop()
