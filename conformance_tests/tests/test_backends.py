"""Backends and precision: which tolerance entry a row uses, and what the report calls a backend.

No GPU or TPU is needed: the backends are built by hand, as ``harness.backends`` would build them
on such a machine.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from conformance_tests import harness, spec
from conformance_tests.tolerances import TOLERANCES, tolerance

CPU_DEVICE = jax.devices("cpu")[0]
CASE = next(c for c in spec.CASES if c.name == "doc_mha_2heads")


def _backend(name, strict):
    return harness.Backend(name, CPU_DEVICE, "cpu", strict)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("name", "strict", "precision", "label"),
    [
        ("cpu", True, None, "cpu"),
        ("cpu", False, None, "cpu/default"),  # CPU's default float32 matmul is full float32
        ("gpu", True, None, "gpu"),
        ("gpu", False, "tf32", "gpu/default"),
        ("tpu", True, None, "tpu"),
        ("tpu", False, "bf16", "tpu/default"),
    ],
)
def test_default_precision_picks_its_own_tolerances(name, strict, precision, label):
    backend = _backend(name, strict)
    assert backend.precision == precision
    assert backend.label == label
    strict_tol = tolerance("float32", "forward")
    # an error of 1e-3: far outside float32's tolerance, inside TF32's (2e-3) and bf16's
    reference = {"out": np.zeros((2, 3), np.float32)}
    actual = {"out": np.full((2, 3), 1e-3, np.float32)}
    row = harness.make_row(
        CASE.name, backend, "float32", "forward", reference, actual, "forward:documents"
    )
    assert row.backend == label
    if precision is None:
        assert row.tol == tolerance("float32", "forward:documents") and not row.passed
    else:
        assert row.tol == TOLERANCES[("float32", f"forward:{precision}")] > strict_tol
        assert row.passed


@pytest.mark.quick
def test_precision_entries_cover_every_float32_check_they_loosen():
    for precision in ("tf32", "bf16"):
        for check in ("forward", "forward:documents", "grad", "train", "dropout"):
            assert tolerance("float32", check, precision) > tolerance("float32", check)
        # self-comparisons and statistics do not depend on the matmul precision
        assert tolerance("float32", "mask", precision) == tolerance("float32", "mask")
        assert tolerance("float32", "dropout:stats", precision) == 5.0
        # the low-precision dtype rows already round more than any matmul precision
        assert tolerance("bfloat16", "forward", precision) == tolerance("bfloat16", "forward")


def test_a_mesh_backend_runs_sharded_and_says_so(tmp_path):
    backend = harness.backends(["cpu"], mesh=(1, 1))[0]
    assert dict(backend.mesh.shape) == {"data": 1, "model": 1}
    assert backend.label == "cpu[mesh 1x1]"
    assert harness.parse_mesh("2X4") == (2, 4)
    (row,) = harness.run_case(CASE, "forward", backend, "float32", str(tmp_path))
    assert row.backend == "cpu[mesh 1x1]" and row.passed, row
    _, module = harness.build_pair(CASE, str(tmp_path), mesh=backend.mesh)
    assert module.W_query.kernel[...].sharding.mesh == backend.mesh


@pytest.mark.quick
@pytest.mark.parametrize("strict", [True, False])
def test_a_backend_scope_restores_torch_and_jax_settings_on_exit(strict):
    """``Backend.scope`` sets torch's two TF32 switches, jax's default device and matmul
    precision (and mesh) for the check, and puts every one back as it found it, also when the
    check raises."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before_jax = jax.config.jax_default_matmul_precision
    for found in (True, False):  # whatever the caller had, it gets back
        matmul.allow_tf32 = cudnn.allow_tf32 = found
        try:
            with _backend("gpu", strict).scope():
                assert matmul.allow_tf32 is cudnn.allow_tf32 is (not strict)
                inside = jax.config.jax_default_matmul_precision
                assert inside == ("highest" if strict else "default"), inside
                raise RuntimeError("a failing check")
        except RuntimeError:
            pass
        finally:
            restored = (matmul.allow_tf32, cudnn.allow_tf32)
            matmul.allow_tf32 = cudnn.allow_tf32 = False  # conftest's setting
        assert restored == (found, found), f"TF32 switches {restored}, were {found}"
        assert jax.config.jax_default_matmul_precision == before_jax
