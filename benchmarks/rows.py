"""Rows (one dict per measurement, keys ``benchmarks.ROW_FIELDS``) and output comparison."""

from __future__ import annotations

import numpy as np

from benchmarks import ROW_FIELDS

__all__ = ["make_row", "max_diffs"]


def max_diffs(result: dict, reference: dict) -> tuple[float, float]:
    """``(max_abs, max_rel)`` over the tensors of ``reference`` (by name), where a tensor's
    relative difference is ``max|diff| / max(1, max|reference|)`` (the spec's tolerance rule)."""
    missing = sorted(set(reference) - set(result))
    if missing:
        raise ValueError(f"result is missing tensors ({missing}) to compare with torch")
    worst_abs = worst_rel = 0.0
    for name, ref in reference.items():
        ref = np.asarray(ref, np.float64)
        got = np.asarray(result[name], np.float64)
        if got.shape != ref.shape:
            raise ValueError(f"{name}: shape ({got.shape}) must equal torch's ({ref.shape})")
        diff = float(np.max(np.abs(got - ref))) if ref.size else 0.0
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / max(1.0, float(np.max(np.abs(ref)))))
    return worst_abs, worst_rel


def make_row(
    section,
    case,
    mode,
    framework,
    implementation,
    *,
    resolved=None,
    batch=None,
    tokens=None,
    timing=None,
    value=None,
    unit=None,
    ratio_vs_eager=None,
    ratio_vs_sdpa=None,
    ratio=None,
    ratio_of=None,
    target=None,
    met=None,
    diffs=None,
    skipped=False,
    note="",
) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(
        section=section,
        case=case,
        mode=mode,
        framework=framework,
        implementation=implementation,
        resolved=resolved or implementation,
        batch=batch,
        tokens=tokens,
        repeats=0,
        value=value,
        unit=unit,
        ratio_vs_eager=ratio_vs_eager,
        ratio_vs_sdpa=ratio_vs_sdpa,
        ratio=ratio,
        ratio_of=ratio_of,
        target=target,
        met=met,
        skipped=bool(skipped),
        note=note,
    )
    if timing is not None:
        row.update(
            median_ms=timing["median_ms"], min_ms=timing["min_ms"], repeats=timing["repeats"]
        )
    if diffs is not None:
        row.update(max_abs_diff=diffs[0], max_rel_diff=diffs[1])
    return row
