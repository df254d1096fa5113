"""Comparison: report rows, and the one rule by which a tensor passes.

A tensor passes when its max abs error <= ``tol * max(1, max|reference|)``; a row compares
same-named tensors and names the worst.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import jax.numpy as jnp
import numpy as np
import torch

from conformance_tests.tolerances import tolerance

__all__ = ["Row", "compare", "make_row", "to_numpy"]


@dataclass
class Row:
    """One line of the report (the API's fields, plus which tensor was worst)."""

    case: str
    backend: str
    dtype: str
    check: str
    max_abs_err: float
    max_rel_err: float
    tol: float
    passed: bool
    worst: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


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


def compare(reference: dict, actual: dict, tol: float) -> tuple[float, float, bool, str]:
    """``(max_abs_err, max_rel_err, passed, worst)`` over same-named tensors.

    A tensor passes when its max abs error <= ``tol * max(1, max|reference|)``;
    ``max_rel_err`` is the error over ``max|reference|``; ``worst`` names the tensor furthest
    past (or closest to) its tolerance.
    """
    if set(reference) != set(actual):
        raise KeyError(f"tensors differ: {sorted(set(reference) ^ set(actual))}")
    abs_err, rel_err, passed, worst, worst_ratio = 0.0, 0.0, True, "", -1.0
    for name in reference:
        err, ref_max = _err_and_scale(reference[name], actual[name])
        ratio = err / (tol * max(1.0, ref_max))
        passed &= ratio <= 1.0
        if ratio > worst_ratio:
            worst, worst_ratio = name, ratio
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / ref_max if ref_max > 0 else err)
    return abs_err, rel_err, bool(passed), worst


def make_row(name, backend, dtype, check, reference, actual, tol_key=None, ok=True) -> Row:
    """The row of ``check`` for the case (or pair) called ``name``: ``reference`` against
    ``actual`` under the tolerance entry ``tol_key`` (default: ``check``) for ``backend``."""
    tol = tolerance(dtype, tol_key or check, backend.precision)
    abs_err, rel_err, passed, worst = compare(reference, actual, tol)
    return Row(name, backend.label, dtype, check, abs_err, rel_err, tol, passed and ok, worst)
