"""``benchmarks.modern`` compares what it times before timing it: its rows hold the outputs'
largest difference, small where the two sides compute the same attention."""

from __future__ import annotations

import pytest

from benchmarks import modern


@pytest.mark.quick
def test_the_modern_rows_time_equal_computations():
    rows = modern.run_gqa(1, 32, 1, d=24, heads=6, groups=2)
    rows += modern.run_swa(64, 8, 1, d=24, heads=6) + modern.run_swa_core(64, 8, 1, 6, 4)
    assert [r["pass"] for r in rows] == ["forward", "forward+backward", "forward", "forward"]
    for row in rows:
        assert row["max_diff"] < 1e-5, row  # Flax against torch SDPA; window against full
        assert row["flax_ms"] > 0 and row["baseline_ms"] > 0, row
