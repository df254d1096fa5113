"""``benchmarks.timing``: every callable once per round, the rounds ordered by a balanced Latin
square, so no callable always runs right after the same one (torch's spinning OpenMP threads
slow whatever follows it)."""

import itertools

import pytest

from benchmarks.timing import interleaved, median_ms, rotations


def _followers(orders):
    """``{(before, after): count}`` over consecutive calls within each round."""
    pairs = {}
    for order in orders:
        for before, after in itertools.pairwise(order):
            pairs[(before, after)] = pairs.get((before, after), 0) + 1
    return pairs


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_a_whole_square_puts_every_name_right_after_every_other(n):
    names = [f"f{i}" for i in range(n)]
    square = n if n % 2 == 0 else 2 * n  # an odd count needs the square and its mirror
    orders = list(rotations(names, square))
    assert all(sorted(order) == names for order in orders)  # each round calls each once
    pairs = _followers(orders)
    expected = 1 if n % 2 == 0 else 2
    assert pairs == {(a, b): expected for a in names for b in names if a != b}


def test_seven_callables_three_rounds_no_one_always_follows_the_same():
    names = ["eager", "sdpa", "reference", "xla", "blocked", "native", "default"]
    orders = list(rotations(names, 3))
    for name in names:
        before = {order[order.index(name) - 1] for order in orders if order.index(name) > 0}
        assert len(before) > 1 or sum(order.index(name) > 0 for order in orders) <= 1, name


def test_interleaved_calls_each_once_per_round_in_the_squares_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = interleaved(fns, repeats=4)
    assert calls == [name for order in rotations(list("abc"), 4) for name in order]
    assert calls[:3] != calls[3:6]  # the order changes between rounds
    assert {name: timing["repeats"] for name, timing in timings.items()} == dict.fromkeys("abc", 4)
    assert all(timing["median_ms"] >= 0.0 for timing in timings.values())


def test_median_ms_warms_each_callable_up_once_then_times_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    result = median_ms(fns, repeats=3)
    assert calls[:2] == ["a", "b"]  # the warm-up, not timed
    assert sorted(calls[2:]) == sorted("ab" * 3)
    assert set(result) == {"a", "b"} and all(ms >= 0.0 for ms in result.values())
