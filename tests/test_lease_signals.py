"""The public lease signals: what tracing tools (benchmarks/bench_crawl.py) subscribe to instead of patching."""

from __future__ import annotations

from scrapy import Request
from test_middlewares import Harness, run

from scrapy_proxy_shard import signals as shard_signals


def test_lease_acquired_and_released_are_sent_once_per_lease_with_redis_times():
    h = Harness()
    got: list[tuple] = []
    h.crawler.signals.connect(lambda request, lease, waited: got.append(("acquired", request, lease, waited)),
                              signal=shard_signals.lease_acquired, weak=False)
    h.crawler.signals.connect(
        lambda request, lease, outcome, reason, result: got.append(("released", request, lease, outcome, result)),
        signal=shard_signals.lease_released, weak=False)

    async def scenario():
        await h.open()
        request = Request("http://shop.example/item")
        await h.lease_mw.process_request(request)
        retry = await h.respond(request, status=429)
        await h.lease_mw.process_request(retry)
        await h.respond(retry)
        return request, retry

    request, retry = run(scenario())
    assert [g[0] for g in got] == ["acquired", "released", "acquired", "released"]
    (_, r1, lease1, waited), (_, r2, lease2, outcome1, result1) = got[0], got[1]
    assert r1 is r2 is request and lease1 is lease2 and waited >= 0
    assert lease1.proxy_id == request.meta["proxy_shard_proxy_id"] and lease1.site == "shop.example"
    assert outcome1 == "ban" and result1.status == "ok" and result1.now >= lease1.issued_at
    assert got[2][1] is retry and got[3][3] == "ok" and got[2][2].proxy_id != lease1.proxy_id
