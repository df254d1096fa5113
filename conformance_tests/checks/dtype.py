"""The ``dtype`` check: the Flax side computing in bfloat16 or float16 (float32 parameters)
against torch in float32, under that dtype's ``forward`` tolerance."""

from __future__ import annotations

from conformance_tests.checks.forward import check_forward
from conformance_tests.compare import Row
from conformance_tests.pairs import Subject

__all__ = ["check_dtype"]


def check_dtype(subject: Subject, backend, dtype: str) -> list[Row]:
    """A forward pass of the Flax side in ``dtype`` (a lower precision than float32)."""
    return check_forward(subject, backend, dtype)
