"""Timing helpers: medians of wall-clock calls, interleaved across the compared callables.

The machine is shared and noisy, so the callables compared in one ratio are timed round-robin
(call 1 of each, then call 2 of each, ...): a burst of load from elsewhere hits all of them, and
the ratio of medians stays meaningful where absolute times drift. torch's OpenMP threads spin for
about 10 ms after its call returns, and XLA's pool less (a torch product took 12.5 ms right after
an XLA call, 12.0 after torch's), which slows whatever runs next (docs/performance.md,
"Measurements behind the benchmarks' own choices"). So each call of a round starts ``SETTLE_S``
after the one before ended, as it would run alone, and the rounds' orders come from a balanced
Latin square (``rotations``), so no callable always comes right after any one other.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import jax

__all__ = ["SETTLE_S", "Timing", "block", "interleaved", "median_ms", "rotations", "time_calls"]

#: Seconds between the calls of a round, for the threads of the call before to go to sleep: an
#: XLA product of 12.3 ms took 17.4 ms right after a torch call, 16.1 after 1 ms, 12.3 after 10.
SETTLE_S = 0.02


class Timing(dict):
    """``{"median_ms", "min_ms", "repeats", "samples_ms"}``."""

    @classmethod
    def of(cls, samples_s: list[float]) -> Timing:
        samples_ms = [s * 1e3 for s in samples_s]
        return cls(
            median_ms=statistics.median(samples_ms),
            min_ms=min(samples_ms),
            repeats=len(samples_ms),
            samples_ms=samples_ms,
        )


def block(result):
    """Wait for every JAX array in ``result``, and for torch's queued CUDA work where torch
    runs on a GPU (``benchmarks.torch_device``; on the CPU its results are ready on return).
    Where torch was never imported there is none (``benchmarks.march`` times JAX alone, and
    does not import it)."""
    result = jax.block_until_ready(result)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return result


def _once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    block(fn())
    return time.perf_counter() - start


def time_calls(fn: Callable[[], object], repeats: int) -> Timing:
    """Median of ``repeats`` calls of ``fn`` (already warm)."""
    return Timing.of([_once(fn) for _ in range(repeats)])


def rotations(names: list, repeats: int):
    """``repeats`` orders of ``names`` from a balanced Latin square (Williams): over a whole
    square every name runs right after every other once (an odd count needs the square and its
    mirror), so none always follows torch's SDPA or any one other name."""
    n = len(names)
    first = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    for r in range(repeats):
        yield [names[i] for i in rows[r % len(rows)]]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, progress=None):
    """``{name: Timing}`` from ``repeats`` rounds, each calling every ``fn`` once, in the orders
    of ``rotations``, ``SETTLE_S`` apart (not timed).

    ``progress`` (a ``conformance_tests.progress.Bar``, or ``None``) is advanced once per call.
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for order in rotations(list(fns), repeats):
        for name in order:
            time.sleep(SETTLE_S)
            samples[name].append(_once(fns[name]))
            if progress is not None:
                progress.update(1)
    return {name: Timing.of(s) for name, s in samples.items()}


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """One warm-up call of each ``fn``, then ``interleaved``: ``{name: median ms}``."""
    for fn in fns.values():
        block(fn())
    return {name: timing["median_ms"] for name, timing in interleaved(fns, repeats).items()}
