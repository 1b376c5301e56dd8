"""The site circuit breaker around the engine: its settings, what a crawl does with its events (stats,
one WARNING, retries that wait without spending the ban budget, a clear error past MAX_WAIT), and how
`status` and the exporter show it. fakeredis throughout (the state machine itself: test_breaker.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import fakeredis
import pytest
from scrapy import Request
from test_middlewares import Harness, _next_ms

from scrapy_proxy_shard.engine.bans import BanOptions
from scrapy_proxy_shard.engine.breaker import BreakerOptions
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.exceptions import NoProxyAvailable, SettingError
from scrapy_proxy_shard.modes.pools import store_kwargs
from scrapy_proxy_shard.ops import views
from scrapy_proxy_shard.ops.exporter import pool_metrics
from scrapy_proxy_shard.ops.snapshot import read_pool
from scrapy_proxy_shard.settings import ShardSettings

PROXIES = [f"http://10.9.1.{i}:3128" for i in range(1, 7)]
SITE = "shop.example"


# --- settings ---------------------------------------------------------------------------------------

def test_defaults_and_per_site_options():
    s = ShardSettings.from_settings({"PROXY_SHARD_SITES": {
        "www.shop.example": {"breaker_threshold": 8, "breaker_cooloff": 5},
        "quiet.example": {"breaker_enabled": False},
    }})
    assert s.breaker_for("other.example") == BreakerOptions(5, 3, 60.0, 30.0, 600.0, 3)
    assert s.breaker_for(SITE) == BreakerOptions(8, 3, 60.0, 5.0, 600.0, 3)
    assert s.breaker_for("quiet.example") is None
    off = ShardSettings.from_settings({"PROXY_SHARD_BREAKER_ENABLED": "False",
                                       "PROXY_SHARD_SITES": {SITE: {"breaker_enabled": True}}})
    assert off.breaker_for("other.example") is None and off.breaker_for(SITE) == BreakerOptions()
    assert store_kwargs(s)["breakers"](SITE).threshold == 8  # what the crawl's stores are built with


@pytest.mark.parametrize(("settings", "message"), [
    ({"PROXY_SHARD_BREAKER_THRESHOLD": 0}, "PROXY_SHARD_BREAKER_THRESHOLD (0) must be >= 1"),
    ({"PROXY_SHARD_BREAKER_THRESHOLD": 2.5}, "PROXY_SHARD_BREAKER_THRESHOLD (2.5) must be a whole number"),
    ({"PROXY_SHARD_BREAKER_MIN_PROXIES": 6}, "PROXY_SHARD_BREAKER_MIN_PROXIES (6) must be <= "
                                             "PROXY_SHARD_BREAKER_THRESHOLD (5)"),
    ({"PROXY_SHARD_BREAKER_WINDOW": 0}, "PROXY_SHARD_BREAKER_WINDOW (0) must be >= 0.001"),
    ({"PROXY_SHARD_BREAKER_COOLOFF": "soon"}, "PROXY_SHARD_BREAKER_COOLOFF ('soon') must be a number"),
    ({"PROXY_SHARD_BREAKER_MAX_COOLOFF": 10}, "PROXY_SHARD_BREAKER_MAX_COOLOFF (10.0) must be >= "
                                              "PROXY_SHARD_BREAKER_COOLOFF (30.0)"),
    ({"PROXY_SHARD_BREAKER_PROBES": 0}, "PROXY_SHARD_BREAKER_PROBES (0) must be >= 1"),
    ({"PROXY_SHARD_BREAKER_ENABLED": "maybe"}, "PROXY_SHARD_BREAKER_ENABLED ('maybe') must be True or False"),
    ({"PROXY_SHARD_SITES": {SITE: {"breaker_probes": -1}}},
     "PROXY_SHARD_SITES['shop.example'].breaker_probes (-1) must be >= 1"),
    ({"PROXY_SHARD_SITES": {SITE: {"breaker_enabled": "sometimes"}}},
     "PROXY_SHARD_SITES['shop.example'].breaker_enabled ('sometimes') must be True or False"),
    ({"PROXY_SHARD_SITES": {SITE: {"breaker_treshold": 3}}}, "unknown option(s) ['breaker_treshold']"),
])
def test_bad_values_name_the_setting(settings, message):
    with pytest.raises(SettingError) as error:
        ShardSettings.from_settings(settings)
    assert message in str(error.value)


# --- the crawl ----------------------------------------------------------------------------------------

BREAKER_SETTINGS = {"PROXY_SHARD_BREAKER_THRESHOLD": 3, "PROXY_SHARD_BREAKER_MIN_PROXIES": 3,
                    "PROXY_SHARD_BREAKER_COOLOFF": 30, "PROXY_SHARD_MAX_WAIT": 0.3}


def test_a_site_rejecting_everyone_opens_the_breaker_once_and_retries_wait_unbilled(caplog):
    # A cool-off past the pause horizon: the retry is not sent; the crawl would close (no engine here).
    h = Harness({**BREAKER_SETTINGS, "PROXY_SHARD_PAUSE_HORIZON": 5}, proxies=PROXIES)

    async def scenario():
        await h.open()
        requests = [Request(f"http://{SITE}/item/{n}") for n in range(5)]
        retries = []
        for wave in (requests[:2], requests[2:]):  # the second sent after the first was rejected
            await _next_ms()
            for request in wave:
                await h.lease_mw.process_request(request)
            retries += [await h.respond(request, status=403) for request in wave]
        # The first three were quarantined (the third opened the breaker); the last two were spared.
        assert [r.meta["proxy_shard_ban_retries"] for r in retries] == [1, 1, 1, 0, 0]
        with pytest.raises(NoProxyAvailable, match="circuit breaker is open"):
            await h.lease_mw.process_request(retries[-1])
        await h.lease_mw.process_request(Request("http://other.example/"))  # other sites lease as usual

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        asyncio.run(scenario())
    assert h.stat("breaker/opened") == 1 and h.stat("breaker/spared") == 2
    assert h.stat("breaker/waits") == 1 and h.stat("wait/gave_up") == 1
    assert h.stat("bans") == 5  # responses judged a ban, spared or not
    assert len([b for b in h.admin.bans("default") if b.scope == SITE]) == 3
    opened = [r for r in caplog.records if "circuit breaker OPEN" in r.getMessage()]
    assert len(opened) == 1 and opened[0].levelno == logging.WARNING
    text = opened[0].getMessage()
    assert "3 quarantines from 3 distinct proxies within 60s" in text and "http_403 x3" in text
    assert "for 30s" in text
    assert not [r for r in caplog.records if "quarantine of proxy" in r.getMessage()
                and "strike 0" in r.getMessage()]  # a spared ban is not reported as a quarantine


def test_one_burst_of_rejections_probes_within_a_second_a_fine_probe_closes_it(caplog):
    """Requests in flight together, all rejected (stalled requests arriving at once): the breaker spares
    the rest of the burst but probes after 1 s, not the 30 s cool-off; a fine probe closes it."""
    h = Harness({**BREAKER_SETTINGS, "PROXY_SHARD_MAX_WAIT": 5}, proxies=PROXIES)

    async def scenario():
        await h.open()
        requests = [Request(f"http://{SITE}/item/{n}") for n in range(4)]
        for request in requests:
            await h.lease_mw.process_request(request)
        await _next_ms()
        retries = [await h.respond(request, status=429) for request in requests]
        assert [r.meta["proxy_shard_ban_retries"] for r in retries] == [1, 1, 1, 0]
        state = h.admin.breaker("default", SITE)
        assert state.state == "open" and state.cooloff == pytest.approx(1.0)
        started = asyncio.get_running_loop().time()
        await h.lease_mw.process_request(retries[-1])  # waits for the probe, and is it
        assert 0.8 < asyncio.get_running_loop().time() - started < 3.0
        await h.respond(retries[-1])

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        asyncio.run(scenario())
    assert h.stat("breaker/opened") == 1 and h.stat("breaker/closed") == 1
    assert h.admin.breaker("default", SITE) is None
    assert any("for 1s" in r.getMessage() for r in caplog.records if "circuit breaker OPEN" in r.getMessage())


def test_a_probe_answered_fine_closes_it_and_says_so(caplog):
    h = Harness({**BREAKER_SETTINGS, "PROXY_SHARD_BREAKER_COOLOFF": 0.2, "PROXY_SHARD_MAX_WAIT": 5},
                proxies=PROXIES)

    async def scenario():
        await h.open()
        requests = [Request(f"http://{SITE}/item/{n}") for n in range(3)]
        for request in requests:
            await h.lease_mw.process_request(request)
        retries = [await h.respond(request, status=403) for request in requests]
        await h.lease_mw.process_request(retries[0])  # waits through the cool-off: it is the probe
        assert await h.respond(retries[0]) is not None
        for retry in retries[1:]:  # closed: leasing as usual
            await h.lease_mw.process_request(retry)

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        asyncio.run(scenario())
    assert h.stat("breaker/opened") == 1 and h.stat("breaker/closed") == 1
    assert any("circuit breaker for site shop.example (pool 'default') closed" in r.getMessage()
               for r in caplog.records)
    assert h.admin.breaker("default", SITE) is None


# --- status and metrics ----------------------------------------------------------------------------------

def test_status_and_metrics_show_an_open_breaker_and_its_history():
    store = PoolStore(fakeredis.FakeRedis(decode_responses=True), namespace="t", host_id="h",
                      bans=BanOptions(ttl=600, max_ttl=600, jitter=0), breakers=BreakerOptions(threshold=3, cooloff=90))
    store.add_proxies("dc", PROXIES)
    store.release(store.lease("dc", SITE, ttl=60), outcome="ban", reason="http_429")
    time.sleep(0.002)  # the next three were sent after that rejection (not one burst)
    leases = [store.lease("dc", SITE, ttl=60) for _ in range(3)]
    for lease in leases:
        store.release(lease, outcome="ban", reason="http_429")
    store.release(store.lease("dc", "calm.example", ttl=60), outcome="ok")
    snap = read_pool(store, "dc")

    text = views.status_text(snap)
    row = next(line for line in text.splitlines() if line.strip().startswith(SITE))
    assert "OPEN 1m" in row and "(opened 1x)" in row
    assert "closed" in next(line for line in text.splitlines() if line.strip().startswith("calm.example"))
    sites = {s["site"]: s for s in views.status_json(snap)["sites"]}
    shop = sites[SITE]["breaker"]
    assert (shop["state"], shop["opened"], shop["spared"], shop["probes"]) == ("open", 1, 1, 3)
    assert 80 < shop["probe_in"] <= 90
    assert sites["calm.example"]["breaker"] == {"state": "closed", "opened": 0, "reopened": 0, "closed": 0,
                                                "spared": 0}

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in pool_metrics([snap]) for s in family.samples}
    assert samples[("proxy_shard_breaker_state", (("pool", "dc"), ("site", SITE), ("state", "open")))] == 1
    assert samples[("proxy_shard_breaker_state", (("pool", "dc"), ("site", SITE), ("state", "closed")))] == 0
    assert samples[("proxy_shard_breaker_opened_total", (("pool", "dc"), ("site", SITE)))] == 1
    assert samples[("proxy_shard_breaker_spared_total", (("pool", "dc"), ("site", SITE)))] == 1


def test_a_ban_redis_did_not_record_is_not_logged_as_a_quarantine(caplog, monkeypatch):
    """A release Redis did not run (an outage: the fallback answers "lost") started no quarantine in
    Redis: the log says so instead of "quarantine ... (strike 0, 0s)"."""
    import time

    from scrapy_proxy_shard.engine.store import ReleaseResult

    h = Harness(proxies=PROXIES)

    async def lost(*args, **kwargs):
        return ReleaseResult("lost", time.time())

    async def scenario():
        await h.open()
        request = Request(f"http://{SITE}/item/1")
        await h.lease_mw.process_request(request)
        monkeypatch.setattr(h.runtime.store, "release", lost)
        await h.respond(request, status=403)

    with caplog.at_level(logging.INFO, logger="scrapy_proxy_shard"):
        asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "quarantine of proxy" in m], messages
    assert [m for m in messages if "without a quarantine confirmed by Redis (release lost" in m], messages
