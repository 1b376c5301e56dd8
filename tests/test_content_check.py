"""A content check that fails for every proxy before it ever passed is suspected, not the proxies.

Seen: a spider-wide required CSS selector its start page lacked quarantined every proxy for 28 minutes
on every host after one request each (``missing_css, strike 1``), and the crawl ended with 0 items and
exit code 0. Now, while the check never passed on the site (cluster-wide, content.lua), failures
quarantine nobody; when N distinct proxies (all of them in a smaller pool) failed it, the site's
breaker opens with cause ``content``, one ERROR line names the selector and the site, and the crawl
closes ``proxy_shard_content_check``. Once the check passed there, failures are bans as before.

The engine tests run against fakeredis, each redis-server line and the Redis Cluster (``backend``).
"""

from __future__ import annotations

import asyncio
import logging

from scrapy import Request, Spider
from test_middlewares import PROXIES, Harness

from scrapy_proxy_shard.crawl.liveness import CONTENT_REASON
from scrapy_proxy_shard.engine.proxies import proxy_id
from scrapy_proxy_shard.exceptions import PoolExhausted
from scrapy_proxy_shard.signals import content_check_suspected

POOL = "main"
SITE = "shop.example"
URLS = [f"http://10.7.0.{i}:3128" for i in range(1, 6)]
LACKING = b"<html><body><div class='listing'>x</div>" + b"<p>filler</p>" * 200 + b"</body></html>"
PAGE = b"<html><body><div class='product'>x</div>" + b"<p>filler</p>" * 200 + b"</body></html>"


# --- the engine: content.lua ---------------------------------------------------------------------------
def test_failures_of_a_never_passed_check_are_suspect_until_n_proxies_then_the_breaker_opens(store):
    store.add_proxies(POOL, URLS)
    ids = [proxy_id(u) for u in URLS]
    check = "'div.product'"
    kinds = [store.content_check(POOL, SITE, "fail", proxy_id=i, check=check, suspects=3) for i in
             (ids[0], ids[0], ids[1], ids[2], ids[3])]
    assert [(v.kind, v.proxies, v.needed) for v in kinds] == [
        ("suspect", 1, 3), ("suspect", 1, 3), ("suspect", 2, 3), ("opened", 3, 3), ("open", 4, 3)]
    assert kinds[3].cooloff > 0 and all(v.suspect for v in kinds)
    state = store.breaker(POOL, SITE)
    assert state.state == "open" and state.cause == "content" and state.check == check
    wait = store.lease(POOL, SITE, ttl=30)
    assert wait.reason == "breaker" and wait.firm
    assert store.bans(POOL) == []  # no proxy quarantined
    assert store.lease(POOL, "other.example", ttl=30).proxy_id  # other sites lease as usual


def test_a_pool_smaller_than_n_opens_once_every_proxy_failed(store):
    store.add_proxies(POOL, URLS[:2])
    a, b = (proxy_id(u) for u in URLS[:2])
    assert store.content_check(POOL, SITE, "fail", proxy_id=a, check="x", suspects=3).kind == "suspect"
    opened = store.content_check(POOL, SITE, "fail", proxy_id=b, check="x", suspects=3)
    assert (opened.kind, opened.proxies, opened.needed) == ("opened", 2, 2)


def test_once_the_check_passed_on_a_site_its_failures_are_trusted(store):
    store.add_proxies(POOL, URLS)
    a = proxy_id(URLS[0])
    assert store.content_check(POOL, SITE, "fail", proxy_id=a, check="x").kind == "suspect"
    first = store.content_check(POOL, SITE, "pass")
    again = store.content_check(POOL, SITE, "pass")
    assert first.kind == "passed" and first.first and not again.first
    assert store.content_check(POOL, SITE, "fail", proxy_id=a, check="x").kind == "trusted"
    assert store.breaker(POOL, SITE) is None
    # per site: another site's check has not passed
    assert store.content_check(POOL, "other.example", "fail", proxy_id=a, check="x").kind == "suspect"


# --- the crawl: the middlewares --------------------------------------------------------------------
class CheckedSpider(Spider):
    name = "checked"
    proxy_shard_required_css = "div.product"


