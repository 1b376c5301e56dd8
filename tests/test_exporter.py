"""The Prometheus exporter: scraped over HTTP on 127.0.0.1 after known leases and bans."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scrapy_proxy_shard.demo.redis_server import free_port
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.ops.exporter import serve

NS = "exp"
URLS = ["http://alice:Pw-Exp-1@10.5.0.1:3128", "http://10.5.0.2:3128", "http://10.5.0.3:3128",
        "http://10.5.0.4:3128"]
ALLOWED_LABELS = {"pool", "site", "state", "reason", "outcome", "host", "quantile", "status", "change"}


@pytest.fixture
def exporter(real_redis):
    store = PoolStore(real_redis, namespace=NS, host_id="exporter")
    server, thread = serve(store, host="127.0.0.1", port=free_port())
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()
    thread.join(5)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    assert "Pw-Exp-1" not in text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples, name, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_metrics_after_known_leases_and_bans(real_redis, exporter):
    a = PoolStore(real_redis, namespace=NS, host_id="host-a")
    b = PoolStore(real_redis, namespace=NS, host_id="host-b")
    a.add_proxies("dc", URLS)
    a.heartbeat("dc", ttl=60)
    b.heartbeat("dc", ttl=60)
    held = a.lease("dc", "shop.example", ttl=60)                       # leased by host-a
    first = b.lease("dc", "shop.example", ttl=60)
    b.release(first, outcome="ban", reason="http_429")                 # banned on the site
    second = b.lease("dc", "shop.example", ttl=60)
    b.release(second, outcome="ok", latency=0.4, min_interval=120)     # cooling
    third = a.lease("dc", "other.example", ttl=60)
    a.release(third, outcome="dead", reason="connection_refused")     # proxy-wide quarantine
    spare = next(r.id for r in a.list_proxies("dc") if r.id not in (first.proxy_id, third.proxy_id))
    a.ban("dc", spare, site="other.example", ttl=100, reason="manual")
    a.heartbeat("dc", ttl=60)
    b.heartbeat("dc", ttl=60)

    m = scrape(exporter)
    assert value(m, "proxy_shard_up") == 1.0
    assert value(m, "proxy_shard_proxies", pool="dc") == 4
    assert value(m, "proxy_shard_proxies_dead", pool="dc") == 1
    assert value(m, "proxy_shard_proxies_active", pool="dc") == 3
    assert value(m, "proxy_shard_proxies_banned", pool="dc") == 2
    shop = {state: value(m, "proxy_shard_slots", pool="dc", site="shop.example", state=state)
            for state in ("free", "leased", "session", "cooling", "banned")}
    assert shop == {"free": 1, "leased": 1, "session": 0, "cooling": 1, "banned": 1}
    assert value(m, "proxy_shard_slots_held", pool="dc", host="host-a") == 1
    assert value(m, "proxy_shard_quarantines_running", pool="dc", site="shop.example", reason="http_429") == 1
    assert value(m, "proxy_shard_quarantines_running", pool="dc", site="*", reason="connection_refused") == 1
    assert value(m, "proxy_shard_site_quarantines_total", pool="dc", site="other.example", reason="manual") == 1
    assert value(m, "proxy_shard_quarantines_started_total", pool="dc") == 3
    assert 100 < value(m, "proxy_shard_quarantine_mean_seconds", pool="dc") < 1900
    assert value(m, "proxy_shard_requests_total", pool="dc", site="shop.example") == 3
    assert value(m, "proxy_shard_responses_total", pool="dc", site="shop.example", outcome="ok") == 1
    assert value(m, "proxy_shard_responses_total", pool="dc", site="shop.example", outcome="banned") == 1
    assert value(m, "proxy_shard_responses_total", pool="dc", site="other.example", outcome="banned") == 1
    assert value(m, "proxy_shard_success_ratio", pool="dc") == pytest.approx(1 / 3)
    assert value(m, "proxy_shard_proxy_latency_seconds", pool="dc", quantile="0.5") == pytest.approx(0.4)
    assert value(m, "proxy_shard_host_up", pool="dc", host="host-a") == 1
    assert value(m, "proxy_shard_host_requests_total", pool="dc", host="host-b") == 2
    assert value(m, "proxy_shard_host_responses_total", pool="dc", host="host-b", outcome="banned") == 1
    assert value(m, "proxy_shard_host_success_ratio", pool="dc", host="host-b") == 0.5
    assert value(m, "proxy_shard_host_recent_leases", pool="dc", host="host-a") == 2
    assert value(m, "proxy_shard_host_load_share", pool="dc", host="host-a") == 0.5
    assert value(m, "proxy_shard_host_heartbeat_age_seconds", pool="dc", host="host-a") < 30
    # Low cardinality: no proxy id or address is ever a label value.
    ids = {r.id for r in a.list_proxies("dc")}
    label_values = {v for (_, labels) in m for _, v in labels}
    assert not label_values & ids and not any("10.5.0." in v for v in label_values)

    a.leave("dc")
    a.release(held)
    m = scrape(exporter)
    assert value(m, "proxy_shard_host_up", pool="dc", host="host-a") is None
    assert value(m, "proxy_shard_slots", pool="dc", site="shop.example", state="leased") == 0


def test_a_scrape_while_redis_is_down_says_up_0(redis_server):
    from redis import Redis

    store = PoolStore(Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", decode_responses=True), namespace=NS)
    server, thread = serve(store, host="127.0.0.1", port=free_port())
    try:
        m = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        store.client.close()
    assert value(m, "proxy_shard_up") == 0.0
    assert not any(name.startswith("proxy_shard_proxies") and labels for (name, labels) in m)


def test_dashboard_and_alerts_use_only_exported_metrics(exporter):
    with urllib.request.urlopen(exporter, timeout=10) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    exported = {f.name for f in families} | {f"{f.name}_total" for f in families if f.type == "counter"}
    folder = Path(__file__).resolve().parents[1] / "example_project" / "monitoring"
    dashboard = json.loads((folder / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append((folder / "alerts.yml").read_text())
    used = {name for expr in exprs for name in re.findall(r"proxy_shard_[a-z_]+", expr)}
    assert used and used <= exported, used - exported
