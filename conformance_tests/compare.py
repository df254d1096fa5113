"""Comparison: report rows, and the one rule by which a tensor passes.

A tensor passes when its max abs error <= its bound, ``tol * max(1, max|reference|)``; a row
compares same-named tensors, names the worst (the one closest to or furthest past its bound) and
shows that tensor's bound and its error over it, so a row says what ``tol`` was held against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import torch

from conformance_tests.tolerances import tolerance

__all__ = ["Comparison", "Row", "compare", "make_row", "to_numpy"]


@dataclass
class Row:
    """One line of the report: the API's fields, with the worst tensor's bound (``tol *
    max(1, its max|reference|)``) and its error over that bound after ``tol`` (the row passes
    when ``err_over_bound <= 1`` and the check's own conditions hold: finite gradients, the
    seeds of a dropout draw), and which tensor was worst.

    ``max_abs_err`` and ``max_rel_err`` (the error over ``max|reference|``) are the largest over
    the row's tensors, not necessarily the worst tensor's: a tensor of scale 100 may err more
    than the worst tensor and still sit further inside its own bound."""

    case: str
    backend: str
    dtype: str
    check: str
    max_abs_err: float
    max_rel_err: float
    tol: float
    bound: float
    err_over_bound: float
    passed: bool
    worst: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


class Comparison(NamedTuple):
    """What ``compare`` measured over a row's tensors."""

    max_abs_err: float  # the largest max abs error of any tensor
    max_rel_err: float  # the largest of each tensor's max abs error over its max|reference|
    passed: bool  # every tensor within its bound
    worst: str  # the tensor with the largest error over its bound
    bound: float  # the worst tensor's bound: tol * max(1, its max|reference|)
    err_over_bound: float  # the worst tensor's max abs error over its bound


def to_numpy(x) -> np.ndarray:
    """float64 NumPy of a torch tensor (on any device) or a jax/NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(np.float64)
    return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


def _err_and_scale(reference, actual) -> tuple[float, float]:
    """Max abs error (NaN on both sides agrees; NaN on one side is inf) and the tensor's scale."""
    ref, act = to_numpy(reference), to_numpy(actual)
    if ref.shape != act.shape:
        raise ValueError(f"shape {act.shape} must equal the reference's {ref.shape}")
    with np.errstate(invalid="ignore"):
        diff = np.abs(ref - act)
    diff = np.where(np.isnan(ref) & np.isnan(act), 0.0, diff)
    err = float(np.where(np.isnan(diff), np.inf, diff).max()) if diff.size else 0.0
    finite = np.abs(ref[np.isfinite(ref)])
    return err, float(finite.max()) if finite.size else 0.0


def compare(reference: dict, actual: dict, tol: float) -> Comparison:
    """``Comparison`` of same-named tensors: a tensor passes when its max abs error
    <= ``tol * max(1, max|reference|)``, its bound."""
    if set(reference) != set(actual):
        raise KeyError(f"tensors differ: {sorted(set(reference) ^ set(actual))}")
    abs_err, rel_err, passed = 0.0, 0.0, True
    worst, bound, worst_ratio = "", tol, -1.0
    for name in reference:
        err, ref_max = _err_and_scale(reference[name], actual[name])
        own_bound = tol * max(1.0, ref_max)
        ratio = err / own_bound
        passed &= ratio <= 1.0
        if ratio > worst_ratio:
            worst, bound, worst_ratio = name, own_bound, ratio
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / ref_max if ref_max > 0 else err)
    return Comparison(abs_err, rel_err, bool(passed), worst, bound, max(worst_ratio, 0.0))


def make_row(
    name, backend, dtype, check, reference, actual, tol_key=None, ok=True, tol=None
) -> Row:
    """The row of ``check`` for the case (or pair) called ``name``: ``reference`` against
    ``actual`` under the tolerance entry ``tol_key`` (default: ``check``) for ``backend``, or
    under ``tol`` itself when given (a bound measured on the peer: the whole GPT's bfloat16
    rows); ``ok=False`` fails it whatever the errors (a check's own condition failed)."""
    if tol is None:
        tol = tolerance(dtype, tol_key or check, backend.precision)
    result = compare(reference, actual, tol)
    return Row(
        name, backend.label, dtype, check, result.max_abs_err, result.max_rel_err, tol,
        result.bound, result.err_over_bound, result.passed and ok, result.worst,
    )  # fmt: skip
