"""Liveness, not only safety (issue 19, item 6).

(a) A request whose site no proxy can serve before its wait limit ends (every proxy quarantined or
resting there, nothing in use; or the site's breaker open past it) fails at once instead of waiting
the whole PROXY_SHARD_MAX_WAIT, and a crawl that can serve nothing closes with reason
``proxy_pool_exhausted``, keeping its requests in JOBDIR. A wait for slots *in use* never fails early.
(b) A site whose ready set was lost (eviction, a partial restore) while the pool still holds its
proxies is rebuilt from the pool instead of answering "holds no proxies".

The engine tests run against fakeredis, each redis-server line and the Redis Cluster (``backend``).
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import time

import pytest
from scrapy import Request
from scrapy.downloadermiddlewares.httpproxy import HttpProxyMiddleware
from scrapy.utils.test import get_crawler

from scrapy_proxy_shard.crawl import browser
from scrapy_proxy_shard.crawl.liveness import Liveness
from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.proxies import proxy_id
from scrapy_proxy_shard.engine.store import Lease, LeaseWait
from scrapy_proxy_shard.exceptions import NoProxyAvailable, PoolExhausted

POOL = "main"
URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://user:Pa55word@10.0.0.3:8000"]
SITE = "a.example"


def _ids(store, urls):
    return [proxy_id(url) for url in urls]


def _lease(store, site=SITE, **kw):
    kw.setdefault("ttl", 60)
    return store.lease(POOL, site, **kw)


# --- (a) the engine says when a wait is firm ---------------------------------------------------------
def test_a_wait_on_quarantined_slots_with_nothing_in_use_is_firm(store):
    store.add_proxies(POOL, URLS[:2])
    for pid in _ids(store, URLS[:2]):
        store.ban(POOL, pid, site=SITE, ttl=600)
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool" and wait.firm, wait
    assert 590 < wait.wait <= 600
    other = _lease(store, "b.example")  # another site is served by the same proxies
    assert isinstance(other, Lease)


def test_a_wait_with_a_slot_in_use_is_never_firm_even_when_the_earliest_slot_rests(store):
    """The earliest slot is quarantined (60 s) and the other is leased with a longer TTL (120 s): a
    'pool' wait, but that lease's release may free its slot at any moment."""
    store.add_proxies(POOL, URLS[:2])
    held = _lease(store, ttl=120)
    assert isinstance(held, Lease)
    other = next(pid for pid in _ids(store, URLS[:2]) if pid != held.proxy_id)
    store.ban(POOL, other, site=SITE, ttl=60)
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool" and not wait.firm, wait
    assert 50 < wait.wait <= 60
    store.release(held)
    assert isinstance(_lease(store), Lease)  # the release freed it long before either time


def test_a_wait_for_slots_in_use_is_not_firm(store):
    store.add_proxies(POOL, URLS[:1])
    assert isinstance(_lease(store, ttl=600), Lease)
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and wait.reason == "held" and not wait.firm, wait


def test_a_pacing_wait_with_nothing_in_use_is_firm_and_short(store):
    store.add_proxies(POOL, URLS[:1])
    store.release(_lease(store), min_interval=5.0)
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and wait.reason == "pool" and wait.firm and wait.wait <= 5.0, wait


def test_an_open_breaker_wait_is_firm_and_its_probe_in_flight_is_not(store, backend):
    store.add_proxies(POOL, URLS[:2])
    prefix = store.prefix(POOL)
    now_ms = int(time.time() * 1000)
    key = schema.breaker_key(prefix, SITE)
    backend.hset(key, mapping={"st": "open", "until": now_ms + 600_000, "cool": 600_000, "maxc": 600_000,
                               "probes": 3, "used": 0, "ptok": "", "pexp": 0})
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and wait.reason == "breaker" and wait.firm, wait
    backend.hset(key, mapping={"st": "half", "until": 0, "ptok": "probe-token", "pexp": now_ms + 600_000})
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and wait.reason == "breaker" and not wait.firm, wait


# --- (b) a lost ready set is rebuilt from the pool -----------------------------------------------------
def test_a_site_whose_ready_set_was_lost_is_rebuilt_from_the_pool(store, backend):
    store.add_proxies(POOL, URLS)
    first = _lease(store)
    assert isinstance(first, Lease)
    store.release(first)
    backend.delete(schema.site_part(store.prefix(POOL), schema.READY, SITE))  # evicted, or not restored
    got = {_lease(store).proxy_id for _ in range(3)}
    assert got == set(_ids(store, URLS))
    assert isinstance(_lease(store), LeaseWait)


