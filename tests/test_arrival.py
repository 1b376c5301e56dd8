"""The arrival guard's floors (crawl/arrival.py): what a release tells release.lua to count from."""

from __future__ import annotations

import pytest

from scrapy_proxy_shard.crawl.arrival import CLOCK_STEP, PAIR_SAMPLES, WARM_SAMPLES, WINDOW, ArrivalGuard


def warm(guard: ArrivalGuard, site: str, proxy: str, *samples: float) -> None:
    for sample in samples:
        guard.observe(site, proxy, sample)


def test_a_pair_is_cold_until_this_host_timed_it_enough():
    guard = ArrivalGuard()
    assert guard.floor("a.example", "p1") is None
    warm(guard, "a.example", "p1", *([0.08] * (WARM_SAMPLES - 1)))
    assert guard.floor("a.example", "p1") is None  # its first answers came while it warmed up
    warm(guard, "a.example", "p1", 0.06)
    assert guard.floor("a.example", "p1") == pytest.approx(0.06 - CLOCK_STEP)
    assert guard.floor("b.example", "p1") is None and guard.floor("a.example", "p2") is None


def test_a_young_pair_counts_from_the_sites_quickest_answer_an_older_one_from_its_own():
    guard = ArrivalGuard()
    warm(guard, "a.example", "fast", 0.05, 0.05)
    warm(guard, "a.example", "slow", 0.20, 0.20)
    assert guard.floor("a.example", "slow") == pytest.approx(0.05 - CLOCK_STEP)  # young: the site's floor
    warm(guard, "a.example", "slow", *([0.20] * (PAIR_SAMPLES - 2)))
    # A proxy that is slower but steady pays no shift for being slow once its own floor is known.
    assert guard.floor("a.example", "slow") == pytest.approx(0.20 - CLOCK_STEP)


def test_a_quicker_answer_lowers_the_floor_at_once_a_slower_path_raises_it_after_two_windows():
    guard = ArrivalGuard()
    warm(guard, "a.example", "p", *([0.10] * PAIR_SAMPLES))
    guard.observe("a.example", "p", 0.04)
    assert guard.floor("a.example", "p") == pytest.approx(0.04 - CLOCK_STEP)
    warm(guard, "a.example", "p", *([0.30] * WINDOW))
    assert guard.floor("a.example", "p") == pytest.approx(0.04 - CLOCK_STEP)  # still within the windows
    warm(guard, "a.example", "p", *([0.30] * (2 * WINDOW)))
    assert guard.floor("a.example", "p") == pytest.approx(0.30 - CLOCK_STEP)  # the path got slower for good


@pytest.mark.parametrize(("elapsed", "floor", "cap", "shift"), [
    (0.25, 0.05, 1.0, 0.20),   # it can have arrived 0.2 s late
    (0.25, 0.05, 0.1, 0.10),   # capped
    (0.03, 0.05, 1.0, 0.001),  # quicker than the floor: on time (1 ms: the start is whole ms)
    (0.25, None, 0.1, 0.25),   # cold: paced from the release, whatever the cap
])
def test_the_shift_is_the_same_formula_as_release_lua(elapsed, floor, cap, shift):
    assert ArrivalGuard.shift(elapsed, floor, cap) == pytest.approx(shift)


def test_the_oldest_pair_is_forgotten_first():
    guard = ArrivalGuard(max_pairs=2)
    for proxy in ("p1", "p2", "p3"):
        warm(guard, "a.example", proxy, 0.05, 0.05)
    assert len(guard) == 2
    assert guard.floor("a.example", "p1") is None  # cold again
    assert guard.floor("a.example", "p3") is not None
