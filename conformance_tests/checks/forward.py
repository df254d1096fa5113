"""The ``forward`` check: eval-mode outputs (and kept weights) of both sides, by name."""

from __future__ import annotations

import torch

from conformance_tests.compare import Row, make_row
from conformance_tests.pairs import Subject, call_torch, flax_forward, named, prepare, torch_on

__all__ = ["check_forward"]


def check_forward(subject: Subject, backend, dtype="float32") -> list[Row]:
    """Every output of both sides, the Flax side computing in ``dtype``."""
    tm, fm = subject.make_pair(dtype=dtype, mesh=backend.mesh)
    tm = torch_on(tm, backend.torch_device)
    t_inputs, t_mask, f_inputs, f_mask = prepare(backend, subject.inputs, subject.mask, dtype)
    with torch.no_grad():
        reference = named(subject, call_torch(subject, tm, t_inputs, t_mask))
    actual = named(subject, flax_forward(subject, fm, f_inputs, f_mask))
    key = subject.forward_key if dtype == "float32" else "forward"
    return [make_row(subject.name, backend, dtype, "forward", reference, actual, key)]