def test_a_rebuilt_site_keeps_its_held_slots_and_quarantines(store, backend):
    store.add_proxies(POOL, URLS)
    held = _lease(store, ttl=600)
    banned = next(pid for pid in _ids(store, URLS) if pid != held.proxy_id)
    store.ban(POOL, banned, site=SITE, ttl=600)
    backend.delete(schema.site_part(store.prefix(POOL), schema.READY, SITE))
    free = _lease(store)
    assert isinstance(free, Lease) and free.proxy_id not in (held.proxy_id, banned)
    wait = _lease(store)
    assert isinstance(wait, LeaseWait) and not wait.firm  # the held slot is still held: never handed out


# --- the runtime: fail at once on a firm wait past the deadline, wait on a busy one -------------------
class _Stats:
    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def inc_value(self, key, n=1):
        self.values[key] = self.values.get(key, 0) + n

    def set_value(self, key, value):
        self.values[key] = value

    def get_value(self, key, default=None):
        return self.values.get(key, default)


def test_liveness_parks_only_a_firm_wait_past_the_horizon_and_raises_when_nothing_else_is_served():
    async def go():
        held = [1]
        live = Liveness(object(), _Stats(), 3.0, lambda: len(held), horizon=3.0)
        live.enter(POOL, SITE)
        assert not live.check(POOL, SITE, LeaseWait(600.0, "held"))  # busy: a release may come
        assert not live.check(POOL, SITE, LeaseWait(600.0, "pool"))  # not firm
        assert not live.check(POOL, SITE, LeaseWait(1.0, "pool", True))  # firm, within the horizon: wait
        assert live.check(POOL, SITE, LeaseWait(600.0, "pool", True))  # past it, a lease in flight: park
        held.clear()
        with pytest.raises(PoolExhausted) as info:  # past it, nothing else served: the crawl closes
            live.check(POOL, SITE, LeaseWait(600.0, "pool", True))
        return info.value

    exc = asyncio.run(go())
    assert isinstance(exc, NoProxyAvailable) and exc.pool == POOL and exc.site == SITE and exc.reason == "pool"
    assert "cannot serve site 'a.example' before" in str(exc) and "PROXY_SHARD_PAUSE_HORIZON 3s" in str(exc)


def test_a_site_past_the_horizon_closes_the_crawl_only_when_this_host_serves_nothing_else():
    """Another site in flight or waiting for a busy slot keeps the crawl going (the requests past the
    horizon park: none is dropped); once nothing else is served, the next check closes the crawl."""
    class Request:
        url = "http://a.example/1"

    async def go():
        held = [1]
        stats = _Stats()
        live = Liveness(object(), stats, 3.0, lambda: len(held), horizon=3.0)

        def ask():
            try:
                return live.check(POOL, SITE, LeaseWait(600.0, "pool", True))
            except PoolExhausted as exc:
                return live.failed(Request(), exc)

        live.enter(POOL, SITE)
        assert ask() is True and not live.closing  # a lease of this host is in flight: parked
        held.clear()
        live.enter(POOL, "b.example")  # a request waits for a busy slot of another site
        assert ask() is True and not live.closing
        live.leave(POOL, "b.example")
        live.leased(POOL, "b.example")  # ... and got it a moment ago: its site is still being crawled
        assert ask() is True and not live.closing
        live._last_lease -= 2.0
        assert isinstance(ask(), PoolExhausted) and live.closing  # nothing else served: close (no engine here)
        return stats.values

    values = asyncio.run(go())
    assert values["proxy_shard/exhausted"] == 1 and values["proxy_shard/exhausted/closed"] == f"{POOL}/{SITE}"


def test_a_pool_exhausted_right_after_its_last_lease_still_closes_the_crawl():
    """Every proxy dead: each is leased, refused and quarantined within one second. The requests park
    while a lease granted under QUIET ago may still mean the site is served, then the crawl closes."""
    async def go():
        stats = _Stats()
        live = Liveness(object(), stats, 3.0, lambda: 0, horizon=3.0)
        live.leased(POOL, SITE)  # the last dead proxy was leased just now
        live.enter(POOL, SITE)
        assert live.check(POOL, SITE, LeaseWait(600.0, "pool", True))
        await asyncio.sleep(1.05)
        with pytest.raises(PoolExhausted):
            live.check(POOL, SITE, LeaseWait(600.0, "pool", True))

    asyncio.run(go())


