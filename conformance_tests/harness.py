"""One harness for the spec: the small entry point over its parts.

``run_case(case, check, backend, dtype)`` builds the pair for a case, runs one check on both
sides and returns report rows (``Row``). Every check compares torch (float32, TF32 off) with Flax
(highest matmul precision unless asked otherwise) tensor by tensor, by name, and names the worst
tensor. The parts, one concern each:

| module | what |
|---|---|
| ``layers.py`` | each layer once, as data (``LayerSpec``): inputs, mask, outputs, dropout |
| ``backends.py`` | ``Backend``, ``backends()``, meshes; numerics set per check, then restored |
| ``pairs.py`` | the one pair builder, inputs and masks, calling both sides, ``Subject`` |
| ``compare.py`` | ``Row``, ``compare`` (the pass rule, each tensor's bound), ``make_row`` |
| ``optimisers.py`` | torch and optax optimisers with matched hyperparameters (Adam as torch's) |
| ``checks/`` | one module per check: forward, grad, train, dropout, mask, dtype |
| ``whole_models.py`` | the whole-model cases (``spec.MODEL_CASES``): forward, grad, train |
| ``parity.py`` | the same checks on a user's own pair |
"""

from __future__ import annotations

import contextlib
import tempfile

from conformance_tests.backends import (
    DEFAULT_PRECISION,
    Backend,
    backends,
    make_mesh,
    parse_mesh,
    torch_tf32,
)
from conformance_tests.checks import CHECK_FUNCTIONS, check_dtype
from conformance_tests.checks.dropout import (
    FlaxInjectedDropout,
    TorchInjectedDropout,
    inject_dropout,
)
from conformance_tests.checks.grad import flax_grads, torch_grads
from conformance_tests.compare import Comparison, Row, compare, make_row, to_numpy
from conformance_tests.optimisers import OPTIMIZERS, scale_by_adam_as_torch
from conformance_tests.pairs import (
    DTYPES,
    Subject,
    build_pair,
    call_flax,
    call_torch,
    flax_forward,
    make_inputs,
    make_mask,
    named,
    output_names,
    prepare,
    subject_of,
)
from conformance_tests.pairs import mesh_skip_reason as _layer_mesh_skip_reason
from conformance_tests.spec import Case, ModelCase
from conformance_tests.whole_models import MESH_SKIP_REASON, run_model_case

__all__ = [
    "CHECK_FUNCTIONS",
    "Comparison",
    "DEFAULT_PRECISION",
    "DTYPES",
    "OPTIMIZERS",
    "Backend",
    "FlaxInjectedDropout",
    "Row",
    "Subject",
    "TorchInjectedDropout",
    "backends",
    "build_pair",
    "call_flax",
    "call_torch",
    "compare",
    "flax_forward",
    "flax_grads",
    "inject_dropout",
    "make_inputs",
    "make_mask",
    "make_mesh",
    "make_row",
    "mesh_skip_reason",
    "named",
    "output_names",
    "parse_mesh",
    "planned",
    "prepare",
    "run_case",
    "scale_by_adam_as_torch",
    "subject_of",
    "to_numpy",
    "torch_grads",
    "torch_tf32",
]


def mesh_skip_reason(case: Case | ModelCase, backend: Backend) -> str | None:
    """Why ``case`` cannot run on ``backend.mesh``, or ``None``: a layer size that does not
    divide over the mesh's ``model`` axis; a whole model (run on one device only)."""
    if isinstance(case, ModelCase):
        return None if backend.mesh is None else MESH_SKIP_REASON
    return _layer_mesh_skip_reason(case, backend)


def run_case(
    case: Case | ModelCase, check: str, backend: Backend, dtype: str = "float32", workdir=None
):
    """Rows of one check of one case on one backend. ``dtype`` other than float32 runs the
    ``dtype`` check (a forward pass of the Flax side in that dtype). A whole-model case
    (``spec.MODEL_CASES``) runs in ``whole_models.py``."""
    if isinstance(case, ModelCase):
        with backend.scope():
            return run_model_case(case, check, backend, dtype)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(backend.scope())
        if dtype != "float32":
            if check != "dtype":
                return []
            return check_dtype(subject_of(case, workdir), backend, dtype)
        if check == "dtype":
            return []
        return CHECK_FUNCTIONS[check](subject_of(case, workdir), backend, dtype)


def planned(cases, dtypes=("float32", "bfloat16", "float16")):
    """``(case, check, dtype)`` triples to run: float32 for every check but ``dtype``, which runs
    in each lower precision."""
    for case in cases:
        for check in case.checks:
            if check == "dtype":
                for dtype in dtypes:
                    if dtype != "float32":
                        yield case, check, dtype
            elif "float32" in dtypes:
                yield case, check, "float32"
