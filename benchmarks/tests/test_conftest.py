"""The benchmarks' tests run under the suite's strict settings (``conftest.py`` imports
``conformance_tests/tests/conftest.py``), whether or not the conformance tests run beside them."""

import os

import jax
import pytest
import torch

from conformance_tests.tests.conftest import OPTIMIZATION_LEVEL, TEST_CODEGEN


@pytest.mark.quick
def test_the_strict_settings_hold_here():
    assert jax.config.jax_default_matmul_precision == "highest"
    assert jax.config.jax_numpy_rank_promotion == "raise"
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
    # the tests' code generation (TEST_CODEGEN), or the level the environment named instead
    flags = os.environ["XLA_FLAGS"].split()
    levels = [f for f in flags if f.startswith(OPTIMIZATION_LEVEL)]
    assert levels == [TEST_CODEGEN] or len(levels) == 1 and TEST_CODEGEN not in flags, flags