def test_a_pause_logs_one_warning_per_interval_and_one_info_when_serving_resumes(caplog):
    async def go():
        stats = _Stats()
        live = Liveness(object(), stats, 3.0, lambda: 0, horizon=3600.0, log_interval=0.2)
        for _ in range(12):
            live.enter(POOL, SITE)
        wait = LeaseWait(1800.0, "pool", True)
        assert not live.check(POOL, SITE, wait)  # within the horizon: the requests wait
        for _ in range(3):
            if live.pause_due(POOL, SITE):
                live.paused(POOL, SITE, wait, "all 18 proxies quarantined (rate_limit x18)")
        await asyncio.sleep(0.25)
        assert live.pause_due(POOL, SITE)
        live.paused(POOL, SITE, wait, "all 18 proxies quarantined (rate_limit x18)")
        live.leased(POOL, SITE)
        return stats.values

    with caplog.at_level("INFO", logger="scrapy_proxy_shard.crawl.liveness"):
        values = asyncio.run(go())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("proxy_shard: 12 requests for a.example (pool 'main') wait: all 18 proxies "
                                  "quarantined (rate_limit x18) until ") and "next line in 0.2 s" in warnings[0]
    assert len(infos) == 1 and "serving a.example (pool 'main') again after" in infos[0]
    assert values["proxy_shard/pauses"] == 1 and 0.2 < values["proxy_shard/paused_seconds"] < 1.0


def test_a_crawl_finished_with_requests_not_sent_exits_1():
    class Crawler:
        spider = object()

    stats = _Stats()
    crawler = Crawler()
    live = Liveness(crawler, stats, 3.0, lambda: 0)
    live.spider_closed("finished")
    assert crawler.spider is not None  # nothing lost: exit 0
    stats.inc_value("proxy_shard/not_sent")
    live.spider_closed("finished")
    assert crawler.spider is None  # the runners count a crawler without a spider as failed


def test_a_kept_browser_request_carries_no_credential_to_jobdir():
    """A browser request bound to its leased proxy (crawl/browser.py bind) and kept for the next run
    loses the context, its marker and the proxy in playwright_context_kwargs, not the user's kwargs."""
    url = URLS[2]
    kept = []

    class Engine:
        spider = object()

        def crawl(self, request):
            kept.append(request)

    crawler = get_crawler(settings_dict={"JOBDIR": "/nonexistent/jobdir"})
    crawler.engine = Engine()
    pid = proxy_id(url)
    request = Request("https://a.example/1", meta={
        "playwright": True, "playwright_context_kwargs": {"locale": "de-DE"},
        "proxy": url, "_proxy_shard_proxy": pid, "proxy_shard_proxy_id": pid,
        "download_slot": f"{SITE}|{pid}", "_proxy_shard_slot": f"{SITE}|{pid}"})
    browser.bind(request.meta, pid, url)
    HttpProxyMiddleware.from_crawler(crawler).process_request(request)
    assert b"Proxy-Authorization" in request.headers and "_auth_proxy" in request.meta

    assert Liveness(crawler, _Stats(), 3.0, lambda: 0)._keep(request)
    (again,) = kept
    assert again.meta["playwright_context_kwargs"] == {"locale": "de-DE"}
    for key in ("playwright_context", "_proxy_shard_context", "proxy", "_auth_proxy", "download_slot"):
        assert key not in again.meta, key
    on_disk = pickle.dumps(again.to_dict())
    for secret in (b"Pa55word", base64.b64encode(b"user:Pa55word")):
        assert secret not in on_disk
    assert b"Proxy-Authorization" not in again.headers
    assert "playwright_context" in request.meta  # the original request is left as it was

    bare = Request("https://a.example/2", meta={"playwright": True, "proxy": url, "_proxy_shard_proxy": pid})
    browser.bind(bare.meta, pid, url)
    assert Liveness(crawler, _Stats(), 3.0, lambda: 0)._keep(bare)
    assert "playwright_context_kwargs" not in kept[-1].meta and "playwright_context" not in kept[-1].meta
