"""The interval bench/training.py puts beside each step-time median."""

import functools
import math
import os
import random
import statistics
import sys

from hypothesis import given
from hypothesis import strategies as st
from repo import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import training


@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=60, unique=True))
def test_the_interval_holds_the_sample_median_and_its_coverage_is_the_binomial_one(values):
    low, high, coverage = training.median_interval(values)
    assert low <= statistics.median(values) <= high
    assert low in values and high in values
    n = len(values)
    rank = sorted(values).index(low) + 1  # low is the k-th smallest, high the k-th largest
    assert sorted(values)[n - rank] == high
    below = sum(math.comb(n, i) for i in range(rank)) / 2 ** n
    assert math.isclose(coverage, 1 - 2 * below)
    # The narrowest interval that keeps 95%: one value further in on each side would drop below it.
    if n >= 6:  # fewer values cannot reach 95% (the whole range of 5 holds the median with 94%)
        assert coverage >= 0.95
        assert rank == n // 2 or 1 - 2 * (below + math.comb(n, rank) / 2 ** n) < 0.95
    else:
        assert (low, high) == (min(values), max(values))


def test_the_interval_covers_the_true_median_as_often_as_it_says():
    rng = random.Random(7)
    hits = 0
    for _ in range(4000):
        low, high, coverage = training.median_interval([_draw(rng) for _ in range(24)])
        hits += low <= _population_median() <= high
    assert coverage > 0.95 and hits / 4000 > 0.95


def _draw(rng: random.Random) -> float:
    """A ratio from a skewed population, as pair ratios are (the disk's bursts lengthen some phases)."""
    return math.exp(rng.gauss(0, 0.1)) * (1 + rng.expovariate(20) - math.log(2) / 20)


@functools.cache
def _population_median() -> float:
    rng = random.Random(1)
    return statistics.median(_draw(rng) for _ in range(400_000))