def test_a_wrong_check_burns_no_proxy_opens_the_breaker_and_closes_the_crawl(caplog):
    h = Harness({"PROXY_SHARD_PAUSE_HORIZON": 60}, spidercls=CheckedSpider, proxies=PROXIES)
    told = []
    h.crawler.signals.connect(lambda **kw: told.append(kw), signal=content_check_suspected, weak=False)

    async def scenario():
        await h.open()
        requests = [Request(f"http://{SITE}/item/{n}") for n in range(3)]
        for request in requests:
            await h.lease_mw.process_request(request)
        retries = [await h.respond(request, body=LACKING) for request in requests]
        assert all(isinstance(r, Request) for r in retries)  # retried, not lost
        live = h.runtime.liveness
        live._last_lease -= 2.0  # nothing else served for a while
        try:
            await h.lease_mw.process_request(retries[0])
        except PoolExhausted as exc:
            return exc, live
        raise AssertionError("the retry was leased through an open breaker")

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        exc, live = asyncio.run(scenario())
    assert exc.reason == "content" and live.closing and live.close_reason == CONTENT_REASON
    assert h.admin.bans("default") == []  # not one proxy quarantined
    state = h.admin.breaker("default", SITE)
    assert state.state == "open" and state.cause == "content" and state.check == "'div.product'"
    assert h.stat("content/suspect") == 3 and h.stat("content/breaker_opened") == 1
    assert [(k["site"], k["check"], k["proxies"]) for k in told] == [(SITE, "'div.product'", 3)]
    assert not h.stat("bans")  # no answer counted as a ban
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    wrong = [m for m in errors if "the check may be wrong" in m]
    assert len(wrong) == 1, errors
    assert f"every proxy's first answer from {SITE} lacks 'div.product'" in wrong[0]
    assert "PROXY_SHARD_REQUIRED_CSS" in wrong[0] and "proxy_shard_required_css" in wrong[0]
    closing = [m for m in errors if f"closing the spider ({CONTENT_REASON})" in m]
    assert len(closing) == 1 and "the content check 'div.product' failed" in closing[0], errors
    assert not [r for r in caplog.records if "quarantine of proxy" in r.getMessage()]


def test_once_the_check_passed_a_missing_selector_quarantines_as_before():
    h = Harness({}, spidercls=CheckedSpider, proxies=PROXIES)

    async def scenario():
        await h.open()
        good = Request(f"http://{SITE}/item/1")
        await h.lease_mw.process_request(good)
        await h.respond(good, body=PAGE)
        bad = Request(f"http://{SITE}/item/2")
        await h.lease_mw.process_request(bad)
        return await h.respond(bad, body=LACKING)

    retry = asyncio.run(scenario())
    assert isinstance(retry, Request)
    bans = [b for b in h.admin.bans("default") if b.scope == SITE]
    assert len(bans) == 1 and bans[0].reason == "missing_css"
    assert not h.stat("content/suspect") and h.stat("bans/reason/missing_css") == 1


def test_the_fallback_store_asks_redis_and_its_local_engine_while_redis_is_away():
    """Hybrid mode: while Redis answers, Redis records the check; while it is away, the local slice's
    engine does (a suspect check opens the local breaker; nothing is quarantined either way)."""
    import redis
    from test_modes import HOSTS, _fallback_store

    from scrapy_proxy_shard.demo.redis_server import RedisServer
    from scrapy_proxy_shard.engine.store import PoolStore

    server = RedisServer().start()
    try:
        PoolStore(redis.Redis.from_url(server.url, decode_responses=True)).add_proxies("default", URLS)

        async def scenario():
            store = _fallback_store(server.url, HOSTS[0])
            lease = await store.lease("default", SITE, ttl=30)  # the snapshot, while Redis answers
            await store.release(lease)
            online = await store.content_check("default", SITE, "fail", proxy_id=lease.proxy_id, check="x")
            state = await store.breaker("default", SITE)
            server.kill()
            got = await store.lease("default", "b.example", ttl=30)
            assert store.state == "fallback" and got.proxy_id
            local = [await store.content_check("default", "b.example", "fail", proxy_id=got.proxy_id, check="y",
                                               suspects=1)]
            local_state = await store.breaker("default", "b.example")
            await store.aclose()
            return online, state, local, local_state

        online, state, local, local_state = asyncio.run(scenario())
        assert online.kind == "suspect" and state is None
        assert local[0].kind == "opened" and local_state.cause == "content"
    finally:
        server.stop()
