"""Static splits: no proxy on two hosts, and consistent hashing moves only what it must."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scrapy_proxy_shard.engine.proxies import proxy_id
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.modes.sharding import assign, moved_fraction, partition_by_platform, slice_for

PROXIES = [proxy_id(f"http://10.{i // 250}.{i % 250}.1:3128") for i in range(2000)]
host_lists = st.lists(st.text("abcdefghij-:0123456789", min_size=1, max_size=12), min_size=1, max_size=12,
                      unique=True)


@settings(max_examples=60, deadline=None)
@given(hosts=host_lists, strategy=st.sampled_from(["consistent", "modulo"]))
def test_every_proxy_has_exactly_one_host(hosts, strategy):
    slices = [set(slice_for(PROXIES[:300], hosts, h, strategy)) for h in hosts]
    assert sum(len(s) for s in slices) == 300
    assert set().union(*slices) == set(PROXIES[:300])


@settings(max_examples=40, deadline=None)
@given(hosts=host_lists, newcomer=st.text("klmnop", min_size=1, max_size=6))
def test_a_joining_host_takes_about_its_share_and_only_from_others(hosts, newcomer):
    before, after = assign(PROXIES, hosts), assign(PROXIES, [*hosts, newcomer])
    moved = [p for p in PROXIES if before[p] != after[p]]
    assert all(after[p] == newcomer for p in moved)  # nothing moves between old hosts
    share = 1 / (len(hosts) + 1)
    assert len(moved) / len(PROXIES) <= share + 4 * (share * (1 - share) / len(PROXIES)) ** 0.5 + 0.01


@settings(max_examples=40, deadline=None)
@given(hosts=host_lists.filter(lambda h: len(h) >= 2), data=st.data())
def test_a_leaving_host_moves_only_its_own_proxies(hosts, data):
    leaving = data.draw(st.sampled_from(hosts))
    before = assign(PROXIES, hosts)
    after = assign(PROXIES, [h for h in hosts if h != leaving])
    assert all(before[p] == leaving for p in PROXIES if before[p] != after[p])


def test_modulo_reshuffles_most_proxies_when_a_host_joins():
    hosts = [f"host-{i}" for i in range(3)]
    consistent = moved_fraction(PROXIES, hosts, [*hosts, "host-3"], "consistent")
    modulo = moved_fraction(PROXIES, hosts, [*hosts, "host-3"], "modulo")
    assert consistent == pytest.approx(0.25, abs=0.04)
    assert modulo > 0.7  # the seed article's warning, measured


def test_split_is_even_enough():
    hosts = [f"host-{i}" for i in range(5)]
    sizes = [len(slice_for(PROXIES, hosts, h)) for h in hosts]
    assert max(sizes) - min(sizes) < 0.15 * len(PROXIES) / 5 * 2


def test_platform_partition_gives_each_proxy_one_platform():
    parts = partition_by_platform(PROXIES[:500], ["ozon", "wildberries", "avito"])
    flat = [p for ps in parts.values() for p in ps]
    assert sorted(flat) == sorted(PROXIES[:500]) and len(set(flat)) == 500
    assert all(len(ps) > 100 for ps in parts.values())


def test_bad_inputs_are_named():
    with pytest.raises(SettingError, match="not in the host list"):
        slice_for(PROXIES, ["a", "b"], "c")
    with pytest.raises(SettingError, match="host list is empty"):
        assign(PROXIES, [])
    with pytest.raises(SettingError, match="PROXY_SHARD_SHARDING"):
        assign(PROXIES, ["a"], "random")
