"""``benchmarks.timing.interleaved``: every callable once per round, each round starting one
further on (no callable always runs right after the same one)."""

from benchmarks.timing import interleaved


def test_rounds_rotate_their_start():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = interleaved(fns, repeats=4)
    assert calls == [*"abc", *"bca", *"cab", *"abc"]
    assert {name: timing["repeats"] for name, timing in timings.items()} == dict.fromkeys("abc", 4)
    assert all(timing["median_ms"] >= 0.0 for timing in timings.values())
