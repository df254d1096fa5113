"""``benchmarks.timing``: every callable once per round, the rounds ordered by a balanced Latin
square, so no callable always runs right after the same one (torch's spinning OpenMP threads
slow whatever follows it)."""

import itertools

import jax
import numpy as np
import pytest
import torch

from benchmarks import torch_device
from benchmarks.timing import block, interleaved, median_ms, rotations


def _followers(orders):
    """``{(before, after): count}`` over consecutive calls within each round."""
    pairs = {}
    for order in orders:
        for before, after in itertools.pairwise(order):
            pairs[(before, after)] = pairs.get((before, after), 0) + 1
    return pairs


@pytest.mark.quick
@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_a_whole_square_puts_every_name_right_after_every_other(n):
    names = [f"f{i}" for i in range(n)]
    square = n if n % 2 == 0 else 2 * n  # an odd count needs the square and its mirror
    orders = list(rotations(names, square))
    assert all(sorted(order) == names for order in orders)  # each round calls each once
    pairs = _followers(orders)
    expected = 1 if n % 2 == 0 else 2
    assert pairs == {(a, b): expected for a in names for b in names if a != b}


@pytest.mark.quick
def test_seven_callables_three_rounds_no_one_always_follows_the_same():
    names = ["eager", "sdpa", "reference", "xla", "blocked", "native", "default"]
    orders = list(rotations(names, 3))
    for name in names:
        before = {order[order.index(name) - 1] for order in orders if order.index(name) > 0}
        assert len(before) > 1 or sum(order.index(name) > 0 for order in orders) <= 1, name


@pytest.mark.quick
def test_interleaved_calls_each_once_per_round_in_the_squares_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = interleaved(fns, repeats=4)
    assert calls == [name for order in rotations(list("abc"), 4) for name in order]
    assert calls[:3] != calls[3:6]  # the order changes between rounds
    assert {name: timing["repeats"] for name, timing in timings.items()} == dict.fromkeys("abc", 4)
    assert all(timing["median_ms"] >= 0.0 for timing in timings.values())


@pytest.mark.quick
def test_median_ms_warms_each_callable_up_once_then_times_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    result = median_ms(fns, repeats=3)
    assert calls[:2] == ["a", "b"]  # the warm-up, not timed
    assert sorted(calls[2:]) == sorted("ab" * 3)
    assert set(result) == {"a", "b"} and all(ms >= 0.0 for ms in result.values())


@pytest.mark.quick
def test_torch_runs_on_the_cpu_beside_a_cpu_backend_and_arrays_round_trip():
    """On CPU torch stays on the CPU (on a GPU backend it follows onto CUDA, where torch sees
    one); the conversions keep the values and the dtype."""
    assert jax.default_backend() == "cpu"
    assert torch_device.device() == torch.device("cpu")
    values = np.arange(6, dtype=np.int64).reshape(2, 3)
    tensor = torch_device.to_torch(values)
    assert tensor.device == torch.device("cpu") and tensor.dtype == torch.int64
    back = torch_device.to_numpy(tensor.float().requires_grad_(True) * 2)
    np.testing.assert_array_equal(back, values * 2)
    assert back.dtype == np.float32


@pytest.mark.quick
def test_block_waits_for_jax_and_for_torch_cuda_work_once_torch_used_cuda(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    out = block({"x": jax.numpy.ones(3)})
    np.testing.assert_array_equal(out["x"], np.ones(3))
    assert synced == [True]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    block(jax.numpy.ones(3))
    assert synced == [True]
